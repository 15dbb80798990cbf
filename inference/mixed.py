"""The Engine's mixed chunk: one program that runs the decode token of every running
sequence and chunks of waiting prompts as one flattened batch of N query tokens over the
paged cache (`gpt_jax.ragged`), decode tokens first (Sarathi-Serve's stall-free batching,
Agrawal et al. 2024; vLLM v1's scheduler), samples the next token of every decoded row and
the first token of every prompt the step completes, then runs CHUNK - 1 decode steps of the
decoded rows. A long prompt goes in over several calls while the others keep decoding,
CHUNK tokens each per call, as in a decode chunk. One compiled program per count of decode
rows and of prompt tokens (`Scheduler.mixed_rows`, `Scheduler.mixed_shapes`), whatever
the mix.

Shapes: the letters of `gpt_jax.model`; N the step's query tokens (n_rows single ones for
the decode rows, then the prompt chunks' blocks), R = max_slots the rows it samples (a
decode row, or a prompt it completes), W a row's window (`inference.decode`);
`recent_width` counts a row's recent tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gpt_jax import cache as kv
from gpt_jax.model import lm_head
from gpt_jax.ragged import QUERY_BLOCK, ragged_transformer
from inference import stopping
from inference.batching import _gather_rows, _scatter_rows, live_slots, put_history
from inference.decode import CHUNK, DecodeState, decode_chunk, sample_and_record
from inference.buckets import MIN_PROMPT_BUCKET, bucket
from inference.scheduler import PrefillWork, Sequence
from inference.steps import run_step
from inference.transfer import to_device


@struct.dataclass
class MixedBatch:
    """One mixed step's query tokens and sampled rows (padding: slot = max_slots)."""

    tokens: jax.Array  # [N] int32, prompt tokens (a decode token comes from the state)
    slot: jax.Array  # [N] int32, the token's cache slot
    position: jax.Array  # [N] int32, its position in its sequence
    decode: jax.Array  # [N] bool, a running row's token: its last sampled (`next_token`)
    valid: jax.Array  # [N] bool, a real token (a chunk's block padding is not stored)
    row_slot: jax.Array  # [R] int32, the slot of each row sampled in this step
    row_at: jax.Array  # [R] int32, the index among the N of its last token
    insert: jax.Array  # [R] bool, its prompt completes: it joins the decode state
    step: jax.Array  # [R] int32, tokens the request had generated (a preempted one resumes)
    recent: jax.Array  # [R, recent_width] int32, its last generated tokens
    window: jax.Array  # [R, W] int32, its last W tokens of prompt and output
    prompt_seen: jax.Array  # [R, V] bool, tokens of its prompt
    output_counts: jax.Array  # [R, V] int32, occurrences among its generated tokens
    constraint: jax.Array  # [R] int32, its automaton's state after its output (0: none)


def mixed_batch(decode: list[Sequence], work: list[PrefillWork], max_slots: int,
                vocab_size: int, recent_width: int, window_width: int, tokenizer=None,
                n_prompt: int | None = None, n_rows: int | None = None) -> MixedBatch:
    """The host arrays of a mixed step: `n_rows` (default max_slots, at least
    `len(decode)`) single tokens, the `decode` sequences' first (one each, at position
    length - 1), then `n_prompt` tokens (default: the bucket of the `work` chunks, each
    padded to whole blocks of QUERY_BLOCK, at least one block) holding the chunks."""
    padded = sum(blocks(w.n) for w in work)
    n_prompt = bucket(padded, MIN_PROMPT_BUCKET) if n_prompt is None else n_prompt
    n_rows = max_slots if n_rows is None else n_rows
    N, R, V = n_rows + n_prompt, max_slots, vocab_size
    tokens, position = np.zeros(N, np.int32), np.zeros(N, np.int32)
    slot, is_decode, valid = np.full(N, max_slots, np.int32), np.zeros(N, bool), np.zeros(N, bool)
    row_slot, row_at = np.full(R, max_slots, np.int32), np.zeros(R, np.int32)
    insert = np.zeros(R, bool)
    step, constraint = np.zeros(R, np.int32), np.zeros(R, np.int32)
    recent = np.full((R, recent_width), stopping.BEFORE_START, np.int32)
    window = np.zeros((R, window_width), np.int32)
    seen, counts = np.zeros((R, V), bool), np.zeros((R, V), np.int32)
    r = 0
    for i, seq in enumerate(decode):
        slot[i], position[i], is_decode[i], valid[i] = seq.slot, seq.length - 1, True, True
        row_slot[r], row_at[r], r = seq.slot, i, r + 1
    i = n_rows
    for w in work:
        seq, n = w.seq, blocks(w.n)
        tokens[i: i + w.n] = seq.target[w.start: w.start + w.n]
        slot[i: i + n], position[i: i + n] = seq.slot, w.start + np.arange(n)
        valid[i: i + w.n] = True
        if w.completes:
            row_slot[r], row_at[r], insert[r] = seq.slot, i + w.n - 1, True
            put_history(seq, r, step, recent, window, seen, counts, constraint, tokenizer)
            r += 1
        i += n
    return MixedBatch(*to_device((tokens, slot, position, is_decode, valid, row_slot, row_at,
                                  insert, step, recent, window, seen, counts, constraint)))


def blocks(n: int) -> int:
    """Tokens that `n` prompt tokens take in a mixed step: whole query blocks."""
    return -(-n // QUERY_BLOCK) * QUERY_BLOCK


def _insert(state: DecodeState, batch: MixedBatch) -> DecodeState:
    """`state` with every row whose prompt completes set to its history, running."""
    B = state.done.shape[0]
    at_R = jnp.where(batch.insert, batch.row_slot, B)
    put = lambda x, y: x.at[at_R].set(y, mode="drop")  # noqa: E731
    return state.replace(
        step=put(state.step, batch.step), num_tokens=put(state.num_tokens, batch.step),
        done=put(state.done, False), finish=put(state.finish, stopping.RUNNING),
        recent=put(state.recent, batch.recent), window=put(state.window, batch.window),
        prompt_seen=put(state.prompt_seen, batch.prompt_seen),
        output_counts=put(state.output_counts, batch.output_counts),
        constraint=put(state.constraint, batch.constraint))


@functools.partial(jax.jit, static_argnames=("config", "n_rows", "pad_id"),
                   donate_argnames="state")
def engine_mixed(params, config, state: DecodeState, page_table, batch: MixedBatch, rows,
                 stops, *, n_rows: int, pad_id: int):
    """One mixed chunk: a mixed step, then CHUNK - 1 decode steps of its decode rows.

    The mixed step: the N query tokens through the model (`ragged_transformer`: each
    token's keys and values stored at its position in its slot's pages), each touched
    slot's length set to its last position + 1, the completed prompts inserted into the
    decode state (as `batching.engine_prefill`) and every sampled row's next token sampled
    and recorded (`sample_and_record`, on the R rows only). Then the rows it decoded (not
    the prompts it completed: their pages hold only the prompt) run CHUNK - 1 more decode
    steps, gathered compactly as in `batching.engine_decode`: a decoding request gets
    CHUNK tokens per call with or without a prompt going in, and the call's fixed cost
    (dispatch, host arrays, the read back) is paid once per CHUNK tokens, as a decode
    chunk's. `n_rows` (static): the decode rows, the first n_rows of the N tokens
    (`Scheduler.mixed_rows`: at least the decoded count). `state` is donated."""
    B = state.done.shape[0]
    slot_N = batch.slot
    tokens_N = jnp.where(batch.decode, state.next_token[jnp.minimum(slot_N, B - 1)],
                         batch.tokens)
    table_NM = jnp.take(page_table, slot_N, axis=0, mode="fill", fill_value=kv.NO_PAGE)
    cache = state.model.replace(page_table=page_table)
    x_ND, cache = ragged_transformer(params, tokens_N, batch.position, table_NM, batch.valid,
                                     cache, config, n_single=n_rows)
    written_N = jnp.where(batch.valid, slot_N, B)
    lengths = cache.lengths.at[written_N].set(0, mode="drop").at[written_N].max(
        batch.position + 1, mode="drop")
    state = _insert(state.replace(model=cache.replace(lengths=lengths)), batch)
    logits_RV = lm_head(params, x_ND[batch.row_at], config)
    take = lambda x: jnp.take(x, batch.row_slot, axis=0, mode="fill", fill_value=0)  # noqa: E731
    sub = sample_and_record(_gather_rows(state, batch.row_slot), logits_RV, batch.row_slot < B,
                            jax.tree.map(take, rows), jax.tree.map(take, stops), pad_id)
    state = _scatter_rows(state, batch.row_slot, sub)
    return _decode_rows(params, config, state, batch, rows, stops, n_rows, pad_id)


def _decode_rows(params, config, state: DecodeState, batch: MixedBatch, rows, stops,
                 n_rows: int, pad_id: int) -> DecodeState:
    """CHUNK - 1 decode steps of the rows `batch` decoded (no window forward: the scheduler
    mixes no row that could outgrow the context in a chunk, `Scheduler.mixable`)."""
    B = state.done.shape[0]
    decoded_B = jnp.zeros((B,), bool).at[jnp.where(batch.insert, B, batch.row_slot)].set(
        True, mode="drop")
    slots_R = live_slots(decoded_B, n_rows)
    step_fn = lambda tokens_B, cache, advance_B, window_BW: run_step(  # noqa: E731
        params, config, tokens_B, cache, advance_B)
    take = lambda x: jnp.take(x, slots_R, axis=0, mode="fill", fill_value=0)  # noqa: E731
    chunk = decode_chunk(_gather_rows(state, slots_R), step_fn, jax.tree.map(take, rows),
                         jax.tree.map(take, stops), pad_id, chunk=CHUNK - 1)
    return _scatter_rows(state, slots_R, chunk)
