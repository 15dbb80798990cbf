"""Padded sizes and token budgets of the engine's calls, so that few programs are compiled:
the power-of-two buckets of prompt lengths and rows, and the prompt tokens a mixed chunk takes
beside decoding rows (`mixed_budget`). Plain Python: no JAX here."""

from __future__ import annotations

MIN_PROMPT_BUCKET = 16  # the shortest padded prompt length of a prefill call

# Prompt tokens of a mixed chunk per decode token it runs, with one prompt waiting
# (`mixed_budget`): on CPU a step costs about in proportion to its tokens, so a mixed
# chunk of n decoding rows beside one prompt costs about 1 + this share of a decode chunk
# (the stall bound; benchmarks/README.md, "Serving").
MIXED_PROMPT_SHARE = 0.25


def mixed_budget(n_decode: int, queued_tokens: int, decode_chunk: int,
                 max_prefill_tokens: int) -> int:
    """Prompt tokens of a mixed chunk that decodes `n_decode` sequences `decode_chunk`
    tokens each, with `queued_tokens` prompt tokens waiting behind the prompt going in
    (every other prefilling sequence's rest, and the queued ones' prompts). With none
    decoding, `max_prefill_tokens` (nothing to stall). Else MIXED_PROMPT_SHARE of the
    chunk's decode tokens in whole blocks of MIN_PROMPT_BUCKET tokens, at least one block,
    plus the queued tokens in whole blocks, at most `max_prefill_tokens`. One long prompt
    alone goes in at the share (a short one whole: `Scheduler.mixed_work`), so a call costs
    at most about 1.25 decode chunks on CPU (issue 39's stall bound); prompts queued
    behind it go in with it, up to the whole budget, as vLLM's and Sarathi-Serve's fixed
    token budget is filled whenever prompts wait (arrivals that bring more prompt tokens per decode token than the share would
    queue behind it: benchmarks/README.md, "Serving"). Example: 16 rows, chunk 8: 32
    alone; 32 + 80 = 112 with a 72-token prompt queued; 128 (the default
    `max_prefill_tokens`) with more.

    Raises:
      ValueError: a negative count, decode_chunk or max_prefill_tokens below 1.
    """
    if n_decode < 0 or queued_tokens < 0 or decode_chunk < 1 or max_prefill_tokens < 1:
        raise ValueError(f"mixed_budget needs n_decode, queued_tokens >= 0 and decode_chunk, "
                         f"max_prefill_tokens >= 1; got {n_decode}, {queued_tokens}, "
                         f"{decode_chunk}, {max_prefill_tokens}")
    if n_decode == 0:
        return max_prefill_tokens
    share = int(MIXED_PROMPT_SHARE * decode_chunk * n_decode)
    share = max(share - share % MIN_PROMPT_BUCKET, MIN_PROMPT_BUCKET)
    return min(max_prefill_tokens, share + bucket_up(queued_tokens, MIN_PROMPT_BUCKET))


def bucket(n: int, floor: int = 1) -> int:
    """The power of two at or above `n` (and `floor`): padded sizes, so few programs."""
    return max(floor, 1 << max(0, n - 1).bit_length())


def bucket_up(n: int, step: int) -> int:
    """`n` rounded up to a multiple of `step`."""
    return -(-n // step) * step
