"""The programs an `inference.Engine` can run, listed and compiled before any request: each
mixed step's token count (`Scheduler.mixed_shapes`; without mixed steps, each prefill shape
the scheduler can form, `Scheduler.prefill_shapes`) and each decode chunk's
batch size (`inference.batching.decode_rows` of the running count: the decode rows are the
running slots gathered compactly), with `crop` also each count of rows that may outgrow
the context. `Engine.warmup` calls `compile_all`; a test checks that a random workload runs
no program outside `programs` (tests/test_engine.py)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import jax
import numpy as np

from inference import stopping
from inference.batching import PrefillBatch, decode_rows, engine_decode, engine_prefill
from inference.mixed import engine_mixed, mixed_batch
from inference.transfer import to_device


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
    """Have every program of `programs(engine, crop)` compiled (or loaded from the
    persistent cache) now rather than while requests wait, with the slots' sampling arrays
    `rows` and `stops` (`Engine._row_arrays`, or a constrained variant of them).

    An exported program (`inference.exported`: `serve` and `LLM` with the cache) is only
    lowered and compiled, not run, several at once in a thread pool (XLA compiles outside
    the GIL); any other is run once on the engine's idle state, with
    padding rows only (no slot changes). The arrays are built with numpy and placed as the
    engine's calls place theirs (`inference.transfer.to_device`: no program of their own)."""
    table = engine._page_table()
    ahead = []  # what compiles each exported program
    for program in programs(engine, crop):
        fn, args, kwargs = _call(engine, program, table, rows, stops)
        if hasattr(fn, "precompile"):
            ahead.append(fn.precompile(*args, **kwargs))
        else:  # jit's own cache: the arrays as the engine's calls pass them
            args = to_device(args)
            engine.state = fn(*args, **kwargs)
        if program.kind == "prefill" and engine.draft is not None:
            # its draft model's prefill (`inference.draft_engine`), run once
            engine.draft.prefill(table, to_device(args[4]))
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        for done in [pool.submit(compile_call) for compile_call in ahead]:
            done.result()
    jax.block_until_ready(engine.state)


def _call(engine, program: Program, table, rows, stops) -> tuple:
    """`program`'s entry point (the engine's exported one, else the jitted one) and its
    arguments `(fn, args, kwargs)` on the engine's idle state: padding rows only, host
    arrays as numpy."""
    R, T, V = program.rows, program.length, engine.config.vocab_size
    recent_width = engine.state.recent.shape[1]
    common = (engine.params, engine.config, engine.state, table)
    if program.kind == "mixed":
        batch = mixed_batch([], [], engine.max_slots, V, recent_width,
                            engine.state.window.shape[1], n_prompt=T, n_rows=R)  # padding only
        return (engine.mixed_program or engine_mixed), (*common, batch, rows, stops), \
            {"n_rows": R, "pad_id": 0}
    if program.kind == "prefill":
        zeros = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)  # noqa: E731
        batch = PrefillBatch(
            zeros(R, T), zeros(R), zeros(R), np.full(R, engine.max_slots, np.int32),
            zeros(R, dtype=bool), zeros(R),
            np.full((R, recent_width), stopping.BEFORE_START, np.int32),
            zeros(R, engine.config.max_seq_len), zeros(R, V, dtype=bool),
            zeros(R, V), zeros(R))  # padding rows: no effect
        return (engine.prefill_program or engine_prefill), (*common, batch, rows, stops), \
            {"pad_id": 0}
    live = np.zeros((engine.max_slots,), bool)
    window = np.full((program.window,), engine.max_slots, np.int32)
    return (engine.decode_program or engine_decode), \
        (*common, live, rows, stops, window), {"n_rows": R, "pad_id": 0}
