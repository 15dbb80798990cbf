"""The verification step of speculative decoding (`inference.speculative`): every row feeds
its last sampled token and its drafted tokens, T = k + 1 positions, through the paged cache
in one forward and gets the logits of each position.

It is the prefill row function (`inference.steps`) keeping every position's logits: T new
tokens of one sequence attend to its pages and causally to each other
(`gpt_jax.model.transformer`), vmapped over the batch, and all of a row's fed tokens are
stored (`gpt_jax.cache.write`); the caller then sets the row's length to the tokens it
accepted, so keys and values past it are overwritten later. On CPU the T positions read the
row's pages in one pass of the decode kernel (`gpt_jax.attention.KERNEL_MAX_NEW_TOKENS`), as
a decode step does, and with few rows in all (batch times T, up to 8) the matrix products
run in a CPU kernel (`gpt_jax.kernels.few_rows_matmul`) instead of XNNPACK. A chunk step in
which no row drafts feeds only position 0 (the decode step's work), so rows that stopped
drafting pay nothing for the others' speculation once all have.

Shapes: the letters of `gpt_jax.model`; here T = width + 1, the fed positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt_jax import cache as kv
from gpt_jax.cache import CACHE_ROW_AXES
from gpt_jax.kernels import few_rows_matmul as few_rows_kernel
from gpt_jax.model import lm_head, transformer
from gpt_jax.params import decode_layout


def _verify_row(params, tokens_T, cache_row, bound, *, config):
    x_TD, new_kv = transformer(params, tokens_T, cache_row, config, bound)
    return lm_head(params, x_TD, config), new_kv


def _forward(params, config, tokens_BT, cache):
    """Every row's logits and new keys and values for `tokens_BT` fed at its length, the
    pools only read: `(logits_BTV, (k_LBTKH, v_LBTKH))`."""
    row = functools.partial(_verify_row, config=config)
    with few_rows_kernel.rows_per_call(tokens_BT.shape[0]):  # few rows: the CPU kernel
        return jax.vmap(row, in_axes=(None, 0, CACHE_ROW_AXES, None))(
            params, tokens_BT, cache, cache.lengths.max())


def run_verify(params, config, tokens_BT, cache, n_valid_B):
    """Feed `tokens_BT` (int32, row b's first `n_valid_B[b]` real) at each row's length.
    Returns `(logits_BTV, cache)`: float32 logits of every position (position t predicts the
    token after tokens_BT[:, t]), and the cache with the real tokens stored and the lengths
    advanced by `n_valid_B`."""
    logits_BTV, (k_LBTKH, v_LBTKH) = _forward(params, config, tokens_BT, cache)
    return logits_BTV, kv.write(cache, k_LBTKH, v_LBTKH, n_valid_B.astype(jnp.int32),
                                after=logits_BTV)


def verifier(params, config):
    """`verify_fn(tokens_BT, cache, n_valid_B) -> (logits_BTV, cache)` over weights laid
    out once (`decode_layout`): `run_verify`, whose forward feeds only position 0 (one
    token per row, the decode step's work) when no row feeds more than one token; its
    logits land at position 0 (the others are zeros, which no row reads). Only the forward,
    which reads the pools, is inside the `lax.cond`; the write comes after it (a cond whose
    branches wrote the pools made XLA copy them: `inference.decode.decode_one`)."""
    params = decode_layout(params)

    def verify_fn(tokens_BT, cache, n_valid_B):
        T = tokens_BT.shape[1]

        def one(cache):
            logits_B1V, new_kv = _forward(params, config, tokens_BT[:, :1], cache)
            pad = lambda x: jnp.pad(x, [(0, 0), (0, T - 1)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
            return pad(logits_B1V), jax.tree.map(pad, new_kv)

        logits_BTV, (k_LBTKH, v_LBTKH) = jax.lax.cond(
            (n_valid_B > 1).any(), lambda c: _forward(params, config, tokens_BT, c), one, cache)
        return logits_BTV, kv.write(cache, k_LBTKH, v_LBTKH, n_valid_B.astype(jnp.int32),
                                    after=logits_BTV)

    return verify_fn
