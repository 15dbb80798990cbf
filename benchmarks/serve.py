"""Load test: `gpt-jax serve` against `transformers serve --continuous-batching`, the same
seeded workload and the same client (the `openai` async client, streaming). Both servers are
up; one is sent traffic at a time, rate by rate, in alternating order.

Usage (also `gpt-jax bench serve [flags]`; writes benchmarks/results/serve-load.json + .png):
  pip install -e '.[hf,bench]'     # transformers + torch (CPU) + accelerate
  python benchmarks/serve.py --requests 32 --rates 0.5 2 8

Model: GPT-2 small's shape (12 layers, 12 heads, 768 wide, 1024 positions) with random
weights and a byte-level BPE tokenizer trained on the Shakespeare corpus (--vocab-size
tokens), saved once with `save_hf_gpt2` + tokenizer.json; both servers load that directory.
Neither has an EOS id, so every request generates exactly its max_tokens (greedy).

Workload per rate: --requests arrivals, Poisson at the rate (requests/s), prompts cut from
the corpus (other prompts at each rate, the same for both servers) with token lengths
uniform in [--prompt-min, --prompt-max], max_tokens uniform in [--out-min, --out-max]; a
request not finished --time-limit seconds after the first was sent counts as failed. Figures
per server and rate: generated tokens/s (all tokens / (last finish - first send)), time to
first token (TTFT) and inter-token latency (ITL, per request: (last - first chunk time) /
(tokens - 1)) p50 and p99, failed requests. Each server is warmed up (its programs compiled)
by a few requests before the first timed rate; an idle server waits without using the CPU.
Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file or by `gpt-jax bench`
from speed import save  # noqa: E402


def model_dir(directory: Path, vocab_size: int) -> Path:
    """GPT-2 small shaped random weights + a BPE tokenizer trained on Shakespeare (made once)."""
    if (directory / "tokenizer.json").exists():
        return directory
    import jax

    from gpt_jax import GPTConfig, init_params, save_hf_gpt2
    from gpt_jax.tokenizer import BPETokenizer
    from training.data import shakespeare_text

    tokenizer = BPETokenizer.from_text(shakespeare_text(), vocab_size=vocab_size)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, max_seq_len=1024, n_layers=12,
                       n_heads=12, d_model=768)
    save_hf_gpt2(config, init_params(config, jax.random.key(0)), directory)
    tokenizer.save(directory / "tokenizer.json")
    return directory


def workload(args, rate: float, seed: int) -> list[tuple[float, str, int]]:
    """`(arrival seconds, prompt text, max_tokens)` per request, seeded."""
    from gpt_jax.tokenizer import BPETokenizer
    from training.data import shakespeare_text

    tokenizer = BPETokenizer.load(args.model_dir / "tokenizer.json")
    ids = tokenizer.encode(shakespeare_text()[:200_000])
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, args.requests))
    out = []
    for t in arrivals:
        n = int(rng.integers(args.prompt_min, args.prompt_max + 1))
        start = int(rng.integers(0, len(ids) - n))
        out.append((float(t), tokenizer.decode(ids[start:start + n]),
                    int(rng.integers(args.out_min, args.out_max + 1))))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(name: str, args, port: int) -> subprocess.Popen:
    if name == "gpt-jax":
        command = [sys.executable, "-m", "gpt_jax.cli", "serve", "--hf-checkpoint",
                   str(args.model_dir), "--port", str(port), "--max-queue", "4096",
                   "--served-model-name", "model",
                   *(["--max-slots", str(args.max_slots)] if args.max_slots else []),
                   *(["--mixed-steps"] if args.mixed_steps else [])]
    else:
        command = [str(Path(sys.executable).with_name("transformers")), "serve",
                   str(args.model_dir), "--continuous-batching", "--device", "cpu",
                   "--host", "127.0.0.1", "--port", str(port)]
    log = open(args.log_dir / f"{name}.log", "w")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float) -> None:
    import httpx2 as httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see its log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server on port {port} was not healthy after {timeout} s")


async def replay(base_url: str, model: str, requests, time_limit: float) -> list[dict]:
    """Send each request at its arrival time (streamed); per request: send, first and last
    chunk times, chunks, finish reason, error."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0,
                                timeout=time_limit)
    t0 = time.perf_counter()

    async def one(arrival, prompt, max_tokens):
        await asyncio.sleep(max(0.0, arrival - (time.perf_counter() - t0)))
        record = {"sent": time.perf_counter() - t0, "max_tokens": max_tokens, "times": [],
                  "finish": None, "error": None}
        try:
            stream = await client.completions.create(model=model, prompt=prompt,
                                                     max_tokens=max_tokens, temperature=0.0,
                                                     stream=True)
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    record["times"].append(time.perf_counter() - t0)
                if chunk.choices and chunk.choices[0].finish_reason:
                    record["finish"] = chunk.choices[0].finish_reason
        except Exception as error:  # counted as a failed request
            record["error"] = f"{type(error).__name__}: {error}"[:200]
        return record

    async def bounded(r):
        try:
            return await asyncio.wait_for(one(*r), time_limit + r[0])
        except asyncio.TimeoutError:
            return {"sent": r[0], "max_tokens": r[2], "times": [], "finish": None,
                    "error": "time limit"}

    async with client:
        return await asyncio.gather(*(bounded(r) for r in requests))


def figures(records: list[dict]) -> dict:
    ok = [r for r in records if r["error"] is None and r["finish"] == "length" and r["times"]]
    ttft = [r["times"][0] - r["sent"] for r in ok]
    itl = [(r["times"][-1] - r["times"][0]) / (r["max_tokens"] - 1) for r in ok
           if r["max_tokens"] > 1]
    span = max((r["times"][-1] for r in ok), default=0.0) - min(r["sent"] for r in records)
    pct = lambda xs, q: float(np.percentile(xs, q)) if xs else float("nan")  # noqa: E731
    return {"completed": len(ok), "failed": len(records) - len(ok),
            "tokens_per_s": sum(r["max_tokens"] for r in ok) / span if span > 0 else 0.0,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
            "errors": sorted({r["error"] or f"finish {r['finish']}" for r in records
                              if r not in ok})[:3]}


SPY_HZ = 100  # py-spy samples per second


def profile_summary(raw: Path, tokens: int) -> dict:
    """From py-spy's raw (collapsed) stacks of the gpt-jax server (threads that hold or wait
    for the GIL; a thread inside XLA or waiting idle is not sampled): seconds each thread
    ran Python, and the event loop's milliseconds per generated token by what it ran, the
    leaf-most known frame deciding (SSE, JSON, HTTP, our handler, asyncio itself)."""
    kinds = (("sse_starlette", "sse"), ("json/", "json"), ("starlette/", "http"),
             ("fastapi/", "http"), ("uvicorn/", "http"), ("h11", "http"),
             ("httptools", "http"), ("inference/server.py", "handler"),
             ("inference/api.py", "handler"), ("inference/streaming.py", "handler"),
             ("asyncio/", "asyncio"))
    threads: dict[str, float] = {}
    parts = dict.fromkeys(("sse", "json", "http", "handler", "asyncio", "other"), 0.0)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        seconds = int(count) / SPY_HZ
        thread, *frames = stack.split(";")
        name = thread.split(": ", 1)[-1]
        threads[name] = threads.get(name, 0.0) + seconds
        if name == "MainThread":
            kind = next((k for f in reversed(frames) for key, k in kinds if key in f), "other")
            parts[kind] += seconds
    return {"python_busy_s_by_thread": threads,
            "event_loop_ms_per_token": {k: 1e3 * v / max(1, tokens) for k, v in parts.items()}}


@dataclasses.dataclass
class Server:
    name: str  # "gpt-jax" or "transformers"
    proc: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT/v1
    model: str  # the model name it serves


def launch(name: str, args) -> Server:
    """Start a server, wait until it answers /health, and warm it up (its programs compiled)
    with a few requests."""
    port = free_port()
    server = Server(name, start(name, args, port), f"http://127.0.0.1:{port}/v1",
                    "model" if name == "gpt-jax" else str(args.model_dir))
    wait_healthy(server.proc, port, args.start_timeout)
    warm = [(0.0, p, m) for _, p, m in workload(args, 1.0, seed=99)[:4]]
    asyncio.run(replay(server.base_url, server.model, warm, args.time_limit))
    return server


def stop(server: Server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()


def measure(server: Server, rate: float, seed: int, args) -> dict:
    """One rate's workload (seeded by `seed`) against one server; py-spy samples gpt-jax at
    the highest rate when --profile is given."""
    spy = None
    if args.profile and server.name == "gpt-jax" and rate == max(args.rates):
        raw = args.log_dir / "py-spy.txt"
        spy = subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record",
                                "--pid", str(server.proc.pid), "--format", "raw", "--threads",
                                "--rate", str(SPY_HZ), "--output", str(raw)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = asyncio.run(replay(server.base_url, server.model, workload(args, rate, seed),
                                 args.time_limit))
    row = {"server": server.name, "rate": rate, **figures(records)}
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
        tokens = sum(r["max_tokens"] for r in records if r["error"] is None)
        args.profile_result = profile_summary(raw, tokens)
        print(args.profile_result, flush=True)
    print(row, flush=True)
    return row


def run(args) -> list[dict]:
    """Every server up (started one after another), then each rate against each server in
    turn, the order alternating from rate to rate: a machine that gets busier or quieter
    during the run slows both alike. Each rate has its own prompts (seeded by its index):
    both servers cache prefixes, and a rate that repeated an earlier one's prompts would be
    served from that cache."""
    servers: list[Server] = []
    rows = []
    try:
        for name in args.servers:
            servers.append(launch(name, args))
        for i, rate in enumerate(args.rates):
            for server in servers if i % 2 == 0 else servers[::-1]:
                rows.append(measure(server, rate, i, args))
    finally:
        for server in servers:
            stop(server)
    return rows


def plot(ax, rows):
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == name]
        ax.plot([r["rate"] for r in mine], [r["tokens_per_s"] for r in mine], "o-",
                label=f"{name} tokens/s")
    ax.set_xscale("log")
    ax.set_xlabel("request rate (requests/s)")
    ax.set_ylabel("generated tokens/s")
    ax.legend()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="gpt-jax bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", nargs="+", default=["gpt-jax", "transformers"],
                   choices=["gpt-jax", "transformers"])
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 2.0, 8.0])
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--out-min", type=int, default=16)
    p.add_argument("--out-max", type=int, default=64)
    p.add_argument("--max-slots", type=int, default=None,
                   help="gpt-jax serve --max-slots (default: serve's)")
    p.add_argument("--mixed-steps", action="store_true", help="gpt-jax serve --mixed-steps")
    p.add_argument("--name", default="serve-load", help="results file name under results/")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="seconds a rate's requests may take in all")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--profile", action="store_true",
                   help="sample gpt-jax serve with py-spy at the highest rate (pip install "
                        "py-spy): where the event loop spends its time per token")
    p.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) /
                   "gpt-jax-bench-serve-model")
    args = p.parse_args(argv)
    args.model_dir = model_dir(args.model_dir, args.vocab_size)
    args.log_dir = Path(tempfile.mkdtemp(prefix="gpt-jax-bench-serve-"))
    args.profile_result = None
    print(f"model: {args.model_dir}; server logs: {args.log_dir}", flush=True)
    rows = run(args)
    for row in rows:
        row["errors"] = "; ".join(row["errors"])
    extra = {"workload": {k: getattr(args, k) for k in (
        "requests", "prompt_min", "prompt_max", "out_min", "out_max", "max_slots",
        "mixed_steps", "vocab_size")}, "profile": args.profile_result}
    save(args.name, rows, plot, extra)


if __name__ == "__main__":
    main()
