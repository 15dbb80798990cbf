"""The three maintained structured-output libraries on the same constraints and vocabulary:
outlines-core (what `inference.constraints` uses), llguidance and xgrammar. For the nested
schema of `structured.py`, `{"type": "object"}` (json_object) and a regex, over the same
50,257-token byte-level BPE: seconds to compile (cold, every cache off) and the host cost of
one step's token mask plus the state advance, median and mean over a seeded random walk through
each library's own mask (a uniformly drawn allowed token each step, EOS never, at most
`STEPS`). outlines-core's step is the table lookup that `inference.constraint_mask` does on
the device inside the compiled loop, here in numpy.

Usage (llguidance and xgrammar outside the project's environment; outlines-core is ours):
  pip install --target /tmp/structured-libs llguidance xgrammar
  PYTHONPATH=/tmp/structured-libs gpt-jax bench structured_libraries        # 3 rounds
  PYTHONPATH=/tmp/structured-libs gpt-jax bench structured_libraries --repeats 1

Writes benchmarks/results/structured-libraries.json and .png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file or by `gpt-jax bench`

STEPS = 64  # most mask steps timed per walk
REGEX = (r"[A-Z][a-z]{2,9}( [A-Z][a-z]{2,9}){0,2}, born (19|20)[0-9]{2}-(0[1-9]|1[0-2])-"
         r"(0[1-9]|[12][0-9]|3[01]), [a-z0-9._]{1,16}@[a-z]{2,12}\.(com|org|net)")
OTHERS = ("llguidance", "xgrammar")


def missing() -> list[str]:
    """The libraries besides outlines-core that are not importable."""
    return [name for name in OTHERS if importlib.util.find_spec(name) is None]


def constraints(nested: dict) -> dict[str, tuple[str, object]]:
    """name -> (kind, value): kind "schema" or "regex"."""
    return {"nested schema": ("schema", nested), "json_object": ("schema", {"type": "object"}),
            "regex": ("regex", REGEX)}


def timed(fn):
    tick = time.perf_counter()
    out = fn()
    return time.perf_counter() - tick, out


def walk(step, allowed, n_vocab: int, eos: int, seed: int = 0) -> list[float]:
    """Seconds of each `step(token)` call (None: the first mask) along a random walk:
    `step` computes the mask after consuming `token`, `allowed()` reads it as bool `[V]`."""
    rng, times, token = np.random.default_rng(seed), [], None
    for _ in range(STEPS):
        times.append(timed(lambda: step(token))[0])
        live = allowed()[:n_vocab].copy()
        live[eos] = False
        if not live.any():
            break
        token = int(rng.choice(np.flatnonzero(live)))
    return times


def outlines_core_run(kind, value, tokenizer, V: int, eos: int) -> dict:
    from inference import SamplingParams
    from inference.constraints import _compile, _Vocab, constraint_regex, token_bytes

    setup_s, vocab = timed(lambda: _Vocab(token_bytes(tokenizer), V))  # as a new process
    setup_s += timed(lambda: vocab.vocabulary)[0]
    sp = SamplingParams(json_schema=value) if kind == "schema" else SamplingParams(regex=value)
    compile_s, table = timed(lambda: _compile(constraint_regex(sp)[1], vocab))
    state, live = [0], [None]

    def step(token):
        if token is not None:
            state[0] = int(table.next_state[state[0], table.token_class[token]])
        live[0] = table.next_state[state[0]][table.token_class] >= 0

    return {"tokenizer_setup_s": setup_s, "compile_s": compile_s,
            "step_s": walk(step, lambda: live[0], V, eos)}


def llguidance_run(kind, value, hf, V: int, eos: int) -> dict:
    import llguidance
    import llguidance.numpy as llnp

    setup_s, tok = timed(lambda: llguidance.LLTokenizer(hf.backend_tokenizer.to_str(),
                                                        n_vocab=V, eos_token=eos))
    grammar = (llguidance.LLMatcher.grammar_from_json_schema(value) if kind == "schema"
               else llguidance.LLMatcher.grammar_from_regex(value))
    compile_s, matcher = timed(lambda: llguidance.LLMatcher(tok, grammar))
    assert not matcher.is_error(), matcher.get_error()
    bitmask = llnp.allocate_token_bitmask(1, V)

    def step(token):
        if token is not None:
            assert matcher.consume_token(token), matcher.get_error()
        llnp.fill_next_token_bitmask(matcher, bitmask)

    return {"tokenizer_setup_s": setup_s, "compile_s": compile_s,
            "step_s": walk(step, lambda: _bits(bitmask), V, eos)}


def xgrammar_run(kind, value, hf, V: int, eos: int) -> dict:
    import xgrammar as xgr

    setup_s, info = timed(lambda: xgr.TokenizerInfo.from_huggingface(
        hf, vocab_size=V, stop_token_ids=[eos]))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_s, grammar = timed(lambda: compiler.compile_json_schema(
        json.dumps(value), any_whitespace=False) if kind == "schema"
        else compiler.compile_regex(value))
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, V)

    def step(token):
        if token is not None:
            assert matcher.accept_token(token)
        matcher.fill_next_token_bitmask(bitmask)

    return {"tokenizer_setup_s": setup_s, "compile_s": compile_s,
            "step_s": walk(step, lambda: _bits(bitmask.numpy()), V, eos)}


def _bits(bitmask) -> np.ndarray:
    """bool `[32 * words]` of a `[1, words]` int32 bitmask (bit i of word w: token 32w+i)."""
    return np.unpackbits(np.ascontiguousarray(bitmask[0]).view(np.uint8), bitorder="little")\
        .astype(bool)


def plot(ax, rows) -> None:
    """Cold compile seconds per constraint, a bar per library (log scale)."""
    names = list(dict.fromkeys(r["constraint"] for r in rows))
    libraries = list(dict.fromkeys(r["library"] for r in rows))
    for i, library in enumerate(libraries):
        got = {r["constraint"]: r["compile_s"] for r in rows if r["library"] == library}
        ax.bar(np.arange(len(names)) + 0.8 * i / len(libraries),
               [got.get(n, 0) for n in names], 0.8 / len(libraries), label=library)
    ax.set_xticks(np.arange(len(names)) + 0.4 - 0.4 / len(libraries), names)
    ax.set_yscale("log")
    ax.set_ylabel("cold compile, s")
    ax.legend()


def compare(tokenizer, nested: dict, repeats: int) -> None:
    """Run every library present on every constraint, `repeats` cold compiles each (the
    rounds alternate libraries), print the table and save the results."""
    from transformers import PreTrainedTokenizerFast

    from speed import save

    V = tokenizer.tokenizer.get_vocab_size()
    eos = tokenizer.tokenizer.token_to_id("<|endoftext|>")
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer,
                                 eos_token="<|endoftext|>")
    runners = {"outlines-core": lambda k, v: outlines_core_run(k, v, tokenizer, V, eos),
               "llguidance": lambda k, v: llguidance_run(k, v, hf, V, eos),
               "xgrammar": lambda k, v: xgrammar_run(k, v, hf, V, eos)}
    absent = missing()
    runs: dict = {}
    for _ in range(repeats):
        for name, (kind, value) in constraints(nested).items():
            for library, run in runners.items():
                if library not in absent:
                    runs.setdefault((library, name), []).append(run(kind, value))
                    print(f"{library} {name}: compiled in "
                          f"{runs[library, name][-1]['compile_s']:.3f} s", flush=True)
    rows = [{"library": library, "constraint": name,
             "compile_s": statistics.median(r["compile_s"] for r in got),
             "tokenizer_setup_s": statistics.median(r["tokenizer_setup_s"] for r in got),
             "first_mask_ms": 1e3 * statistics.median(r["step_s"][0] for r in got),
             "step_us": 1e6 * statistics.median(s for r in got for s in r["step_s"][1:]),
             "step_mean_us": 1e6 * statistics.mean(s for r in got for s in r["step_s"][1:]),
             "steps": len(got[-1]["step_s"])}
            for (library, name), got in runs.items()]
    save("structured-libraries", rows, plot, {
        "vocab_size": V, "repeats": repeats, "load_average": os.getloadavg(),
        "missing": absent, "regex": REGEX, "nested_schema": json.dumps(nested)})


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpt-jax bench structured_libraries", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="cold compiles per library and "
                   "constraint, rounds alternating the libraries")
    args = p.parse_args(argv)
    absent = missing()
    if absent:
        print(f"gpt-jax bench structured_libraries: {' and '.join(absent)} not installed: "
              f"pip install {' '.join(absent)} (into a --target directory on PYTHONPATH keeps "
              "the project's environment as it is)", file=sys.stderr)
        if len(absent) == len(OTHERS):
            raise SystemExit(1)
    from structured import NESTED, bpe_tokenizer

    compare(bpe_tokenizer(), NESTED, args.repeats)


if __name__ == "__main__":
    main()
