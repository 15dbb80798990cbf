"""Time to first token of a chat's second turn, with and without prefix caching, at the
SmolLM2-135M shape (preset smollm2-135m, random weights, float32), one decode slot as
`gpt-jax chat` runs it.

Usage:
  .venv/bin/python benchmarks/chat_ttft.py
  gpt-jax bench chat_ttft --first 440 --reply 40 --ask 20 --rounds 5

A conversation of token ids: turn 1 is a prompt of `--first` tokens and a greedy reply of
`--reply` tokens; turn 2's prompt is all of that plus `--ask` new tokens (about 500 in all
by default), the whole conversation again, as a chat client sends it. Each round starts a
new conversation (fresh random ids, so nothing is cached from an earlier round) on each of
two engines, one with prefix caching and one without, in alternating order; the time from
`add_request` of turn 2 to its first token is measured, with how many of its prompt
tokens were prefilled and how many came from the prefix cache. A first round compiles
every program and is not counted. Prints medians, their ratio and the load average, and
writes benchmarks/results/chat_ttft.json.
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
import numpy as np

from gpt_jax import GPTConfig, init_params
from inference import Engine, SamplingParams


def first_token_s(engine: Engine, request_id: str, prompt: list[int],
                  sampling: SamplingParams) -> tuple[float, list[int]]:
    """Seconds from adding the request to its first token, and all its tokens (the engine
    is stepped until it finishes)."""
    tick = time.perf_counter()
    engine.add_request(request_id, prompt, sampling)
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            if tokens and first is None:
                first = time.perf_counter() - tick
    return first, tokens


def conversation_round(engine: Engine, rng, args, tag: str) -> dict:
    """Turn 1, then turn 2 timed: its TTFT (ms) and its prefilled and reused tokens."""
    vocab = engine.config.vocab_size
    first = rng.integers(0, vocab, args.first).tolist()
    reply = SamplingParams(temperature=0.0, max_new_tokens=args.reply, min_tokens=args.reply)
    _, said = first_token_s(engine, f"{tag}-1", first, reply)
    second = first + said + rng.integers(0, vocab, args.ask).tolist()
    before = engine.stats()
    ttft, _ = first_token_s(engine, f"{tag}-2", second,
                            SamplingParams(temperature=0.0, max_new_tokens=1))
    after = engine.stats()
    return {"ttft_ms": 1e3 * ttft, "prompt_tokens": len(second),
            "prefilled": after["prefilled_tokens"] - before["prefilled_tokens"],
            "reused": (after["prefix_cache_hits"] - before["prefix_cache_hits"]) *
            engine.page_size}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="gpt-jax bench chat_ttft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--first", type=int, default=440, help="turn 1's prompt tokens")
    p.add_argument("--reply", type=int, default=40, help="turn 1's reply tokens")
    p.add_argument("--ask", type=int, default=20, help="turn 2's new tokens")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (after one to compile)")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "chat_ttft.json"))
    args = p.parse_args(argv)
    config = GPTConfig.preset("smollm2-135m")
    params = init_params(config, jax.random.key(0))
    engines = {cached: Engine(params, config, max_slots=1, prefix_caching=cached)
               for cached in (True, False)}
    rng = np.random.default_rng(0)
    rows: dict[bool, list[dict]] = {True: [], False: []}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds + 1):
        for cached in ((True, False) if r % 2 else (False, True)):  # alternate the order
            row = conversation_round(engines[cached], rng, args, f"r{r}-{cached}")
            if r:  # round 0 compiles
                rows[cached].append(row)
    loads.append(os.getloadavg()[0])
    result = {name: {"ttft_ms_median": statistics.median(x["ttft_ms"] for x in rows[cached]),
                     "ttft_ms": [round(x["ttft_ms"], 1) for x in rows[cached]],
                     "prompt_tokens": rows[cached][0]["prompt_tokens"],
                     "prefilled": rows[cached][0]["prefilled"],
                     "reused": rows[cached][0]["reused"]}
              for name, cached in (("prefix_caching", True), ("no_prefix_caching", False))}
    ratio = result["no_prefix_caching"]["ttft_ms_median"] / \
        result["prefix_caching"]["ttft_ms_median"]
    for name, row in result.items():
        print(f"{name:18s} turn 2 TTFT median {row['ttft_ms_median']:8.1f} ms "
              f"({row['prompt_tokens']} prompt tokens: {row['reused']} reused, "
              f"{row['prefilled']} prefilled) rounds {row['ttft_ms']}")
    print(f"without / with prefix caching: {ratio:.2f}x; load average {loads[0]:.1f} before, "
          f"{loads[1]:.1f} after ({os.cpu_count()} CPUs)")
    Path(args.out).write_text(json.dumps({
        "benchmark": "chat_ttft", "preset": "smollm2-135m", "dtype": "float32",
        "args": vars(args) | {"out": None}, "results": result, "speedup": round(ratio, 2),
        "load_average": loads, "device": jax.devices()[0].device_kind,
        "machine": platform.machine(), "cpus": os.cpu_count()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
