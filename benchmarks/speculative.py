"""Speculative decoding (n-gram prompt lookup, or a draft model with `--draft-run-dir`)
against plain decoding in `generate`: tokens/s side by side, acceptance and tokens per
verification, on a copy-heavy and a plain continuation workload, at batch 1 and 8.

Usage:
  nice -n 10 .venv/bin/python benchmarks/speculative.py
  gpt-jax bench speculative --preset gpt2 --batch 1 --max-new-tokens 32
  gpt-jax bench speculative --run-dir runs/shakespeare-char
  gpt-jax bench speculative --run-dir runs/big --draft-run-dir runs/small --name spec-draft

Workloads (greedy): (a) copy-heavy: a document D, the model's own greedy continuation of a
seed prompt S (a speaker's name for a trained run, random tokens otherwise), placed in the
prompt as "S D S D[:h]", so the text left to write is in the prompt (a model that has
learned to copy, as a trained one has, repeats it); (b) plain continuation of the seeds.
Without `--run-dir` the weights are random (`--scale` sharpens them; a random model copies
only where its own output loops). Each configuration is compiled first, then off and on
are timed in alternating rounds (`--repeats`, median reported) in one process, with the
load average printed; the rows whose greedy tokens are identical off and on are counted.
The ratio is also given over the tokens after the first ("decode_speedup"): each side's
time less that of the same call with max_new_tokens 1 (the prefill), timed in the rounds.
Writes benchmarks/results/NAME.json and .png (`--name`, default speculative) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from gpt_jax import GPTConfig, init_params
from gpt_jax.checkpoint import load_params, load_tokenizer
from inference import SamplingParams, generate

RESULTS = Path(__file__).parent / "results"


def load_model(args):
    """`(params, config, source)`: a trained run's checkpoint or random weights."""
    if args.run_dir:
        config, params, _ = load_params(args.run_dir)
        return params, config, f"run {args.run_dir}"
    config = dataclasses.replace(GPTConfig.preset(args.preset), max_seq_len=args.max_seq_len)
    params = init_params(config, jax.random.key(0))
    params = jax.tree.map(lambda x: x * args.scale if x.ndim >= 2 else x, params)
    return params, config, f"random {args.preset} (context {args.max_seq_len}) x{args.scale}"


SEEDS = ["ROMEO:\n", "JULIET:\n", "KING HENRY:\n", "First Citizen:\n", "HAMLET:\n",
         "MENENIUS:\n", "LADY MACBETH:\n", "GLOUCESTER:\n"]


def seed_prompts(args, config, batch: int, rng) -> list[list[int]]:
    """A trained run's speaker prompts (its tokenizer), else random tokens."""
    if args.run_dir:
        tokenizer = load_tokenizer(args.run_dir)
        return [tokenizer.encode(SEEDS[i % len(SEEDS)]) for i in range(batch)]
    return [rng.integers(0, config.vocab_size, 8).tolist() for _ in range(batch)]


def workloads(args, params, config, batch: int, new: int, rng) -> dict[str, list[list[int]]]:
    """The prompts of each workload (see the module docstring): copy-heavy, "S D S D[:h]"
    where D is the model's greedy continuation of the seed S and `new` tokens of D are left
    to write, within the context; plain, the seeds alone."""
    seeds = seed_prompts(args, config, batch, rng)
    doc_len = (config.max_seq_len - 2 * max(map(len, seeds))) // 2
    if doc_len <= new:
        raise SystemExit(f"--max-new-tokens {new} leaves no document to copy in a context of "
                         f"{config.max_seq_len}; allowed: below {doc_len}")
    docs = generate(params, config, seeds, SamplingParams(temperature=0,
                                                         max_new_tokens=doc_len))
    copy = [s + d.tokens + s + d.tokens[: doc_len - new] for s, d in zip(seeds, docs)]
    return {"copy": copy, "plain": seeds}


def run_once(params, config, prompts, sampling, draft=None):
    tick = time.perf_counter()
    outs = generate(params, config, prompts, sampling, draft=draft)
    return time.perf_counter() - tick, outs


def measure(params, config, prompts, new: int, k: int, repeats: int, draft=None,
            ngram_max: int = 3) -> dict:
    """Median tokens/s off and on (n-gram drafts, or `draft`'s: `(params, config)`),
    alternated, and the speculative counts; and the same ratio over the tokens after the
    first ("decode_speedup": each side's median time less that of the same call with
    max_new_tokens 1, the prefill and first token, timed in the same rounds)."""
    first = SamplingParams(temperature=0, max_new_tokens=1)
    off = SamplingParams(temperature=0, max_new_tokens=new)
    on = SamplingParams(temperature=0, max_new_tokens=new, num_speculative_tokens=k,
                        speculative="ngram" if draft is None else "draft",
                        prompt_lookup_max=ngram_max)
    run_once(params, config, prompts, off), run_once(params, config, prompts, on, draft)
    run_once(params, config, prompts, first)
    times, outs = {"off": [], "on": [], "first": []}, {}
    for _ in range(repeats):
        for name, sp in (("off", off), ("on", on), ("first", first)):
            seconds, outs[name] = run_once(params, config, prompts, sp, draft)
            times[name].append(seconds)
    counts = [o.speculation for o in outs["on"]]
    tokens = sum(len(o.tokens) for o in outs["on"])
    identical = sum(a.tokens == b.tokens for a, b in zip(outs["off"], outs["on"]))
    drafted, accepted = (sum(c[key] for c in counts) for key in ("drafted", "accepted"))
    off_s, on_s, first_s = (statistics.median(times[n]) for n in ("off", "on", "first"))
    return {"tokens": tokens, "off_tokens_per_s": tokens / off_s,
            "on_tokens_per_s": tokens / on_s, "speedup": off_s / on_s,
            "first_token_s": first_s, "decode_speedup": (off_s - first_s) / (on_s - first_s),
            "acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_step": tokens / sum(c["steps"] for c in counts),
            "identical_rows": f"{identical}/{len(prompts)}"}


def plot(rows, path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 (only to plot)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    labels = [f"{r['workload']}\nbatch {r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, [r["speedup"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=1)
    for i, r in enumerate(rows):
        ax.text(i, r["speedup"], f"{r['speedup']:.2f}x\nacc {r['acceptance']:.0%}",
                ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens/s, speculative / off")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gpt-jax bench speculative", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", default=None, help="a trained run (default: random)")
    parser.add_argument("--draft-run-dir", default=None,
                        help="a trained run with the same tokenizer whose model drafts "
                             "(speculative='draft') instead of n-grams")
    parser.add_argument("--preset", default="shakespeare-char")
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--scale", type=float, default=3.0)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--ngram-max", type=int, default=3,
                        help="prompt_lookup_max, the longest n-gram matched (n-gram drafts)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--name", default="speculative")
    args = parser.parse_args(argv)
    params, config, source = load_model(args)
    draft = None
    if args.draft_run_dir:
        draft_config, draft_params, _ = load_params(args.draft_run_dir)
        draft, source = (draft_params, draft_config), f"{source}, draft {args.draft_run_dir}"
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batch:
        for workload, prompts in workloads(args, params, config, batch,
                                           args.max_new_tokens, rng).items():
            row = measure(params, config, prompts, args.max_new_tokens, args.k, args.repeats,
                          draft, args.ngram_max)
            rows.append({"workload": workload, "batch": batch, **row})
            print(f"{workload:6} batch {batch}: off {row['off_tokens_per_s']:8.1f} tok/s  "
                  f"on {row['on_tokens_per_s']:8.1f} tok/s  {row['speedup']:.2f}x "
                  f"(after the first token {row['decode_speedup']:.2f}x)  "
                  f"acceptance {row['acceptance']:.0%}  tokens/step "
                  f"{row['tokens_per_step']:.2f}  greedy tokens identical "
                  f"{row['identical_rows']}", flush=True)
    load = os.getloadavg()
    print(f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    RESULTS.mkdir(exist_ok=True)
    result = {"model": source, "drafts": "n-gram" if draft is None else "draft model",
              "k": args.k, "ngram_max": args.ngram_max, "max_new_tokens": args.max_new_tokens,
              "repeats": args.repeats, "load_average": load, "rows": rows}
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(rows, RESULTS / f"{args.name}.png",
         f"{result['drafts']} speculation, k={args.k}, {source}, load {load[0]:.0f}")


if __name__ == "__main__":
    main()
