"""Tensor parallelism for inference: the model's weights and KV page pools split over the
"model" axis of a `jax.sharding.Mesh`, Megatron-style.

Layout (Shoeybi et al. 2019, "Megatron-LM", sec. 3): each device holds N/n of the query
heads and K/n of the kv heads (the columns of w_q, w_k, w_v and their biases), F/n of the
MLP's hidden width (the columns of w_gate and w_in), and the matching rows of w_o and w_out;
the residual stream, norms, embeddings and output projection are replicated. A block then
needs one all-reduce (a `psum` of `[T, D]` partial sums) after the attention output and one
after the MLP output, and nothing else: each device attends with its own kv heads over its
own share of every KV page (the pools `[num_pages, K, P, H]` are split along K), through
the same page tables, so the scheduler and its page accounting do not change.

Kv heads that do not divide the mesh are replicated as vLLM does: with n a multiple of K,
each kv head is repeated n/K times (its weights copied, `replicate_kv_heads`), making a
model with n kv heads, one per device, that computes exactly the same function (query head
i reads kv head i // (N/K) either way); the KV pools grow by n/K.

How it runs: `transformer` is `gpt_jax.model.transformer` under `jax.shard_map` when the
context mesh (`jax.set_mesh`, which the jitted programs are traced under) has a "model"
axis over more than one device. Inside, every function sees its device's local weights
and heads (a config with N/n and K/n heads), so the CPU kernels (paged attention, int8
matmul: XLA custom calls that GSPMD's partitioner cannot split and would feed gathered
operands) run per shard on local arrays, and the row-split products psum their partial
sums (`RowParallel`). Outside it (cache writes, the output projection, sampling) XLA's
GSPMD partitioner follows the arrays' shardings: the scatter into the K-split pools is
local, the rest is replicated work.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from gpt_jax import model
from gpt_jax.cache import PagedKVCache, cache_bytes
from gpt_jax.config import GPTConfig
from gpt_jax.layers import Int8Weight, OutputMajor, Weight, to_panels

MODEL = "model"  # the mesh axis the heads and the MLP width are split along
COLUMN = ("w_q", "w_k", "w_v", "w_gate", "w_in", "b_q", "b_k", "b_v", "b_gate", "b_in")
ROW = ("w_o", "w_out")  # their partial sums are all-reduced; their biases are added after


def make_mesh(n_devices: int, devices=None) -> Mesh:
    """A 1-D mesh with axis "model" over the first `n_devices` of `devices` (default
    `jax.devices()`: every process's, in process order).

    Raises:
      ValueError: `n_devices` < 1 or more than there are devices.
    """
    devices = jax.devices() if devices is None else list(devices)
    if not 1 <= n_devices <= len(devices):
        raise ValueError(f"tensor parallelism over {n_devices} devices needs 1 to "
                         f"{len(devices)} (the devices JAX sees: {devices})")
    return Mesh(np.array(devices[:n_devices]), (MODEL,), axis_types=(AxisType.Auto,))


def model_size(mesh: Mesh | None) -> int:
    """Devices along the mesh's "model" axis (1 for no mesh)."""
    return 1 if mesh is None else dict(zip(mesh.axis_names, mesh.axis_sizes)).get(MODEL, 1)


def check_mesh(mesh, config: GPTConfig) -> None:
    """Raise ValueError unless `mesh` is None or a Mesh with a "model" axis whose size
    divides the query heads and the MLP width, and either divides the kv heads or is a
    multiple of them (replicated kv heads)."""
    if mesh is None:
        return
    if not isinstance(mesh, Mesh) or MODEL not in mesh.axis_names:
        raise ValueError(f"mesh must be a jax.sharding.Mesh with a {MODEL!r} axis, got {mesh!r}")
    n, N, K = model_size(mesh), config.n_heads, config.kv_heads
    if N % n or config.d_ff % n or (K % n and n % K):
        raise ValueError(
            f"tensor parallelism over {n} devices needs n_heads={N} and the MLP width "
            f"{config.d_ff} divisible by {n}, and n_kv_heads={K} a multiple or a divisor of {n} "
            f"(a divisor: kv heads are replicated); choose a model axis that fits")


def sharded_config(config: GPTConfig, mesh: Mesh | None) -> GPTConfig:
    """The config of the model `shard_params` places on `mesh`: `config` with its kv heads
    replicated where the model axis needs it (`replicate_kv_heads`); `config` for None.
    Raises ValueError as `check_mesh`."""
    check_mesh(mesh, config)
    r = kv_replicas(config, model_size(mesh))
    return config if r == 1 else config.replace(n_kv_heads=config.kv_heads * r)


def kv_replicas(config: GPTConfig, n: int) -> int:
    """How many copies of each kv head n devices hold (1 when K is a multiple of n)."""
    return 1 if config.kv_heads % n == 0 else n // config.kv_heads


def _repeat_heads(w, heads: int, r: int, axis: int):
    """`w` with each of its `heads` head blocks along `axis` repeated `r` times in place."""
    if isinstance(w, Int8Weight):  # the same int8 values and scales, re-cut into panels
        return Int8Weight(to_panels(_repeat_heads(w.values_OI(), heads, r, 0)),
                          _repeat_heads(w.scale_O, heads, r, 0))
    if isinstance(w, OutputMajor):
        return OutputMajor(_repeat_heads(w.w_OI, heads, r, 0))
    shape = w.shape
    split = w.reshape(*shape[:axis], heads, -1, *shape[axis + 1:])
    return jnp.repeat(split, r, axis=axis).reshape(*shape[:axis], -1, *shape[axis + 1:])


def replicate_kv_heads(params, config: GPTConfig, r: int):
    """`(params, config)` with every kv head repeated `r` times (w_k, w_v and their biases;
    params in `decode_layout` or int8): the same function of the tokens with r*K kv heads."""
    if r == 1:
        return params, config
    K = config.kv_heads

    def layer(p):
        attn = dict(p["attn"])
        for name in ("w_k", "w_v", "b_k", "b_v"):
            if name in attn:
                attn[name] = _repeat_heads(attn[name], K, r, 0)
        return {**p, "attn": attn}

    return ({**params, "blocks": tuple(layer(p) for p in params["blocks"])},
            config.replace(n_kv_heads=K * r))


def _spec(path, leaf, n: int) -> P:
    """The PartitionSpec of one parameter array, found by its name (the last dict key on
    its path) and field (`w_OI`, `values`, `scale_O` of a weight type)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    field = path[-1].name if isinstance(path[-1], jax.tree_util.GetAttrKey) else None
    name, ndim = keys[-1], np.ndim(leaf)
    if name in COLUMN:
        if field == "scale_O" and leaf.shape[0] % (Int8Weight.PANEL * n):
            raise ValueError(f"int8 {name} has {leaf.shape[0]} output channels, in panels of "
                             f"{Int8Weight.PANEL}: tensor parallelism over {n} devices needs "
                             f"a multiple of {Int8Weight.PANEL * n}")
        return P(MODEL, *[None] * (ndim - 1))
    if name in ROW and field in ("w_OI", "values"):
        return P(None, MODEL, *[None] * (ndim - 2))
    return P()


def param_specs(params, n: int):
    """The PartitionSpec of every array of inference params (`decode_layout` or int8; see
    the module docstring): column-split weights and biases along their output axis, w_o and
    w_out along their input axis, the rest replicated."""
    return jax.tree_util.tree_map_with_path(lambda path, x: _spec(path, x, n), params)


def cache_specs(cache: PagedKVCache) -> PagedKVCache:
    """PartitionSpecs of a PagedKVCache: the pools split along K, the tables replicated."""
    pools = tuple(P(None, MODEL, None, None) for _ in cache.k)
    return PagedKVCache(k=pools, v=pools, page_table=P(), lengths=P(), overflow=P())


def shard_params(params, config: GPTConfig, mesh: Mesh):
    """Inference params (`gpt_jax.params.inference_params`) placed on `mesh`, Megatron-style,
    with kv heads replicated where they do not divide the model axis. Returns `(params,
    config)`: the config has the replicated kv heads' count (the function is unchanged).

    Raises:
      ValueError: as `check_mesh`, or int8 weights whose panels do not divide the axis.
    """
    check_mesh(mesh, config)
    n = model_size(mesh)
    params, config = replicate_kv_heads(params, config, kv_replicas(config, n))
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), param_specs(params, n))
    return jax.device_put(params, shardings), config


def mesh_stats(mesh: Mesh | None, config: GPTConfig, num_pages: int, page_size: int,
               dtype) -> dict:
    """What a server reports of its mesh: axis names and sizes, devices, kv heads per
    device and the KV page pools' bytes per device (`config` with the kv heads the pools
    hold, replicated ones counted; one device: the whole pool)."""
    n = model_size(mesh)
    axes = {} if mesh is None else dict(zip(mesh.axis_names, map(int, mesh.axis_sizes)))
    return {"axes": axes, "devices": 1 if mesh is None else int(mesh.devices.size),
            "kv_heads_per_device": config.kv_heads // n,
            "kv_cache_bytes_per_device": cache_bytes(config, num_pages, page_size, dtype) // n}


def replicate(tree, mesh: Mesh):
    """Every array of `tree` replicated on `mesh`; a PagedKVCache's pools split along K."""
    def put(x):
        if isinstance(x, PagedKVCache):
            return jax.device_put(x, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                  cache_specs(x)))
        return jax.device_put(x, NamedSharding(mesh, P()))

    return jax.tree.map(put, tree, is_leaf=lambda x: isinstance(x, PagedKVCache))


def constrain_cache(cache: PagedKVCache) -> PagedKVCache:
    """Inside a program traced under a tensor-parallel mesh, `cache` with its pools pinned
    to their K split (so GSPMD never gathers them); otherwise `cache` itself."""
    mesh = _context_mesh()
    if mesh is None:
        return cache
    pool = lambda x: jax.lax.with_sharding_constraint(x, P(None, MODEL, None, None))  # noqa: E731
    return cache.replace(k=tuple(map(pool, cache.k)), v=tuple(map(pool, cache.v)))


def _context_mesh():
    """The mesh programs are being traced under when it splits a "model" axis, else None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or MODEL not in mesh.axis_names or mesh.shape[MODEL] == 1:
        return None
    return mesh


@struct.dataclass
class RowParallel(Weight):
    """A row-split weight inside `shard_map`: each device multiplies its slice of the input
    by its rows of the matrix, and the partial sums are all-reduced over "model"."""

    local: Weight  # this device's rows (input slice) of the matrix

    def matmul(self, x_MI: jax.Array, preferred_element_type=None) -> jax.Array:
        """`psum(x_local @ w_local^T)`, `[M, O]`, the full product on every device."""
        kwargs = {} if preferred_element_type is None else dict(
            preferred_element_type=preferred_element_type)
        return jax.lax.psum(self.local.matmul(x_MI, **kwargs), MODEL)


def _local(params, config: GPTConfig, n: int):
    """Inside `shard_map`: this device's params with w_o and w_out `RowParallel`, and the
    config of its N/n query and K/n kv heads (the head dim kept)."""
    def layer(p):
        return {**p, "attn": {**p["attn"], "w_o": RowParallel(p["attn"]["w_o"])},
                "mlp": {**p["mlp"], "w_out": RowParallel(p["mlp"]["w_out"])}}

    local = config.replace(n_heads=config.n_heads // n, n_kv_heads=config.kv_heads // n,
                           head_size=config.head_dim)
    return {**params, "blocks": tuple(layer(p) for p in params["blocks"])}, local


def transformer(params, tokens_T, cache: PagedKVCache, config: GPTConfig, bound=None):
    """`gpt_jax.model.transformer` (same arguments and results), per device under
    `shard_map` when traced under a tensor-parallel mesh (`jax.set_mesh`): params as
    `shard_params` places them, the cache's pools split along K; the hidden states come
    back replicated, the new keys and values split along K."""
    mesh = _context_mesh()
    if mesh is None:
        return model.transformer(params, tokens_T, cache, config, bound)
    n = mesh.shape[MODEL]
    pools = tuple(P(None, MODEL, None) for _ in cache.k)
    # a Python int bound stays static (a fixed loop); a traced one is an argument
    traced = () if isinstance(bound, int) else (cache.lengths if bound is None else bound,)

    def body(params, tokens_T, cache, *traced):
        local_params, local_config = _local(params, config, n)
        return model.transformer(local_params, tokens_T, cache, local_config,
                                 traced[0] if traced else bound)

    # check_vma off: the hidden states are replicated by construction (every row-split
    # product is psummed), and the kernels' custom calls then need no replication rules
    specs = (param_specs(params, n), P(), cache_specs(cache)) + (P(),) * len(traced)
    return jax.shard_map(body, mesh=mesh, check_vma=False, in_specs=specs,
                         out_specs=(P(), (pools, pools)))(params, tokens_T, cache, *traced)
