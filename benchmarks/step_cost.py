"""The decode step's time at batch 1 for models of several sizes, side by side in one
process: what `inference.spec_cost.STEP_CALIBRATION` is measured with (a draft model's k
steps in the cost of a speculative round, as a share of the target's step).

Usage:
  gpt-jax bench step_cost
  gpt-jax bench step_cost --preset shakespeare-char-llama shakespeare-char-10m --repeats 15

Each preset's model has random weights (a step's time depends on the shape, not the
values) and `--length` cached tokens; its decode step (`inference.steps.run_step`, the
weights in `decode_layout`) is a jitted `lax.scan` of `--steps` steps, the cache length reset
after each. Every model is compiled first, then timed in alternating rounds (`--repeats`,
median per step), with the load average printed. Prints the table to paste into
`STEP_CALIBRATION` (float32 weight bytes, ms per step) and writes
benchmarks/results/NAME.json (`--name`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def decode_program(config, length: int, steps: int):
    """`() -> result`: `steps` decode steps at batch 1 over `length` cached tokens, jitted."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gpt_jax import init_params
    from gpt_jax.cache import init_cache
    from gpt_jax.params import decode_layout
    from inference.steps import run_prefill, run_step

    params = decode_layout(init_params(config, jax.random.key(0)))
    cache = init_cache(config, 1, config.max_seq_len)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, length)),
                         jnp.int32)
    _, cache = jax.jit(lambda p, t, c: run_prefill(p, config, t, jnp.full((1,), length,
                                                                           jnp.int32), c))(
        params, prompt, cache)
    start = cache.lengths

    @jax.jit
    def run(params, cache):
        def body(c, _):
            logits, c = run_step(params, config, jnp.zeros((1,), jnp.int32), c,
                                 jnp.ones((1,), bool))
            return c.replace(lengths=start), logits.sum()
        return jax.lax.scan(body, cache, None, length=steps)[1].sum()

    return lambda: run(params, cache)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpt-jax bench step_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+",
                        default=["shakespeare-char-draft", "shakespeare-char-llama",
                                 "shakespeare-char-10m", "gpt2"],
                        help="GPTConfig presets (gpt_jax/config.py), of different sizes")
    parser.add_argument("--length", type=int, default=64, help="cached tokens")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--name", default="step_cost", help="results/NAME.json")
    args = parser.parse_args(argv)
    if args.length < 1 or args.steps < 1 or args.repeats < 1:
        raise SystemExit(f"--length, --steps and --repeats must be >= 1, got {args.length}, "
                         f"{args.steps}, {args.repeats}")

    import jax

    from gpt_jax import GPTConfig
    from inference.spec_cost import weight_bytes

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from speed import interleaved, ms_per_step

    configs = {name: GPTConfig.preset(name) for name in args.preset}  # unknown: ValueError
    fns = {name: decode_program(config, args.length, args.steps)
           for name, config in configs.items()}
    for f in fns.values():
        jax.block_until_ready(f())
    times = interleaved({name: ms_per_step(f, args.steps) for name, f in fns.items()},
                        args.repeats)
    rows = [{"preset": name, "weight_bytes": weight_bytes(configs[name]),
             "ms_per_step": statistics.median(ms)} for name, ms in times.items()]
    for r in rows:
        print(f"{r['preset']:28} {r['weight_bytes'] / 1e6:9.1f} MB  {r['ms_per_step']:8.3f} "
              "ms/step", flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print("STEP_CALIBRATION = (" + ", ".join(
        f"({r['weight_bytes']:.3g}, {r['ms_per_step']:.3g})"
        for r in sorted(rows, key=lambda r: r["weight_bytes"])) + ")")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"length": args.length, "steps": args.steps, "load_average": load, "rows": rows},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
