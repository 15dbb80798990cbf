"""What a call of the CPU int8 kernel costs beyond reading its bytes: the same int8 weights
read in many narrow calls (one per matrix, as a narrow model's decode step makes them) or in
one call of one tall matrix.

Usage (also `gpt-jax bench int8_calls [flags]`; writes benchmarks/results/int8_calls.json):
  python benchmarks/int8_calls.py                      # 120 calls of 576 x 576, one row
  python benchmarks/int8_calls.py --width 768 --calls 48 --rows 8

smollm2-135m's decode step makes 121 kernel calls (per layer q/k/v, o, gate/up and down;
then the output projection), most under 1 MB of int8 weights; GPT-2's makes 49 of 1.8-2.4 MB.
Each timed program multiplies `--rows` rows by `--calls` distinct `[width, width]` int8
matrices in turn (each call's input the previous output), or by one `[calls * width, width]`
matrix: the same bytes, read from memory either way (together far larger than the caches).
The two run in turn over `--rounds` rounds; medians of wall and process CPU time (both
threads), and the per-call cost `(many - one) / calls` from the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import RESULTS, machine  # noqa: E402

from gpt_jax.kernels import panel_matmul as panel_kernel  # noqa: E402
from gpt_jax.layers import Int8Weight  # noqa: E402


def timings(fn, repeats: int) -> tuple[float, float]:
    """Wall and process CPU milliseconds of one call of `fn` (mean of `repeats`)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        jax.block_until_ready(fn())
    return (1e3 * (time.perf_counter() - wall) / repeats,
            1e3 * (time.process_time() - cpu) / repeats)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench int8_calls",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=576, help="inputs and outputs per matrix")
    parser.add_argument("--calls", type=int, default=120)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    if not panel_kernel.available():
        raise SystemExit("the CPU int8 kernel is not available (see the warning above)")
    rng = np.random.default_rng(0)
    D, N = args.width, args.calls
    quantize = jax.jit(Int8Weight.quantize)
    tall = quantize(jnp.asarray(rng.standard_normal((N * D, D), np.float32)))
    narrow = [quantize(jnp.asarray(rng.standard_normal((D, D), np.float32))) for _ in range(N)]

    @jax.jit
    def many(x, ws):
        for w in ws:
            x = panel_kernel.int8_matmul(x, w.values, w.scale_O) * (1.0 / D)
        return x

    @jax.jit
    def one(x, w):
        return panel_kernel.int8_matmul(x, w.values, w.scale_O)

    x = jnp.ones((args.rows, D), jnp.float32)
    runs = {f"{N} calls": lambda: many(x, narrow), "1 call": lambda: one(x, tall)}
    for run in runs.values():
        jax.block_until_ready(run())  # compile
    load = [round(a, 1) for a in os.getloadavg()]
    wall, cpu = {n: [] for n in runs}, {n: [] for n in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            w, c = timings(run, 5)
            wall[name].append(w)
            cpu[name].append(c)
    med = {n: (float(np.median(wall[n])), float(np.median(cpu[n]))) for n in runs}
    many_name = f"{N} calls"
    per_call = {"wall_us": 1e3 * (med[many_name][0] - med["1 call"][0]) / N,
                "cpu_us": 1e3 * (med[many_name][1] - med["1 call"][1]) / N}
    megabytes = N * D * D / 1e6
    print(f"{megabytes:.1f} MB of int8 weights, {args.rows} row(s); load {load}")
    for name, (w, c) in med.items():
        print(f"  {name:10s} wall {w:7.2f} ms (min {min(wall[name]):.2f}, "
              f"{megabytes / w:.1f} GB/s), CPU {c:7.2f} ms")
    print(f"  per call: wall {per_call['wall_us']:.1f} us, CPU {per_call['cpu_us']:.1f} us")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "int8_calls.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "load_at_start": load,
         "wall_ms": wall, "cpu_ms": cpu, "per_call": per_call}, indent=1))


if __name__ == "__main__":
    main()
