"""The decode step with its weights in 4 KB pages against the same weights in 2 MB pages,
side by side in one process.

Usage (also `gpt-jax bench huge_pages [flags]`; writes benchmarks/results/huge_pages{--tag}.json):
  python benchmarks/huge_pages.py                        # smollm2-135m, batch 1, float32
  python benchmarks/huge_pages.py --quantize int8 --rounds 21

Why: a batch-1 decode step reads every weight once, in runs of at most a few MB, and the
CPU's hardware prefetchers stop at each 4 KB page boundary (and each page costs a TLB
miss); XLA:CPU allocates its buffers in 4 KB pages unless told otherwise (Linux's
transparent huge pages are "madvise" here). Random weights of the preset's shape in the
decode layout (float32, or `--quantize`d) as XLA allocates them ("4k"), a copy whose
buffers are advised into transparent huge pages and collapsed at once ("huge": Linux 6.1+
`madvise(MADV_COLLAPSE)`; only the 2 MB-aligned part of each buffer can be, the collapsed
megabytes are printed), and a copy packed into ONE 2 MB-aligned region advised into huge
pages before it is written ("packed": `gpt_jax.huge_pages.pack`, what `LLM` and `Engine`
run since it measured faster).
`--steps` greedy decode steps of each copy in one scanned program (`speed.decode_runner`),
the order rotated round by round; the medians of milliseconds per step, the medians of the
rounds' ratios to "4k" and the load average are printed and written.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import RESULTS, decode_runner, decode_step_arguments, machine, preset  # noqa: E402

from gpt_jax import init_params  # noqa: E402
from gpt_jax.huge_pages import HUGE_PAGE, pack  # noqa: E402
from gpt_jax.params import decode_layout, quantize  # noqa: E402

MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <linux/mman.h>


def collapse(tree) -> int:
    """Advise the 2 MB-aligned part of every array buffer of `tree` into huge pages and
    collapse it now; returns the bytes collapsed (0 where the kernel refuses)."""
    libc = ctypes.CDLL(None, use_errno=True)
    done = 0
    for leaf in jax.tree.leaves(tree):
        start = -(-leaf.unsafe_buffer_pointer() // HUGE_PAGE) * HUGE_PAGE
        end = (leaf.unsafe_buffer_pointer() + leaf.nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            address, length = ctypes.c_void_p(start), ctypes.c_size_t(end - start)
            libc.madvise(address, length, MADV_HUGEPAGE)
            done += (end - start) if libc.madvise(address, length, MADV_COLLAPSE) == 0 else 0
    return done


def packed(tree):
    """`tree` packed into one huge-page mapping (`gpt_jax.huge_pages.pack`, as `LLM` and
    `Engine` run their weights) and this process's AnonHugePages line. Raises SystemExit if
    it was not packed (jax copied, or not on one CPU device)."""
    out = pack(tree)
    if out is tree:
        raise SystemExit("the weights were not packed (gpt_jax.huge_pages.pack)")
    huge = [line for line in Path("/proc/self/smaps_rollup").read_text().splitlines()
            if line.startswith("AnonHugePages")]
    return out, huge


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench huge_pages",
                                     description=__doc__.split("\n")[0])
    decode_step_arguments(parser, rounds=15)
    args = parser.parse_args(argv)
    config = preset(args.preset)
    small = quantize(jax.jit(decode_layout)(init_params(config, jax.random.key(0))),
                     args.quantize)
    huge = jax.block_until_ready(jax.tree.map(lambda a: a.copy(), small))
    collapsed = collapse(huge)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(huge))
    packed_params, process_huge = packed(small)
    names = ("4k", "huge", "packed")
    runs = {name: decode_runner(params, config, args.batch, args.capacity, args.live,
                                args.steps)
            for name, params in zip(names, (small, huge, packed_params))}
    tokens = {name: np.asarray(run()[0]) for name, run in runs.items()}
    load_start = [round(a, 1) for a in os.getloadavg()]
    times = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            tick = time.perf_counter()
            jax.block_until_ready(runs[name]())
            times[name].append(1e3 * (time.perf_counter() - tick) / args.steps)
    load_end = [round(a, 1) for a in os.getloadavg()]
    medians = {name: float(np.median(t)) for name, t in times.items()}
    ratios = {name: float(np.median(np.array(times[name]) / np.array(times["4k"])))
              for name in names[1:]}
    agree = all((tokens[name] == tokens["4k"]).all() for name in names)
    print(f"{args.preset} batch {args.batch} {args.quantize or 'float32'}: weights "
          f"{total / 2**20:.0f} MB, {collapsed / 2**20:.0f} MB of the copy collapsed into 2 MB "
          f"pages; {process_huge}; ms per step " + ", ".join(
              f"{n} {medians[n]:.2f}" for n in names) + "; paired ratio to 4k: " + ", ".join(
              f"{n} {ratios[n]:.3f}" for n in names[1:]) + f"; greedy tokens agree: {agree}")
    print(f"load average {load_start} -> {load_end}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"huge_pages{args.tag}.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "load_start": load_start,
         "load_end": load_end, "weight_bytes": total, "collapsed_bytes": collapsed,
         "process_huge_pages": process_huge, "median_ms": medians,
         "paired_ratio_to_4k": ratios, "tokens_agree": agree, "ms": times}, indent=1))


if __name__ == "__main__":
    main()
