"""Parameter initialisation and counting.

Parameters are a nested dict of arrays; the per-layer weights under "blocks" are stacked
along a leading L axis so the layers run as one `lax.scan`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from gpt_jax.config import GPTConfig
from gpt_jax.model import Params, decode_layout


def init_params(config: GPTConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm scales,
    and the two residual projections scaled by 1/sqrt(2 * n_layers) (GPT-2 paper, sec. 2.3).

    Returns a params pytree of `dtype` arrays with shapes
      wte [V, D], wpe [max_seq_len, D], ln_f {scale, bias} [D], and under "blocks" (each with a
      leading [L]): ln1/ln2 {scale, bias} [D]; attn w_q [D, N, H], w_k/w_v [D, K, H],
      b_q [N, H], b_k/b_v [K, H], w_o [N, H, D], b_o [D]; mlp w_in [D, F], b_in [F],
      w_out [F, D], b_out [D].
    """
    L, D, N, K, H, F = (
        config.n_layers, config.d_model, config.n_heads, config.kv_heads, config.head_dim,
        config.d_ff,
    )
    std, resid_std = 0.02, 0.02 / math.sqrt(2 * L)
    keys = iter(jax.random.split(key, 8))

    def normal(shape, scale=std):
        return (scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def zeros(*shape):
        return jnp.zeros(shape, dtype)

    def norm(*lead):
        return {"scale": jnp.ones((*lead, D), dtype), "bias": zeros(*lead, D)}

    return {
        "wte": normal((config.vocab_size, D)),
        "wpe": normal((config.max_seq_len, D), 0.01),
        "blocks": {
            "ln1": norm(L),
            "attn": {
                "w_q": normal((L, D, N, H)), "b_q": zeros(L, N, H),
                "w_k": normal((L, D, K, H)), "b_k": zeros(L, K, H),
                "w_v": normal((L, D, K, H)), "b_v": zeros(L, K, H),
                "w_o": normal((L, N, H, D), resid_std), "b_o": zeros(L, D),
            },
            "ln2": norm(L),
            "mlp": {
                "w_in": normal((L, D, F)), "b_in": zeros(L, F),
                "w_out": normal((L, F, D), resid_std), "b_out": zeros(L, D),
            },
        },
        "ln_f": norm(),
    }


def param_count(params: Params) -> int:
    """Total number of scalars (the tied output projection counted once)."""
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


@functools.lru_cache(maxsize=32)
def _expected_shapes(config: GPTConfig, laid_out: bool):
    shapes = jax.eval_shape(lambda key: init_params(config, key), jax.random.key(0))
    return jax.eval_shape(decode_layout, shapes) if laid_out else shapes


def check_params(params: Params, config: GPTConfig) -> None:
    """Check that `params` (stacked, or in `decode_layout`) have the shapes `config` implies.

    Raises:
      ValueError: naming the first parameter whose path or shape differs, with the shape the
        config expects (for example a d_model, vocab_size or n_heads that does not match the
        weights), before anything is traced with them.
    """
    laid_out = isinstance(params.get("blocks"), tuple)
    expected = jax.tree_util.tree_flatten_with_path(_expected_shapes(config, laid_out))[0]
    actual = jax.tree_util.tree_flatten_with_path(params)[0]
    got = {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in actual}
    for path, leaf in expected:
        name = jax.tree_util.keystr(path)
        if got.get(name) != tuple(leaf.shape):
            raise ValueError(
                f"params{name} has shape {got.get(name, 'missing')}, but the config expects "
                f"{tuple(leaf.shape)} (d_model={config.d_model}, n_heads={config.n_heads}, "
                f"kv_heads={config.kv_heads}, n_layers={config.n_layers}, vocab_size="
                f"{config.vocab_size}, max_seq_len={config.max_seq_len}): do the config and "
                "the params belong together?")
