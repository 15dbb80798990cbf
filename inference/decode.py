"""The decode-state machine every driver shares: `DecodeState`, sample-and-record (sample
each row's next token, record it, check its stop conditions) and the decode loop, as a
chunk of steps in one `lax.scan` inside a `lax.while_loop` that exits once every row has
finished.

The loop takes the model as a step function (`StepFn`), so `generate` (the cached model of
`inference.steps`), `naive_generate` (full recomputation, `inference.naive`) and `Engine`'s
decode chunks run the same sampler and stop logic. Every decode step feeds each running row
the token it sampled last and samples its next (`decode_one`); a prefill ends by sampling
each row's first token (`sample_and_record`), so the first token comes with the prefill.
The state keeps, for a row that may outgrow its context ("crop"), its window of tokens.

Shapes: the letters of `gpt_jax.model`, and here W, a row's window of its last tokens
(max_seq_len wide where a row may outgrow its context, else 0). Other axes are counted in
words: a row's generated tokens (`n_steps`), the most likely alternatives per token
(`n_top`), its recent tokens (`recent_width`: the longest token stop sequence), prompts.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import struct

from gpt_jax.cache import PagedKVCache, empty_cache
from inference import constraint_mask, stopping
from inference.sampling import SamplingArrays, sample
from inference.sampling_params import MAX_LOGPROBS

CHUNK = 8  # decode steps per scan chunk; the loop may stop early at chunk boundaries


@struct.dataclass
class DecodeState:
    model: PagedKVCache | struct.PyTreeNode  # the cache (or, for naive decoding, the sequences)
    next_token: jax.Array  # [B] int32, the row's last sampled token, fed at its next step
    tokens: jax.Array  # [B, n_steps] int32, generated tokens, at index = the row's step
    logprobs: jax.Array  # [B, n_steps] float32, model log-prob of each token (0 if none asked)
    top_ids: jax.Array  # [B, n_steps, n_top] int32, most likely alternatives (n_top 0: off)
    top_logprobs: jax.Array  # [B, n_steps, n_top] float32, their log-probs
    step: jax.Array  # [B] int32, tokens the row has generated (the index of its next one)
    done: jax.Array  # [B] bool, row has finished (or holds no request)
    finish: jax.Array  # [B] int32, stopping.RUNNING / EOS / STOP / LENGTH
    num_tokens: jax.Array  # [B] int32, output tokens (EOS kept, a token stop sequence cut)
    recent: jax.Array  # [B, recent_width] int32, last generated tokens (BEFORE_START before)
    # [B, W] int32, the row's last W tokens of prompt and output, next_token last (pad before
    # the prompt); W = max_seq_len where a row may outgrow the context ("crop"), else 0
    window: jax.Array
    prompt_seen: jax.Array  # [B, V] bool, token occurs among the row's real prompt tokens
    output_counts: jax.Array  # [B, V] int32, occurrences among the generated tokens
    constraint: jax.Array  # [B] int32, the row's automaton state (inference.constraint_mask)


# (tokens_B, model_state, advance_B, window_BW) -> (logits_BV, model_state); window_BW is
# DecodeState.window, which a model that outgrows its context predicts from
StepFn = Callable


def prompt_seen(prompt_tokens, prompt_lengths, vocab_size: int):
    """bool `[prompts, V]`: the token occurs among the prompt's real tokens (never padding);
    `prompt_tokens` int32 `[prompts, T]`, right-padded, `prompt_lengths` `[prompts]`."""
    n_prompts, T = prompt_tokens.shape
    real = jnp.arange(T)[None, :] < prompt_lengths[:, None]  # [prompts, T]
    return jnp.zeros((n_prompts, vocab_size), jnp.int32).at[
        jnp.arange(n_prompts)[:, None], prompt_tokens].add(real) > 0


def prompt_window(prompt_tokens, prompt_lengths, width: int, pad_id: int = 0):
    """int32 `[prompts, width]`: the last `width` real tokens of each right-padded prompt,
    right aligned, `pad_id` before a shorter prompt."""
    T = prompt_tokens.shape[1]
    positions = prompt_lengths[:, None] - width + jnp.arange(width)[None, :]  # [prompts, width]
    tail = jnp.take_along_axis(prompt_tokens, jnp.clip(positions, 0, T - 1), axis=1)
    return jnp.where(positions >= 0, tail, pad_id).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=range(8))
def empty_state(config, num_pages: int, max_slots: int, max_pages: int, page_size: int, dtype,
                widths: tuple[int, int, int], n_steps: int) -> DecodeState:
    """An engine's decode state with no request: `empty_cache`'s pages and slots, every row
    finished (`init_state` of rows with max_new_tokens 0, stop arrays `widths` wide, a zero
    window of max_seq_len). One program: built op by op, each array's fill was a program of
    its own, about twenty to look up in the compilation cache at every start (issue 39)."""
    B, V = max_slots, config.vocab_size
    cache = empty_cache(config, num_pages, B, max_pages, page_size, dtype)
    stops = stopping.StopArrays.from_lists([0] * B, [()] * B, [()] * B, widths)
    return init_state(cache, jnp.zeros((B, V), bool), stops,
                      jnp.zeros((B, config.max_seq_len), jnp.int32), n_steps=n_steps,
                      n_top=min(MAX_LOGPROBS, V))


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
        constraint=jnp.zeros((B,), jnp.int32),
    )


def widen_recent(state: DecodeState, width: int) -> DecodeState:
    """`state` with each row's window of recent tokens (`recent`, `[B, width]`) at least
    `width` wide, the new places before the old as `stopping.BEFORE_START` (longer stop
    sequences arrived)."""
    grow = width - state.recent.shape[1]
    if grow <= 0:
        return state
    return state.replace(recent=jnp.pad(state.recent, ((0, 0), (grow, 0)),
                                        constant_values=stopping.BEFORE_START))


def _token_logprobs(logits_BV, token_B, wanted_B, n_top: int):
    """The sampled tokens' log-probs `[B]` and the `n_top` most likely `([B, n_top],
    [B, n_top])`, computed only when some row asked (`wanted_B`): the [B, V] log-softmax and
    top-k are a measurable part of a step (benchmarks/README.md, "Sampling parameters")."""
    B = token_B.shape[0]

    def compute(logits_BV):
        logprobs_BV = jax.nn.log_softmax(logits_BV, axis=-1)
        token_logprob_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], axis=-1)[:, 0]
        top_logprobs, top_ids = jax.lax.top_k(logprobs_BV, n_top)
        return token_logprob_B, top_logprobs, top_ids.astype(jnp.int32)

    def skip(_):
        return (jnp.zeros((B,), jnp.float32), jnp.zeros((B, n_top), jnp.float32),
                jnp.zeros((B, n_top), jnp.int32))

    return jax.lax.cond(wanted_B.any(), compute, skip, logits_BV)


def _shift_in(buffer, token_B, active_B):
    """`buffer` with `token_B` appended (the oldest dropped) in the `active_B` rows."""
    if not buffer.shape[1]:
        return buffer
    shifted = jnp.concatenate([buffer[:, 1:], token_B[:, None]], axis=1)
    return jnp.where(active_B[:, None], shifted, buffer)


def sample_and_record(state: DecodeState, logits_BV, active_B, rows: SamplingArrays,
                      stops: stopping.StopArrays, pad_id: int) -> DecodeState:
    """Sample the next token of every `active_B` row from `logits_BV` and record it at the
    row's step: it becomes the row's `next_token`, fed at its next decode step unless the
    row has now finished. Other rows do not change.

    Stop checks, in order: an EOS id (kept), a token stop sequence the output now ends with
    (cut: `num_tokens` drops its length), `max_new_tokens`. Inside a row's `min_tokens` (its
    step below it) no EOS id can be sampled (`stopping.ban_early_eos`) and no stop sequence
    counts. A row with a constraint (`rows.constraint`) samples only tokens its automaton
    allows, masked before every other rule, and finishes ("stop") once its output is complete
    with no token allowed after it (`inference.constraint_mask`). Log-probs are the model's,
    from `logits_BV` before any of that.
    """
    allowed_BV = logits_BV if rows.constraint is None else constraint_mask.mask_logits(
        logits_BV, rows.constraint, state.constraint, stops.stop_token_ids)
    token_B = sample(stopping.ban_early_eos(allowed_BV, state.step, stops), rows,
                     state.prompt_seen, state.output_counts, state.step, pad_id)
    return record_token(state, token_B, logits_BV, active_B, rows, stops, pad_id)


def record_token(state: DecodeState, token_B, logits_BV, active_B, rows: SamplingArrays,
                 stops: stopping.StopArrays, pad_id: int) -> DecodeState:
    """Record the chosen `token_B` (int32 `[B]`) of every `active_B` row at its step, with
    the stop checks and log-probs of `sample_and_record` (which chose it from `logits_BV`;
    a speculative step chooses it from verified drafts, `inference.speculative`)."""
    B, n_steps = state.tokens.shape
    step_B = state.step
    token_B = jnp.where(active_B, token_B, pad_id)
    constraint_B, ended_B = (state.constraint, False) if rows.constraint is None else \
        constraint_mask.advance(rows.constraint, state.constraint, token_B, active_B)
    token_logprob_B, top_logprobs, top_ids = _token_logprobs(
        logits_BV, token_B, active_B & (rows.logprobs >= 0), state.top_ids.shape[-1])

    num_tokens_B = state.num_tokens + active_B
    recent = _shift_in(state.recent, token_B, active_B)
    eos_B = active_B & stopping.is_eos(token_B, stops.stop_token_ids)
    stop_len_B = jnp.where(active_B & ~eos_B & (step_B >= stops.min_tokens),
                           stopping.matched_stop_length(recent, stops.stop_sequences), 0)
    stop_B = (stop_len_B > 0) | (ended_B & ~eos_B)
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
        top_ids=record(state.top_ids, top_ids),
        top_logprobs=record(state.top_logprobs, top_logprobs),
        step=step_B + active_B,
        done=state.done | eos_B | stop_B | full_B,
        finish=finish_B,
        num_tokens=num_tokens_B - stop_len_B,
        recent=recent,
        window=_shift_in(state.window, token_B, active_B),
        output_counts=state.output_counts.at[row_B, token_B].add(active_B.astype(jnp.int32)),
        constraint=constraint_B,
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
