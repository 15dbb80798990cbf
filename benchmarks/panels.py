"""The decode step with the large float32 block matrices in panels (`PanelMajor`, the panel
kernel) against the same weights `OutputMajor` (XLA's products, the few-rows kernel at one
row), side by side in one process, at several batch sizes.

Usage (also `gpt-jax bench panels [flags]`; writes benchmarks/results/panels{--tag}.{json,png}):
  python benchmarks/panels.py                              # gpt2, batches 1 4 8 16 32
  python benchmarks/panels.py --preset smollm2-135m --batches 1 8 --rounds 15

Random weights of the preset's shape made by `inference_params` (what `LLM` and `Engine`
run: packed into 2 MB pages) with `panels` on ("panels") and off ("output_major");
`--steps` greedy decode steps of every row at `--live` cached tokens in one scanned program
(`speed.decode_runner`). Each round runs both programs of a batch size, the order
alternated; per batch size the medians of milliseconds per step and of the rounds' ratios
(panels over output_major), whether the greedy tokens agree, and the load average are
printed and written, with a plot of milliseconds per step against the batch size.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import decode_runner, preset, save  # noqa: E402

from gpt_jax import init_params  # noqa: E402
from gpt_jax.params import has_panels, inference_params  # noqa: E402

LAYOUTS = ("output_major", "panels")


def plot(ax, rows):
    batches = [r["batch"] for r in rows]
    for name in LAYOUTS:
        ax.plot(batches, [r[f"{name}_ms"] for r in rows], "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (rows per decode step)")
    ax.set_ylabel("ms per decode step (median)")
    ax.legend()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench panels",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--live", type=int, default=128, help="cached tokens per row")
    parser.add_argument("--capacity", type=int, default=256, help="token slots per row")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per timing")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    args = parser.parse_args(argv)
    config = preset(args.preset)
    params = init_params(config, jax.random.key(0))
    layouts = {"output_major": inference_params(params, config, panels=False),
               "panels": inference_params(params, config)}
    if not has_panels(layouts["panels"]):
        raise SystemExit("no weights in panels here (not CPU, the kernel off, or too small)")
    del params
    load_start = [round(a, 1) for a in os.getloadavg()]
    rows = []
    for batch in args.batches:
        runs = {name: decode_runner(p, config, batch, args.capacity, args.live, args.steps)
                for name, p in layouts.items()}
        tokens = {name: np.asarray(run()[0]) for name, run in runs.items()}
        times = {name: [] for name in runs}
        for r in range(args.rounds):
            for name in LAYOUTS[r % 2:] + LAYOUTS[:r % 2]:
                tick = time.perf_counter()
                jax.block_until_ready(runs[name]())
                times[name].append(1e3 * (time.perf_counter() - tick) / args.steps)
        ratios = np.array(times["panels"]) / np.array(times["output_major"])
        rows.append({"batch": batch,
                     **{f"{name}_ms": float(np.median(times[name])) for name in LAYOUTS},
                     "ratio": float(np.median(ratios)),
                     "tokens_agree": bool((tokens["panels"] == tokens["output_major"]).all()),
                     "load": round(os.getloadavg()[0], 1)})
    load_end = [round(a, 1) for a in os.getloadavg()]
    print(f"{args.preset}, live {args.live}, {args.rounds} rounds; load average {load_start} "
          f"-> {load_end}")
    save(f"panels{args.tag}", rows, plot, {"args": vars(args), "load_start": load_start,
                                          "load_end": load_end})


if __name__ == "__main__":
    main()
