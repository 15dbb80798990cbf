"""Inference speed: cached generation against naive decoding and Hugging Face, live-length
decode cost, the memory roofline, time to first token and compile counts.

Usage (also `gpt-jax bench NAME [flags]`; every run writes benchmarks/results/NAME.{json,png}):
  python benchmarks/speed.py throughput            # naive / ours b1 b8 b32 / transformers
  python benchmarks/speed.py throughput --batches 1 8 --new-tokens 32 --presets gpt2
  python benchmarks/speed.py throughput --presets gpt2 --batches 1 8 --new-tokens 128 \
      --quantize int8 --tag=-int8         # + int8 weights, beside float32 and transformers
  python benchmarks/speed.py live-length           # step time vs live length, capacity 1024
  python benchmarks/speed.py roofline              # bandwidth, bytes per step, bound vs step
  python benchmarks/speed.py ttft                  # time to first token, prompts 16..1024
  python benchmarks/speed.py compiles              # 100 requests, prompt lengths 1..512

Weights are random (no downloads), float32 (`roofline` and `throughput --bf16` add the
bfloat16 weights-and-cache mode, `throughput --quantize int8` the int8 weights). Ours and
`transformers` run in the same process
on identical weights (written by `gpt_jax.save_hf`, read by both), in turn
over `--rounds` rounds, each figure the median of its rounds, so a busy moment of the machine
slows both alike: compare the ratios, not the absolute figures.
Compilation is never timed (each program runs once before it is timed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax import GPTConfig, init_params
from gpt_jax.params import QUANTIZE, inference_params, is_quantized
from inference import SamplingParams, compile_counts, generate
from inference.sampling import greedy_tokens
from inference.steps import cached_model, init_cache_rows
from inference.naive import naive_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bandwidth import BANDWIDTH_BYTES, BandwidthProbe  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_LEN = 64


def machine() -> dict:
    """Machine, versions and thread counts, stated in every result."""
    info = {"platform": platform.platform(), "processor": platform.processor(),
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
            "python": platform.python_version(), "jax": jax.__version__,
            "jax_backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    try:
        import torch
        import transformers

        info |= {"torch": torch.__version__, "transformers": transformers.__version__,
                 "torch_threads": torch.get_num_threads()}
    except ImportError:
        pass
    return info


def save(name: str, rows: list[dict], plot, extra: dict | None = None) -> None:
    """Print rows as a table, write results/NAME.json and the PNG that `plot(ax, rows)` draws."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = {k: max(len(k), *(len(fmt(r.get(k, ""))) for r in rows)) for k in keys}
    print("  ".join(k.rjust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(fmt(r.get(k, "")).rjust(widths[k]) for k in keys))
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "machine": machine(), "rows": rows, **(extra or {})}
    (RESULTS / f"{name}.json").write_text(json.dumps(record, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plot(ax, rows)
    ax.set_title(f"{name} ({record['machine']['cpu_count']} CPUs, jax {jax.__version__})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=110)
    print(f"wrote {RESULTS / name}.json and .png")


def seconds(fn) -> float:
    """Wall time of one `fn()` (its arrays ready)."""
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def timed(fn, repeats: int = 1) -> float:
    """Best wall time of `fn()` over `repeats` runs, after one untimed (compiling) run."""
    jax.block_until_ready(fn())
    return min(seconds(fn) for _ in range(repeats))


def interleaved(runs: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each of `runs` (name -> a function returning its own seconds) over
    `rounds` rounds that call them in turn: a slow moment of a noisy machine falls on every
    engine alike, and the median of each is compared (see `throughput`)."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            times[name].append(run())
    return times


def ms_per_step(program, steps: int):
    """A run for `interleaved`: calls `program()` (a jitted function of no arguments that runs
    `steps` steps) and returns its milliseconds per step, the result waited for."""
    def run() -> float:
        tick = time.perf_counter()
        jax.block_until_ready(program())
        return (time.perf_counter() - tick) / steps * 1e3
    return run


def preset(name: str) -> GPTConfig:
    # shakespeare-char's position table (320) is too short for prompt 64 + 512 new tokens.
    return GPTConfig.preset(name, max_seq_len=1024) if name == "shakespeare-char" else \
        GPTConfig.preset(name)


def random_prompts(config, batch, length=PROMPT_LEN, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, config.vocab_size, length).tolist() for _ in range(batch)]


# ----------------------------------------------------------------------- 1 + 2: throughput


def hf_model(config: GPTConfig, directory: str):
    """`(model, params, load_s)`: random weights of `config`'s shape (any family) saved as a
    Hugging Face directory (`gpt_jax.save_hf`), our params loaded from it in `load_s`
    seconds (`gpt_jax.load_hf`, float32), and `transformers` `AutoModelForCausalLM` of the
    same directory: identical weights."""
    from transformers import AutoModelForCausalLM

    from gpt_jax import load_hf, save_hf

    save_hf(config, init_params(config, jax.random.key(0)), directory)
    start = time.perf_counter()
    _, params = load_hf(directory)
    params = jax.block_until_ready(params)
    load_s = time.perf_counter() - start
    model = AutoModelForCausalLM.from_pretrained(directory, dtype="float32").eval()
    return model, params, load_s


def bound_step_seconds(params, config, new_tokens: int, bandwidth_gbs: float) -> float:
    """The float32 memory-bound limit of one batch-1 decode step (the roofline's method):
    every weight byte plus the live KV bytes (the mean live length over the generation),
    read once at `bandwidth_gbs` GB/s (`BandwidthProbe.best_gbs`)."""
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    live = PROMPT_LEN + new_tokens / 2
    return (weight_bytes + live_kv_bytes(config, live)) / (bandwidth_gbs * 1e9)


def live_kv_bytes(config: GPTConfig, tokens: float) -> float:
    """Bytes of float32 keys and values a decode step reads for `tokens` cached tokens (all
    rows together): every layer's K and V, kv_heads x head_dim floats each."""
    return 2 * config.n_layers * tokens * config.kv_heads * config.head_dim * 4


def roofline_columns(params, config, new_tokens: int, probe: BandwidthProbe,
                     times: dict[str, list[float]]) -> dict:
    """A batch-1 row's memory-bound columns from the seconds of the same alternated rounds
    (`times`: "gpt-jax", the `new_tokens` call; "first token", a 1-token call; "bandwidth",
    the probe's read). From the medians and the probe's best read (`bound_ms`,
    `bandwidth_GBs`, the reads' spread): `x_bound`, the bound over the whole call's time
    per new token (prefill and first token included: a lower figure than the step's), and
    the roofline benchmark's own measure, the decode step alone: `decode_ms`, (call - 1-token
    call) / (new_tokens - 1) (the 1-token call runs the same prefill and first token, no
    decode step), and `x_bound_decode`. And per round, `x_bound_decode_rounds`: that
    round's decode step against the bound at that round's read (pairs timed moments apart,
    the steadier figure under load). Raises ValueError for `new_tokens` below 2."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 to time a decode step, got {new_tokens}")

    def decode_s(call_s, first_s):
        return (call_s - first_s) / (new_tokens - 1)

    def bound_s(read_s):
        return bound_step_seconds(params, config, new_tokens, BANDWIDTH_BYTES / read_s / 1e9)

    median = {name: float(np.median(t)) for name, t in times.items()}
    bound = bound_step_seconds(params, config, new_tokens, probe.best_gbs())
    decode = decode_s(median["gpt-jax"], median["first token"])
    rounds = [bound_s(read) / decode_s(call, first) for call, first, read in
              zip(times["gpt-jax"], times["first token"], times["bandwidth"])]
    return {"bandwidth_GBs": probe.best_gbs(), "bandwidth_reads": probe.spread(),
            "bound_ms": 1e3 * bound, "x_bound": bound / (median["gpt-jax"] / new_tokens),
            "decode_ms": 1e3 * decode, "x_bound_decode": bound / decode,
            "x_bound_decode_rounds": [round(r, 2) for r in rounds]}


def roofline_line(name: str, row: dict) -> str:
    """One printed line of a batch-1 row's memory-bound figures (`roofline_columns`)."""
    reads = row["bandwidth_reads"]
    return (f"{name} batch 1: {row['ms_per_step']:.1f} ms per new token, decode step "
            f"{row['decode_ms']:.1f} ms; bound {row['bound_ms']:.1f} ms at {reads['bandwidth_GBs']}"
            f" GB/s (best read; xla {reads['xla']}, threads {reads['threads']}); x_bound "
            f"{row['x_bound']:.2f}, x_bound_decode {row['x_bound_decode']:.2f} (rounds, each "
            f"against its own read: {row['x_bound_decode_rounds']}); load average "
            f"{row['load_average']}")


def hf_generate_seconds(model, prompts, new_tokens) -> float:
    import torch

    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :8], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def generate_seconds(params, config, prompts, sampling, **kwargs) -> float:
    return seconds(lambda: generate(params, config, prompts, sampling, **kwargs))


def naive_step_seconds(params, config, batch, new_tokens) -> float:
    """One step of `naive_generate` at the capacity it uses for `new_tokens`: its cost is
    the same every step (a full forward over the padded sequence buffer)."""
    capacity = min(config.max_seq_len, PROMPT_LEN + new_tokens)
    tokens = jnp.asarray(random_prompts(config, batch), jnp.int32)
    lengths = jnp.full((batch,), PROMPT_LEN, jnp.int32)
    model = lambda params: naive_model(params, config, capacity, jnp.float32)  # noqa: E731
    rows = jnp.arange(batch, dtype=jnp.int32)  # row b is prompt b
    _, seqs = jax.jit(lambda p: model(p)[0](tokens, lengths, rows, False))(params)
    step = jax.jit(lambda p, s: model(p)[1](tokens[:, 0], s, jnp.ones((batch,), bool)))
    return timed(lambda: step(params, seqs), repeats=2)


def throughput(args) -> None:
    if 1 in args.batches and min(args.new_tokens) < 2:  # before any work
        raise SystemExit(f"--new-tokens must be at least 2 with batch 1 (its decode step is "
                         f"timed), got {min(args.new_tokens)}")
    if args.hf:  # --no-hf needs no torch
        import torch

        torch.set_num_threads(args.threads)
    rows, partial = [], RESULTS / f"throughput{args.tag}.partial.json"
    probe = BandwidthProbe() if 1 in args.batches else None
    for name in args.presets:
        config = preset(name)
        with tempfile.TemporaryDirectory() as tmp:
            model, params, load_s = hf_model(config, tmp) if args.hf else (
                None, init_params(config, jax.random.key(0)), None)
        # Ours runs the weights as `LLM` does: in the decode layout, in huge pages, made once.
        laid_out = inference_params(params, config)
        laid_out_bf16 = inference_params(params, config, "bfloat16") if args.bf16 else None
        quantized = inference_params(params, config, quantize_method=args.quantize) \
            if args.quantize else None
        first = SamplingParams(temperature=0.0, max_new_tokens=1)
        first_token_s = timed(lambda: generate(  # noqa: B023
            laid_out, config, random_prompts(config, 1), first), repeats=3)  # noqa: B023
        for new in args.new_tokens:
            step = naive_step_seconds(params, config, 1, new)
            rows.append({"preset": name, "engine": "naive", "batch": 1, "new_tokens": new,
                         "tok_per_s": 1 / step, "ms_per_step": 1e3 * step})
            for batch in args.batches:
                prompts = random_prompts(config, batch)
                sp = SamplingParams(temperature=0.0, max_new_tokens=new)
                runs = {"gpt-jax": functools.partial(
                    generate_seconds, laid_out, config, prompts, sp)}
                if args.bf16:
                    runs["gpt-jax bf16"] = functools.partial(
                        generate_seconds, laid_out_bf16, config, prompts, sp,
                        cache_dtype=jnp.bfloat16)
                if quantized is not None:
                    runs[f"gpt-jax {args.quantize}"] = functools.partial(
                        generate_seconds, quantized, config, prompts, sp)
                if model is not None:
                    runs["transformers"] = functools.partial(
                        hf_generate_seconds, model, prompts, new)
                if batch == 1:  # the bandwidth and the first token in the same rounds
                    probe.restart()
                    runs["bandwidth"] = probe.read
                    runs["first token"] = functools.partial(
                        generate_seconds, laid_out, config, prompts, first)
                for run in runs.values():
                    run()  # compile (ours) and warm up, untimed
                load = os.getloadavg()[0]
                times = interleaved(runs, args.rounds)
                load = f"{load:.1f}->{os.getloadavg()[0]:.1f}"
                median = {engine: float(np.median(t)) for engine, t in times.items()}
                for engine, t in times.items():
                    if engine in ("bandwidth", "first token"):
                        continue
                    row = {"preset": name, "engine": engine, "batch": batch, "new_tokens": new,
                           "tok_per_s": batch * new / median[engine],
                           "ms_per_step": 1e3 * median[engine] / new,
                           "ms_per_step_rounds": [round(1e3 * x / new, 1) for x in t]}
                    if engine == "gpt-jax" and model is not None:
                        row["x_transformers"] = median["transformers"] / median[engine]
                    if engine == "gpt-jax" and batch == 1:
                        row["x_naive"] = row["tok_per_s"] * step  # naive runs 1/step tokens/s
                        row |= roofline_columns(params, config, new, probe, times)
                        row |= {"first_token_ms": 1e3 * first_token_s, "load_s": load_s,
                                "load_average": load}
                        print(roofline_line(name, row), flush=True)
                    if engine in ("gpt-jax bf16", f"gpt-jax {args.quantize}"):
                        row["x_float32"] = median["gpt-jax"] / median[engine]
                        if model is not None:
                            row["x_transformers"] = median["transformers"] / median[engine]
                    rows.append(row)
                # so far, for a long run stopped early (results/NAME.json is written last)
                RESULTS.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
        del model, params, laid_out, laid_out_bf16, quantized  # the next preset's memory

    def plot(ax, rows):
        for engine in ("naive", "gpt-jax", "gpt-jax bf16", f"gpt-jax {args.quantize}",
                       "transformers"):
            sel = [r for r in rows if r["engine"] == engine and r["preset"] == args.presets[0]
                   and r["new_tokens"] == args.new_tokens[0]]
            if sel:
                ax.plot([r["batch"] for r in sel], [r["tok_per_s"] for r in sel], "o-",
                        label=engine)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"tokens/s ({args.presets[0]}, prompt {PROMPT_LEN}, "
                      f"{args.new_tokens[0]} new)")
        ax.legend()

    save("throughput" + args.tag, rows, plot, {"threads": args.threads,
                                               "quantize": args.quantize})
    partial.unlink(missing_ok=True)


# ----------------------------------------------------------------- 3: decode vs live length


def decode_runner(params, config, batch, capacity, live, steps=8):
    """A zero-argument function running `steps` cached decode steps, as the generation loop
    runs them (paged cache, greedy token fed back), with every row at `live` tokens; the
    steps do not advance, so the live length stays fixed. The cache takes the dtype of the
    params (float32 for int8 ones). Each step's logits pick the next tokens: left unused,
    XLA would drop the output projection and the last layer's attention as dead code."""
    dtype = jnp.float32 if is_quantized(params) else params["wte"].dtype

    @jax.jit
    def run(params, cache):  # params as an argument: closed over, XLA would fold 500 MB
        _, step_fn = cached_model(params, config, capacity, dtype)
        hold = jnp.zeros((batch,), bool)

        def body(carry, _):
            tokens, cache = carry
            logits, cache = step_fn(tokens, cache, hold)
            return (greedy_tokens(logits), cache), None  # the sampler's argmax

        start = (jnp.zeros((batch,), jnp.int32), cache)
        return jax.lax.scan(body, start, None, length=steps)[0]

    cache = init_cache_rows(config, batch, capacity, dtype)
    cache = cache.replace(lengths=jnp.full((batch,), live, jnp.int32))
    return functools.partial(run, params, cache)  # .func.lower(*.args) gives its HLO


def decode_step_arguments(parser, rounds: int) -> None:
    """The flags of a benchmark timing `decode_runner` steps of a preset's random weights:
    --preset, --batch, --live, --capacity, --steps, --rounds (default `rounds`), --quantize,
    --tag."""
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--live", type=int, default=128, help="cached tokens per row")
    parser.add_argument("--capacity", type=int, default=256, help="token slots per row")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timing")
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--quantize", choices=QUANTIZE, default=None, help="weights so")
    parser.add_argument("--tag", default="", help="suffix of the result file's name")


def decode_step_seconds(params, config, batch, capacity, live, steps=16) -> float:
    """Wall time of one cached decode step: the marginal cost of `steps` more steps (runs of
    `steps` and `2 * steps` steps, best of 3 each), so per-call costs that a `generate` call
    pays once, not per step (unstacking the layer weights, the copy of the undonated input
    cache on its first write, the dispatch), drop out."""
    short, long = (timed(decode_runner(params, config, batch, capacity, live, n), repeats=3)
                   for n in (steps, 2 * steps))
    return (long - short) / steps


def live_length(args) -> None:
    config = preset(args.preset)
    params = init_params(config, jax.random.key(0))
    rows = []
    for batch in args.batches:
        small = decode_step_seconds(params, config, batch, 128, 64)
        rows.append({"batch": batch, "capacity": 128, "live": 64, "ms_per_step": 1e3 * small})
        for live in args.live:
            t = decode_step_seconds(params, config, batch, args.capacity, live)
            rows.append({"batch": batch, "capacity": args.capacity, "live": live,
                         "ms_per_step": 1e3 * t, "x_cap128_live64": t / small})

    def plot(ax, rows):
        for batch in args.batches:
            sel = [r for r in rows if r["batch"] == batch and r["capacity"] == args.capacity]
            ax.plot([r["live"] for r in sel], [r["ms_per_step"] for r in sel], "o-",
                    label=f"batch {batch}, capacity {args.capacity}")
        ax.set_xlabel("live tokens per row")
        ax.set_ylabel("decode step (ms)")
        ax.legend()

    save("live-length" + args.tag, rows, plot, {"preset": args.preset})


# ---------------------------------------------------------------------------- 4: roofline


def roofline(args) -> None:
    config = preset(args.preset)
    params = init_params(config, jax.random.key(0))
    probe = BandwidthProbe()  # read between the step timings, alternated with them
    probe.read()
    rows = []
    for dtype in args.dtypes:
        cast = jax.tree.map(lambda a: a.astype(dtype), params)  # noqa: B023
        weight_bytes = sum(x.nbytes for x in jax.tree.leaves(cast))
        itemsize = jnp.dtype(dtype).itemsize
        for batch in args.batches:
            kv_bytes = (2 * config.n_layers * batch * args.live * config.kv_heads
                        * config.head_dim * itemsize)
            step = decode_step_seconds(cast, config, batch, PROMPT_LEN + 128, args.live)
            probe.read()
            rows.append({"dtype": dtype, "batch": batch, "live": args.live,
                         "weights_MB": weight_bytes / 1e6, "kv_MB": kv_bytes / 1e6,
                         "step_ms": 1e3 * step})
    bandwidth = probe.best_gbs()  # the best read of the run: the strictest bound
    for row in rows:
        bound_ms = (row["weights_MB"] + row["kv_MB"]) / bandwidth
        row |= {"bandwidth_GBs": bandwidth, "bound_ms": bound_ms,
                "x_bound": row["step_ms"] / bound_ms}
    print(f"bandwidth reads (GB/s): {probe.spread()}; load average {os.getloadavg()[:3]}")

    def plot(ax, rows):
        for dtype in args.dtypes:
            sel = [r for r in rows if r["dtype"] == dtype]
            ax.plot([r["batch"] for r in sel], [r["bound_ms"] for r in sel], "o--",
                    label=f"memory bound, {dtype}")
            ax.plot([r["batch"] for r in sel], [r["step_ms"] for r in sel], "o-",
                    label=f"measured, {dtype}")
        ax.set_xlabel("batch size")
        ax.set_ylabel(f"decode step (ms), live {args.live}")
        ax.legend()

    save("roofline", rows, plot, {"preset": args.preset, "bandwidth_reads": probe.spread()})


# ----------------------------------------------------------------- 5: time to first token


def prefill_peak_bytes(params, config, length: int) -> int:
    """Temporary memory XLA allocates for a batch-1 prefill of `length` tokens."""
    def prefill(params, tokens_BT, lengths_B):
        prefill_fn = cached_model(params, config, length, jnp.float32)[0]
        return prefill_fn(tokens_BT, lengths_B, jnp.zeros((1,), jnp.int32), False)

    compiled = jax.jit(prefill).lower(params, jnp.zeros((1, length), jnp.int32),
                                      jnp.full((1,), length, jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def ttft(args) -> None:
    config = preset(args.preset)
    params = init_params(config, jax.random.key(0))
    laid_out = inference_params(params, config)  # once, as `LLM` does
    rows = []
    one = SamplingParams(temperature=0.0, max_new_tokens=1)
    for length in args.lengths:
        prompts = random_prompts(config, 1, min(length, config.max_seq_len - 1))
        seconds = timed(lambda: generate(laid_out, config, prompts, one),  # noqa: B023
                        repeats=2)
        rows.append({"prompt": length, "ttft_ms": 1e3 * seconds})
    longest = max(args.lengths)
    peak = prefill_peak_bytes(params, config, longest)
    full_scores = config.n_heads * longest * longest * 4  # one layer's [N, T, S] float32
    print(f"prefill of {longest} tokens: XLA temporaries {peak / 1e6:.1f} MB; one layer's "
          f"full [N, T, S] float32 scores would be {full_scores / 1e6:.1f} MB")

    def plot(ax, rows):
        ax.plot([r["prompt"] for r in rows], [r["ttft_ms"] for r in rows], "o-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens (batch 1)")
        ax.set_ylabel("time to first token (ms)")

    save("ttft", rows, plot, {"preset": args.preset, "prefill_tokens": longest,
                              "prefill_temp_bytes": peak, "full_scores_bytes": full_scores})


# -------------------------------------------------------------------------- 6: compiles


def compiles(args) -> None:
    from jax import monitoring

    config = preset(args.preset)
    params = init_params(config, jax.random.key(0))
    seconds = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: seconds.append(duration)
        if event.endswith("backend_compile_duration") else None)
    rng = np.random.default_rng(0)
    before = sum(compile_counts().values())
    rows = []
    start = time.perf_counter()
    for i in range(args.requests):
        length = int(rng.integers(1, 513))
        new = args.max_new_tokens
        prompt = rng.integers(0, config.vocab_size, length).tolist()
        generate(params, config, [prompt], SamplingParams(temperature=0.0, max_new_tokens=new))
        rows.append({"request": i + 1, "prompt": length, "new_tokens": new,
                     "programs": sum(compile_counts().values()) - before,
                     "compile_s": sum(seconds), "elapsed_s": time.perf_counter() - start})
    print(f"{args.requests} requests: {rows[-1]['programs']} programs compiled in "
          f"{rows[-1]['compile_s']:.1f} s of {rows[-1]['elapsed_s']:.1f} s")

    def plot(ax, rows):
        ax.step([r["request"] for r in rows], [r["programs"] for r in rows], where="post")
        ax.set_xlabel("requests served (prompt lengths 1..512)")
        ax.set_ylabel("programs compiled")

    save("compiles", rows[-1:] if not args.all_rows else rows, plot,
         {"preset": args.preset, "per_request": rows})


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="name", required=True)
    p = sub.add_parser("throughput")
    p.add_argument("--presets", nargs="+", default=["gpt2", "shakespeare-char"],
                   help="model shapes (gpt_jax.config presets), random weights; default "
                   "%(default)s")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32],
                   help="prompts generated at once (batch 1 adds the memory-bound columns); "
                   "default %(default)s")
    p.add_argument("--new-tokens", nargs="+", type=int, default=[128, 512],
                   help=f"tokens generated per prompt of {PROMPT_LEN}; default %(default)s")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers")
    p.add_argument("--tag", default="", help="suffix of the result file names (--tag=-x)")
    p.add_argument("--bf16", action="store_true", help="also time ours with bfloat16 weights "
                   "and KV cache")
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each engine, taken "
                   "in turn; each figure is the median (default %(default)s)")
    p.add_argument("--quantize", choices=QUANTIZE, default=None,
                   help="also time ours with weights quantized so (gpt_jax.params.quantize)")
    p = sub.add_parser("live-length")
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--live", nargs="+", type=int, default=[64, 128, 256, 512, 1023])
    p.add_argument("--tag", default="", help="suffix of the result file names (--tag=-x)")
    p = sub.add_parser("roofline")
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--live", type=int, default=PROMPT_LEN + 64)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"], help="weights and KV cache dtype")
    p = sub.add_parser("ttft")
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--lengths", nargs="+", type=int, default=[16, 64, 256, 1023])
    p = sub.add_parser("compiles")
    p.add_argument("--preset", default="shakespeare-char")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=32, help="every request's")
    p.add_argument("--all-rows", action="store_true", help="print every request")
    args = parser.parse_args(argv)
    {"throughput": throughput, "live-length": live_length, "roofline": roofline,
     "ttft": ttft, "compiles": compiles}[args.name](args)


if __name__ == "__main__":
    main()
