"""The decode step with this checkout's CPU kernels against the same step with a git
revision's kernels, side by side in one process.

Usage (also `gpt-jax bench kernel_ab [flags]`; writes benchmarks/results/kernel_ab{--tag}.json):
  python benchmarks/kernel_ab.py                          # smollm2-135m, batch 1, against main
  python benchmarks/kernel_ab.py --base HEAD~1 --rounds 15
  python benchmarks/kernel_ab.py --quantize int8          # the int8 kernel's step

Random weights of the preset's shape in the decode layout (float32, or `--quantize`d),
`--steps` greedy decode steps of every row at `--live` cached tokens in one scanned program
(`speed.decode_runner`: the cache carried, as the generation loop runs it). Two programs:
  base    the few-rows, int8 and paged-attention kernels built from `--base`'s sources
          (registered under their target names + "_base"; the float32 panel target, which
          older revisions lack, stays this checkout's in both);
  this    this checkout's kernels.
Each round runs each program once, the order alternated; the medians of wall and process
CPU milliseconds per step (all threads), the median of the rounds' wall ratios (this over
base), whether the greedy tokens agree and the load average are printed and written. (At
8c7a90d it also traced a third program, the gated MLP in one kernel call.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import RESULTS, decode_runner, decode_step_arguments, machine, preset  # noqa: E402

from gpt_jax import init_params  # noqa: E402
from gpt_jax.kernels import builder  # noqa: E402
from gpt_jax.kernels import few_rows_matmul, paged_attention, panel_matmul  # noqa: E402
from gpt_jax.params import inference_params  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The kernels a decode step calls, and the handler symbol of each one's main target.
KERNELS = {few_rows_matmul: "GptJaxFewRowsMatmul", panel_matmul: "GptJaxInt8Matmul",
           paged_attention: "GptJaxPagedDecodeAttention"}
FORMER_NAMES = {"panel_matmul.cc": "int8_matmul.cc"}  # a source's name in older revisions
NAMES = ("base", "this")


def register_base(revision: str, directory: Path) -> dict:
    """Build each of KERNELS from git `revision`'s sources (copied into `directory`, with
    the revision in a comment so that the build cache keeps them apart) and register it
    under its target name + "_base". Returns {kernel module: base target name}."""
    def show(name):
        run = subprocess.run(["git", "show", f"{revision}:gpt_jax/kernels/{name}"], cwd=ROOT,
                             capture_output=True, text=True)
        if run.returncode and name in FORMER_NAMES:
            return show(FORMER_NAMES[name])
        run.check_returncode()
        return run.stdout
    (directory / "common.h").write_text(show("common.h"))
    targets = {}
    for module, symbol in KERNELS.items():
        source = directory / module.SOURCE.name
        source.write_text(show(module.SOURCE.name) + f"\n// the kernel at {revision}\n")
        target = module.TARGET + "_base"
        if not builder.register(source, {target: symbol}, f"{revision}'s {source.stem}",
                                "nothing"):
            raise SystemExit(f"could not build {source.name} of {revision}")
        targets[module] = target
    return targets


@contextlib.contextmanager
def traced_as(name: str, base_targets: dict):
    """Within this context, programs traced call the kernels of `name` (see the module
    docstring)."""
    targets = {module: module.TARGET for module in KERNELS}
    try:
        if name == "base":
            for module, target in base_targets.items():
                module.TARGET = target
        yield
    finally:
        for module, target in targets.items():
            module.TARGET = target


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench kernel_ab",
                                     description=__doc__.split("\n")[0])
    decode_step_arguments(parser, rounds=11)
    parser.add_argument("--base", default="main", help="git revision of the base kernels")
    args = parser.parse_args(argv)
    if not all(module.available() for module in KERNELS):
        raise SystemExit("a CPU kernel is not available (see the warning above)")
    config = preset(args.preset)
    params = inference_params(init_params(config, jax.random.key(0)), config,
                              quantize_method=args.quantize)  # as `LLM` runs them
    with tempfile.TemporaryDirectory() as tmp:
        base_targets = register_base(args.base, Path(tmp))
    runs, tokens = {}, {}
    for name in NAMES:
        with traced_as(name, base_targets):  # the kernels are chosen when the step is traced
            runs[name] = decode_runner(params, config, args.batch, args.capacity, args.live,
                                       args.steps)
            tokens[name] = np.asarray(runs[name]()[0])
    load_start = [round(a, 1) for a in os.getloadavg()]
    wall, cpu = {n: [] for n in NAMES}, {n: [] for n in NAMES}
    for r in range(args.rounds):
        for name in NAMES[r % 2:] + NAMES[:r % 2]:
            tick, cpu_tick = time.perf_counter(), time.process_time()
            jax.block_until_ready(runs[name]())
            wall[name].append(1e3 * (time.perf_counter() - tick) / args.steps)
            cpu[name].append(1e3 * (time.process_time() - cpu_tick) / args.steps)
    load_end = [round(a, 1) for a in os.getloadavg()]
    result = {
        "median_wall_ms": {n: float(np.median(wall[n])) for n in NAMES},
        "median_cpu_ms": {n: float(np.median(cpu[n])) for n in NAMES},
        "paired_ratio_to_base": {n: float(np.median(np.array(wall[n]) / np.array(wall["base"])))
                                 for n in NAMES[1:]},
        "tokens_agree": all((tokens[n] == tokens["base"]).all() for n in NAMES),
        "wall_ms": wall, "cpu_ms": cpu}
    m, c, ratio = result["median_wall_ms"], result["median_cpu_ms"], result["paired_ratio_to_base"]
    print(f"{args.preset} batch {args.batch} {args.quantize or 'float32'}, ms per step (CPU): "
          + ", ".join(f"{n} {m[n]:.2f} ({c[n]:.2f})" for n in NAMES)
          + "; paired ratio to base: " + ", ".join(f"{n} {ratio[n]:.3f}" for n in NAMES[1:])
          + f"; greedy tokens agree: {result['tokens_agree']}")
    print(f"load average {load_start} -> {load_end}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"kernel_ab{args.tag}.json").write_text(json.dumps(
        {"machine": machine(), "args": vars(args), "load_start": load_start,
         "load_end": load_end, **result}, indent=1))


if __name__ == "__main__":
    main()
