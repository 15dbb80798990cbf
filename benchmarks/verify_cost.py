"""The cost of one speculative verification (T = k + 1 positions per row through the paged
cache, `inference.verify.run_verify`) against one decode step (`inference.steps.run_step`),
same model and cache, batch 1 and 8: with the CPU kernels (what a CPU runs: the
paged-attention kernel reading the pages, and for few rows of small weights the few-rows
matmul kernel), with XLA's blockwise attention (what it ran before the kernel took several
positions), and with XNNPACK's matrix products instead of the few-rows kernel.

Usage:
  gpt-jax bench verify_cost
  gpt-jax bench verify_cost --run-dir runs/shakespeare-char --positions 2 5

On CPU a decode step's matrix products are matrix-vector products, emitted inline; T > 1
makes them matrix products (XNNPACK or Eigen library calls on XLA's thread pool), so where
the weights are small enough to stay in cache the verification costs about T steps, and
where they are read from memory (GPT-2 and up) it costs about one.

Each measurement is a jitted `lax.scan` of `--steps` steps (the cache length reset after
each, so every step attends to `--length` cached tokens), compiled first, then every
variant timed in alternating rounds (`--repeats`, median per step) in one process, with the
load average printed. Writes benchmarks/results/NAME.json (`--name`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def programs(params, config, batch: int, length: int, positions, steps: int):
    """`{name: () -> result}`: the decode step and each verification width, jitted."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gpt_jax.cache import init_cache
    from inference.steps import run_prefill, run_step
    from inference.verify import run_verify

    cache = init_cache(config, batch, config.max_seq_len)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size,
                                                           (batch, length)), jnp.int32)
    _, cache = jax.jit(lambda p, t, c: run_prefill(p, config, t, jnp.full((batch,), length,
                                                                           jnp.int32), c))(
        params, prompt, cache)
    start_B = cache.lengths

    def scanned(one):
        @jax.jit
        def run(params, cache):
            def body(c, _):
                logits, c = one(params, c)
                return c.replace(lengths=start_B), logits.sum()
            return jax.lax.scan(body, cache, None, length=steps)[1].sum()
        return lambda: run(params, cache)

    fns = {"decode": scanned(lambda p, c: run_step(
        p, config, jnp.zeros((batch,), jnp.int32), c, jnp.ones((batch,), bool)))}
    for T in positions:
        fns[f"verify T={T}"] = scanned(lambda p, c, T=T: run_verify(
            p, config, jnp.zeros((batch, T), jnp.int32), c, jnp.full((batch,), T, jnp.int32)))
    return fns


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpt-jax bench verify_cost", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default=None, help="a trained run (default: random)")
    parser.add_argument("--preset", default="shakespeare-char-llama")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--positions", type=int, nargs="+", default=[2, 5])
    parser.add_argument("--length", type=int, default=64, help="cached tokens per row")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--name", default="verify_cost", help="results/NAME.json")
    parser.add_argument("--no-xla", action="store_true",
                        help="time the kernels' programs only (a third of the compiles)")
    args = parser.parse_args(argv)

    import jax

    from gpt_jax import GPTConfig, init_params
    from gpt_jax.checkpoint import load_params
    from gpt_jax.kernels import few_rows_matmul, paged_attention
    from gpt_jax.params import decode_layout

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from speed import interleaved, ms_per_step

    if args.run_dir:
        config, params, _ = load_params(args.run_dir)
    else:
        config = GPTConfig.preset(args.preset)
        params = init_params(config, jax.random.key(0))
    params = decode_layout(params)
    kernel, few_rows = paged_attention.available, few_rows_matmul.available

    rows = []
    for batch in args.batch:
        fns = programs(params, config, batch, args.length, args.positions, args.steps)
        if not args.no_xla:
            paged_attention.available = lambda: False
            xla = programs(params, config, batch, args.length, args.positions, args.steps)
            for f in xla.values():
                jax.block_until_ready(f())  # traced now: XLA's attention
            paged_attention.available = kernel
            fns |= {f"{name} (XLA attention)": f for name, f in xla.items()}
            few_rows_matmul.available = lambda: False
            xnn = programs(params, config, batch, args.length, args.positions, args.steps)
            xnn.pop("decode")
            for f in xnn.values():
                jax.block_until_ready(f())  # traced now: XNNPACK's products
            few_rows_matmul.available = few_rows
            fns |= {f"{name} (XNNPACK products)": f for name, f in xnn.items()}
        for f in fns.values():
            jax.block_until_ready(f())
        times = interleaved({name: ms_per_step(f, args.steps) for name, f in fns.items()},
                            args.repeats)
        decode = statistics.median(times["decode"])
        for name, ms in times.items():
            ms = statistics.median(ms)
            rows.append({"batch": batch, "program": name, "ms_per_step": ms,
                         "of_decode": ms / decode})
            print(f"batch {batch} {name:28} {ms:7.3f} ms/step  {ms / decode:5.2f}x decode",
                  flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(
        {"model": args.run_dir or f"random {args.preset}", "length": args.length,
         "load_average": load, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
