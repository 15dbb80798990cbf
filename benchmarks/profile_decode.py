"""Where a cached decode step spends its time: an XLA profile of a few steps, summed per op.

Usage:
  python benchmarks/profile_decode.py                  # gpt2, batch 8, live 128
  python benchmarks/profile_decode.py --batch 1 --live 64 --top 15
  python benchmarks/profile_decode.py --batch 1 --quantize int8   # int8 weights

Runs the decode step of `benchmarks/speed.py live-length` under `jax.profiler.trace`, then
sums the trace's XLA op events per step by op kind, output shape and source (read from the
compiled HLO) and prints the largest; writes results/profile_decode.json.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import RESULTS, decode_runner, machine, preset, timed  # noqa: E402

from gpt_jax import init_params  # noqa: E402
from gpt_jax.params import QUANTIZE, inference_params  # noqa: E402

NESTING = ("while", "cond", "call")  # containers: their ops are counted themselves


def hlo_ops(hlo_text: str) -> dict[str, str]:
    """Instruction name -> "kind output-shape source" for every instruction of compiled HLO
    text (kind: the name without its number; source: the last part of its jax op_name)."""
    ops = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ", line)
        if m and m.group(1) not in ops:
            source = re.search(r'op_name="([^"]*)"', line)
            tail = source.group(1).split("/")[-1] if source else ""
            kind = re.sub(r"[.]\d+$", "", m.group(1))
            ops[m.group(1)] = f"{kind} {m.group(2)[:40]} {tail[:24]}"
    return ops


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench profile_decode",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--live", type=int, default=128)
    parser.add_argument("--capacity", type=int, default=256)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--quantize", choices=QUANTIZE, default=None, help="weights so")
    parser.add_argument("--tag", default="", help="suffix of the result file's name")
    args = parser.parse_args(argv)
    config = preset(args.preset)
    # Laid out once, as LLM holds them: else every call re-lays the weights (per call, not
    # per step, but a large share of 8 profiled steps).
    params = inference_params(init_params(config, jax.random.key(0)), config,
                              quantize_method=args.quantize)  # as `LLM` runs them
    steps = 8
    run = decode_runner(params, config, args.batch, args.capacity, args.live, steps)
    jax.block_until_ready(run())  # compile outside the trace
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            step = timed(run, repeats=1) / steps
        (trace_file,) = Path(tmp).rglob("*.trace.json.gz")
        events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    ops = hlo_ops(run.func.lower(*run.args).compile().as_text())
    totals, per_thread, count = collections.Counter(), collections.Counter(), 0
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and "dur" in e and name in ops and not name.startswith(NESTING):
            totals[ops[name]] += e["dur"] / 1e3 / (2 * steps)  # ms per step, both threads
            per_thread[e.get("tid")] += e["dur"] / 1e3 / (2 * steps)
            count += 1
    rows = [{"op": op, "ms_per_step": ms} for op, ms in totals.most_common(args.top)]
    busiest = max(per_thread.values(), default=0.0)
    print(f"decode step {1e3 * step:.1f} ms (batch {args.batch}, live {args.live}, traced); "
          f"{count / (2 * steps):.0f} ops a step, {sum(per_thread.values()):.1f} ms of op time "
          f"over {len(per_thread)} threads, the busiest's {busiest:.1f} ms (the rest of its "
          f"step between ops); XLA op time per step, summed over threads, by kind, output "
          f"shape and source:")
    for r in rows:
        print(f"{r['ms_per_step']:8.2f} ms  {r['op']}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "-".join(["profile_decode"] + [a for a in (args.quantize, args.tag) if a])
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "step_ms": 1e3 * step,
         "ops_per_step": count / (2 * steps), "busiest_thread_op_ms": busiest, "top": rows},
        indent=1))


if __name__ == "__main__":
    main()
