"""The reference: generation by full recomputation, no KV cache.

Every step runs `gpt_jax.forward` over the whole sequence so far and reads the logits at each
row's last token. It shares the loop, sampler and stop logic of `inference.engine`, so any
difference from `generate` is the cache's fault.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from gpt_jax.model import forward
from inference.engine import Completion, run


@struct.dataclass
class Sequences:
    tokens: jax.Array  # [B, S] int32, prompt and generated tokens so far, right-padded
    lengths: jax.Array  # [B] int32, real tokens per row


def _last_logits(params, config, seqs: Sequences):
    logits_BSV = forward(params, seqs.tokens, config)
    return jnp.take_along_axis(logits_BSV, (seqs.lengths - 1)[:, None, None], axis=1)[:, 0]


def naive_model(params, config, capacity, cache_dtype):
    """`(prefill_fn, step_fn)` that recompute the full sequence every step (the interface of
    `inference.engine.cached_model`)."""
    del cache_dtype  # nothing is cached

    def prefill_fn(tokens_PT, lengths_P, source_B, forked):
        del forked  # every row is computed from scratch anyway
        P, T = tokens_PT.shape
        seqs = Sequences(jnp.zeros((P, capacity), jnp.int32).at[:, :T].set(tokens_PT), lengths_P)
        seqs = jax.tree.map(lambda x: x[source_B], seqs)  # decode row b is prompt source_B[b]
        return _last_logits(params, config, seqs), seqs

    def step_fn(tokens_B, seqs, advance_B):
        rows = jnp.arange(tokens_B.shape[0])
        write_at = jnp.minimum(seqs.lengths, capacity - 1)
        current_B = seqs.tokens[rows, write_at]
        seqs = Sequences(
            seqs.tokens.at[rows, write_at].set(jnp.where(advance_B, tokens_B, current_B)),
            seqs.lengths + advance_B,
        )
        return _last_logits(params, config, seqs), seqs

    return prefill_fn, step_fn


def naive_generate(params, config, prompts, sampling=None, *, bos_token_id=None,
                   pad_id: int = 0, cache_dtype=jnp.float32) -> list[Completion]:
    """Same arguments and result as `inference.generate`, computed without any cache."""
    return run(params, config, prompts, sampling, model_fns=naive_model,
               bos_token_id=bos_token_id, pad_id=pad_id, cache_dtype=cache_dtype)
