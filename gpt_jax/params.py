"""Parameter initialisation, counting, shape checks and the layouts.

Parameters are a nested dict of arrays; the per-layer weights under "blocks" are stacked
along a leading L axis so the layers run as one `lax.scan` (training). Inference runs them in
`decode_layout` (layers unstacked, block matrices `OutputMajor`; on CPU the large float32
ones in panels, `panel_layout`: `PanelMajor`s), or quantized to int8 (`quantize`:
`Int8Weight`s); `inference_params` makes them once, for `inference.LLM` and
`inference.Engine`. The model takes every layout (`gpt_jax.layers.as_weight`).
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp

from gpt_jax import huge_pages
from gpt_jax.config import GPTConfig
from gpt_jax.kernels import panel_matmul as panel_kernel
from gpt_jax.layers import Int8Weight, OutputMajor, PanelMajor, Weight, to_panels

QUANTIZE = ("int8",)  # the weight quantizations `quantize` offers (None: none)

Params = dict  # nested dict of arrays; layer weights are stacked along a leading L axis


@functools.partial(jax.jit, static_argnames=("config", "dtype"))
def init_params(config: GPTConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit norm scales, and
    the two residual projections scaled by 1/sqrt(2 * n_layers) (GPT-2 paper, sec. 2.3).

    One jitted program, one normal draw cut into the weights: a draw per weight shape
    compiled a threefry kernel per shape, seconds of a short training run's start. (The
    weights only other families have are cut after GPT-2's, so a GPT-2 config draws what
    it always drew.)

    Returns a params pytree of `dtype` arrays with shapes
      wte [V, D], wpe [max_seq_len, D] (learned positions only), lm_head [V, D] (untied
      only), ln_f {scale, bias} [D], and under "blocks" (each with a leading [L]): ln1/ln2
      {scale, bias} [D]; attn w_q [D, N, H], w_k/w_v [D, K, H], b_q [N, H], b_k/b_v
      [K, H], w_o [N, H, D], b_o [D], q_norm/k_norm {scale} [H] (qk_norm only); mlp
      w_gate [D, F] ("gated_silu" only), w_in [D, F], b_gate/b_in [F], w_out [F, D],
      b_out [D]. RMSNorm has no bias; a bias the config turns off is absent.
    """
    L, D, N, K, H, F = (
        config.n_layers, config.d_model, config.n_heads, config.kv_heads, config.head_dim,
        config.d_ff,
    )
    std, resid_std = 0.02, 0.02 / math.sqrt(2 * L)
    learned, gated = config.positions == "learned", config.mlp == "gated_silu"
    shapes = {"wte": (config.vocab_size, D), "wpe": (config.max_seq_len, D) if learned else None,
              "w_q": (L, D, N, H), "w_k": (L, D, K, H), "w_v": (L, D, K, H),
              "w_o": (L, N, H, D), "w_in": (L, D, F), "w_out": (L, F, D),
              "w_gate": (L, D, F) if gated else None,
              "lm_head": None if config.tie_embeddings else (config.vocab_size, D)}
    shapes = {name: shape for name, shape in shapes.items() if shape is not None}
    scales = {"wpe": 0.01, "w_o": resid_std, "w_out": resid_std}  # the rest: std
    sizes = [math.prod(shape) for shape in shapes.values()]
    draw = jax.random.normal(key, (sum(sizes),), jnp.float32)
    w = {name: (scales.get(name, std) * part.reshape(shape)).astype(dtype)
         for (name, shape), part in zip(shapes.items(),
                                        jnp.split(draw, list(itertools.accumulate(sizes[:-1]))))}

    def norm(*lead, width=D, rms=config.norm == "rmsnorm"):
        return {"scale": jnp.ones((*lead, width), dtype),
                **({} if rms else {"bias": jnp.zeros((*lead, width), dtype)})}

    def biases(on, **shapes):
        return {f"b_{name}": jnp.zeros(shape, dtype) for name, shape in shapes.items() if on}

    attn = {"w_q": w["w_q"], "w_k": w["w_k"], "w_v": w["w_v"], "w_o": w["w_o"],
            **biases(config.qkv_bias, q=(L, N, H), k=(L, K, H), v=(L, K, H)),
            **biases(config.out_bias, o=(L, D))}
    if config.qk_norm:
        attn |= {"q_norm": norm(L, width=H, rms=True), "k_norm": norm(L, width=H, rms=True)}
    mlp = {name: w[name] for name in ("w_gate", "w_in", "w_out") if name in w}
    mlp |= biases(config.mlp_bias, **({"gate": (L, F)} if gated else {}), out=(L, D),
                  **{"in": (L, F)})
    extra = {name: w[name] for name in ("wpe", "lm_head") if name in w}
    return {"wte": w["wte"], **extra,
            "blocks": {"ln1": norm(L), "attn": attn, "ln2": norm(L), "mlp": mlp},
            "ln_f": norm()}


def param_count(params: Params) -> int:
    """Total number of scalars (the tied output projection counted once)."""
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


def unstack_layers(params: Params) -> Params:
    """`params` with "blocks" as a tuple of L per-layer dicts instead of arrays stacked on L
    (already so, params come back unchanged).

    `gpt_jax.model.transformer` runs the layers as an unrolled Python loop over such params.
    Inference programs do this once (inside `decode_layout`), outside their decode loop:
    slicing a layer out of the stack inside the loop (what `lax.scan` over stacked weights
    does) copies that layer's weights on every step, which doubles the memory traffic of a
    memory-bound decode step.
    """
    blocks = params["blocks"]
    if isinstance(blocks, tuple):
        return params
    n_layers = jax.tree.leaves(blocks)[0].shape[0]
    layers = tuple(jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(n_layers))
    return {**params, "blocks": layers}


def decode_layout(params: Params) -> Params:
    """`params` as the inference programs run them: layers unstacked (`unstack_layers`) and
    every block matrix `OutputMajor`, `[O, I]` (w_q, w_k, w_v `[N*H, D]`, w_o `[D, N*H]`,
    w_gate, w_in `[F, D]`, w_out `[D, F]`). Already in this layout, params come back unchanged.
    A copy of every block weight: call it once, outside any decode loop."""
    if isinstance(params["blocks"], tuple) and isinstance(
            params["blocks"][0]["mlp"]["w_in"], Weight):
        return params

    def layer(p):
        attn, mlp = p["attn"], p["mlp"]
        D = attn["w_q"].shape[0]
        heads = {name: OutputMajor(attn[name].reshape(D, -1).T) for name in ("w_q", "w_k", "w_v")}
        return {**p,
                "attn": {**attn, **heads, "w_o": OutputMajor(attn["w_o"].reshape(-1, D).T)},
                "mlp": {**mlp, **{name: OutputMajor(mlp[name].T)
                                  for name in ("w_gate", "w_in", "w_out") if name in mlp}}}

    return {**params, "blocks": tuple(layer(p) for p in unstack_layers(params)["blocks"])}


# The block matrices of one input, which one `Weight.linears` call multiplies (one layout).
SHARED_INPUT = (("attn", ("w_q", "w_k", "w_v")), ("attn", ("w_o",)),
                ("mlp", ("w_gate", "w_in")), ("mlp", ("w_out",)))


def _panel_groups(layer: dict) -> list[tuple[str, list[str]]]:
    """The (part, names) of one decode-layout layer's `SHARED_INPUT` groups still
    `OutputMajor` that `PanelMajor.fits`: what `panel_layout` converts."""
    groups = []
    for part, names in SHARED_INPUT:
        names = [n for n in names if n in layer[part]]
        ws = [layer[part][n] for n in names]
        if all(isinstance(w, OutputMajor) for w in ws) and PanelMajor.fits(
                [w.w_OI for w in ws]):
            groups.append((part, names))
    return groups


def panel_layout(params: Params) -> Params:
    """`params` in `decode_layout` with the block matrices of each input (`SHARED_INPUT`)
    that `PanelMajor.fits` (float32, read from memory) in panels, the layout the CPU panel
    kernel reads; the rest as they are. A copy of those weights."""
    def layer(p):
        p = {**p, "attn": dict(p["attn"]), "mlp": dict(p["mlp"])}
        for part, names in _panel_groups(p):
            p[part].update({n: PanelMajor(to_panels(p[part][n].w_OI)) for n in names})
        return p

    return {**params, "blocks": tuple(layer(p) for p in params["blocks"])}


def output_layout(params: Params) -> Params:
    """`params` with every `PanelMajor` block matrix back to `OutputMajor` (`panel_layout`
    undone; a copy of those weights); params without panels come back unchanged."""
    if not has_panels(params):
        return params

    def output_major(w):
        return w.output_major() if isinstance(w, PanelMajor) else w

    blocks = jax.tree.map(output_major, params["blocks"],
                          is_leaf=lambda w: isinstance(w, Weight))
    return {**params, "blocks": blocks}


def has_panels(params: Params) -> bool:
    """Whether `params` hold `PanelMajor` weights (made by `panel_layout`)."""
    return any(isinstance(w, PanelMajor) for w in jax.tree.leaves(
        params.get("blocks"), is_leaf=lambda w: isinstance(w, Weight)))


def _in_layout(params: Params, panels: bool) -> bool:
    """Whether decode-layout `params` have their block matrices as `panel_layout` (with
    `panels`) or `output_layout` (without) would make them."""
    if not panels:
        return not has_panels(params)
    return not any(_panel_groups(p) for p in params["blocks"])  # checked, nothing copied


def quantize(params: Params, method: str | None) -> Params:
    """`params` (either layout) with every weight matrix quantized, for inference.

    "int8": weight-only int8 with one float32 scale per output channel (symmetric absmax;
    `gpt_jax.layers.Int8Weight`, which cites the scheme): the block matrices, the token
    embedding (which is also the tied output projection, a scale per vocabulary row), the
    untied output projection `lm_head` and the position embedding where the model has them;
    norm scales and biases and every bias stay float32, and the
    model computes in float32 (activations, KV cache, logits as before). Quantized params
    come back in `decode_layout`; already quantized ones come back unchanged; None returns
    `params` as they are.

    Raises:
      ValueError: `method` is not None or one of `QUANTIZE` (the message names it and them).
    """
    check_quantize(method)
    if method is None or is_quantized(params):
        return params
    return _quantize_int8(params)


@jax.jit
def _quantize_int8(params: Params) -> Params:
    params = output_layout(decode_layout(jax.tree.map(lambda a: a.astype(jnp.float32), params)))

    def int8(w):
        return Int8Weight.quantize(w.w_OI) if isinstance(w, OutputMajor) else w

    blocks = jax.tree.map(int8, params["blocks"], is_leaf=lambda w: isinstance(w, OutputMajor))
    tables = {name: Int8Weight.quantize(params[name])
              for name in ("wte", "wpe", "lm_head") if name in params}
    return {**params, "blocks": blocks, **tables}


def quantization_error(params: Params, quantized: Params) -> float:
    """The relative logit error that quantizing `params` into `quantized` is expected to stay
    under: `eps = sqrt(sum over uses of r_m^2)`, with `r_m = |W_m - Q_m|_F / |W_m|_F` the
    exact relative (Frobenius) rounding error of each quantized matrix, a tied token
    embedding counted twice (it is the input embedding and the output projection).

    Derivation (first order): a product `x @ Q^T` is off by `x @ (Q - W)^T`; the rounding
    errors are uncorrelated with `x` and with each other, so its error is about `r_m` of
    its output, relatively. Each product's output is a part of the residual stream (or the
    logits), so its error adds at most `r_m` of the stream's size, and independent errors
    add in quadrature; LayerNorm rescales the stream and its error alike. Hence, over many
    positions, the rms of `logits_int8 - logits_f32` is at most about `eps` times the rms of
    the float32 logits (each position's mean removed: a shift changes no probability), and
    the mean loss moves by at most about `sqrt(2) * eps` times that rms (the target's logit
    and the log-sum-exp each move by about the error's rms). It bounds the rms, not every
    position: a few positions exceed `eps` (README "int8 weights" gives the measurements).
    Per-channel absmax steps give `r_m` of about 0.6-1.2% here.
    """
    return math.sqrt(float(_squared_relative_errors(params, quantized)))


@jax.jit
def _squared_relative_errors(params: Params, quantized: Params) -> jax.Array:
    """The sum of `quantization_error`'s `r_m^2`, a tied token embedding's twice."""
    quantized_leaves = jax.tree.leaves(quantized, is_leaf=lambda w: isinstance(w, Int8Weight))
    original_leaves = jax.tree.leaves(output_layout(decode_layout(params)),
                                      is_leaf=lambda w: isinstance(w, OutputMajor))
    total = jnp.zeros((), jnp.float32)
    for w, q in zip(original_leaves, quantized_leaves, strict=True):
        if isinstance(q, Int8Weight):
            w = (w.w_OI if isinstance(w, OutputMajor) else w).astype(jnp.float32)
            r2 = jnp.sum(jnp.square(q.dequantize() - w)) / jnp.sum(jnp.square(w))
            tied = q is quantized["wte"] and "lm_head" not in quantized
            total += 2 * r2 if tied else r2
    return total


def check_quantize(method) -> None:
    """Raise ValueError unless `method` is None or one of `QUANTIZE`, naming both."""
    if method is not None and method not in QUANTIZE:
        raise ValueError(f"quantize must be None or one of {', '.join(map(repr, QUANTIZE))}, "
                         f"got {method!r}")


def is_quantized(params: Params) -> bool:
    """Whether `params` hold int8 weights (made by `quantize`)."""
    return isinstance(params.get("wte"), Int8Weight)


def inference_params(params: Params, config: GPTConfig, dtype="float32",
                     quantize_method: str | None = None, panels: bool = True) -> Params:
    """`params` as `inference.LLM` and `inference.Engine` run them, made once: checked
    against `config`, cast to `dtype` (the float dtype of the weights and KV cache), in
    `decode_layout`, and quantized by `quantize_method` (see `quantize`). Quantized, the
    float params stay float32 whatever `dtype` (then only the KV cache's dtype). Params
    already quantized stay so (as if `quantize_method` were "int8"). With `panels`, float32
    and unquantized, where the panel kernel runs (the default backend is the CPU and
    `gpt_jax.kernels.panel_matmul.use_kernel()`), the large block matrices are laid out in
    panels (`panel_layout`: faster decode steps of several rows); pass False for params to
    be sharded over several devices (`gpt_jax.tensor_parallel`). On one CPU device the
    result is packed into transparent huge pages (`gpt_jax.huge_pages.pack`: the decode
    step reads them faster).

    Raises:
      ValueError: an unknown `quantize_method` (see `check_quantize`), or params whose
        shapes do not match `config` (`check_params`).
    """
    check_quantize(quantize_method)
    check_params(params, config)
    dtype = jnp.dtype(dtype)
    panels = (panels and quantize_method is None and dtype == jnp.float32
              and jax.default_backend() == "cpu" and panel_kernel.use_kernel())
    if is_quantized(params) or (quantize_method is None and decode_layout(params) is params
                                and {a.dtype for a in jax.tree.leaves(params)} == {dtype}
                                and _in_layout(params, panels)):
        return huge_pages.pack(params)  # made so already (an LLM's, given to its Engine)
    return huge_pages.pack(_inference_params(params, dtype, quantize_method, panels))


@functools.partial(jax.jit, static_argnames=("dtype", "quantize_method", "panels"))
def _inference_params(params: Params, dtype, quantize_method, panels) -> Params:
    if quantize_method is not None:
        return quantize(params, quantize_method)
    params = output_layout(decode_layout(jax.tree.map(lambda a: a.astype(dtype), params)))
    return panel_layout(params) if panels else params


@functools.lru_cache(maxsize=32)
def _expected_shapes(config: GPTConfig, layout: str):
    shapes = jax.eval_shape(lambda key: init_params(config, key), jax.random.key(0))
    if layout == "int8":
        return jax.eval_shape(lambda p: quantize(p, "int8"), shapes)
    if layout == "panels":
        return jax.eval_shape(lambda p: panel_layout(decode_layout(p)), shapes)
    return jax.eval_shape(decode_layout, shapes) if layout == "decode" else shapes


def check_params(params: Params, config: GPTConfig) -> None:
    """Check that `params` (stacked, in `decode_layout` or quantized) have the shapes `config`
    implies.

    Raises:
      ValueError: naming the first parameter whose path or shape differs, with the shape the
        config expects (for example a d_model, vocab_size or n_heads that does not match the
        weights), or a parameter the config's model has not (a position table with rotary
        positions), before anything is traced with them.
    """
    layout = "int8" if is_quantized(params) else "panels" if has_panels(params) else \
        "decode" if isinstance(params.get("blocks"), tuple) else "stacked"
    expected = jax.tree_util.tree_flatten_with_path(_expected_shapes(config, layout))[0]
    actual = jax.tree_util.tree_flatten_with_path(params)[0]
    got = {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in actual}
    for path, leaf in expected:
        name = jax.tree_util.keystr(path)
        if got.get(name) != tuple(leaf.shape):
            raise ValueError(
                f"params{name} has shape {got.get(name, 'missing')}, but the config expects "
                f"{tuple(leaf.shape)} (d_model={config.d_model}, n_heads={config.n_heads}, "
                f"kv_heads={config.kv_heads}, head_dim={config.head_dim}, n_layers="
                f"{config.n_layers}, vocab_size={config.vocab_size}, max_seq_len="
                f"{config.max_seq_len}, positions={config.positions!r}, mlp={config.mlp!r}, "
                f"tie_embeddings={config.tie_embeddings}): do the config and the params "
                "belong together?")
    extra = sorted(set(got) - {jax.tree_util.keystr(path) for path, _ in expected})
    if extra:
        raise ValueError(f"params{extra[0]} is not a parameter of this config's model "
                         f"(positions={config.positions!r}, mlp={config.mlp!r}, tie_embeddings="
                         f"{config.tie_embeddings}, its biases and norms): do the config and "
                         "the params belong together?")
