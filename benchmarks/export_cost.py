"""What the exported program costs against `inference.generate`: decode tokens/s of the
`gpt-jax export` artifact (XLA's portable attention, weights inside as constants) and of
`generate` with the CPU attention kernel, same requests, same process, in turns.

Usage (also `gpt-jax bench export_cost [flags]`; writes benchmarks/results/export_cost.json
and .png):
  python benchmarks/export_cost.py                                 # shakespeare-char, gpt2
  python benchmarks/export_cost.py --presets shakespeare-char --batches 1 --rounds 2

Random weights (GPT-2's initialization) in the decode layout (`decode_layout`, as `LLM`
and `Engine` hold them), float32, greedy, no EOS: every row generates --new-tokens tokens (shakespeare-char: 48 after a 16-token prompt, its
64-token context; gpt2: --new-tokens after --prompt-len). Each configuration runs
  generate         `inference.generate` (what this process runs: the CPU kernel decodes);
  generate, XLA    the same `inference.generation.generation` program, jitted fresh and traced
                   inside `gpt_jax.kernels.portable()`: the portable attention, weights passed
                   as arguments (isolates the attention path from the export);
  exported         `export_generate`'s program, serialized and deserialized as a loader
                   does, called with `Exported.call` (weights inside as constants);
compiled first (the export, its file size and the first call's compile time are reported),
then timed over --rounds rounds in turn (each turn at least MIN_TURN_S: short calls are
repeated); each figure is the median of its rounds. The exported tokens are compared with
both: equal to "generate, XLA" (the same computation), and to `generate` up to the float
rounding of the other attention path (the first step where they part, if any, is reported:
it follows a near-tie). `generate` also validates, packs and unpacks its requests on the host each call,
which the exported call does not: at a few ms per call that shows.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gpt_jax import GPTConfig, init_params, kernels
from gpt_jax.params import decode_layout
from inference import SamplingParams, generate, generation
from inference.steps import cached_model
from inference.export import export_generate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file or by `gpt-jax bench`
from speed import interleaved, save  # noqa: E402

MIN_TURN_S = 1.0  # shortest timed turn of one configuration in a round


# `generation.generation` under another function object (same signature): its own jit cache,
# so the trace made inside `portable()` is never shared with `generate_program`'s.
xla_program = jax.jit(functools.wraps(generation.generation)(
    lambda *args, **kwargs: generation.generation(*args, **kwargs)),
    static_argnames=("config", "capacity", "n_steps", "n_top", "model_fns", "cache_dtype",
                     "pad_id", "forked"))


def xla_generate(params, config, prompts, sampling):
    """`generate` with XLA's portable attention (same packing, program and unpacking)."""
    batch = generation.pack(config, *generation.validate(config, prompts, sampling))
    with kernels.portable():
        state = xla_program(params, config, batch.prompt_tokens, batch.prompt_lengths,
                            batch.source_B, batch.rows, batch.stops, capacity=batch.capacity,
                            n_steps=batch.n_steps, n_top=batch.n_top,
                            model_fns=cached_model, cache_dtype=np.dtype("float32"),
                            pad_id=0, forked=batch.forked)
    return [c.tokens for c in generation.unpack(batch, state)]


def _first_difference(rows_a, rows_b) -> int | None:
    """The first step at which any row's tokens differ (None: all equal)."""
    steps = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
             for a, b in zip(rows_a, rows_b)]
    return min((s for s in steps if s is not None), default=None)


def measure(config: GPTConfig, params, batch: int, prompt_len: int, new_tokens: int,
            rounds: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, prompt_len).tolist() for _ in range(batch)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    args = (np.array(prompts, np.int32), np.full(batch, prompt_len, np.int32),
            np.zeros(batch, np.float32), np.ones(batch, np.float32), np.zeros(batch, np.uint32))

    tick = time.perf_counter()
    program = export_generate(params, config, batch=batch, prompt_len=prompt_len,
                              max_new_tokens=new_tokens)
    data = program.serialize()
    export_s = time.perf_counter() - tick
    loaded = jax.export.deserialize(bytearray(data))
    tick = time.perf_counter()
    jax.block_until_ready(loaded.call(*args))
    first_call_s = time.perf_counter() - tick

    def call_exported():
        output_tokens, num_tokens_B = jax.device_get(loaded.call(*args))
        return [row[:n].tolist() for row, n in zip(output_tokens, num_tokens_B)]

    runs = {"generate": lambda: [c.tokens for c in generate(params, config, prompts, sampling)],
            "generate, XLA": lambda: xla_generate(params, config, prompts, sampling),
            "exported": call_exported}
    outputs = {name: run() for name, run in runs.items()}  # compiles; and the tokens to check

    def per_call(run, calls):
        def timed():  # mean seconds per call over `calls` calls
            tick = time.perf_counter()
            for _ in range(calls):
                run()
            return (time.perf_counter() - tick) / calls
        return timed

    # each round's turn lasts >= MIN_TURN_S, so short calls are timed over many (same count
    # for all three)
    tick = time.perf_counter()
    runs["generate"]()
    calls = max(1, int(MIN_TURN_S / (time.perf_counter() - tick)))
    times = interleaved({name: per_call(run, calls) for name, run in runs.items()}, rounds)
    rate = {name: batch * new_tokens / statistics.median(t) for name, t in times.items()}
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "generate_tok_s": rate["generate"], "generate_xla_tok_s": rate["generate, XLA"],
            "exported_tok_s": rate["exported"],
            "exported_vs_generate": rate["exported"] / rate["generate"],
            "exported_vs_generate_xla": rate["exported"] / rate["generate, XLA"],
            "same_as_generate_xla": outputs["exported"] == outputs["generate, XLA"],
            "same_as_generate": outputs["exported"] == outputs["generate"],
            "first_difference": _first_difference(outputs["exported"], outputs["generate"]),
            "calls_per_turn": calls, "export_s": export_s,
            "file_mb": len(data) / 1e6,
            "first_call_s": first_call_s}


def plot(ax, rows):
    """The three tokens/s of each configuration as bars, on a log scale."""
    labels = [f"{r['preset']}\nb{r['batch']}" for r in rows]
    x = np.arange(len(rows))
    for i, (key, label) in enumerate([("generate_tok_s", "generate (CPU kernel)"),
                                      ("generate_xla_tok_s", "generate, XLA attention"),
                                      ("exported_tok_s", "exported program")]):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in rows], 0.27, label=label)
    ax.set_xticks(x, labels)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s, whole call (log)")
    ax.legend()


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpt-jax bench export_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["shakespeare-char", "gpt2"])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64, help="gpt2 (and other) presets")
    p.add_argument("--new-tokens", type=int, default=128, help="gpt2 (and other) presets")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    rows = []
    for name in args.presets:
        config = GPTConfig.preset(name)
        # in the decode layout, as LLM and Engine hold them: `generate` given the stacked
        # layout lays the weights out inside its program, which ran 1.7x slower here (gpt2,
        # batch 1, 64 new tokens: 16.2 -> 27.3 tokens/s laid out beforehand)
        params = jax.jit(decode_layout)(
            jax.jit(init_params, static_argnums=0)(config, jax.random.key(0)))
        # shakespeare-char's context is 64 tokens: a 16-token prompt and 48 new ones
        prompt_len, new_tokens = (16, 48) if config.max_seq_len <= 64 else \
            (args.prompt_len, args.new_tokens)
        for batch in args.batches:
            rows.append({"preset": name, **measure(config, params, batch, prompt_len,
                                                   new_tokens, args.rounds)})
            print(rows[-1], flush=True)

    save("export_cost", rows, plot, {"rounds": args.rounds, "platform": jax.default_backend()})


if __name__ == "__main__":
    main()
