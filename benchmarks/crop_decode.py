"""Decode tokens/s past the context (context_overflow="crop") against cached decoding, at
the shakespeare-char preset shape with random weights, batch 4; and the cost of one crop
step by the exact ways to compute it.

Usage:
  .venv/bin/python benchmarks/crop_decode.py
  gpt-jax bench crop_decode --batch 4 --repeats 3

With learned absolute positions a cropped window puts every token at a new position each
step, so a row past the context needs a forward over its whole window per token. Rows:
  generate / Engine, cached: prompts of 8 tokens, 56 new ones (all inside the 64 context);
  generate / Engine, crop:   prompts of 64 tokens, the same 56 new ones (every one cropped);
  generate, demo-like:       prompts of 8 tokens, 500 new ones under crop (56 cached, 444 not);
  Engine, 16 slots:          16 cached requests, then 15 cached and 1 crop request (the
                             Engine runs windows only for crop rows near the context).
Each is compiled first, then timed `--repeats` times (median). Then one step's model time
(`--batch` windows of 64, compiled, best of 7 x 50 calls): `forward_last` (what crop runs),
`forward(...)[:, -1]`, a re-prefill of the window into an empty paged cache (`prefill`),
one cached decode step for scale, and `forward_last` on 1 and on 16 windows. Prints tables
and writes benchmarks/results/crop_decode.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax import GPTConfig, forward, init_params
from gpt_jax.model import forward_last
from gpt_jax.params import decode_layout
from inference import Engine, SamplingParams, generate
from inference.steps import init_cache_rows, prefill, run_decode


def run_engine(engine, prompts, sampling) -> int:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{time.perf_counter_ns()}-{i}", prompt, sampling)
    n = 0
    while engine.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in engine.step())
    return n


def tokens_per_s(fn, repeats: int) -> float:
    fn()  # compile
    times, n = [], 0
    for _ in range(repeats):
        tick = time.perf_counter()
        n = fn()
        times.append(time.perf_counter() - tick)
    return n / statistics.median(times)


def end_to_end(params, config, batch, repeats) -> dict[str, float]:
    rng = np.random.default_rng(0)
    C, short = config.max_seq_len, 8
    new = C - short
    prompts = {n: rng.integers(0, config.vocab_size, (batch, n)).tolist() for n in (short, C)}
    cases = {  # name: (prompt length, max_new_tokens, context_overflow)
        "cached (prompt 8, 56 new)": (short, new, "error"),
        "crop (prompt 64, 56 new)": (C, new, "crop"),
        "demo-like (prompt 8, 500 new)": (short, 500, "crop"),
    }
    rows = {}
    for name, (length, max_new, overflow) in cases.items():
        sp = SamplingParams(temperature=0.0, max_new_tokens=max_new, context_overflow=overflow)
        rows[f"generate, {name}"] = tokens_per_s(
            lambda: sum(len(o.tokens) for o in generate(params, config, prompts[length], sp)),
            repeats)
        if max_new == new:
            engine = Engine(params, config, max_slots=batch)
            rows[f"Engine, {name}"] = tokens_per_s(
                lambda: run_engine(engine, prompts[length], sp), repeats)
    engine = Engine(params, config, max_slots=16)
    many = rng.integers(0, config.vocab_size, (16, short)).tolist()
    cached = SamplingParams(temperature=0.0, max_new_tokens=new)
    crop = SamplingParams(temperature=0.0, max_new_tokens=new, context_overflow="crop")
    rows["Engine, 16 cached"] = tokens_per_s(lambda: run_engine(engine, many, cached), repeats)
    rows["Engine, 15 cached + 1 crop"] = tokens_per_s(
        lambda: run_mixed(engine, many[:15], cached, prompts[C][0], crop), repeats)
    return rows


def run_mixed(engine, prompts, sampling, crop_prompt, crop_sampling) -> int:
    """`prompts` under `sampling` and one more request, all in the engine at once."""
    engine.add_request(f"crop-{time.perf_counter_ns()}", crop_prompt, crop_sampling)
    return run_engine(engine, prompts, sampling)


def best_ms(fn, *args, n=50) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(7):
        tick = time.perf_counter()
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - tick) / n)
    return 1e3 * min(times)


def step_costs(params, config, batch) -> dict[str, float]:
    """ms per step of a batch of windows, by each exact way, and of a cached decode step."""
    C = config.max_seq_len
    layout = jax.jit(decode_layout)(params)
    windows = jnp.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (batch, C)),
                          jnp.int32)
    empty = init_cache_rows(config, batch, C, jnp.float32)
    full = empty.replace(lengths=jnp.full((batch,), C - 1, jnp.int32))
    hold = jnp.zeros((batch,), bool)
    ways = {
        "forward_last (crop's step)": (jax.jit(forward_last, static_argnames="config"),
                                       (layout, windows, config)),
        "forward(...)[:, -1]": (jax.jit(lambda p, w: forward(p, w, config)[:, -1]),
                                (params, windows)),
        "re-prefill into an empty cache": (
            lambda p, w: prefill(p, config, w, jnp.full((batch,), C, jnp.int32), empty)[0],
            (layout, windows)),
        "cached decode step (for scale)": (
            jax.jit(lambda p, t: run_decode(p, config, t, full, hold)[0]), (layout, windows[:, 0])),
        "forward_last, 1 window": (jax.jit(forward_last, static_argnames="config"),
                                   (layout, windows[:1], config)),
        "forward_last, 16 windows": (jax.jit(forward_last, static_argnames="config"),
                                     (layout, jnp.tile(windows, (-(-16 // batch), 1))[:16],
                                      config)),
    }
    return {name: best_ms(fn, *args) for name, (fn, args) in ways.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpt-jax bench crop_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    config = GPTConfig.preset("shakespeare-char")
    params = init_params(config, jax.random.key(0))
    rows = end_to_end(params, config, args.batch, args.repeats)
    print(f"{'decode, batch ' + str(args.batch):48s} {'tokens/s':>10s}")
    for name, rate in rows.items():
        print(f"{name:48s} {rate:10,.0f}")
    steps = step_costs(params, config, args.batch)
    print(f"\n{'one step, windows of ' + str(config.max_seq_len):48s} {'ms':>10s}")
    for name, ms in steps.items():
        print(f"{name:48s} {ms:10.2f}")
    result = {
        "config": "shakespeare-char (random weights)", "batch": args.batch,
        "tokens_per_s": rows, "step_ms": steps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg": os.getloadavg(), "jax": jax.__version__},
    }
    out = Path("benchmarks/results/crop_decode.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
