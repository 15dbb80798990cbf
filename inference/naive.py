"""The reference: generation by full recomputation, no KV cache.

Every step runs `gpt_jax.forward` over the whole sequence so far and reads the logits at each
row's last token; a sequence longer than the context ("crop" requests) runs from its last
max_seq_len tokens, as nanoGPT's `sample` does (`idx_cond = idx[:, -block_size:]`). It
shares the loop, sampler and stop logic of `inference.decode`, so any difference from
`generate` is the cache's fault.

Shapes: the letters of `gpt_jax.model`, and here C, the context (max_seq_len); prompts are
counted in words.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from gpt_jax.model import forward
from inference.generation import Completion, run


@struct.dataclass
class Sequences:
    tokens: jax.Array  # [B, S] int32, prompt and generated tokens so far, right-padded
    lengths: jax.Array  # [B] int32, real tokens per row


def _last_logits(params, config, seqs: Sequences):
    """float32 `[B, V]`: each row's next-token logits, from `forward` over the row's last
    max_seq_len tokens (its first ones while it is shorter: the same, by causality)."""
    B, S = seqs.tokens.shape
    C = config.max_seq_len
    start_B = jnp.clip(seqs.lengths - C, 0, max(S - C, 0))
    window_BC = jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, min(S, C)))(
        seqs.tokens, start_B)
    logits_BCV = forward(params, window_BC, config)
    last_B = seqs.lengths - 1 - start_B
    return jnp.take_along_axis(logits_BCV, last_B[:, None, None], axis=1)[:, 0]


def naive_model(params, config, capacity, cache_dtype):
    """`(prefill_fn, step_fn)` that recompute the full sequence every step (the interface of
    `inference.steps.cached_model`)."""
    del cache_dtype  # nothing is cached

    def prefill_fn(prompt_tokens, prompt_lengths, source_B, forked):
        del forked  # every row is computed from scratch anyway
        n_prompts, T = prompt_tokens.shape
        seqs = Sequences(jnp.zeros((n_prompts, capacity), jnp.int32).at[:, :T].set(prompt_tokens),
                         prompt_lengths)
        seqs = jax.tree.map(lambda x: x[source_B], seqs)  # decode row b is prompt source_B[b]
        return _last_logits(params, config, seqs), seqs

    def step_fn(tokens_B, seqs, advance_B, window_BW=None):
        del window_BW  # the sequences are kept whole here
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
