"""One optimizer step and one evaluation: the optimizer, `TrainState`, the loss, the jitted
and donated train step, and the val loss.

Usage:
  optimizer = make_optimizer(cfg)
  state, shardings = init_state(cfg, config, optimizer, mesh)
  train_steps = make_train_steps(config, optimizer, shardings=shardings)
  state, losses = train_steps(state, xs, ys, n)   # the first n of the call's steps; the
                                                  # old state's buffers are donated

`training/loop.py` runs these in its loop; `benchmarks/train_vs_torch.py` times them.

Shapes: the letters of `gpt_jax.model`, and here A, the micro-batches of one optimizer step
(their gradients averaged); the steps of one call are named in words (`[steps, A, B, T]`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from gpt_jax.config import GPTConfig
from gpt_jax.model import forward
from gpt_jax.params import init_params, unstack_layers
from training import data, distributed, sharding
from training.config import TrainConfig


@struct.dataclass
class TrainState:
    """What one optimizer step reads and replaces (both float32; on the mesh, replicated or
    with `shard_params` split along one axis). Checkpoints hold the two fields apart."""

    params: dict[str, Any]  # the model's stacked params (gpt_jax/params.py): "wte" [V, D], ...
    opt_state: optax.OptState  # clipping + AdamW state: step count, moments shaped as params


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019) with nanoGPT's schedule: linear warmup
    `learning_rate * (step + 1) / (warmup_steps + 1)`, so the first step already moves the
    weights, then cosine decay to `min_learning_rate` at `max_steps`; after global-norm
    clipping.
    Weight decay applies to the weight matrices and embeddings (names starting with "w"),
    not to biases or LayerNorm parameters, whatever their stacked rank."""
    schedule = optax.warmup_cosine_decay_schedule(
        cfg.learning_rate / (cfg.warmup_steps + 1), cfg.learning_rate, cfg.warmup_steps,
        max(cfg.max_steps, cfg.warmup_steps + 1), cfg.min_learning_rate,
    )

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: str(path[-1].key).startswith("w"), params)

    adamw = optax.adamw(schedule, cfg.beta1, cfg.beta2, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip \
        else adamw


def init_state(cfg: TrainConfig, config: GPTConfig, optimizer, mesh):
    """A fresh `TrainState` placed on the mesh, and its shardings (a `TrainState` of
    `NamedSharding`s, for `make_train_steps`).

    With several processes the params are drawn by process 0 and sent to the others, and
    each process supplies only its own devices' shards (`sharding.put_host`); the optimizer
    state is made on the mesh by one jitted program. Avoided: `device_put` of host copies
    checks leaf by leaf that every process holds the same copy (a cross-process gather per
    array: seconds of start-up, training/README.md), and drawing them everywhere compiles the
    init on every process but 0 (on CPU JAX's persistent cache serves process 0 alone).
    """
    params = distributed.on_process_0(lambda: init_params(config, jax.random.key(cfg.seed)))
    param_shardings = sharding.tree_shardings(params, mesh, cfg.shard_params)
    params = jax.tree.map(sharding.put_host, params, param_shardings)
    opt_shardings = sharding.tree_shardings(jax.eval_shape(optimizer.init, params), mesh,
                                            cfg.shard_params)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    return TrainState(params, opt_state), TrainState(param_shardings, opt_shardings)


def loss_fn(params, config: GPTConfig, x_BT, y_BT, compute_dtype=jnp.float32):
    """Mean next-token cross-entropy in nats per token. With a bfloat16 `compute_dtype` the
    float32 master params are cast for the forward pass (their gradients come back float32);
    logits, LayerNorm and softmax stay float32 inside the model.

    The layers run unrolled (`unstack_layers`): the train step is faster than with the
    `lax.scan` over stacked layers, for a few seconds more compilation (training/README.md).
    Gradients flow back to the stacked params.
    """
    params = unstack_layers(jax.tree.map(lambda p: p.astype(compute_dtype), params))
    logits_BTV = forward(params, x_BT, config)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, y_BT).mean()


def _train_step(config: GPTConfig, optimizer, compute_dtype, shardings: TrainState | None):
    """`train_step(state, x_ABT, y_ABT) -> (state, loss)`: one optimizer step, unjitted.

    x_ABT, y_ABT hold A micro-batches; their gradients are averaged (a `lax.scan`, so memory
    stays one micro-batch) before one optimizer update.

    With replicated params on a mesh of several devices (plain data parallelism) each device
    takes the gradients of its own part of the batch and the devices average them as ONE
    flat array (`mean_over_devices`). Left to XLA's partitioner, the gradients cross in one
    all-reduce of a tuple of ~60 arrays, which XLA:CPU runs as one rendezvous per array,
    far slower than one flat array (training/README.md, "One flat all-reduce").
    """
    grad_fn = jax.value_and_grad(loss_fn)

    def mean_grads(params, x_ABT, y_ABT):
        def micro(acc, xy):
            loss, grads = grad_fn(params, config, *xy, compute_dtype)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        total, _ = jax.lax.scan(micro, zero, (x_ABT, y_ABT))
        return jax.tree.map(lambda t: t / x_ABT.shape[0], total)

    mesh = None if shardings is None else jax.tree.leaves(shardings.params)[0].mesh
    if mesh is not None and mesh.devices.size > 1 and all(
            s.is_fully_replicated for s in jax.tree.leaves(shardings.params)):
        mean_grads = mean_over_devices(mean_grads, mesh)

    def train_step(state: TrainState, x_ABT, y_ABT):
        loss, grads = mean_grads(state.params, x_ABT, y_ABT)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return state.replace(params=params, opt_state=opt_state), loss

    return train_step


def make_train_steps(config: GPTConfig, optimizer, compute_dtype=jnp.float32,
                     shardings: TrainState | None = None):
    """`train_steps(state, xs, ys, n) -> (state, losses)`, jitted, donating the old
    state: optimizer steps (`_train_step`) on the first `n` (int32 scalar, 1 <= n <= steps)
    of the call's steps' batches, as ONE compiled program (a `lax.fori_loop` with a traced
    trip count, so every n shares one compilation). `losses[:n]` (float32 `[steps]`) are the
    steps' losses in order, the rest 0; xs, ys are int32 `[steps, A, B, T]`, the batch axis
    (2) split over the mesh. `shardings` (from `init_state`) pins the new state to the old
    one's layout on a mesh.

    Why: the host's per-step work (dispatching the step, placing its batch, reading its
    loss, the loop's bookkeeping) runs on the same cores as the devices (on CPU every core
    is a device), and a device it delays holds the other at the gradient all-reduce; once a
    call it delays them less (figures: training/README.md, "several steps a call").
    """
    train_step = _train_step(config, optimizer, compute_dtype, shardings)

    def train_steps(state: TrainState, xs, ys, n):
        def body(k, carry):
            state, losses = carry
            state, loss = train_step(state, xs[k], ys[k])
            return state, losses.at[k].set(loss)

        losses = jnp.zeros(xs.shape[0], jnp.float32)  # [steps]
        return jax.lax.fori_loop(0, n, body, (state, losses))

    out_shardings = None if shardings is None else (shardings, None)
    return jax.jit(train_steps, donate_argnames="state", out_shardings=out_shardings)


def mean_over_devices(mean_grads, mesh):
    """`mean_grads(params, x_ABT, y_ABT) -> (loss, grads)` run on each device of `mesh` for
    its slice of the batch (axis 1), the results averaged over the devices as one flat
    float32 array (one `lax.pmean`). Params must be replicated.

    The shard_map skips JAX's check that values replicated on entry stay so (`check_vma`):
    `gpt_jax.layers._matmul`'s hand-written backward gives each device its own weight
    gradients, which that check refuses for replicated weights, and they are averaged over
    the devices right after."""
    def local(params, x_ABT, y_ABT):
        flat, unravel = ravel_pytree(mean_grads(params, x_ABT, y_ABT))
        return unravel(jax.lax.pmean(flat, sharding.DATA))

    batch = P(None, sharding.DATA)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), batch, batch), out_specs=P(),
                         check_vma=False)


_eval_loss = jax.jit(loss_fn, static_argnums=(1, 4))  # one cache for every run in a process


def evaluate(params, config: GPTConfig, cfg: TrainConfig, batches: data.Batches,
             mesh) -> dict[str, float]:
    """Val loss over `eval_batches` fixed batches (the same every evaluation), in nats per
    token and per character (per-token loss x tokens / characters of the val split)."""
    dtype = jnp.dtype(cfg.compute_dtype)
    losses = []
    for i in range(cfg.eval_batches):
        x, y = data.get_batch(batches.val, cfg.batch_size, batches.block, cfg.seed + 1, i)
        losses.append(_eval_loss(params, config, sharding.put_batch(x, mesh),
                                 sharding.put_batch(y, mesh), dtype))
    per_token = float(np.mean(jax.device_get(losses)))
    return {"val_loss": per_token, "val_loss_per_char": per_token / batches.val_chars_per_token}
