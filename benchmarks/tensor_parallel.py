"""Tensor-parallel decode on host CPU devices: the `Engine` on 1 device against 2 (the CPU
split into two XLA devices, each with a core), decode tokens/s, and the all-reduces' share
of a step from an XLA profile.

Usage:
  gpt-jax bench tensor_parallel                       # gpt2 and qwen2.5-0.5b shapes
  python benchmarks/tensor_parallel.py --presets gpt2 --batches 1 --rounds 3

Random weights of each preset's shape (max_seq_len cut to 512: the pool, not the model,
depends on it). Each engine holds `batch` requests of a 16-token prompt; after their prefill
and one untimed decode chunk, rounds alternate the two engines, each timing one chunk of
`CHUNK` decode steps (`Engine.step`, host reads included); medians are reported. Then the
2-device engine runs one chunk under `jax.profiler.trace`, and the trace's all-reduce
events (per device) are summed against the chunk's wall time. Writes
results/tensor_parallel.json.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.sharding import split_host_cpu  # noqa: E402

import jax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speed import RESULTS, machine  # noqa: E402

from gpt_jax import init_params, tensor_parallel  # noqa: E402
from gpt_jax.config import GPTConfig  # noqa: E402
from inference import Engine, SamplingParams  # noqa: E402
from inference.decode import CHUNK  # noqa: E402

PROMPT = 16


def filled_engine(params, config, batch: int, mesh) -> Engine:
    """An engine whose `batch` requests are prefilled and decoding (one chunk run)."""
    engine = Engine(params, config, max_slots=batch, num_pages=batch * 32, page_size=16,
                    mesh=mesh)
    for b in range(batch):
        engine.add_request(str(b), [(7 * b + i) % config.vocab_size for i in range(PROMPT)],
                           SamplingParams(temperature=0.0, max_new_tokens=400))
    while engine.stats()["running"] < batch:
        engine.step()
    engine.step()  # the decode chunk's compile
    return engine


def chunk_seconds(engine: Engine) -> float:
    tick = time.perf_counter()
    engine.step()
    return time.perf_counter() - tick


def all_reduce_ms(engine: Engine) -> tuple[float, float]:
    """`(chunk wall ms, all-reduce ms per device)` of one decode chunk under the profiler."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            wall = chunk_seconds(engine)
        (trace_file,) = Path(tmp).rglob("*.trace.json.gz")
        events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    # XLA:CPU traces an all-reduce as its devices' "Rendezvous" (the wait for the other
    # device included: what the step loses to it)
    total = sum(e["dur"] for e in events if e.get("ph") == "X" and "dur" in e
                and (e["name"] == "Rendezvous" or e["name"].startswith("all-reduce")))
    return 1e3 * wall, total / 1e3 / 2  # microseconds over both devices -> ms per device


def bench(preset: str, batch: int, rounds: int) -> dict:
    config = GPTConfig.preset(preset).replace(max_seq_len=512)
    params = init_params(config, jax.random.key(0))
    engines = {"1 device": filled_engine(params, config, batch, None),
               "2 devices": filled_engine(params, config, batch, tensor_parallel.make_mesh(2))}
    del params  # each engine holds its own layout of them
    times = {name: [] for name in engines}
    for _ in range(rounds):
        for name, engine in engines.items():
            times[name].append(chunk_seconds(engine))
    wall_ms, reduce_ms = all_reduce_ms(engines["2 devices"])
    row = {"preset": preset, "batch": batch,
           "tokens_per_s": {name: batch * CHUNK / statistics.median(t)
                            for name, t in times.items()},
           "profiled_chunk_ms": wall_ms, "all_reduce_ms_per_device": reduce_ms,
           "all_reduce_share": reduce_ms / wall_ms,
           "all_reduces_per_token": 2 * config.n_layers,
           "bytes_per_all_reduce_per_token": config.d_model * 4}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench tensor_parallel",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--presets", nargs="+", default=["gpt2", "qwen2.5-0.5b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    split_host_cpu(2)  # before JAX starts its CPU backend (not at import: --help runs in-process)
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    for preset in args.presets:
        for batch in args.batches:
            rows.append(bench(preset, batch, args.rounds))
            (RESULTS / "tensor_parallel.json").write_text(json.dumps(  # each row as it comes
                {"machine": machine(), "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
