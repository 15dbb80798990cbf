"""The continuous-batching programs `Engine` runs on its one long-lived decode state, and the
host packing of their inputs: `engine_prefill` prefills chunks of prompts into their slots
and inserts each completed prompt into the decode state with its first token;
`engine_decode` runs one chunk of decode steps (`inference.decode`) for the running slots
only, gathered into `decode_rows` compact rows and scattered back. The scheduler
(`inference.scheduler`) decides which sequences, slots and pages; these only run what it
planned.

Shapes: the letters of `gpt_jax.model`, and here R, the rows of a prefill call (one per
prompt chunk, each in its own cache slot), and W, a row's window of its last tokens
(`inference.decode`); `recent_width` counts a row's recent tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gpt_jax import cache as kv
from inference import stopping
from inference.constraint_mask import constraint_arrays
from inference.constraints import automaton
from inference.decode import DecodeState, decode_chunk, sample_and_record
from inference.sampling import SamplingArrays
from inference.sampling_params import SamplingParams
from inference.buckets import bucket
from inference.scheduler import PrefillWork, Sequence, SequenceResult
from inference.steps import run_prefill, run_step
from inference.transfer import to_device


@struct.dataclass
class PrefillBatch:
    """One call's prompt chunks, a row each (rows past the real ones have slot = max_slots)."""

    tokens: jax.Array  # [R, T] int32, the chunk's tokens, right-padded
    n_valid: jax.Array  # [R] int32, real tokens in the chunk
    start: jax.Array  # [R] int32, position of the chunk's first token
    slot: jax.Array  # [R] int32, the cache slot and decode row
    insert: jax.Array  # [R] bool, the chunk completes the prompt: the row joins the decode batch
    step: jax.Array  # [R] int32, tokens the request had generated (a preempted one resumes)
    recent: jax.Array  # [R, recent_width] int32, its last generated tokens (BEFORE_START before)
    window: jax.Array  # [R, W] int32, its last W tokens of prompt and output (0 before)
    prompt_seen: jax.Array  # [R, V] bool, tokens of its prompt
    output_counts: jax.Array  # [R, V] int32, occurrences among its generated tokens
    constraint: jax.Array  # [R] int32, its automaton's state after its output (0: none)


@functools.partial(jax.jit, static_argnames=("config", "pad_id"), donate_argnames="state")
def engine_prefill(params, config, state: DecodeState, page_table, batch: PrefillBatch, rows,
                   stops, *, pad_id: int):
    """Prefill one chunk per row into its slot (at `batch.start`, attending to what the slot
    already holds); every row whose prompt is now complete joins the decode state (its
    history and step) with its first token sampled from the prefill's logits. `state` is
    donated: the cache is written in place."""
    cache = state.model.replace(page_table=page_table)
    cache = cache.replace(lengths=cache.lengths.at[batch.slot].set(batch.start, mode="drop"))
    logits_RV, cache = run_prefill(params, config, batch.tokens, batch.n_valid, cache,
                                   batch.slot)
    B = state.done.shape[0]
    at_R = jnp.where(batch.insert, batch.slot, B)
    put = lambda x, y: x.at[at_R].set(y, mode="drop")  # noqa: E731
    state = state.replace(
        model=cache, step=put(state.step, batch.step), num_tokens=put(state.num_tokens, batch.step),
        done=put(state.done, False), finish=put(state.finish, stopping.RUNNING),
        recent=put(state.recent, batch.recent), window=put(state.window, batch.window),
        prompt_seen=put(state.prompt_seen, batch.prompt_seen),
        output_counts=put(state.output_counts, batch.output_counts),
        constraint=put(state.constraint, batch.constraint))
    inserted_B = jnp.zeros((B,), bool).at[at_R].set(True, mode="drop")
    logits_BV = jnp.zeros((B, logits_RV.shape[-1]), jnp.float32).at[at_R].set(logits_RV,
                                                                              mode="drop")
    return sample_and_record(state, logits_BV, inserted_B, rows, stops, pad_id)


def decode_rows(n: int, max_slots: int) -> int:
    """Rows a decode chunk runs to cover slots 0..n-1: powers of two up to 8, then halfway
    steps (12, 16, 24, 32), at most `max_slots`. Halfway steps keep a 17th request from
    doubling the step of 16 (benchmarks/README.md, "Serving") for two programs per
    doubling; with more than 32 slots (`serve`'s 64), powers of two only, so that the
    warmup stays within 12 programs (issue 39)."""
    if n <= 8 or max_slots > 32:
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


def live_slots(live_B, n_rows: int):
    """int32 `[n_rows]`: the `live_B` slots, ascending, padded with B (an out-of-range slot:
    a padding row). `n_rows` must be at least the live count (`decode_rows` of it)."""
    B = live_B.shape[0]
    return jnp.nonzero(live_B, size=n_rows, fill_value=B)[0].astype(jnp.int32)


def _gather_rows(state: DecodeState, slots_R) -> DecodeState:
    """The decode rows `slots_R` of `state`, compactly (the cache pools stay whole: they are
    shared); a padding slot (>= B) is an empty, finished row: no pages, length 0."""
    def take(x, fill=0):
        return jnp.take(x, slots_R, axis=0, mode="fill", fill_value=fill)

    cache = state.model
    model = cache.replace(page_table=take(cache.page_table, kv.NO_PAGE),
                          lengths=take(cache.lengths), overflow=take(cache.overflow, False))
    rows = jax.tree.map(take, state.replace(model=None))
    return rows.replace(model=model, done=take(state.done, True))


def _scatter_rows(state: DecodeState, slots_R, rows: DecodeState) -> DecodeState:
    """`state` with its rows `slots_R` replaced by `rows` (padding slots dropped) and its
    pools by theirs."""
    put = lambda x, y: x.at[slots_R].set(y, mode="drop")  # noqa: E731
    model = state.model.replace(k=rows.model.k, v=rows.model.v,
                                lengths=put(state.model.lengths, rows.model.lengths),
                                overflow=put(state.model.overflow, rows.model.overflow))
    merged = jax.tree.map(put, state.replace(model=None), rows.replace(model=None))
    return merged.replace(model=model)


@functools.partial(jax.jit, static_argnames=("config", "n_rows", "pad_id"),
                   donate_argnames="state")
def engine_decode(params, config, state: DecodeState, page_table, live_B, rows, stops,
                  window_slots, *, n_rows: int, pad_id: int):
    """One chunk of decode steps for the `live_B` slots only, gathered into `n_rows` compact
    rows (`live_slots`; padding rows are finished and cost no attention), their results
    scattered back: finished and free slots cost nothing. Slots not `live_B` are finished
    first (freed, aborted or stopped on the host). The slots `window_slots` (int32 `[R]`,
    R = 0 when no row can outgrow the context in this chunk; entries >= max_slots are
    padding) are the rows that may: each step, those whose context is full are predicted
    from their window (`inference.steps.window_logits`). `state` is donated: the cache is
    written in place."""
    state = state.replace(model=state.model.replace(page_table=page_table),
                          done=state.done | ~live_B)
    B = live_B.shape[0]
    slots_R = live_slots(live_B, n_rows)
    compact_B = jnp.cumsum(live_B) - 1  # a live slot's row among the compact rows
    window_R = jnp.where(window_slots < B, compact_B[jnp.minimum(window_slots, B - 1)], n_rows)
    step_fn = lambda tokens_B, cache, advance_B, window_BW: run_step(  # noqa: E731
        params, config, tokens_B, cache, advance_B, window_BW, window_R)
    take = lambda x: jnp.take(x, slots_R, axis=0, mode="fill", fill_value=0)  # noqa: E731
    chunk = decode_chunk(_gather_rows(state, slots_R), step_fn, jax.tree.map(take, rows),
                         jax.tree.map(take, stops), pad_id)
    return _scatter_rows(state, slots_R, chunk)


def prefill_shape(shapes: list[tuple[int, int]], work: list[PrefillWork]) -> tuple[int, int]:
    """The `(R, T)` of `shapes` (`Scheduler.prefill_shapes`, the ones warmup compiles) that
    holds `work`'s rows (R at least the rows, T at least the longest chunk) with the fewest
    padded tokens R x T; on a tie, fewer rows. Example: the defaults' shapes (1, 16),
    (8, 16), (1, 32), (4, 32), (1, 64), (2, 64): one 20-token chunk takes (1, 32); two 10-token chunks take (2, 64) (128 tokens,
    as many as (8, 16) and (4, 32), in the fewest rows).

    Raises:
      ValueError: no shape holds the work (a plan `Scheduler.prefill_work` cannot make).
    """
    longest = max(w.n for w in work)
    fits = [(R * T, R, T) for R, T in shapes if R >= len(work) and T >= longest]
    if not fits:
        raise ValueError(f"prefill_shape: no shape of {shapes} holds {len(work)} rows of up "
                         f"to {longest} tokens")
    return min(fits)[1:]


def prefill_batch(work: list[PrefillWork], max_slots: int, vocab_size: int, recent_width: int,
                  window_width: int, shape: tuple[int, int], tokenizer=None) -> PrefillBatch:
    """The rows of a prefill call, padded to `shape` (R, T: `prefill_shape`); a row that
    completes its prompt carries the sequence's history (a preempted one resumes where it
    was): `recent_width` last generated tokens, `window_width` (W) last tokens, its
    automaton's state (structured output, compiled with `tokenizer`)."""
    R, T = shape
    V = vocab_size
    tokens = np.zeros((R, T), np.int32)
    n_valid, start, step, constraint = (np.zeros(R, np.int32) for _ in range(4))
    slot = np.full(R, max_slots, np.int32)
    insert = np.zeros(R, bool)
    recent = np.full((R, recent_width), stopping.BEFORE_START, np.int32)
    window = np.zeros((R, window_width), np.int32)
    seen, counts = np.zeros((R, V), bool), np.zeros((R, V), np.int32)
    for r, w in enumerate(work):
        seq = w.seq
        tokens[r, : w.n] = seq.target[w.start: w.start + w.n]
        n_valid[r], start[r], slot[r] = w.n, w.start, seq.slot
        if w.completes:
            insert[r] = True
            put_history(seq, r, step, recent, window, seen, counts, constraint, tokenizer)
    return PrefillBatch(*to_device((tokens, n_valid, start, slot, insert, step, recent, window,
                                    seen, counts, constraint)))


def put_history(seq: Sequence, r: int, step, recent, window, seen, counts, constraint,
                tokenizer=None) -> None:
    """Write, at row `r` of the host arrays (`PrefillBatch`'s fields of the same names), the
    history of a sequence whose prompt completes (a preempted one resumes where it was):
    its step, last generated tokens, last W tokens, prompt tokens, output counts and its
    automaton's state (structured output, compiled with `tokenizer`)."""
    recent_width, W = recent.shape[1], window.shape[1]
    step[r] = len(seq.output)
    seen[r, seq.prompt] = True
    np.add.at(counts[r], seq.output, 1)
    tail = seq.output[-recent_width:]
    recent[r, recent_width - len(tail):] = tail
    tail = seq.target[-W:]  # the target is at most max_seq_len
    window[r, W - len(tail):] = tail
    table = automaton(seq.sampling, tokenizer, seen.shape[1])
    constraint[r] = table.walk(seq.output) if table is not None else 0


def row_arrays(active: list[Sequence], max_slots: int, vocab_size: int, widths,
               tokenizer=None):
    """Per-slot sampling and stop arrays of the `active` sequences (a free slot gets inert
    defaults), with their structured-output tables (compiled with `tokenizer`, cached);
    `widths`: the stop arrays' widths (`stopping.needed_widths`)."""
    by_slot: list[Sequence | None] = [None] * max_slots
    for seq in active:
        by_slot[seq.slot] = seq
    idle = SamplingParams(max_new_tokens=0)
    params = [q.sampling if q else idle for q in by_slot]
    rows = SamplingArrays.from_params(params, [q.seed if q else 0 for q in by_slot],
                                      [q.sample_index if q else 0 for q in by_slot],
                                      [q.prompt_hash if q else 0 for q in by_slot],
                                      vocab_size)
    tables = tuple(automaton(q.sampling, tokenizer, vocab_size) if q else None for q in by_slot)
    rows = rows.replace(constraint=constraint_arrays(tables, vocab_size))
    return rows, stopping.StopArrays.from_params(params, widths)


def sequence_results(state: DecodeState, seqs: list[Sequence]) -> list[SequenceResult]:
    """Read the decode state (one transfer): the new tokens of each sequence since its
    last result (the token buffer is a ring), their log-probs when asked, and whether it
    finished (its reason and output length)."""
    want_logprobs = any(q.sampling.logprobs is not None for q in seqs)
    host = jax.device_get(state.replace(
        model=None, prompt_seen=None, output_counts=None,
        **({} if want_logprobs else {"logprobs": None, "top_ids": None, "top_logprobs": None})))
    results = []
    for seq in seqs:
        b = seq.slot
        at = np.arange(len(seq.output), int(host.step[b])) % host.tokens.shape[1]  # a ring
        result = SequenceResult(seq, host.tokens[b, at].tolist(), [], [])
        if seq.sampling.logprobs is not None:
            k = seq.sampling.logprobs
            result.logprobs = host.logprobs[b, at].tolist()
            result.top_logprobs = [dict(zip(host.top_ids[b, i, :k].tolist(),
                                            host.top_logprobs[b, i, :k].tolist()))
                                   for i in at]
        if host.done[b]:
            result.num_tokens = int(host.num_tokens[b])  # a token stop sequence cut off
            result.finish_reason = stopping.FINISH_REASONS[int(host.finish[b])]
        results.append(result)
    return results
