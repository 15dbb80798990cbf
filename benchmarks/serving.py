"""Serving: continuous batching (`inference.Engine`) against static batching of the same
seeded arrival workload, with `inference.generate` on the batch that has arrived when the
previous one ends (our static batching), and optionally `transformers` `generate` likewise.

Usage (also `gpt-jax bench serving [flags]`; writes benchmarks/results/serving-SCENARIO.*):
  python benchmarks/serving.py arrivals --preset gpt2 --requests 48 --rates 2 8
  python benchmarks/serving.py prefix --preset gpt2       # 32 requests, 256-token prefix
  python benchmarks/serving.py long-prompt --preset gpt2  # 1,000 tokens while 16 decode
  python benchmarks/serving.py decode-step --preset gpt2  # 32 running slots vs generate

Scenarios:
  arrivals: the workload below through each engine.
  prefix: 32 requests at once sharing a 256-token prefix (+ 8-32 own tokens), prefix caching
    on and off: tokens prefilled, TTFT p50/p99.
  long-prompt: 16 requests decoding (--out-max tokens each), then a 1,000-token prompt
    arrives, with mixed steps and with prefill and decode taking turns; time per output
    token of the 16 (the time since a request's previous tokens over its new ones, so a
    prefill step that stalls it counts), p50 and p99, with prefill budgets (and chunks) of
    64, 128 and 1024 (the whole prompt in one prefill), and with --max-prefill-tokens and
    --prefill-chunk-tokens (the Engine's defaults: 128 and 64).
  decode-step: an engine step with 32 running slots (no prefill), per decode step, against
    the marginal decode step of `generate` at batch 32 (same live length), in turns.

Workload: Poisson arrivals at each rate (requests/s); prompt lengths uniform in
[--prompt-min, --prompt-max]; output lengths (max_new_tokens) either uniform in [--out-min,
--out-max] (`--outputs uniform`) or as a model that stops at EOS makes them (`--outputs
eos`, the default): a stop with the same chance after every token, i.e. geometric lengths
of mean --out-mean, clipped to [--out-min, --out-max]; greedy; random token ids; random
weights (no downloads). The same workload for every engine. Static batching returns a batch
at its end, so its first token arrives then (it does not stream). Figures: generated
tokens/s over the whole run, time to first token (TTFT) and time per output token (TPOT,
per request: (last - first token time) / (tokens - 1)) p50 and p99, peak KV pages in use.
The Engine first runs the workload until a run compiles no new program (its warmup compiles
every shape); static batching's clock stops while a batch of a new shape compiles. Then
--rounds timed runs take turns between the engines (a busy machine slows all alike), and
each figure is the median over the rounds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

from gpt_jax import init_params
from inference import Engine, SamplingParams, compile_counts, generate

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file or by `gpt-jax bench`
from speed import preset, save  # noqa: E402


def workload(args, config, rate, seed):
    """`(arrival seconds, prompt ids, max_new_tokens)` per request, seeded."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, args.requests))
    prompts = rng.integers(args.prompt_min, args.prompt_max + 1, args.requests)
    if args.outputs == "uniform":
        outputs = rng.integers(args.out_min, args.out_max + 1, args.requests)
    else:  # stopped at EOS: P(stop after each token) = 1 / mean
        outputs = np.clip(rng.geometric(1 / args.out_mean, args.requests), args.out_min,
                          args.out_max)
    return [(float(t), rng.integers(0, config.vocab_size, int(n)).tolist(), int(m))
            for t, n, m in zip(arrivals, prompts, outputs)]


def run_continuous(params, config, args, requests, mixed=True):
    """Add each request at its arrival time, step the engine (`mixed`: with mixed steps),
    time every token."""
    engine = Engine(params, config, max_slots=args.max_slots,
                    max_prefill_tokens=args.max_prefill_tokens,
                    prefill_chunk_tokens=args.prefill_chunk_tokens, mixed_steps=mixed)
    engine.warmup()
    times = {i: [] for i in range(len(requests))}
    start, pending, peak = time.perf_counter(), list(enumerate(requests)), 0
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][1][0] <= now:
            i, (_, prompt, m) = pending.pop(0)
            engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_new_tokens=m))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][1][0] - now))
            continue
        outs = engine.step()
        t = time.perf_counter() - start
        peak = max(peak, engine.stats()["pages_in_use"])
        for out in outs:
            times[int(out.request_id)] += [t] * len(out.new_token_ids)
    return times, peak


def run_static(generate_fn, requests, max_batch):
    """Run every request that has arrived (at most `max_batch`) as one batch; repeat. A batch
    whose shape compiles a new program is run again and only that run is timed (the clock
    stops for the first), since which shapes a run meets depends on its timing."""
    times = {i: [] for i in range(len(requests))}
    start, pending = time.perf_counter(), list(enumerate(requests))
    while pending:
        now = time.perf_counter() - start
        if pending[0][1][0] > now:
            time.sleep(pending[0][1][0] - now)
            continue
        batch = [p for p in pending if p[1][0] <= now][:max_batch]
        pending = [p for p in pending if p not in batch]
        tick, before = time.perf_counter(), sum(compile_counts().values())
        lengths = generate_fn([r[1] for _, r in batch], [r[2] for _, r in batch])
        if sum(compile_counts().values()) != before:
            start += time.perf_counter() - tick
            lengths = generate_fn([r[1] for _, r in batch], [r[2] for _, r in batch])
        t = time.perf_counter() - start
        for (i, _), n in zip(batch, lengths):
            times[i] = [t] * n
    return times


def without_compiles(run, tries=4):
    """`run()` again until a run compiles no new program (batch shapes depend on timing, so
    a faster run can meet shapes a slower one did not); that run's result is the timed one.
    Raises RuntimeError if every try compiled something."""
    for _ in range(tries):
        before = sum(compile_counts().values())
        result = run()
        if sum(compile_counts().values()) == before:
            return result
    raise RuntimeError(f"every one of {tries} runs compiled a new program")


def figures(requests, times):
    ttft = [times[i][0] - r[0] for i, r in enumerate(requests) if times[i]]
    tpot = [(times[i][-1] - times[i][0]) / (len(times[i]) - 1)
            for i in range(len(requests)) if len(times[i]) > 1]
    makespan = max(t[-1] for t in times.values() if t) - requests[0][0]
    return {"tok_per_s": sum(map(len, times.values())) / makespan,
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p99": float(np.percentile(ttft, 99)),
            "tpot_p50": float(np.percentile(tpot, 50)), "tpot_p99": float(np.percentile(tpot, 99))}


def ours_static(params, config):
    def run(prompts, max_new):
        sampling = [SamplingParams(temperature=0.0, max_new_tokens=m) for m in max_new]
        return [len(c.tokens) for c in generate(params, config, prompts, sampling)]
    return run


def transformers_static(params, config):
    import tempfile

    import torch
    from transformers import GPT2LMHeadModel

    from gpt_jax import save_hf_gpt2

    folder = tempfile.mkdtemp()
    save_hf_gpt2(config, params, folder)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()

    def run(prompts, max_new):
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(max_new),
                           do_sample=False, pad_token_id=0)
        return list(max_new)
    return run


def prefix(args, params, config):
    rng = np.random.default_rng(args.seed)
    shared = rng.integers(0, config.vocab_size, 256).tolist()
    prompts = [shared + rng.integers(0, config.vocab_size, int(n)).tolist()
               for n in rng.integers(8, 33, 32)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=32)
    rows = []
    for caching in (True, False):
        for timed in (False, True):  # the first run compiles
            engine = Engine(params, config, max_slots=args.max_slots, prefix_caching=caching,
                            max_prefill_tokens=args.max_prefill_tokens,
                            prefill_chunk_tokens=args.prefill_chunk_tokens)
            start, first = time.perf_counter(), {}
            for i, prompt in enumerate(prompts):
                engine.add_request(str(i), prompt, sp)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    first.setdefault(out.request_id, time.perf_counter() - start)
        stats = engine.stats()
        ttft = list(first.values())
        rows.append({"prefix_caching": caching, "prefilled_tokens": stats["prefilled_tokens"],
                     "prefix_cache_hits": stats["prefix_cache_hits"],
                     "ttft_p50": float(np.percentile(ttft, 50)),
                     "ttft_p99": float(np.percentile(ttft, 99)),
                     "seconds": time.perf_counter() - start})
    rows[0]["x_fewer_prefill_tokens"] = rows[1]["prefilled_tokens"] / rows[0]["prefilled_tokens"]
    rows[0]["x_lower_ttft_p50"] = rows[1]["ttft_p50"] / rows[0]["ttft_p50"]

    def plot(ax, rows):
        ax.bar([f"caching {'on' if r['prefix_caching'] else 'off'}" for r in rows],
               [r["ttft_p50"] for r in rows])
        ax.set_ylabel("TTFT p50 (s), 32 requests, 256-token shared prefix")

    save("serving-prefix", rows, plot, vars(args))


def _long_prompt_run(args, params, config, budget, chunk, mixed, rng):
    """16 requests decoding, a 1,000-token prompt arriving at their 5th step: the 16's time
    per output token, one value per step's output (time since its previous tokens over its
    new ones)."""
    engine = Engine(params, config, max_slots=args.max_slots, max_prefill_tokens=budget,
                    prefill_chunk_tokens=chunk, mixed_steps=mixed)
    for i in range(16):
        engine.add_request(str(i), rng.integers(0, config.vocab_size, 32).tolist(),
                           SamplingParams(temperature=0.0, max_new_tokens=args.out_max))
    while engine.stats()["prefilling"] or engine.stats()["waiting"]:
        engine.step()
    engine.step()  # every one of the 16 has an output time
    per_token, last, steps = [], {}, 0
    while engine.has_unfinished_requests():
        if steps == 4:
            engine.add_request("long", rng.integers(0, config.vocab_size, 1000).tolist(),
                               SamplingParams(temperature=0.0, max_new_tokens=8))
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id != "long" and o.new_token_ids and o.request_id in last:
                per_token.append((now - last[o.request_id]) / len(o.new_token_ids))
            last[o.request_id] = now
        steps += 1
    return per_token


def long_prompt(args, params, config):
    """Each setting (budget, chunk, mixed steps or turns) once untimed (it compiles), then
    --rounds timed runs taking turns between the settings; medians over the rounds."""
    rng = np.random.default_rng(args.seed)
    settings = list(dict.fromkeys([(64, 64, False), (128, 128, False), (1024, 1024, False),
                                   (args.max_prefill_tokens, args.prefill_chunk_tokens, False),
                                   (args.max_prefill_tokens, args.prefill_chunk_tokens, True),
                                   (64, 64, True)]))
    for setting in settings:
        _long_prompt_run(args, params, config, *setting, rng)
    runs = {setting: [] for setting in settings}
    for _ in range(args.rounds):
        for setting in settings:
            tick = time.perf_counter()
            per_token = _long_prompt_run(args, params, config, *setting, rng)
            p50, p99 = np.percentile(per_token, 50), np.percentile(per_token, 99)
            runs[setting].append((p50, p99, p99 / p50, time.perf_counter() - tick))
    rows = [{"max_prefill_tokens": b, "prefill_chunk_tokens": c, "mixed_steps": m,
             **{k: float(np.median([r[i] for r in results]))
                for i, k in enumerate(["tpot_p50", "tpot_p99", "p99_over_p50", "run_s"])}}
            for (b, c, m), results in runs.items()]

    def plot(ax, rows):
        ax.bar([f"budget {r['max_prefill_tokens']}, chunk {r['prefill_chunk_tokens']}"
                f"{', mixed' if r['mixed_steps'] else ''}" for r in rows],
               [r["p99_over_p50"] for r in rows])
        ax.set_ylabel("TPOT p99 / p50 of 16 decoding requests")

    save("serving-long-prompt", rows, plot, vars(args))


def decode_step(args, params, config):
    from speed import decode_step_seconds

    engine = Engine(params, config, max_slots=32)
    for i in range(32):
        engine.add_request(str(i), [1] * 64, SamplingParams(temperature=0.0, max_new_tokens=900))
    while engine.stats()["prefilling"] or engine.stats()["waiting"]:
        engine.step()
    for _ in range(2):  # compiled, and the cache warm
        engine.step()
    rows = []
    for _ in range(args.rounds):
        tick = time.perf_counter()
        for _ in range(4):
            engine.step()
        engine_step = (time.perf_counter() - tick) / (4 * 8)  # CHUNK decode steps per step
        live = int(np.asarray(engine.state.model.lengths).max())
        static = decode_step_seconds(params, config, 32, live + 64, live)
        rows.append({"live": live, "engine_ms": 1e3 * engine_step, "generate_ms": 1e3 * static,
                     "x_generate": engine_step / static})

    def plot(ax, rows):
        ax.plot([r["live"] for r in rows], [r["engine_ms"] for r in rows], "o-", label="Engine")
        ax.plot([r["live"] for r in rows], [r["generate_ms"] for r in rows], "o-",
                label="generate")
        ax.set_xlabel("live tokens per row")
        ax.set_ylabel("decode step, batch 32 (ms)")
        ax.legend()

    save("serving-decode-step", rows, plot, vars(args))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="gpt-jax bench serving", description=__doc__.split("\n")[0])
    p.add_argument("scenario", choices=["arrivals", "prefix", "long-prompt", "decode-step"])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--rounds", type=int, default=3,
                   help="arrivals, decode-step: timed rounds, engines in turn")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rates", type=float, nargs="+", default=[2.0, 8.0])
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=128)
    p.add_argument("--outputs", choices=["eos", "uniform"], default="eos",
                   help="output lengths: geometric (stopped at EOS) or uniform")
    p.add_argument("--out-mean", type=int, default=64, help="--outputs eos: mean length")
    p.add_argument("--out-min", type=int, default=8)
    p.add_argument("--out-max", type=int, default=256)
    p.add_argument("--max-slots", type=int, default=None,
                   help="engine slots and static batch size (default: 16 for arrivals, else 32)")
    p.add_argument("--max-prefill-tokens", type=int, default=128)
    p.add_argument("--prefill-chunk-tokens", type=int, default=64)
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.max_slots is None:
        args.max_slots = 16 if args.scenario == "arrivals" else 32
    config = preset(args.preset)
    params = init_params(config, jax.random.key(0))
    scenarios = {"prefix": prefix, "long-prompt": long_prompt, "decode-step": decode_step}
    if args.scenario in scenarios:
        return scenarios[args.scenario](args, params, config)
    static = ours_static(params, config)
    hf = None if args.no_hf else transformers_static(params, config)  # loaded once
    rows = []
    for rate in args.rates:
        requests = workload(args, config, rate, args.seed)
        runs = {"continuous (Engine)": lambda: run_continuous(params, config, args, requests),
                "continuous (Engine, turns)": lambda: run_continuous(params, config, args,
                                                                     requests, mixed=False),
                "static (generate)": lambda: (run_static(static, requests, args.max_slots), None)}
        without_compiles(runs["continuous (Engine)"])
        without_compiles(runs["continuous (Engine, turns)"])
        rounds = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                before = sum(compile_counts().values())
                times, peak = run()
                rounds[name].append({**figures(requests, times),
                                     "compiles": sum(compile_counts().values()) - before,
                                     **({} if peak is None else {"peak_pages": peak})})
        for name, results in rounds.items():
            rows.append({"engine": name, "rate": rate, "rounds": len(results),
                         **{k: float(np.median([r[k] for r in results])) for k in results[0]}})
        if hf:  # one round: it compiles nothing, and it is slow
            times = run_static(hf, requests, args.max_slots)
            rows.append({"engine": "static (transformers)", "rate": rate, "rounds": 1,
                         **figures(requests, times)})
        base = next(r for r in rows if r["rate"] == rate and r["engine"] == "static (generate)")
        for r in rows:
            if r["rate"] == rate:
                r["x_static_tok_per_s"] = r["tok_per_s"] / base["tok_per_s"]
                r["x_static_ttft_p50"] = r["ttft_p50"] / base["ttft_p50"]

    def plot(ax, rows):
        for name in dict.fromkeys(r["engine"] for r in rows):
            sel = [r for r in rows if r["engine"] == name]
            ax.plot([r["rate"] for r in sel], [r["tok_per_s"] for r in sel], "o-", label=name)
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("generated tokens/s")
        ax.legend()

    save("serving-arrivals", rows, plot, vars(args))


if __name__ == "__main__":
    main()
