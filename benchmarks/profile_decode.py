"""Where a cached decode step spends its time: an XLA profile of a few steps, summed per op.

Usage:
  python benchmarks/profile_decode.py                  # gpt2, batch 8, live 128
  python benchmarks/profile_decode.py --batch 1 --live 64 --top 15
  python benchmarks/profile_decode.py --batch 1 --quantize int8   # int8 weights
  python benchmarks/profile_decode.py --preset smollm2-135m --batch 1 --rounds 7

Runs the decode step of `benchmarks/speed.py live-length` under `jax.profiler.trace`, then
sums the trace's XLA op events per step by op kind (a kernel call by its target), output
shape and source (read from the compiled HLO) and prints the largest; writes
results/profile_decode.json.

Each of `--rounds` rounds also reads the memory bandwidth twice (`bandwidth.BandwidthProbe`,
alternated with the step as `throughput` alternates it) and splits the traced step's time
on the thread that runs it into the weight products' kernel calls (the few-rows, panel and
int8 kernels: every weight byte is read there), the attention kernel's calls, and the rest
(XLA's own ops and the time between ops), so a round says how fast the products read the
weights against the probe's read of the same minute (`products_x_read`) and what share of
the step they are: the memory-bound limit's ratio (`x_bound`, weights and live KV over the
read, over the untraced step) is their product, less the KV's share.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import BandwidthProbe  # noqa: E402
from speed import RESULTS, decode_runner, live_kv_bytes, machine, preset, seconds  # noqa: E402

from gpt_jax import init_params  # noqa: E402
from gpt_jax.kernels import few_rows_matmul, paged_attention, panel_matmul  # noqa: E402
from gpt_jax.params import QUANTIZE, inference_params  # noqa: E402

NESTING = ("while", "cond", "call")  # containers: their ops are counted themselves
PRODUCTS = (few_rows_matmul.TARGET, panel_matmul.TARGET, panel_matmul.F32_TARGET)
ATTENTION = paged_attention.TARGET


def hlo_ops(hlo_text: str) -> dict[str, str]:
    """Instruction name -> "kind output-shape source" for every instruction of compiled HLO
    text (kind: a custom call's target, else the name without its number; source: the last
    part of its jax op_name)."""
    ops = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+) ", line)
        if m and m.group(1) not in ops:
            source = re.search(r'op_name="([^"]*)"', line)
            tail = source.group(1).split("/")[-1] if source else ""
            target = re.search(r'custom_call_target="([^"]*)"', line)
            kind = target.group(1) if target else re.sub(r"[.]\d+$", "", m.group(1))
            ops[m.group(1)] = f"{kind} {m.group(2)[:40]} {tail[:24]}"
    return ops


def traced_events(run, ops: dict[str, str]) -> tuple[float, list[dict]]:
    """One traced call of `run`: its wall seconds and the trace's op events (complete events
    of `ops`' instructions, containers left out)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            wall = seconds(run)
        (trace_file,) = Path(tmp).rglob("*.trace.json.gz")
        events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    return wall, [e for e in events if e.get("ph") == "X" and "dur" in e
                  and e.get("name", "") in ops and not e["name"].startswith(NESTING)]


def split_step(events: list[dict], ops: dict[str, str], traced_ms: float) -> dict[str, float]:
    """Milliseconds per step on the thread that runs the step (the one with the most ops):
    the weight products' kernel calls, the attention kernel's, and the rest of the traced
    step (`traced_ms`). Per step of those the trace holds (it may miss some: each product
    instruction of the program runs once a step)."""
    threads = collections.defaultdict(list)
    for e in events:
        threads[e.get("tid")].append(e)
    main = max(threads.values(), key=len)
    kind = {name: op.split()[0] for name, op in ops.items()}
    calls = PRODUCTS + (ATTENTION,)
    per_step = sum(k in calls for k in kind.values())
    steps = sum(kind[e["name"]] in calls for e in main) / max(per_step, 1)

    def total(kinds):
        return sum(e["dur"] for e in main if kind[e["name"]] in kinds) / 1e3 / max(steps, 1)

    products, attention = total(PRODUCTS), total((ATTENTION,))
    return {"steps_traced": steps, "products_ms": products, "attention_ms": attention,
            "rest_ms": traced_ms - products - attention}


def probe_rounds(run, ops, steps, rounds, weight_bytes, kv_bytes) -> list[dict]:
    """`rounds` rounds of: two bandwidth reads, the step timed, the step traced and split by
    `split_step`; each round's rates against its own best read."""
    probe, rows = BandwidthProbe(), []
    for _ in range(rounds):
        probe.restart()
        probe.read(), probe.read()
        read = probe.best_gbs()
        step = seconds(run) / steps
        traced, events = traced_events(run, ops)
        row = {"read_GBs": read, "step_ms": 1e3 * step, "traced_ms": 1e3 * traced / steps}
        row |= split_step(events, ops, row["traced_ms"])
        if row["products_ms"] > 0:  # none where XLA runs every product
            row["products_GBs"] = weight_bytes / row["products_ms"] / 1e6
            row["products_x_read"] = row["products_GBs"] / read
        row["x_bound"] = (weight_bytes + kv_bytes) / (read * 1e9) / step
        rows.append(row)
        print("  " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
    return rows


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
    parser.add_argument("--rounds", type=int, default=0,
                        help="rounds of bandwidth reads and traced steps split into products, "
                        "attention and the rest (module docstring); 0: none")
    args = parser.parse_args(argv)
    if args.rounds < 0:
        raise SystemExit(f"--rounds must be 0 or more, got {args.rounds}")
    config = preset(args.preset)
    # Laid out once, as LLM holds them: else every call re-lays the weights (per call, not
    # per step, but a large share of 8 profiled steps).
    params = inference_params(init_params(config, jax.random.key(0)), config,
                              quantize_method=args.quantize)  # as `LLM` runs them
    steps = 8
    run = decode_runner(params, config, args.batch, args.capacity, args.live, steps)
    jax.block_until_ready(run())  # compile outside the trace
    ops = hlo_ops(run.func.lower(*run.args).compile().as_text())
    wall, events = traced_events(run, ops)
    step = wall / steps
    totals, per_thread = collections.Counter(), collections.Counter()
    for e in events:
        totals[ops[e["name"]]] += e["dur"] / 1e3 / steps  # ms per step, all threads
        per_thread[e.get("tid")] += e["dur"] / 1e3 / steps
    rows = [{"op": op, "ms_per_step": ms} for op, ms in totals.most_common(args.top)]
    busiest = max(per_thread.values(), default=0.0)
    count = len(events)
    print(f"decode step {1e3 * step:.1f} ms (batch {args.batch}, live {args.live}, traced); "
          f"{count / steps:.0f} ops a step, {sum(per_thread.values()):.1f} ms of op time "
          f"over {len(per_thread)} threads, the busiest's {busiest:.1f} ms (the rest of its "
          f"step between ops); XLA op time per step, summed over threads, by kind, output "
          f"shape and source:")
    for r in rows:
        print(f"{r['ms_per_step']:8.2f} ms  {r['op']}")
    rounds, medians = [], {}
    if args.rounds:
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
        kv_bytes = live_kv_bytes(config, args.batch * args.live)
        load = os.getloadavg()[0]
        print(f"{args.rounds} rounds (weights {weight_bytes / 1e6:.0f} MB, live KV "
              f"{kv_bytes / 1e6:.1f} MB a step):")
        rounds = probe_rounds(run, ops, steps, args.rounds, weight_bytes, kv_bytes)
        medians = {k: float(np.median([r[k] for r in rounds if k in r])) for k in rounds[0]}
        medians["load_average"] = f"{load:.1f}->{os.getloadavg()[0]:.1f}"
        print("medians: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in medians.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = "-".join(["profile_decode"] + [a for a in (args.quantize, args.tag) if a])
    (RESULTS / f"{name}.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "step_ms": 1e3 * step,
         "ops_per_step": count / steps, "busiest_thread_op_ms": busiest, "top": rows,
         "rounds": rounds, "medians": medians},
        indent=1))


if __name__ == "__main__":
    main()
