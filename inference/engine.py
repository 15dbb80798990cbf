"""Inference: the jitted prefill and decode step over the paged KV cache, the generation loop
as one XLA program, and `Engine`, which runs the same steps with continuous batching.

Prefill and decode are written for one sequence (`gpt_jax.model.transformer` on one row of a
`PagedKVCache`: its page table and length, the shared page pools read only) and `jax.vmap`ped
over a padded batch, so every row has its own length, write position and positions, and a
row's output never depends on the other rows. The new keys and values of all rows are then
stored with one scatter per layer (`gpt_jax.cache.write`).

`generate` runs the whole token loop inside one jitted program: prefill with the first
token, then a `lax.scan` over a chunk of steps inside a `lax.while_loop` that exits once
every row has finished. A request with
`n > 1` is prefilled once, into the pages of its first sample's row; the other samples'
rows get a copy of those pages. The loop takes the model as two functions (`prefill_fn`,
`step_fn`), so `naive_generate` (inference.naive) runs the same loop, sampler and stop logic
with full recomputation instead of a cache.

`Engine` (continuous batching: requests join and leave between chunks of decode steps) runs
the same `prefill` and decode step on one long-lived cache whose pages the host hands out
(`inference.scheduler`): `engine_prefill` prefills chunks of prompts into their slots and
inserts finished prompts into the decode state with their first token; `engine_decode` runs
one chunk of decode steps for every occupied slot.

Every decode step feeds each running row the token it sampled last and samples its next
(`decode_one`); a prefill ends by sampling each row's first token (`sample_and_record`), so
the first token comes with the prefill.

Past the context (`SamplingParams.context_overflow="crop"`): a row whose cache holds
max_seq_len tokens is predicted from its last max_seq_len tokens run from position 0, as
nanoGPT's `sample` crops (`window_logits`, inside the same step); learned absolute
positions leave nothing in the cache reusable there, so such a row costs a forward over the
window per token, while rows below the context keep decoding from the cache. The decode
state keeps each row's window of tokens for it.

Bounded compilation: prompt length, batch size and max_new_tokens are padded to power-of-two
buckets, and sampling parameters are traced arrays, so a new program is compiled only for a
new bucket. `compile_counts()` reports how many programs each entry point has compiled.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import secrets
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gpt_jax import cache as kv
from gpt_jax.cache import CACHE_ROW_AXES, PagedKVCache
from gpt_jax.config import GPTConfig
from gpt_jax.model import forward_last, lm_head, transformer
from gpt_jax.params import Params, check_params, decode_layout, inference_params
from inference import stopping
from inference.sampling import MAX_LOGPROBS, SamplingArrays, SamplingParams, prompt_hash, sample
from inference.scheduler import (MIN_PROMPT_BUCKET, PrefillWork, Scheduler, Sequence,
                                 Status, bucket)

CHUNK = 8  # decode steps per scan chunk; the loop may stop early at chunk boundaries
PAGE_SIZE = 16  # token slots per KV page, unless a caller chooses another
FINISHED_IDS = 100_000  # finished request ids an Engine remembers (abort of one: no error)
# Ends the message for a request that does not fit the context under "error" (the server,
# whose requests cannot crop, and the CLI, whose flag is spelled otherwise, replace it).
CROP_HINT = ' (or context_overflow="crop" to predict each token from the last max_seq_len)'


# ----------------------------------------------------------------------------- model steps


def _prefill_row(params, tokens_T, n_valid, cache_row, bound, *, config, padding_side):
    if padding_side == "left":  # move the real tokens to the front: positions start at 0
        tokens_T = jnp.roll(tokens_T, n_valid - tokens_T.shape[0])
    x_TD, new_kv = transformer(params, tokens_T, cache_row, config, bound)
    return lm_head(params, x_TD[jnp.maximum(n_valid - 1, 0)], config), new_kv


def _decode_row(params, token, cache_row, bound, *, config):
    x_TD, new_kv = transformer(params, token[None], cache_row, config, bound)
    return lm_head(params, x_TD[0], config), new_kv


def _select(cache: PagedKVCache, slots_R) -> PagedKVCache:
    """The rows `slots_R` of the cache (pools shared); a slot past the last is an empty row."""
    take = lambda x, fill: jnp.take(x, slots_R, axis=0, mode="fill", fill_value=fill)  # noqa: E731
    return cache.replace(page_table=take(cache.page_table, kv.NO_PAGE),
                         lengths=take(cache.lengths, 0), overflow=take(cache.overflow, False))


def _merge(cache: PagedKVCache, slots_R, rows: PagedKVCache) -> PagedKVCache:
    """`cache` with the pools of `rows` and, at `slots_R`, its lengths and overflow flags."""
    put = lambda x, y: x.at[slots_R].set(y, mode="drop")  # noqa: E731
    return cache.replace(k=rows.k, v=rows.v, lengths=put(cache.lengths, rows.lengths),
                         overflow=put(cache.overflow, rows.overflow))


def run_rows(row_fn, params, cache: PagedKVCache, tokens, n_valid_B, *batched, slots=None):
    """vmap `row_fn(params, tokens_row, *batched_rows, cache_row, bound)` over the rows of the
    cache (or the rows `slots` of it), then store every row's first `n_valid_B` new keys and
    values. `bound`, the longest row's length, is passed unmapped: every row reads the same
    pages, so the attention loop has one trip count (the live length).
    Returns `(logits, cache)`."""
    rows = cache if slots is None else _select(cache, slots)
    in_axes = (None, 0) + (0,) * len(batched) + (CACHE_ROW_AXES, None)
    logits, (k_LBTKH, v_LBTKH) = jax.vmap(row_fn, in_axes=in_axes)(
        params, tokens, *batched, rows, rows.lengths.max())
    rows = kv.write(rows, k_LBTKH, v_LBTKH, n_valid_B, after=logits)
    return logits, (rows if slots is None else _merge(cache, slots, rows))


def _prefill(params, config, tokens_BT, lengths_B, cache, slots=None, padding_side="right"):
    row = functools.partial(_prefill_row, config=config, padding_side=padding_side)
    return run_rows(row, params, cache, tokens_BT, lengths_B, lengths_B, slots=slots)


def _decode(params, config, tokens_B, cache, advance_B):
    row = functools.partial(_decode_row, config=config)
    return run_rows(row, params, cache, tokens_B, advance_B.astype(jnp.int32))


def window_logits(params, config, window_BW, past_B, logits_BV, slots_R=None):
    """`logits_BV` with each `past_B` row's replaced by the logits of its window
    `window_BW[b]` run from position 0 (`gpt_jax.model.forward_last`): nanoGPT's `sample`,
    which crops the sequence to its last `block_size` tokens (`idx_cond =
    idx[:, -block_size:]`) before every step. With learned absolute positions every token
    of the window moves to a new position at each step, so nothing cached can be reused:
    each past row costs a forward over W tokens per token.
    Only the rows `slots_R` (int32 `[R]`, out-of-range entries padding) are computed, all
    rows by default; the forward runs only on steps where some row is past.

    Args:
      window_BW: int32, each row's last W (= max_seq_len) tokens, the newest last.
      past_B: bool, the row's context is full (its cache holds max_seq_len tokens).
      logits_BV: float32, the rows' logits from the cache.
    Returns:
      float32 `[B, V]`.
    """
    slots_R = jnp.arange(past_B.shape[0]) if slots_R is None else slots_R

    def run(logits_BV):
        take = lambda x, fill: jnp.take(x, slots_R, axis=0, mode="fill", fill_value=fill)  # noqa: E731
        past_R = take(past_B, False)
        window_RV = forward_last(params, take(window_BW, 0), config)
        window_RV = jnp.where(past_R[:, None], window_RV, take(logits_BV, 0.0))
        return logits_BV.at[slots_R].set(window_RV, mode="drop")

    return jax.lax.cond(past_B.any(), run, lambda x: x, logits_BV)


def _step(params, config, tokens_B, cache, advance_B, window_BW=None, slots_R=None):
    """One decode step over the cache; a row whose context is full (only a
    `context_overflow="crop"` request gets there) is not written to the cache but predicted
    from its window instead (`window_logits`; skipped when `window_BW` is None or has no
    columns, or `slots_R` is empty). Returns `(logits_BV, cache)`."""
    past_B = cache.lengths >= config.max_seq_len
    logits_BV, cache = _decode(params, config, tokens_B, cache, advance_B & ~past_B)
    if window_BW is not None and window_BW.shape[1] and (slots_R is None or slots_R.shape[0]):
        logits_BV = window_logits(params, config, window_BW, advance_B & past_B, logits_BV,
                                  slots_R)
    return logits_BV, cache


@functools.partial(jax.jit, static_argnames=("config", "padding_side"))
def prefill(params: Params, config: GPTConfig, tokens_BT, lengths_B, cache: PagedKVCache,
            slots=None, padding_side: str = "right"):
    """Run padded prompts (or prompt chunks) into the cache. Returns `(logits_BV, cache)`.

    Args:
      tokens_BT: int32 tokens padded to a common length T; row b's real tokens are its
        first `lengths_B[b]` (`padding_side="right"`) or its last (`"left"`).
      lengths_B: int32 real token counts, >= 1.
      cache: a PagedKVCache; row b's tokens are written from its slot's current length (0
        for a fresh slot; a later chunk of a prompt continues where the last one ended and
        attends to it through the pages).
      slots: int32 `[B]`, the cache slot of each row (default: row b is slot b); a slot
        past the last is a padding row that writes nothing.
    Returns:
      float32 next-token logits `[B, V]` at each row's last real token, and the cache with
      those slots' lengths advanced. A slot whose tokens do not fit its pages writes none
      and is flagged in `cache.overflow` (check bounds before calling; `generate` and
      `Engine` do).
    """
    return _prefill(params, config, tokens_BT, lengths_B, cache, slots, padding_side)


@functools.partial(jax.jit, static_argnames="config")
def decode_step(params: Params, config: GPTConfig, tokens_B, cache: PagedKVCache):
    """Feed one token per slot at its current length. Returns `(logits_BV, cache)`, float32
    logits `[B, V]` and the cache with every slot's length advanced by one."""
    return _decode(params, config, tokens_B, cache, jnp.ones(tokens_B.shape, bool))


# ----------------------------------------------------------------------------- the loop


@struct.dataclass
class DecodeState:
    model: PagedKVCache | struct.PyTreeNode  # the cache (or, for naive decoding, the sequences)
    next_token: jax.Array  # [B] int32, the row's last sampled token, fed at its next step
    tokens: jax.Array  # [B, N] int32, generated tokens, at index = the row's step
    logprobs: jax.Array  # [B, N] float32, model log-prob of each token (0 if none asked, R = 0)
    top_ids: jax.Array  # [B, N, R] int32, most likely alternatives per step (R = 0 if off)
    top_logprobs: jax.Array  # [B, N, R] float32, their log-probs
    step: jax.Array  # [B] int32, tokens the row has generated (the index of its next one)
    done: jax.Array  # [B] bool, row has finished (or holds no request)
    finish: jax.Array  # [B] int32, stopping.RUNNING / EOS / STOP / LENGTH
    num_tokens: jax.Array  # [B] int32, output tokens (EOS kept, a token stop sequence cut)
    recent: jax.Array  # [B, M] int32, last M generated tokens (stopping.BEFORE_START before)
    # [B, W] int32, the row's last W tokens of prompt and output, next_token last (pad before
    # the prompt); W = max_seq_len where a row may outgrow the context ("crop"), else 0
    window: jax.Array
    prompt_seen: jax.Array  # [B, V] bool, token occurs among the row's real prompt tokens
    output_counts: jax.Array  # [B, V] int32, occurrences among the generated tokens


# (tokens_B, model_state, advance_B, window_BW) -> (logits_BV, model_state); window_BW is
# DecodeState.window, which a model that outgrows its context predicts from
StepFn = Callable


def prompt_seen(tokens_PT, lengths_P, vocab_size: int):
    """bool `[P, V]`: the token occurs among the row's real prompt tokens (never padding)."""
    P, T = tokens_PT.shape
    real_PT = jnp.arange(T)[None, :] < lengths_P[:, None]
    return jnp.zeros((P, vocab_size), jnp.int32).at[jnp.arange(P)[:, None], tokens_PT].add(real_PT) > 0


def prompt_window(tokens_PT, lengths_P, width: int, pad_id: int = 0):
    """int32 `[P, width]`: the last `width` real tokens of each right-padded prompt, right
    aligned, `pad_id` before a shorter prompt."""
    T = tokens_PT.shape[1]
    position_PW = lengths_P[:, None] - width + jnp.arange(width)[None, :]
    tokens_PW = jnp.take_along_axis(tokens_PT, jnp.clip(position_PW, 0, T - 1), axis=1)
    return jnp.where(position_PW >= 0, tokens_PW, pad_id).astype(jnp.int32)


def init_state(model, seen_BV, stops, window_BW, *, n_steps, n_top, pad_id=0) -> DecodeState:
    """The decode state before the first token (sampled from the prefill's logits by
    `sample_and_record`): the token buffer holds `pad_id`, which a finished row's places keep.
    `window_BW`: each row's prompt window (`prompt_window`; `[B, 0]` when no row outgrows
    the context)."""
    B, V = seen_BV.shape
    done_B = stops.max_new_tokens <= 0
    return DecodeState(
        model=model,
        next_token=jnp.full((B,), pad_id, jnp.int32),
        tokens=jnp.full((B, n_steps), pad_id, jnp.int32),
        logprobs=jnp.zeros((B, n_steps), jnp.float32),
        top_ids=jnp.zeros((B, n_steps, n_top), jnp.int32),
        top_logprobs=jnp.zeros((B, n_steps, n_top), jnp.float32),
        step=jnp.zeros((B,), jnp.int32),
        done=done_B,
        finish=jnp.where(done_B, stopping.LENGTH, stopping.RUNNING).astype(jnp.int32),  # not weak
        num_tokens=jnp.zeros((B,), jnp.int32),
        recent=jnp.full((B, stops.stop_sequences.shape[-1]), stopping.BEFORE_START, jnp.int32),
        window=window_BW,
        prompt_seen=seen_BV,
        output_counts=jnp.zeros((B, V), jnp.int32),
    )


def _token_logprobs(logits_BV, token_B, wanted_B, n_top: int):
    """The sampled tokens' log-probs `[B]` and the `n_top` most likely `([B, R], [B, R])`,
    computed only when some row asked (`wanted_B`): the [B, V] log-softmax and top-k cost
    ~3% of a gpt2 batch-32 step."""
    B = token_B.shape[0]

    def compute(logits_BV):
        logprobs_BV = jax.nn.log_softmax(logits_BV, axis=-1)
        token_logprob_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], axis=-1)[:, 0]
        top_logprobs_BR, top_ids_BR = jax.lax.top_k(logprobs_BV, n_top)
        return token_logprob_B, top_logprobs_BR, top_ids_BR.astype(jnp.int32)

    def skip(_):
        return (jnp.zeros((B,), jnp.float32), jnp.zeros((B, n_top), jnp.float32),
                jnp.zeros((B, n_top), jnp.int32))

    return jax.lax.cond(wanted_B.any(), compute, skip, logits_BV)


def _shift_in(buffer_BM, token_B, active_B):
    """`buffer_BM` with `token_B` appended (the oldest dropped) in the `active_B` rows."""
    if not buffer_BM.shape[1]:
        return buffer_BM
    shifted_BM = jnp.concatenate([buffer_BM[:, 1:], token_B[:, None]], axis=1)
    return jnp.where(active_B[:, None], shifted_BM, buffer_BM)


def sample_and_record(state: DecodeState, logits_BV, active_B, rows: SamplingArrays,
                      stops: stopping.StopArrays, pad_id: int) -> DecodeState:
    """Sample the next token of every `active_B` row from `logits_BV` and record it at the
    row's step: it becomes the row's `next_token`, fed at its next decode step unless the
    row has now finished. Other rows do not change.

    Stop checks, in order: an EOS id (kept), a token stop sequence the output now ends with
    (cut: `num_tokens` drops its length), `max_new_tokens`. Inside a row's `min_tokens` (its
    step below it) no EOS id can be sampled (`stopping.ban_early_eos`) and no stop sequence
    counts. Log-probs are the model's, from `logits_BV` before any of that.
    """
    B, n_steps = state.tokens.shape
    step_B = state.step
    token_B = sample(stopping.ban_early_eos(logits_BV, step_B, stops), rows, state.prompt_seen,
                     state.output_counts, step_B, pad_id)
    token_B = jnp.where(active_B, token_B, pad_id)
    token_logprob_B, top_logprobs_BR, top_ids_BR = _token_logprobs(
        logits_BV, token_B, active_B & (rows.logprobs >= 0), state.top_ids.shape[-1])

    num_tokens_B = state.num_tokens + active_B
    recent_BM = _shift_in(state.recent, token_B, active_B)
    eos_B = active_B & stopping.is_eos(token_B, stops.stop_token_ids)
    stop_len_B = jnp.where(active_B & ~eos_B & (step_B >= stops.min_tokens),
                           stopping.matched_stop_length(recent_BM, stops.stop_sequences), 0)
    stop_B = stop_len_B > 0
    full_B = active_B & (num_tokens_B >= stops.max_new_tokens)
    finish_B = jnp.select([eos_B, stop_B, full_B],
                          [stopping.EOS, stopping.STOP, stopping.LENGTH], state.finish)
    # index step mod n_steps: the Engine's buffer is a ring, read by the host every chunk
    row_B, at_B = jnp.arange(B), jnp.where(active_B, step_B % n_steps, n_steps)  # n_steps: dropped
    record = lambda buf, x: buf.at[row_B, at_B].set(x, mode="drop")  # noqa: E731
    return state.replace(
        next_token=jnp.where(active_B, token_B, state.next_token),
        tokens=record(state.tokens, token_B),
        logprobs=record(state.logprobs, token_logprob_B),
        top_ids=record(state.top_ids, top_ids_BR),
        top_logprobs=record(state.top_logprobs, top_logprobs_BR),
        step=step_B + active_B,
        done=state.done | eos_B | stop_B | full_B,
        finish=finish_B,
        num_tokens=num_tokens_B - stop_len_B,
        recent=recent_BM,
        window=_shift_in(state.window, token_B, active_B),
        output_counts=state.output_counts.at[row_B, token_B].add(active_B.astype(jnp.int32)),
    )


def decode_one(state: DecodeState, step_fn: StepFn, rows: SamplingArrays,
               stops: stopping.StopArrays, pad_id: int) -> DecodeState:
    """One decode step: feed every running row its last sampled token, then sample and
    record its next (`sample_and_record`). A finished row stops changing: it is fed but does
    not advance, records nothing and adds nothing to its counts."""
    running_B = ~state.done
    # Always feed (finished rows do not advance): a lax.cond skipping the step once every
    # row is done made XLA copy the whole KV cache in both branches on every step.
    logits_BV, model = step_fn(state.next_token, state.model, running_B, state.window)
    return sample_and_record(state.replace(model=model), logits_BV, running_B, rows, stops,
                             pad_id)


def decode_chunk(state, step_fn, rows, stops, pad_id, chunk=CHUNK) -> DecodeState:
    """`chunk` decode steps as one `lax.scan`."""
    body = lambda s, _: (decode_one(s, step_fn, rows, stops, pad_id), None)  # noqa: E731
    return jax.lax.scan(body, state, None, length=chunk)[0]


def decode_loop(state, step_fn, rows, stops, pad_id) -> DecodeState:
    """Scan chunks inside a `lax.while_loop` until every row has finished."""
    return jax.lax.while_loop(
        lambda s: ~s.done.all(),
        lambda s: decode_chunk(s, step_fn, rows, stops, pad_id),
        state,
    )


# ------------------------------------------------------------------- the cached model pair


def fork_pages(cache: PagedKVCache, source_B) -> PagedKVCache:
    """Row b continues the sequence of row `source_B[b]` (the n samples of one prompt): a row
    whose source is another row gets a copy of that row's pages and its length. Rows own
    equal page runs (`gpt_jax.cache.init_cache`)."""
    B, M = cache.page_table.shape
    copied_B = source_B != jnp.arange(B)
    target_BM = jnp.where(copied_B[:, None], cache.page_table, cache.num_pages)
    cache = kv.copy_pages(cache, cache.page_table[source_B].reshape(-1), target_BM.reshape(-1))
    return cache.replace(lengths=cache.lengths[source_B])


def cached_model(params, config, capacity, cache_dtype):
    """`(prefill_fn, step_fn)` over a paged KV cache whose rows own `capacity` token slots
    each, at most max_seq_len (`gpt_jax.cache.init_cache`); `capacity` is the longest a row
    can grow, past max_seq_len only for "crop" requests. `prefill_fn(tokens_PT, lengths_P,
    source_B, forked)` prefills the P prompts into the first decode row of each and, when
    `forked` (static: some prompt has n > 1), copies their pages to the other rows of the
    same prompt. `step_fn` predicts a row whose cache is full from its window (`_step`).
    The weights take the decode layout once here, outside the decode loop."""
    params = decode_layout(params)
    capacity = min(capacity, config.max_seq_len)

    def prefill_fn(tokens_PT, lengths_P, source_B, forked):
        P, B = tokens_PT.shape[0], source_B.shape[0]
        cache = init_cache_rows(config, B, capacity, cache_dtype)
        if not forked:  # row p is prompt p (rows past the prompts are padding)
            logits_PV, cache = _prefill(params, config, tokens_PT, lengths_P, cache)
            return logits_PV[source_B], cache
        first_P = jnp.full((P,), B, jnp.int32).at[source_B].min(jnp.arange(B, dtype=jnp.int32))
        logits_PV, cache = _prefill(params, config, tokens_PT, lengths_P, cache, first_P)
        return logits_PV[source_B], fork_pages(cache, first_P[source_B])

    def step_fn(tokens_B, cache, advance_B, window_BW=None):
        return _step(params, config, tokens_B, cache, advance_B, window_BW)

    return prefill_fn, step_fn


def init_cache_rows(config, batch_size, capacity, cache_dtype) -> PagedKVCache:
    """`gpt_jax.cache.init_cache` with pages of PAGE_SIZE slots (fewer for a short capacity)."""
    return kv.init_cache(config, batch_size, capacity, cache_dtype,
                         page_size=min(PAGE_SIZE, capacity))


def _start(params, config, tokens_PT, lengths_P, source_B, rows, stops, *, capacity, n_steps,
           n_top, model_fns, cache_dtype, forked, pad_id):
    """Prefill, and the first token of every row sampled from the prefill's logits."""
    prefill_fn, _ = model_fns(params, config, capacity, cache_dtype)
    logits_BV, model = prefill_fn(tokens_PT, lengths_P, source_B, forked)
    seen_PV = prompt_seen(tokens_PT, lengths_P, logits_BV.shape[-1])
    width = config.max_seq_len if capacity > config.max_seq_len else 0  # a row may outgrow it
    window_PW = prompt_window(tokens_PT, lengths_P, width, pad_id)
    state = init_state(model, jnp.take(seen_PV, source_B, axis=0), stops,
                       jnp.take(window_PW, source_B, axis=0), n_steps=n_steps, n_top=n_top,
                       pad_id=pad_id)
    return sample_and_record(state, logits_BV, ~state.done, rows, stops, pad_id)


_STATIC = ("config", "capacity", "n_steps", "n_top", "model_fns", "cache_dtype", "pad_id",
           "forked")


def generation(params, config, tokens_PT, lengths_P, source_B, rows, stops, *, capacity,
               n_steps, n_top, model_fns, cache_dtype, pad_id, forked) -> DecodeState:
    """Prefill and the whole decode loop, traceable: `generate_program` jits it and
    `inference.export` exports it. Returns the final DecodeState."""
    state = _start(params, config, tokens_PT, lengths_P, source_B, rows, stops, capacity=capacity,
                   n_steps=n_steps, n_top=n_top, model_fns=model_fns, cache_dtype=cache_dtype,
                   forked=forked, pad_id=pad_id)
    _, step_fn = model_fns(params, config, capacity, cache_dtype)
    return decode_loop(state, step_fn, rows, stops, pad_id)


# Prefill and the whole decode loop, as one compiled program.
generate_program = jax.jit(generation, static_argnames=_STATIC)


def compile_counts() -> dict[str, int]:
    """Programs compiled so far by each jitted entry point (their jit cache sizes)."""
    fns = {"prefill": prefill, "decode_step": decode_step, "generate": generate_program,
           "engine_prefill": engine_prefill, "engine_decode": engine_decode}
    return {name: fn._cache_size() for name, fn in fns.items()}


# ----------------------------------------------------------------------------- host side


@dataclasses.dataclass
class Completion:
    """One generated sequence."""

    tokens: list[int]  # generated token ids (an EOS that ended the row included)
    finish_reason: str  # "eos", "stop" or "length"
    # The request's seed: passed back in SamplingParams (same n) it repeats the sample. With
    # n > 1 the request's completions are its samples 0..n-1 in order, and sample k draws from
    # that seed folded with k (`sampling.row_keys`): all n share the seed, not the draws.
    seed: int
    logprobs: list[float] | None = None  # model log-prob of each token (raw logits)
    top_logprobs: list[dict[int, float]] | None = None  # the `logprobs` most likely per step


@dataclasses.dataclass(frozen=True)
class Batch:
    """Validated requests packed into bucketed arrays: one prefill row per request, one
    decode row per sample."""

    tokens_PT: np.ndarray  # [P, T] int32, right-padded prompts, one row per request
    lengths_P: np.ndarray  # [P] int32
    source_B: np.ndarray  # [B] int32, the prefill row each decode row starts from
    rows: SamplingArrays
    stops: stopping.StopArrays
    requests: tuple[SamplingParams, ...]  # per real row
    seeds: tuple[int, ...]  # per real row
    n_real: int  # rows before batch padding
    capacity: int  # tokens a row can reach; past max_seq_len only when a row may "crop"
    n_steps: int  # token buffer length (bucketed max_new_tokens)
    n_top: int  # alternatives recorded per step
    forked: bool  # some prompt has n > 1 rows (they copy its prefilled pages)


def _expand_sampling(prompts, sampling) -> list[SamplingParams]:
    if sampling is None:
        sampling = SamplingParams()
    if isinstance(sampling, SamplingParams):
        return [sampling] * len(prompts)
    sampling = list(sampling)
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    for s in sampling:
        if not isinstance(s, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(s).__name__}")
    return sampling


def validate(config: GPTConfig, prompts, sampling, bos_token_id=None):
    """Check every request before any work starts. Returns `(prompts, sampling)` lists.

    A request's `context_overflow` (None: "error") says what a request longer than the
    model's context does: under "crop" a prompt longer than config.max_seq_len is cropped to
    its last max_seq_len tokens (nanoGPT's `idx[:, -block_size:]`) and max_new_tokens may
    take it past the context; under "error" neither is allowed.

    Raises:
      ValueError: a token id that is not an integer or is outside [0, vocab_size); an empty
        prompt without a BOS id;
        under "error", a prompt length + max_new_tokens above config.max_seq_len (both
        numbers named, and "crop" suggested);
        a stop_token_id, stop_sequences id or logit_bias id outside the vocabulary (the id
        and vocab_size named).
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of token-id lists")
    sampling = _expand_sampling(prompts, sampling)
    V = config.vocab_size
    out = []
    for index, (prompt, sp) in enumerate(zip(prompts, sampling)):
        not_ints = [t for t in prompt
                    if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if not_ints:
            raise ValueError(f"prompt {index}: token id {not_ints[0]!r} is not an integer")
        prompt = [int(t) for t in prompt]
        if not prompt:
            if bos_token_id is None and sp.max_new_tokens > 0:
                raise ValueError(
                    f"prompt {index} is empty; a prompt needs at least one token (pass "
                    "bos_token_id to inference.generate to start empty prompts from BOS)"
                )
            prompt = [] if bos_token_id is None else [int(bos_token_id)]
        for what, ids in (("token id", prompt), ("stop_token_ids id", sp.stop_token_ids),
                          ("stop_sequences id", [t for q in sp.stop_sequences for t in q]),
                          ("logit_bias id", [t for t, _ in sp.logit_bias])):
            bad = [t for t in ids if not 0 <= t < V]
            if bad:
                raise ValueError(f"prompt {index}: {what} {bad[0]} is outside [0, {V}) "
                                 f"(the model's vocab_size is {V})")
        if sp.logprobs is not None and sp.logprobs > V:
            raise ValueError(f"prompt {index}: logprobs={sp.logprobs} asks for more "
                             f"alternatives than the vocabulary has; allowed: [0, {V}]")
        if sp.overflow("error") == "crop":
            prompt = prompt[-config.max_seq_len:]
        elif len(prompt) >= config.max_seq_len:  # whatever max_new_tokens: say so
            raise ValueError(
                f"prompt {index}: prompt length {len(prompt)} leaves no room for a new token "
                f"in the model's max_seq_len {config.max_seq_len}; allowed: prompt length + "
                f"max_new_tokens {sp.max_new_tokens} at most {config.max_seq_len}{CROP_HINT}"
            )
        elif len(prompt) + sp.max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"prompt {index}: prompt length {len(prompt)} + max_new_tokens "
                f"{sp.max_new_tokens} = {len(prompt) + sp.max_new_tokens} exceeds the "
                f"model's max_seq_len {config.max_seq_len}; allowed: a sum of at most "
                f"{config.max_seq_len}{CROP_HINT}"
            )
        out.append(prompt)
    return out, sampling


def pack(config: GPTConfig, prompts, sampling, pad_id: int = 0) -> Batch:
    """Expand `n` (decode rows share their request's prefill row), draw missing seeds, and
    pad prompts, rows and steps to buckets."""
    rows, source, seeds, index = [], [], [], []
    for p, sp in enumerate(sampling):
        seed = sp.seed if sp.seed is not None else secrets.randbits(32)
        for k in range(sp.n):
            rows.append(sp), source.append(p), seeds.append(seed), index.append(k)
    n_real = len(rows)
    P, B = bucket(len(prompts)), bucket(n_real)
    T = min(config.max_seq_len, bucket(max(map(len, prompts)), MIN_PROMPT_BUCKET))
    n_steps = bucket(max(r.max_new_tokens for r in rows), CHUNK)
    outgrows = any(len(prompts[p]) + r.max_new_tokens > config.max_seq_len  # only "crop" rows
                   for p, r in zip(source, rows))
    capacity = T + n_steps if outgrows else min(config.max_seq_len, T + n_steps)
    tokens = np.full((P, T), pad_id, np.int32)
    lengths = np.ones((P,), np.int32)
    for p, prompt in enumerate(prompts):
        tokens[p, : len(prompt)] = prompt
        lengths[p] = len(prompt)
    filler = SamplingParams(max_new_tokens=0, seed=0)
    padded = rows + [filler] * (B - n_real)
    want_logprobs = any(r.logprobs is not None for r in rows)
    return Batch(
        tokens_PT=tokens,
        lengths_P=lengths,
        source_B=np.array(source + [0] * (B - n_real), np.int32),
        rows=SamplingArrays.from_params(
            padded, seeds + [0] * (B - n_real), index + [0] * (B - n_real),
            [prompt_hash(prompts[p]) for p in source] + [0] * (B - n_real), config.vocab_size),
        stops=stopping.StopArrays.from_params(padded),
        requests=tuple(rows),
        seeds=tuple(seeds),
        n_real=n_real,
        capacity=capacity,
        n_steps=n_steps,
        n_top=min(MAX_LOGPROBS, config.vocab_size) if want_logprobs else 0,
        forked=n_real > len(prompts),
    )


def fetch(state: DecodeState) -> DecodeState:
    """The decode state on the host, without the model and the per-vocabulary arrays."""
    return jax.device_get(state.replace(model=None, prompt_seen=None,
                                        output_counts=None))


def unpack_row(batch: Batch, b: int, host: DecodeState, n: int, finish_reason: str) -> Completion:
    """Decode row b's first n tokens (and, if asked, their log-probs) as a Completion."""
    sp = batch.requests[b]
    completion = Completion(tokens=host.tokens[b, :n].tolist(), finish_reason=finish_reason,
                            seed=batch.seeds[b])
    if sp.logprobs is not None:
        completion.logprobs = host.logprobs[b, :n].tolist()
        completion.top_logprobs = [
            dict(zip(host.top_ids[b, i, : sp.logprobs].tolist(),
                     host.top_logprobs[b, i, : sp.logprobs].tolist()))
            for i in range(n)
        ]
    return completion


def unpack(batch: Batch, state: DecodeState) -> list[Completion]:
    """Turn the final decode state into one Completion per real row."""
    host = fetch(state)
    return [
        unpack_row(batch, b, host, int(host.num_tokens[b]),
                   stopping.FINISH_REASONS[int(host.finish[b])])
        for b in range(batch.n_real)
    ]


def run(params, config, prompts, sampling, *, model_fns, bos_token_id=None, pad_id=0,
        cache_dtype=jnp.float32) -> list[Completion]:
    """Validate, pack, run one compiled generation program, unpack."""
    check_params(params, config)
    prompts, sampling = validate(config, prompts, sampling, bos_token_id)
    if any(sp.stop for sp in sampling):
        raise ValueError("stop strings need a tokenizer: use inference.LLM for them")
    if all(sp.max_new_tokens == 0 for sp in sampling):  # nothing to do: compile nothing
        return [Completion([], "length", sp.seed or 0) for sp in sampling for _ in range(sp.n)]
    batch = pack(config, prompts, sampling, pad_id)
    state = generate_program(
        params, config, jnp.asarray(batch.tokens_PT), jnp.asarray(batch.lengths_P),
        jnp.asarray(batch.source_B), batch.rows, batch.stops, capacity=batch.capacity,
        n_steps=batch.n_steps, n_top=batch.n_top, model_fns=model_fns, cache_dtype=cache_dtype,
        pad_id=pad_id, forked=batch.forked,
    )
    return unpack(batch, state)


def generate(params: Params, config: GPTConfig, prompts, sampling=None, *, bos_token_id=None,
             pad_id: int = 0, cache_dtype=jnp.float32) -> list[Completion]:
    """Generate from a batch of token-id prompts with a KV cache, in one compiled program.

    Args:
      params: weights in either layout (stacked, `gpt_jax.model.decode_layout`), or int8
        (`gpt_jax.params.quantize(params, "int8")`). Stacked ones are laid out inside the
        program on every call (a copy of every weight: gpt2 batch 1, 64 new tokens, 1.24x
        the tokens/s laid out once beforehand): to call it repeatedly, lay them out once
        (`jax.jit(decode_layout)(params)`, as `inference.LLM` does).
      prompts: list of token-id lists, any lengths.
      sampling: one SamplingParams for all prompts, or one per prompt (default greedy-free
        SamplingParams()). A request with n > 1 gives n consecutive Completions.
      bos_token_id: an empty prompt starts from this token; without it an empty prompt
        raises ValueError (unless its max_new_tokens is 0, which returns []).
      pad_id: the token recorded after a row has finished.
    Returns:
      One Completion per prompt and sample, in input order.
    Raises:
      ValueError: before anything is compiled, for any invalid request (see `validate`) or
        params whose shapes do not match `config` (see `gpt_jax.params.check_params`).
    """
    return run(params, config, prompts, sampling, model_fns=cached_model,
               bos_token_id=bos_token_id, pad_id=pad_id, cache_dtype=cache_dtype)


# ---------------------------------------------------------------------- continuous batching


@struct.dataclass
class PrefillBatch:
    """One call's prompt chunks, a row each (rows past the real ones have slot = max_slots)."""

    tokens: jax.Array  # [R, T] int32, the chunk's tokens, right-padded
    n_valid: jax.Array  # [R] int32, real tokens in the chunk
    start: jax.Array  # [R] int32, position of the chunk's first token
    slot: jax.Array  # [R] int32, the cache slot and decode row
    insert: jax.Array  # [R] bool, the chunk completes the prompt: the row joins the decode batch
    step: jax.Array  # [R] int32, tokens the request had generated (a preempted one resumes)
    recent: jax.Array  # [R, M] int32, its last M generated tokens (BEFORE_START before)
    window: jax.Array  # [R, W] int32, its last W tokens of prompt and output (0 before)
    prompt_seen: jax.Array  # [R, V] bool, tokens of its prompt
    output_counts: jax.Array  # [R, V] int32, occurrences among its generated tokens


@functools.partial(jax.jit, static_argnames=("config", "pad_id"), donate_argnames="state")
def engine_prefill(params, config, state: DecodeState, page_table, batch: PrefillBatch, rows,
                   stops, *, pad_id: int):
    """Prefill one chunk per row into its slot (at `batch.start`, attending to what the slot
    already holds); every row whose prompt is now complete joins the decode state (its
    history and step) with its first token sampled from the prefill's logits. `state` is
    donated: the cache is written in place."""
    cache = state.model.replace(page_table=page_table)
    cache = cache.replace(lengths=cache.lengths.at[batch.slot].set(batch.start, mode="drop"))
    logits_RV, cache = _prefill(params, config, batch.tokens, batch.n_valid, cache, batch.slot)
    B = state.done.shape[0]
    at_R = jnp.where(batch.insert, batch.slot, B)
    put = lambda x, y: x.at[at_R].set(y, mode="drop")  # noqa: E731
    state = state.replace(
        model=cache, step=put(state.step, batch.step), num_tokens=put(state.num_tokens, batch.step),
        done=put(state.done, False), finish=put(state.finish, stopping.RUNNING),
        recent=put(state.recent, batch.recent), window=put(state.window, batch.window),
        prompt_seen=put(state.prompt_seen, batch.prompt_seen),
        output_counts=put(state.output_counts, batch.output_counts))
    inserted_B = jnp.zeros((B,), bool).at[at_R].set(True, mode="drop")
    logits_BV = jnp.zeros((B, logits_RV.shape[-1]), jnp.float32).at[at_R].set(logits_RV,
                                                                              mode="drop")
    return sample_and_record(state, logits_BV, inserted_B, rows, stops, pad_id)


def decode_rows(n: int, max_slots: int) -> int:
    """Rows a decode chunk runs to cover slots 0..n-1: powers of two up to 8, then halfway
    steps (12, 16, 24, 32, 48, ...), at most `max_slots`. Halfway steps keep a 17th request
    from doubling the step of 16 (a gpt2 step at 32 rows took 1.5x one at 16, at 24 1.3x)
    for two programs per doubling."""
    if n <= 8:
        return min(max_slots, bucket(n))
    step = bucket(n) // 4  # two steps from the power of two below n to the one above
    return min(max_slots, -(-n // step) * step)


def _first_rows(state: DecodeState, n: int) -> DecodeState:
    """Decode rows 0..n-1 of `state` (the cache pools stay whole: they are shared)."""
    first = lambda x: x[:n]  # noqa: E731
    model = state.model.replace(page_table=first(state.model.page_table),
                                lengths=first(state.model.lengths),
                                overflow=first(state.model.overflow))
    return jax.tree.map(first, state.replace(model=None)).replace(model=model)


def _put_first_rows(state: DecodeState, rows: DecodeState) -> DecodeState:
    """`state` with rows 0..n-1 replaced by `rows` (and its pools by theirs)."""
    put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis=0)  # noqa: E731
    model = state.model.replace(
        k=rows.model.k, v=rows.model.v,
        lengths=put(state.model.lengths, rows.model.lengths),
        overflow=put(state.model.overflow, rows.model.overflow))
    merged = jax.tree.map(put, state.replace(model=None), rows.replace(model=None))
    return merged.replace(model=model)


@functools.partial(jax.jit, static_argnames=("config", "n_rows", "pad_id"),
                   donate_argnames="state")
def engine_decode(params, config, state: DecodeState, page_table, live_B, rows, stops,
                  window_slots, *, n_rows: int, pad_id: int):
    """One chunk of decode steps for the first `n_rows` slots (every live slot among them):
    rows not `live_B` are finished first (freed, aborted or stopped on the host). The slots
    `window_slots` (int32 `[R]`, R = 0 when no row can outgrow the context in this chunk;
    entries >= n_rows are padding) are the rows that may: each step, those whose context is
    full are predicted from their window (`window_logits`). `state` is donated: the cache
    is written in place."""
    state = state.replace(model=state.model.replace(page_table=page_table),
                          done=state.done | ~live_B)
    first = lambda x: x[:n_rows]  # noqa: E731
    step_fn = lambda tokens_B, cache, advance_B, window_BW: _step(  # noqa: E731
        params, config, tokens_B, cache, advance_B, window_BW, window_slots)
    chunk = decode_chunk(_first_rows(state, n_rows), step_fn, jax.tree.map(first, rows),
                         jax.tree.map(first, stops), pad_id)
    return _put_first_rows(state, chunk)


@dataclasses.dataclass
class RequestOutput:
    """What one sample of a request has produced so far (returned by `Engine.step`)."""

    request_id: str
    sample_index: int  # 0..n-1 for a request with n samples
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # those generated since the last output of this sample
    finished: bool
    finish_reason: str | None  # "eos", "stop" or "length"; None while running
    seed: int  # the request's seed (see `Completion.seed`)
    text: str | None = None  # decoded text so far, with a tokenizer (final text when finished)
    new_text: str | None = None  # text since the last output (never a partial character or
    #                              a possible start of a stop string)
    logprobs: list[float] | None = None  # per token of token_ids, when asked
    top_logprobs: list[dict[int, float]] | None = None  # the `logprobs` most likely per step


INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a character missing bytes


def _text_of(tokenizer, tokens: list[int], final: bool) -> str:
    """Decoded text; while the row runs, without a trailing incomplete character."""
    text = tokenizer.decode(tokens)
    return text if final else text.rstrip(INCOMPLETE)


def _stop_cut(tokenizer, tokens: list[int], text: str, stops,
              min_tokens: int = 0) -> tuple[str, list[int]] | None:
    """If `text` contains a stop string: the text before it and the tokens through the one
    that completed it (the first prefix whose text reaches the stop string's end). Only an
    occurrence completed after the first `min_tokens` tokens counts (it ends past their
    text)."""
    after = len(_text_of(tokenizer, tokens[:min_tokens], final=False)) if min_tokens else 0
    hit = stopping.find_stop(text, stops, after)
    if hit is None:
        return None
    start, end = hit
    k = next((k for k in range(1, len(tokens) + 1)
              if len(_text_of(tokenizer, tokens[:k], final=False)) >= end), len(tokens))
    return text[:start], tokens[:k]


class Engine:
    """Continuous batching (Orca's iteration-level scheduling, Yu et al. 2022) over one paged
    KV cache (PagedAttention, Kwon et al. 2023), in the shape of vLLM's `LLMEngine`.

        engine = Engine(params, config, tokenizer=None, max_slots=16)
        engine.add_request("a", [1, 2, 3], SamplingParams(max_new_tokens=20))
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.request_id, out.new_token_ids, out.finished)

    Each `step()` admits waiting requests into free slots, then either prefills up to
    `max_prefill_tokens` prompt tokens (a long prompt goes in over several steps: chunked
    prefill) and samples the first token of every prompt that is complete, or runs one chunk
    of `CHUNK` decode steps for every running request as one compiled `lax.scan`; with both
    to do they take turns, so running requests keep producing tokens while prompts load.
    It frees the pages and slot of every request that finished. Requests join and leave
    between chunks. When the pages cannot hold the next chunk of every running request, the
    most recently admitted request is preempted (pages freed, output kept) and recomputed
    when a slot and pages free up.
    With `prefix_caching`, full prompt pages are shared by requests whose prompts start
    alike (`inference.scheduler`). A "crop" request (`SamplingParams.context_overflow`)
    holds at most max_seq_len tokens of pages; past that, the decode chunks run its window
    (`window_logits`) for it and any other crop row near the context, no other row. A request's tokens do not depend on when it arrived or
    on its neighbours: every row samples from its own seed, sample index and step.

    Args:
      params: model weights (either layout); config: their GPTConfig.
      tokenizer: encodes string prompts and decodes `text`; needed for stop strings.
      max_slots: most requests (samples) decoded at once.
      num_pages, kv_cache_bytes: the page pool's size, in pages or in bytes
        (`gpt_jax.cache.cache_bytes`); default: every slot can hold max_seq_len tokens.
      page_size: token slots per page.
      cache_dtype: "float32" or "bfloat16" (weights are cast to it too, as in `LLM`, unless
        quantized).
      quantize: None, or "int8": weights quantized once, here, to int8 with a float32 scale
        per output channel (`gpt_jax.params.quantize`; LayerNorm, biases, activations and
        logits float32). Params already quantized are run as they are.
      prefix_caching: share full prompt pages between requests (automatic prefix caching).
      max_prefill_tokens: most prompt tokens prefilled per step (the call's budget): rows x
        padded length of the call, filled with several prompts' chunks
        (`Scheduler.prefill_work`).
      prefill_chunk_tokens: most tokens of one prompt per prefill step (vLLM's
        long_prefill_token_threshold). A prefill step stalls the running requests once. At
        gpt2 shape on 2 CPU cores, with 16 requests decoding while a 1,000-token prompt
        loads, their p99 time per token stays within 2x its median with 64-token chunks
        (1.59-1.71x) but not always with 128 (1.84-2.36x); arriving prompts of 16-128
        tokens are admitted faster two to a 128-token call than one to a 64-token call
        (`benchmarks/serving.py arrivals` at 8 requests/s: 1.66x static batching's tokens/s
        with these defaults, 1.46x with a 64-token budget).
    Raises:
      ValueError: a size that is not an int >= 1 (the message names it), both num_pages and
        kv_cache_bytes given, kv_cache_bytes below one page, prefix_caching not a bool, a
        tokenizer without encode/decode, another cache dtype, a quantize other than None or
        `gpt_jax.params.QUANTIZE`, a page_size above config.max_seq_len (and 16), or params
        that do not match `config`. (A pool too small for some request is found per
        request, by add_request.)
    """

    def __init__(self, params, config: GPTConfig, tokenizer=None, *, max_slots: int = 16,
                 num_pages: int | None = None, kv_cache_bytes: int | None = None,
                 page_size: int = PAGE_SIZE, cache_dtype="float32", prefix_caching: bool = True,
                 max_prefill_tokens: int = 128, prefill_chunk_tokens: int = 64,
                 quantize: str | None = None):
        sizes = dict(max_slots=max_slots, page_size=page_size,
                     max_prefill_tokens=max_prefill_tokens,
                     prefill_chunk_tokens=prefill_chunk_tokens, num_pages=num_pages,
                     kv_cache_bytes=kv_cache_bytes)
        for name, value in sizes.items():
            if value is None and name in ("num_pages", "kv_cache_bytes"):
                continue
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Engine {name} must be an int >= 1, got {value!r}")
        max_slots, page_size, max_prefill_tokens, prefill_chunk_tokens = map(
            int, (max_slots, page_size, max_prefill_tokens, prefill_chunk_tokens))
        if num_pages is not None and kv_cache_bytes is not None:
            raise ValueError("give the Engine num_pages or kv_cache_bytes, not both")
        if not isinstance(prefix_caching, bool):
            raise ValueError(f"Engine prefix_caching must be True or False, got {prefix_caching!r}")
        if tokenizer is not None and not (hasattr(tokenizer, "encode")
                                          and hasattr(tokenizer, "decode")):
            raise ValueError(f"Engine tokenizer must have encode and decode, got {tokenizer!r}")
        try:
            dtype = jnp.dtype(cache_dtype)
        except TypeError:
            dtype = None
        if dtype is None or dtype.name not in ("float32", "bfloat16"):
            raise ValueError(f"Engine cache_dtype must be float32 or bfloat16, got {cache_dtype!r}")
        if page_size > max(config.max_seq_len, PAGE_SIZE):  # a page past the context
            raise ValueError(f"Engine page_size must be at most the model's max_seq_len "
                             f"{config.max_seq_len} (or {PAGE_SIZE}), got {page_size}")
        max_pages = kv.pages_for(config.max_seq_len, page_size)
        if kv_cache_bytes is not None:
            page_bytes = kv.cache_bytes(config, 1, page_size, dtype)
            num_pages = int(kv_cache_bytes) // page_bytes
            if num_pages < 1:
                raise ValueError(f"Engine kv_cache_bytes={kv_cache_bytes} holds no page; one "
                                 f"page of {page_size} tokens takes {page_bytes} bytes")
        num_pages = max_slots * max_pages if num_pages is None else int(num_pages)
        self.params = inference_params(params, config, dtype, quantize)
        self.config, self.tokenizer, self.cache_dtype = config, tokenizer, dtype
        self.max_slots, self.num_pages, self.page_size = max_slots, num_pages, page_size
        self.scheduler = Scheduler(max_slots=max_slots, num_pages=num_pages,
                                   page_size=page_size, max_seq_len=config.max_seq_len,
                                   max_prefill_tokens=max_prefill_tokens,
                                   prefill_chunk_tokens=prefill_chunk_tokens,
                                   prefix_caching=prefix_caching)
        self.widths = (4, 4, 4)  # stop arrays' (E, Q, M), grown on demand
        cache = kv.empty_cache(config, num_pages, max_slots, max_pages, page_size, dtype)
        B, V, C = max_slots, config.vocab_size, config.max_seq_len
        # The token buffer is a ring of C (>= one chunk) steps: the host reads every chunk.
        self.state = init_state(
            cache, jnp.zeros((B, V), bool),
            stopping.StopArrays.from_lists([0] * B, [()] * B, [()] * B, self.widths),
            jnp.zeros((B, C), jnp.int32), n_steps=max(C, CHUNK),
            n_top=min(MAX_LOGPROBS, config.vocab_size))
        self.last_step_prefilled = False
        self.requests: dict[str, list[Sequence]] = {}  # unfinished requests' samples
        # ids of finished requests (aborting one does nothing), the latest FINISHED_IDS kept
        self.finished_ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.finished_at_once: list[Sequence] = []  # max_new_tokens = 0: output next step
        self.arrivals = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: list[int] | str,
                    sampling: SamplingParams | None = None) -> None:
        """Queue a request. Raises ValueError (before it is queued; the engine keeps serving
        the others) for a duplicate request_id, an empty prompt or one with ids outside
        the vocabulary, a prompt + max_new_tokens past max_seq_len or past what the page
        pool can ever hold, stop strings or a text prompt without a tokenizer; TypeError for
        sampling that is not SamplingParams."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a str, got {request_id!r}")
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in the engine")
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass one to the Engine")
            prompt = self.tokenizer.encode(prompt)
        if isinstance(prompt, np.ndarray):
            prompt = prompt.tolist()
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass one to the Engine")
        if not isinstance(prompt, (str, list, tuple)) or (
                not prompt and sampling.max_new_tokens > 0):
            raise ValueError(f"request {request_id!r}: the prompt is {prompt!r:.40}; a prompt "
                             "is a non-empty list of token ids (or text, with a tokenizer)")
        try:
            (prompt,), _ = validate(self.config, [prompt], [sampling])
        except ValueError as error:  # name the request, not a position in a list
            raise ValueError(str(error).replace("prompt 0", f"request {request_id!r}", 1)) \
                from None
        # At most max_seq_len tokens in the cache: a "crop" request past it reads its window.
        need = kv.pages_for(min(len(prompt) + sampling.max_new_tokens, self.config.max_seq_len),
                            self.page_size)
        if need > self.num_pages:
            raise ValueError(
                f"request {request_id!r}: prompt length {len(prompt)} + max_new_tokens "
                f"{sampling.max_new_tokens} needs {need} pages of {self.page_size} tokens, but "
                f"the page pool has {self.num_pages}")
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(32)
        seqs = [Sequence(request_id, k, prompt, sampling, seed, prompt_hash(prompt),
                         self.arrivals)
                for k in range(sampling.n)]
        self.arrivals += 1
        self.requests[request_id] = seqs
        self.finished_ids.pop(request_id, None)
        self.widths = tuple(np.maximum(self.widths, stopping.needed_widths(
            [sampling.stop_token_ids], [sampling.stop_sequences])))
        if self.state.recent.shape[1] < self.widths[2]:  # longer stop sequences: wider window
            grow = self.widths[2] - self.state.recent.shape[1]
            self.state = self.state.replace(recent=jnp.pad(
                self.state.recent, ((0, 0), (grow, 0)), constant_values=stopping.BEFORE_START))
        for seq in seqs:
            if sampling.max_new_tokens == 0:
                seq.status, seq.finish_reason = Status.FINISHED, "length"
                self.finished_at_once.append(seq)
            else:
                self.scheduler.waiting.append(seq)

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its pages and slot; `step()` returns nothing more for
        it. Aborting a finished request does nothing; an unknown request_id raises
        KeyError."""
        if request_id in self.finished_ids:
            return
        if request_id not in self.requests:
            raise KeyError(f"unknown request_id {request_id!r}")
        for seq in self.requests.pop(request_id):
            if seq in self.finished_at_once:
                self.finished_at_once.remove(seq)
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
            self.scheduler.free(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
        self._remember_finished(request_id)

    def warmup(self, crop: bool = False) -> int:
        """Compile every program `step()` can run (each prefill shape the scheduler can form
        and each decode batch size; with `crop`, also each count of rows that outgrow the
        context, for "crop" requests) with nothing in the engine, so none compiles while
        requests wait. Returns how many programs it compiled. Raises RuntimeError when the
        engine holds requests."""
        if self.requests:
            raise RuntimeError("warm the Engine up before adding requests")
        before = sum(compile_counts().values())
        V, M = self.config.vocab_size, self.state.recent.shape[1]
        rows, stops = self._row_arrays()
        table = jnp.asarray(self.scheduler.page_table)
        zeros = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
        for R, T in self.scheduler.prefill_shapes():
            batch = PrefillBatch(*map(jnp.asarray, (
                zeros(R, T), zeros(R), zeros(R), np.full(R, self.max_slots, np.int32),
                zeros(R, dtype=bool), zeros(R), np.full((R, M), stopping.BEFORE_START, np.int32),
                zeros(R, self.config.max_seq_len), zeros(R, V, dtype=bool),
                zeros(R, V))))  # padding rows: no effect
            self.state = engine_prefill(self.params, self.config, self.state, table, batch,
                                        rows, stops, pad_id=0)
        live = jnp.zeros((self.max_slots,), bool)
        for n_rows in sorted({decode_rows(k, self.max_slots)
                              for k in range(1, self.max_slots + 1)}):
            windows = {decode_rows(k, n_rows) for k in range(1, n_rows + 1)} if crop else set()
            for n_window in [0] + sorted(windows):
                self.state = engine_decode(self.params, self.config, self.state, table, live,
                                           rows, stops, jnp.full((n_window,), self.max_slots,
                                                                 jnp.int32),
                                           n_rows=n_rows, pad_id=0)
        jax.block_until_ready(self.state)
        return sum(compile_counts().values()) - before

    def _remember_finished(self, request_id: str) -> None:
        self.finished_ids[request_id] = None
        if len(self.finished_ids) > FINISHED_IDS:
            self.finished_ids.popitem(last=False)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict:
        """Counters: pages (total, free, in use, cached), slots, queue lengths, preemptions,
        prefix cache hits (pages reused instead of prefilled: from the prefix cache, and,
        with caching on or off, between the n samples of one request) and prefilled tokens
        (tokens run through prefill)."""
        s = self.scheduler
        return {"total_pages": self.num_pages, "free_pages": s.pool.num_free(),
                "pages_in_use": self.num_pages - s.pool.num_free(),
                "cached_pages": len(s.pool.key_of), "max_slots": self.max_slots,
                "running": sum(q.status == Status.RUNNING for q in s.active),
                "prefilling": sum(q.status == Status.PREFILLING for q in s.active),
                "waiting": len(s.waiting), "preemptions": s.preemptions,
                "prefix_cache_hits": s.prefix_cache_hits, "prefilled_tokens": s.prefilled_tokens}

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: admit waiting requests, then either prefill a chunk of
        prompts (the first token of every prompt it completes is sampled at once) or run a
        chunk of decode steps for every running request; with both to do, the two take
        turns, so prompts arriving or loading never stall the running requests for more
        than one prefill chunk in a row. Returns an output for every sample that produced
        tokens or finished in it."""
        outputs = [self._output(seq) for seq in self.finished_at_once]  # max_new_tokens = 0
        self.finished_at_once.clear()
        s = self.scheduler
        s.admit()
        work = s.prefill_work()
        running = [q for q in s.active if q.status == Status.RUNNING]
        if work and not (running and self.last_step_prefilled):
            rows, stops = self._row_arrays()
            self.state = engine_prefill(self.params, self.config, self.state,
                                        jnp.asarray(s.page_table), self._prefill_batch(work),
                                        rows, stops, pad_id=0)
            s.prefilled(work)
            outputs += self._collect([w.seq for w in work if w.completes])
            self.last_step_prefilled = True
        elif running:
            self.last_step_prefilled = False
            s.reserve_decode(CHUNK)  # may preempt some of them (all, in a corner case)
            running = [q for q in s.active if q.status == Status.RUNNING]
            if running:
                outputs += self._decode(running)
        for request_id in [r for r, seqs in self.requests.items()
                           if all(q.status == Status.FINISHED for q in seqs)]:
            del self.requests[request_id]
            self._remember_finished(request_id)
        return outputs

    def _decode(self, running: list[Sequence]) -> list[RequestOutput]:
        """One chunk of decode steps over the first slots, every running one among them."""
        live = np.zeros(self.max_slots, bool)
        live[[q.slot for q in running]] = True
        n_rows = decode_rows(max(q.slot for q in running) + 1, self.max_slots)
        rows, stops = self._row_arrays()
        self.state = engine_decode(self.params, self.config, self.state,
                                   jnp.asarray(self.scheduler.page_table), jnp.asarray(live),
                                   rows, stops, self._window_slots(running, n_rows),
                                   n_rows=n_rows, pad_id=0)
        return self._collect(running)

    def _window_slots(self, running: list[Sequence], n_rows: int):
        """The slots of the "crop" requests whose context may be full within the next chunk,
        padded with `max_slots` to a `decode_rows` bucket (none: an empty array, and the
        chunk compiles without the window forward)."""
        C = self.config.max_seq_len
        near = [q.slot for q in running if q.length + CHUNK > C
                and len(q.prompt) + q.sampling.max_new_tokens > C]  # only "crop" ones can
        slots = np.full(decode_rows(len(near), n_rows) if near else 0, self.max_slots, np.int32)
        slots[: len(near)] = sorted(near)
        return jnp.asarray(slots)

    def _prefill_batch(self, work: list[PrefillWork]) -> PrefillBatch:
        R = bucket(len(work))
        T = bucket(max(w.n for w in work), MIN_PROMPT_BUCKET)
        V, M = self.config.vocab_size, self.state.recent.shape[1]
        tokens = np.zeros((R, T), np.int32)
        n_valid, start, step = (np.zeros(R, np.int32) for _ in range(3))
        slot = np.full(R, self.max_slots, np.int32)
        insert = np.zeros(R, bool)
        recent = np.full((R, M), stopping.BEFORE_START, np.int32)
        window = np.zeros((R, self.state.window.shape[1]), np.int32)
        seen, counts = np.zeros((R, V), bool), np.zeros((R, V), np.int32)
        for r, w in enumerate(work):
            seq = w.seq
            tokens[r, : w.n] = seq.target[w.start: w.start + w.n]
            n_valid[r], start[r], slot[r] = w.n, w.start, seq.slot
            if w.completes:
                insert[r], step[r] = True, len(seq.output)
                seen[r, seq.prompt] = True
                np.add.at(counts[r], seq.output, 1)
                tail = seq.output[-M:]
                recent[r, M - len(tail):] = tail
                tail = seq.target[-window.shape[1]:]  # the target is at most max_seq_len
                window[r, window.shape[1] - len(tail):] = tail
        return PrefillBatch(*map(jnp.asarray, (tokens, n_valid, start, slot, insert, step,
                                               recent, window, seen, counts)))

    def _row_arrays(self):
        """Per-slot sampling and stop arrays (a free slot gets inert defaults)."""
        by_slot: list[Sequence | None] = [None] * self.max_slots
        for seq in self.scheduler.active:
            by_slot[seq.slot] = seq
        idle = SamplingParams(max_new_tokens=0)
        params = [q.sampling if q else idle for q in by_slot]
        rows = SamplingArrays.from_params(params, [q.seed if q else 0 for q in by_slot],
                                          [q.sample_index if q else 0 for q in by_slot],
                                          [q.prompt_hash if q else 0 for q in by_slot],
                                          self.config.vocab_size)
        return rows, stopping.StopArrays.from_params(params, self.widths)

    def _collect(self, running: list[Sequence]) -> list[RequestOutput]:
        """Read the decode state: new tokens of each running sample, finished ones freed."""
        want_logprobs = any(q.sampling.logprobs is not None for q in running)
        host = jax.device_get(self.state.replace(
            model=None, prompt_seen=None, output_counts=None,
            **({} if want_logprobs else {"logprobs": None, "top_ids": None,
                                         "top_logprobs": None})))
        outputs = []
        for seq in running:
            b, old = seq.slot, len(seq.output)
            at = np.arange(old, int(host.step[b])) % host.tokens.shape[1]  # a ring of steps
            seq.output += host.tokens[b, at].tolist()
            if seq.sampling.logprobs is not None:
                k = seq.sampling.logprobs
                seq.logprobs += host.logprobs[b, at].tolist()
                seq.top_logprobs += [dict(zip(host.top_ids[b, i, :k].tolist(),
                                              host.top_logprobs[b, i, :k].tolist()))
                                     for i in at]
            if host.done[b]:
                n = int(host.num_tokens[b])  # a token stop sequence is cut off
                del seq.output[n:], seq.logprobs[n:], seq.top_logprobs[n:]
                seq.status = Status.FINISHED
                seq.finish_reason = stopping.FINISH_REASONS[int(host.finish[b])]
                self.scheduler.free(seq)
            outputs.append(self._output(seq, old))
        return outputs

    def _output(self, seq: Sequence, old: int | None = None) -> RequestOutput:
        """The sample's RequestOutput; with a tokenizer, its text, cut at a stop string (which
        finishes it)."""
        old = len(seq.output) if old is None else old
        text = new_text = None
        if self.tokenizer is not None:
            text, new_text = self._text(seq)
        ask = seq.sampling.logprobs is not None
        return RequestOutput(
            seq.request_id, seq.sample_index, list(seq.output), seq.output[old:],
            seq.status == Status.FINISHED, seq.finish_reason, seq.seed, text, new_text,
            list(seq.logprobs) if ask else None, list(seq.top_logprobs) if ask else None)

    def _text(self, seq: Sequence) -> tuple[str, str]:
        """Text so far and the new part of it. While the sample runs, the text shown stops
        before an incomplete UTF-8 character and before any tail that could still grow into
        a stop string; a stop string found finishes the sample (reason "stop")."""
        finished = seq.status == Status.FINISHED
        text_tokens = seq.output[:-1] if seq.finish_reason == "eos" else seq.output
        text = _text_of(self.tokenizer, text_tokens, final=finished)
        stops = seq.sampling.stop
        cut = _stop_cut(self.tokenizer, text_tokens, text, stops,
                        seq.sampling.min_tokens) if stops else None
        if cut is not None and not (finished and seq.finish_reason == "stop" and seq.text):
            text, kept = cut
            del seq.output[len(kept):], seq.logprobs[len(kept):], seq.top_logprobs[len(kept):]
            if not finished:
                self.scheduler.free(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "stop"
            finished = True
        if not finished:
            text = text[: len(text) - stopping.held_back(text, stops)]
        new_text, seq.shown = text[seq.shown:], len(text)
        if finished:
            seq.text = text
        return text, new_text
