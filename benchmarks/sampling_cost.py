"""What per-row sampling parameters cost: decode tokens/s of one batch with every sampling
option on, against greedy only and plain temperature sampling, same batch, same run.

Usage:
  .venv/bin/python benchmarks/sampling_cost.py                  # shakespeare-char, batch 8
  .venv/bin/python benchmarks/sampling_cost.py --preset tiny --batch 4 --repeats 3

Random parameters (weights x6 so the model does not repeat one token). Each configuration
runs the same prompts and max_new_tokens through `inference.generate` (one compiled program:
prefill and the decode loop); the configurations are timed in turns, `--repeats` times, and
the median is reported. Prints a table and writes benchmarks/results/sampling_cost.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from gpt_jax import GPTConfig, init_params
from inference import SamplingParams, generate


def configurations(params, config, prompts, max_new_tokens: int) -> dict:
    """name -> one SamplingParams for the whole batch, or one per row.

    "all options on" also checks an EOS id and a token stop sequence every step; they are
    picked from tokens its seeded run never produces (found by a pilot run without them,
    which draws the same tokens), so every configuration generates the same token count.
    """
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    no_stops = SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
        presence_penalty=0.1, frequency_penalty=0.1, seed=1, logprobs=5,
        max_new_tokens=max_new_tokens,
    )
    produced = {t for o in generate(params, config, prompts, no_stops) for t in o.tokens}
    unused = sorted(set(range(config.vocab_size)) - produced)
    if len(unused) < 2:
        raise SystemExit("every token id occurs in the pilot run: lower --max-new-tokens")
    everything = dataclasses.replace(no_stops, stop_token_ids=[unused[0]],
                                     stop_sequences=[[unused[1], unused[0]]])
    half = len(prompts) // 2
    return {
        "greedy only": greedy,
        "temperature only": SamplingParams(temperature=0.8, seed=1, max_new_tokens=max_new_tokens),
        "all options on": everything,
        "half greedy, half all on": [greedy] * half + [everything] * (len(prompts) - half),
    }


def timed(params, config, prompts, sampling) -> tuple[float, int]:
    tick = time.perf_counter()
    outs = generate(params, config, prompts, sampling)
    return time.perf_counter() - tick, sum(len(o.tokens) for o in outs)


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpt-jax bench sampling_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="shakespeare-char")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/sampling_cost.json")
    args = p.parse_args(argv)

    config = GPTConfig.preset(args.preset)
    params = jax.tree.map(lambda x: x * 6 if x.ndim >= 2 else x,
                          init_params(config, jax.random.key(0)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    runs = configurations(params, config, prompts, args.max_new_tokens)
    for sampling in runs.values():  # compile each (different logprobs / stop shapes)
        timed(params, config, prompts, sampling)
    seconds = {name: [] for name in runs}
    tokens = {}
    for _ in range(args.repeats):  # interleaved, so load changes hit every configuration
        for name, sampling in runs.items():
            s, n = timed(params, config, prompts, sampling)
            seconds[name].append(s)
            tokens[name] = n

    base = statistics.median(seconds["greedy only"]) / tokens["greedy only"]
    rows = []
    print(f"{args.preset}, batch {args.batch}, prompt {args.prompt_len}, "
          f"max_new_tokens {args.max_new_tokens}, {jax.devices()[0].platform}, "
          f"median of {args.repeats}")
    print(f"{'configuration':<26} {'tokens':>7} {'seconds':>8} {'tokens/s':>10} {'vs greedy':>10}")
    for name in runs:
        median = statistics.median(seconds[name])
        rate = tokens[name] / median
        rows.append({"configuration": name, "tokens": tokens[name], "seconds": median,
                     "tokens_per_s": rate, "cost_per_token_vs_greedy": median / tokens[name] / base})
        print(f"{name:<26} {tokens[name]:>7} {median:>8.3f} {rate:>10,.0f} "
              f"{rows[-1]['cost_per_token_vs_greedy']:>9.2f}x")
    result = {"preset": args.preset, "batch": args.batch, "prompt_len": args.prompt_len,
              "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
              "platform": jax.devices()[0].platform, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
