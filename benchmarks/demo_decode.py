"""Decode tokens/s of cached `generate` against `naive_generate` on a trained run, same
batch (the demo's four speaker prompts), same run.

Usage:
  .venv/bin/python benchmarks/demo_decode.py --run-dir runs/shakespeare-char
  gpt-jax bench demo_decode --run-dir runs/shakespeare-char --max-new-tokens 100

Both are compiled first, then timed in turns `--repeats` times (median reported). Prints a
table and writes benchmarks/results/demo_decode.json.
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

from gpt_jax.checkpoint import load_params
from inference import SamplingParams, generate, naive_generate
from training.demo import PROMPTS as DEMO_PROMPTS


def timed(fn, params, config, prompts, sampling) -> tuple[float, list]:
    tick = time.perf_counter()
    outs = fn(params, config, prompts, sampling)
    return time.perf_counter() - tick, outs


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpt-jax bench demo_decode", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default="runs/shakespeare-char")
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    config, params, tokenizer = load_params(args.run_dir)
    prompts = [tokenizer.encode(p) for p in DEMO_PROMPTS]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens)
    runs = {"generate (KV cache)": generate, "naive_generate (no cache)": naive_generate}
    outputs = {name: fn(params, config, prompts, sampling) for name, fn in runs.items()}  # compile
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            times[name].append(timed(fn, params, config, prompts, sampling)[0])
    new_tokens = sum(len(o.tokens) for o in outputs["generate (KV cache)"])
    same = all(a.tokens == b.tokens for a, b in zip(*outputs.values()))
    rows = {name: new_tokens / statistics.median(t) for name, t in times.items()}
    ratio = rows["generate (KV cache)"] / rows["naive_generate (no cache)"]
    print(f"{'':28s} {'tokens/s':>10s}")
    for name, tok_s in rows.items():
        print(f"{name:28s} {tok_s:10,.0f}")
    print(f"ratio cached/naive: {ratio:.1f}x; identical greedy tokens: {same}")
    result = {
        "run_dir": args.run_dir, "batch": len(prompts), "max_new_tokens": args.max_new_tokens,
        "tokens_per_s": rows, "ratio": ratio, "identical_tokens": same,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_avg": os.getloadavg(), "jax": jax.__version__},
    }
    out = Path("benchmarks/results/demo_decode.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
