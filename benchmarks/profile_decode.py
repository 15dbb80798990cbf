"""Where a cached decode step spends its time: an XLA profile of a few steps, summed per op.

Usage:
  python benchmarks/profile_decode.py                  # gpt2, batch 8, live 128
  python benchmarks/profile_decode.py --batch 1 --live 64 --top 15

Runs the decode step of `benchmarks/speed.py live-length` under `jax.profiler.trace`, then
sums the trace's events by name and prints the largest; writes results/profile_decode.json.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import RESULTS, decode_runner, machine, preset, timed  # noqa: E402

from gpt_jax import init_params  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--live", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    config = preset(args.preset)
    params = init_params(config, jax.random.key(0))
    steps = 8
    run = decode_runner(params, config, args.batch, args.capacity, args.live, steps)
    jax.block_until_ready(run())  # compile outside the trace
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            step = timed(run, repeats=1) / steps
        (trace_file,) = Path(tmp).rglob("*.trace.json.gz")
        events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    totals = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and not e["name"].startswith("$"):
            totals[e["name"]] += e["dur"] / 1e3  # XLA ops and runtime events, no Python
    rows = [{"op": name[:70], "ms": ms} for name, ms in totals.most_common(args.top)]
    print(f"decode step {1e3 * step:.1f} ms (batch {args.batch}, live {args.live}); "
          f"trace totals over 2 x {steps} steps (nested events overlap):")
    for r in rows:
        print(f"{r['ms']:10.1f} ms  {r['op']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "profile_decode.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "step_ms": 1e3 * step, "top": rows},
        indent=1))


if __name__ == "__main__":
    main()
