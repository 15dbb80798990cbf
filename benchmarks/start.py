"""`gpt-jax bench start`: how long `gpt-jax serve` takes from its start to its first answer, with
an empty compilation cache (cold) and with the cache the previous start left (warm), and
whether `jax.export` artifacts load an engine program faster than the cache does.

    gpt-jax bench start [--models shakespeare-char gpt2] [--rounds 2] [--slots 64]
    gpt-jax bench start --part export [--models shakespeare-char gpt2] [--rounds 5]

serve: per model shape (random weights, a tokenizer of one character per id), rounds of a
cold start (a fresh cache directory) then a warm one (the same directory again), each timed
from the process start to the first completion's answer, in wall and in CPU seconds (the
server's user + system time: less dependent on the machine's other work); the programs it
loaded and compiled are its log line. export: in one process, rounds alternated, the time to have the
engine's decode program ready to run (a) from the persistent cache (trace, lower, load) and
(b) from a serialized `jax.export` artifact (deserialize, lower the call, load), both after
`jax.clear_caches()` and with the cache warm. Writes benchmarks/results/start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

from gpt_jax import GPTConfig, checkpoint, init_params
from gpt_jax.tokenizer import CharTokenizer

RESULTS = Path(__file__).resolve().parent / "results"
LINE = re.compile(r"(\d+) programs loaded from cache, (\d+) compiled in ([\d.]+) s")


def save_run(run_dir: Path, config: GPTConfig) -> None:
    import jax

    params = init_params(config, jax.random.key(0))
    checkpoint.save_config(run_dir, config)
    checkpoint.save_tokenizer(run_dir, CharTokenizer([chr(0x100 + i)
                                                      for i in range(config.vocab_size)]))
    checkpoint.save(checkpoint.manager(run_dir), 1, params, params, {"step": 1})


def first_answer(run_dir: Path, cache: Path, slots: int) -> dict:
    """Start `gpt-jax serve`, wait for its first completion; the seconds and its log line."""
    port = 18000 + os.getpid() % 1000
    tick = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt_jax.cli", "serve", "--run-dir", str(run_dir), "--port",
         str(port), "--max-slots", str(slots)], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "GPT_JAX_CACHE": str(cache)})
    try:
        printed = ""
        for line in proc.stdout:
            printed += line
            if " ready on " in line:
                break
        body = {"model": "run", "prompt": chr(0x100) * 8, "max_tokens": 8, "temperature": 0}
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=3600)
        seconds = time.monotonic() - tick
        cpu = cpu_seconds(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    loaded, compiled, warmup = LINE.search(printed).groups()
    return {"seconds": seconds, "cpu_s": cpu, "loaded": int(loaded),
            "compiled": int(compiled), "warmup_s": float(warmup)}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` has run (Linux /proc): what a start costs,
    less dependent than wall time on what else the machine runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve_starts(models: list[str], rounds: int, slots: int) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            run_dir = Path(tmp) / name
            save_run(run_dir, GPTConfig.preset(name))
            runs = {"cold": [], "warm": []}
            for r in range(rounds):
                cache = Path(tmp) / f"xla-{name}-{r}"
                for kind in ("cold", "warm"):
                    runs[kind].append(first_answer(run_dir, cache, slots))
                    print(name, kind, runs[kind][-1], os.getloadavg(), flush=True)
            out[name] = {kind: {"median_s": statistics.median(x["seconds"] for x in v),
                                "median_cpu_s": statistics.median(x["cpu_s"] for x in v),
                                "runs": v} for kind, v in runs.items()}
    return out


def decode_program(config: GPTConfig, slots: int):
    """The engine's decode program for `slots` rows, as (jitted fn, its flat arguments)."""
    import jax

    from inference import Engine
    from inference.batching import engine_decode

    engine = Engine(init_params(config, jax.random.key(0)), config, max_slots=slots)
    rows, stops = engine._row_arrays()
    args = (engine.params, engine.state, engine._page_table(),
            jax.numpy.zeros((slots,), bool), rows, stops, jax.numpy.zeros((0,), jax.numpy.int32))
    leaves, tree = jax.tree.flatten(args)

    def flat(*leaves):
        p, state, table, live, rows, stops, window = jax.tree.unflatten(tree, leaves)
        return jax.tree.leaves(engine_decode(p, config, state, table, live, rows, stops,
                                             window, n_rows=slots, pad_id=0))
    return flat, leaves


def export_vs_cache(models: list[str], rounds: int, slots: int) -> dict:
    import jax

    from inference import compile_cache, exported

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        compile_cache.enable(tmp)
        for name in models:
            flat, leaves = decode_program(GPTConfig.preset(name), slots)
            blob = jax.export.export(jax.jit(flat), disabled_checks=exported.KERNEL_CHECKS)(
                *leaves).serialize()  # the CPU kernel's call kept, as the engine's are
            times = {"cache": [], "export": []}
            for r in range(rounds + 1):  # round 0 fills the cache
                for kind in times:
                    jax.clear_caches()
                    tick = time.monotonic()
                    if kind == "cache":
                        jax.jit(flat).lower(*leaves).compile()
                    else:
                        program = jax.export.deserialize(bytearray(blob))
                        jax.jit(program.call).lower(*leaves).compile()
                    if r:
                        times[kind].append(time.monotonic() - tick)
            out[name] = {k: {"median_s": statistics.median(v), "runs": v}
                         for k, v in times.items()}
            out[name]["artifact_bytes"] = len(blob)
            print(name, out[name], os.getloadavg(), flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="gpt-jax bench start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("serve", "export"), default="serve")
    p.add_argument("--models", nargs="+", default=["shakespeare-char", "gpt2"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--slots", type=int, default=64, help="serve's --max-slots (its default)")
    args = p.parse_args(argv)
    load = os.getloadavg()
    run = serve_starts if args.part == "serve" else export_vs_cache
    result = {"part": args.part, "slots": args.slots, "load_before": load,
              "results": run(args.models, args.rounds, args.slots),
              "load_after": os.getloadavg()}
    path = RESULTS / f"start-{args.part}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
