"""The programs an `inference.Engine` can run, listed and compiled before any request: each
mixed step's token count (`Scheduler.mixed_shapes`; without mixed steps, each prefill shape
the scheduler can form, `Scheduler.prefill_shapes`) and each decode chunk's
batch size (`inference.batching.decode_rows` of the running count: the decode rows are the
running slots gathered compactly), with `crop` also each count of rows that may outgrow
the context. `Engine.warmup` calls `compile_all`; a test checks that a random workload runs
no program outside `programs` (tests/test_engine.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from inference import stopping
from inference.batching import PrefillBatch, decode_rows, engine_decode, engine_prefill
from inference.mixed import engine_mixed, mixed_batch


@dataclasses.dataclass(frozen=True, order=True)
class Program:
    """One compiled program of the Engine: a mixed step of `rows` decode tokens and
    `length` prompt tokens (kind "mixed"), a prefill call of `rows` x `length` tokens
    (kind "prefill"), or a decode chunk of `rows` rows, `window` of them rows that may
    outgrow the context (kind "decode")."""

    kind: str
    rows: int
    length: int = 0  # prefill: the padded chunk length T
    window: int = 0  # decode: rows whose window forward runs ("crop" requests)


def programs(engine, crop: bool = False) -> list[Program]:
    """Every program `engine.step()` can run (plain decode: speculative chunks and
    structured-output tables compile their own), prefill shapes first, each once; a
    prefill program with a draft model is two (`compile_all` runs both)."""
    if engine.mixed:
        listed = [Program("mixed", R, n) for R in sorted({engine.scheduler.mixed_rows(k)
                                                          for k in (0, engine.max_slots)})
                  for n in engine.scheduler.mixed_shapes()]
    else:
        listed = [Program("prefill", R, T) for R, T in engine.scheduler.prefill_shapes()]
    for n_rows in sorted({decode_rows(k, engine.max_slots)
                          for k in range(1, engine.max_slots + 1)}):
        windows = {decode_rows(k, n_rows) for k in range(1, n_rows + 1)} if crop else set()
        listed += [Program("decode", n_rows, window=w) for w in [0] + sorted(windows)]
    return listed


def compile_all(engine, crop: bool, rows, stops) -> None:
    """Run every program of `programs(engine, crop)` once on the engine's idle state, with
    padding rows only (no slot changes) and the slots' sampling arrays `rows` and `stops`
    (`Engine._row_arrays`, or a constrained variant of them): each is compiled (or loaded
    from the persistent cache) now rather than while requests wait."""
    V, recent_width = engine.config.vocab_size, engine.state.recent.shape[1]
    table = engine._page_table()
    zeros = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
    live = jnp.zeros((engine.max_slots,), bool)
    for program in programs(engine, crop):
        R, T = program.rows, program.length
        if program.kind == "mixed":
            batch = mixed_batch([], [], engine.max_slots, V, recent_width,
                                engine.state.window.shape[1], n_prompt=T, n_rows=R)  # padding
            engine.state = (engine.mixed_program or engine_mixed)(
                engine.params, engine.config, engine.state, table, batch, rows, stops,
                n_rows=R, pad_id=0)
        elif program.kind == "prefill":
            batch = PrefillBatch(*map(jnp.asarray, (
                zeros(R, T), zeros(R), zeros(R), np.full(R, engine.max_slots, np.int32),
                zeros(R, dtype=bool), zeros(R),
                np.full((R, recent_width), stopping.BEFORE_START, np.int32),
                zeros(R, engine.config.max_seq_len), zeros(R, V, dtype=bool),
                zeros(R, V), zeros(R))))  # padding rows: no effect
            engine.state = (engine.prefill_program or engine_prefill)(
                engine.params, engine.config, engine.state, table, batch, rows, stops, pad_id=0)
            if engine.draft is not None:  # its draft model's prefill (`inference.draft_engine`)
                engine.draft.prefill(table, batch)
        else:
            engine.state = (engine.decode_program or engine_decode)(
                engine.params, engine.config, engine.state, table, live, rows, stops,
                jnp.full((program.window,), engine.max_slots, jnp.int32), n_rows=R, pad_id=0)
    jax.block_until_ready(engine.state)
