"""The decode step with the CPU few-rows kernel against the same step with XLA's products,
side by side in one process.

Usage (also `gpt-jax bench few_rows_decode [flags]`; writes
benchmarks/results/few_rows_decode{--tag}.json):
  python benchmarks/few_rows_decode.py                          # smollm2-135m, batch 1
  python benchmarks/few_rows_decode.py --preset gpt2 --rounds 15
  python benchmarks/few_rows_decode.py --batches 8 --force   # where XLA's products are kept

Random weights of the preset's shape in the decode layout, float32, every row at `--live`
cached tokens. Two programs of `inference.steps.run_decode` are compiled: one as traced by
default (the weight products in `gpt_jax.kernels.few_rows_matmul` where it applies), one
traced with that kernel off (XLA's products; every other kernel as usual). Each round times
`--steps` steps of each, in alternating order, and keeps the wall and process CPU time
(all threads) per step; the medians, the median of the rounds' paired ratios (kernel over
XLA), the largest logit difference between the two and the load average are printed and
written.
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

from gpt_jax import GPTConfig, init_cache, init_params  # noqa: E402
from gpt_jax.kernels import few_rows_matmul as few_rows_kernel  # noqa: E402
from gpt_jax.params import decode_layout  # noqa: E402
from inference import steps  # noqa: E402


def compiled_step(params, config, batch: int, live: int, kernel: bool, force: bool = False):
    """`(step, tokens, cache)`: the compiled decode step at `batch` rows of `live` cached
    tokens, traced with the few-rows kernel as it applies (`kernel`) or off; with `force`,
    2 to 8 rows use it over weights of any size (where `use_kernel` leaves them to XLA)."""
    cache = init_cache(config, batch, live + 1)
    cache = cache.replace(lengths=jnp.full((batch,), live, jnp.int32))
    tokens = jnp.zeros((batch,), jnp.int32)
    available, limit = few_rows_kernel.available, few_rows_kernel.MAX_CACHED_FLOATS
    if not kernel:
        few_rows_kernel.available = lambda: False
    if force and batch > 1:
        few_rows_kernel.MAX_CACHED_FLOATS = 1 << 62
    try:
        fn = jax.jit(lambda p, t, c: steps.run_decode(p, config, t, c, jnp.ones(t.shape, bool)))
        step = fn.lower(params, tokens, cache).compile()
    finally:
        few_rows_kernel.available, few_rows_kernel.MAX_CACHED_FLOATS = available, limit
    if (few_rows_kernel.TARGET in step.as_text()) != kernel:
        raise SystemExit(f"the step traced with kernel={kernel} does not match (is the "
                         "kernel available, and used at this batch?)")
    return step, tokens, cache


def per_step(step, params, tokens, cache, n: int) -> tuple[float, float]:
    """Wall and process CPU milliseconds per step over `n` steps (the cache is only read:
    every step is the same step)."""
    jax.block_until_ready(step(params, tokens, cache))
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        out = step(params, tokens, cache)
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - wall) / n, 1e3 * (time.process_time() - cpu) / n


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench few_rows_decode",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--live", type=int, default=128, help="cached tokens per row")
    parser.add_argument("--steps", type=int, default=16, help="steps per timing")
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--force", action="store_true",
                        help="at batch 2-8, the kernel for weights of any size (off by default)")
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    args = parser.parse_args(argv)
    if not few_rows_kernel.available():
        raise SystemExit("the CPU few-rows kernel is not available (see the warning above)")
    config = GPTConfig.preset(args.preset)
    params = decode_layout(init_params(config, jax.random.key(0)))
    load_start = [round(a, 1) for a in os.getloadavg()]
    rows = []
    for batch in args.batches:
        runs = {name: compiled_step(params, config, batch, args.live, name == "kernel",
                                     args.force)
                for name in ("kernel", "xla")}
        logits = {name: np.asarray(step(params, t, c)[0]) for name, (step, t, c) in runs.items()}
        wall, cpu = {n: [] for n in runs}, {n: [] for n in runs}
        for r in range(args.rounds):
            for name in (("kernel", "xla") if r % 2 == 0 else ("xla", "kernel")):
                step, tokens, cache = runs[name]
                w, c = per_step(step, params, tokens, cache, args.steps)
                wall[name].append(w)
                cpu[name].append(c)
        row = {"batch": batch, "wall_ms": wall, "cpu_ms": cpu,
               "median_wall_ms": {n: float(np.median(wall[n])) for n in runs},
               "median_cpu_ms": {n: float(np.median(cpu[n])) for n in runs},
               "paired_ratio": float(np.median(np.array(wall["kernel"]) / np.array(wall["xla"]))),
               "max_logit_diff": float(np.abs(logits["kernel"] - logits["xla"]).max())}
        rows.append(row)
        m, c = row["median_wall_ms"], row["median_cpu_ms"]
        print(f"{args.preset} batch {batch}: kernel {m['kernel']:.2f} ms (CPU {c['kernel']:.2f}), "
              f"XLA {m['xla']:.2f} ms (CPU {c['xla']:.2f}); paired ratio "
              f"{row['paired_ratio']:.3f}; max logit difference {row['max_logit_diff']:.2g}")
    load_end = [round(a, 1) for a in os.getloadavg()]
    print(f"load average {load_start} -> {load_end}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"few_rows_decode{args.tag}.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "load_start": load_start,
         "load_end": load_end, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
