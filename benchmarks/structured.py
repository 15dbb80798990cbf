"""What structured output costs: decode tokens/s of one batch with every row constrained by a
nested JSON schema against the same batch unconstrained, the time to compile a schema (cold
and cached), and the device bytes of one constrained row's tables.

Usage:
  gpt-jax bench structured                          # GPT-2 shape, batch 8, 128 tokens
  gpt-jax bench structured --preset tiny --repeats 2 --max-new-tokens 32   # a quick look
  gpt-jax bench structured_libraries   # outlines-core beside llguidance and xgrammar

Random GPT-2-shaped weights and a byte-level BPE of GPT-2's 50,257 tokens trained on
Shakespeare (with its upper-cased copy, so there are enough merges). Both configurations run
the same prompts and seeds through `inference.generate` (one compiled program each: prefill
and the decode loop), timed in turns `--repeats` times; medians. The schema's last field is a
free string, so constrained rows run on as long as unconstrained ones (a random model rarely
closes it). Writes benchmarks/results/structured.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file or by `gpt-jax bench`
from speed import save  # noqa: E402

NESTED = {  # nested objects, bounded integers, enums, an array, a pattern, a free string
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "user": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                     "minItems": 1, "maxItems": 3},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["name", "role", "tags", "zip"]},
        "active": {"type": "boolean"},
        "notes": {"type": "string"}},
    "required": ["id", "user", "active", "notes"],
}


def bpe_tokenizer():
    """A byte-level BPE of GPT-2's 50,257 tokens trained on Shakespeare and its upper-cased
    copy (so there are enough merges), `<|endoftext|>` its one special token."""
    from gpt_jax.tokenizer import BPETokenizer
    from training.data import shakespeare_text

    text = shakespeare_text()
    return BPETokenizer.from_text(text + text.upper(), vocab_size=50257,
                                  special_tokens=("<|endoftext|>",))


def compile_times(tokenizer, vocab_size: int) -> dict:
    """Seconds to compile the nested schema and json_object (`inference.constraints.
    automaton`): cold (an empty disk cache in a temporary directory, the tokenizer's
    vocabulary already made: `vocabulary_s`, once per tokenizer), cached in memory, and
    cached on disk only (what a new process pays: the tokenizer's key hashed, the entry
    read); with each table's states and token classes."""
    import tempfile
    from unittest import mock

    from inference import SamplingParams, constraint_cache, constraints

    out = {}
    with tempfile.TemporaryDirectory() as directory, \
            mock.patch.dict(os.environ, {constraint_cache.ENV: directory}):
        tick = time.perf_counter()
        constraints._vocab(tokenizer, vocab_size).vocabulary
        out["vocabulary_s"] = time.perf_counter() - tick
        for name, sp in (("schema", SamplingParams(json_schema=NESTED)),
                         ("json_object", SamplingParams(json_object=True))):
            seconds = []
            for fresh in (False, False, True):  # cold, in memory, on disk only
                if fresh:
                    constraints._CACHE.clear()
                    constraints._VOCABS.clear()
                tick = time.perf_counter()
                table = constraints.automaton(sp, tokenizer, vocab_size)
                seconds.append(time.perf_counter() - tick)
            out |= {f"{name}_cold_s": seconds[0], f"{name}_cached_s": seconds[1],
                    f"{name}_disk_s": seconds[2], f"{name}_states": table.next_state.shape[0],
                    f"{name}_classes": table.next_state.shape[1]}
    return out


def timed(params, config, prompts, sampling, tokenizer) -> tuple[float, int, list]:
    from inference import generate

    tick = time.perf_counter()
    outs = generate(params, config, prompts, sampling, tokenizer=tokenizer)
    return time.perf_counter() - tick, sum(len(o.tokens) for o in outs), outs


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpt-jax bench structured", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)

    from gpt_jax import GPTConfig, init_params
    from gpt_jax.params import decode_layout
    from inference import SamplingParams
    from inference.constraint_mask import constraint_arrays, device_bytes
    from inference.constraints import automaton
    from training.data import shakespeare_text

    text = shakespeare_text()
    tokenizer = bpe_tokenizer()
    config = GPTConfig.preset(args.preset, vocab_size=50257)
    compiled = compile_times(tokenizer, config.vocab_size)
    params = jax.jit(decode_layout)(init_params(config, jax.random.key(0)))
    prompts = [tokenizer.encode(line) for line in text.splitlines() if line][: args.batch]
    runs = {name: [SamplingParams(seed=s, max_new_tokens=args.max_new_tokens, **fields)
                   for s in range(args.batch)]
            for name, fields in (("unconstrained", {}), ("nested schema", {"json_schema": NESTED}))}
    for sampling in runs.values():  # compile each program
        timed(params, config, prompts, sampling, tokenizer)
    seconds, tokens = {name: [] for name in runs}, {}
    for _ in range(args.repeats):  # interleaved, so load changes hit both
        for name, sampling in runs.items():
            s, tokens[name], outs = timed(params, config, prompts, sampling, tokenizer)
            seconds[name].append(s)
    for o in outs:  # the constrained run's last outputs: valid prefixes of the schema
        assert o.finish_reason in ("stop", "length"), o.finish_reason
    table = automaton(runs["nested schema"][0], tokenizer, config.vocab_size)
    per_row = device_bytes(constraint_arrays((table,), config.vocab_size))
    base = tokens["unconstrained"] / statistics.median(seconds["unconstrained"])
    rows = [{"configuration": name, "tokens": tokens[name],
             "seconds": statistics.median(seconds[name]),
             "tokens_per_s": tokens[name] / statistics.median(seconds[name]),
             "vs_unconstrained": tokens[name] / statistics.median(seconds[name]) / base}
            for name in runs]

    def plot(ax, rows):
        ax.bar([r["configuration"] for r in rows], [r["tokens_per_s"] for r in rows])
        ax.set_ylabel("decode tokens/s")

    save("structured", rows, plot, {
        "preset": args.preset, "batch": args.batch, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "platform": jax.devices()[0].platform,
        "load_average": os.getloadavg(), "compile": compiled,
        "device_bytes_per_constrained_row": per_row, "schema": json.dumps(NESTED)})
    print(f"compile: {compiled}; device bytes per constrained row: {per_row:,}")


if __name__ == "__main__":
    main()
