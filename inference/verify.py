"""The verification step of speculative decoding (`inference.speculative`): every row feeds
its last sampled token and its drafted tokens, T = k + 1 positions, through the paged cache
in one forward and gets the logits of each position.

It is the prefill row function (`inference.steps`) keeping every position's logits: T new
tokens of one sequence attend to its pages and causally to each other
(`gpt_jax.model.transformer`), vmapped over the batch, and all of a row's fed tokens are
stored (`gpt_jax.cache.write`); the caller then sets the row's length to the tokens it
accepted, so keys and values past it are overwritten later. A chunk step in which no row
drafts runs the plain decode step instead (one position, the CPU decode kernel), so rows
that stopped drafting pay nothing for the others' speculation once all have.

Shapes: the letters of `gpt_jax.model`; here T = width + 1, the fed positions.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt_jax.model import lm_head, transformer
from gpt_jax.params import decode_layout
from inference.steps import run_rows, run_step


def _verify_row(params, tokens_T, cache_row, bound, *, config):
    x_TD, new_kv = transformer(params, tokens_T, cache_row, config, bound)
    return lm_head(params, x_TD, config), new_kv


def run_verify(params, config, tokens_BT, cache, n_valid_B):
    """Feed `tokens_BT` (int32, row b's first `n_valid_B[b]` real) at each row's length.
    Returns `(logits_BTV, cache)`: float32 logits of every position (position t predicts the
    token after tokens_BT[:, t]), and the cache with the real tokens stored and the lengths
    advanced by `n_valid_B`."""
    row = functools.partial(_verify_row, config=config)
    return run_rows(row, params, cache, tokens_BT, n_valid_B.astype(jnp.int32))


def verifier(params, config):
    """`verify_fn(tokens_BT, cache, n_valid_B) -> (logits_BTV, cache)` over weights laid
    out once (`decode_layout`): `run_verify` when some row feeds more than one token, else
    the decode step (`inference.steps.run_step`) on position 0, whose logits land at
    position 0 (the others are zeros, which no row reads)."""
    params = decode_layout(params)

    def verify_fn(tokens_BT, cache, n_valid_B):
        def verify(cache):
            return run_verify(params, config, tokens_BT, cache, n_valid_B)

        def decode(cache):
            logits_BV, cache = run_step(params, config, tokens_BT[:, 0], cache, n_valid_B > 0)
            return jnp.zeros(tokens_BT.shape + logits_BV.shape[-1:]).at[:, 0].set(logits_BV), cache

        return jax.lax.cond((n_valid_B > 1).any(), verify, decode, cache)

    return verify_fn
