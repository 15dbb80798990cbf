"""What leaving JAX for ONNX Runtime costs or gains: decode tokens/s of the `gpt-jax export
--format onnx` graph run by `inference/onnx_runner.py` in ONNX Runtime (CPU execution
provider, --threads intra-op threads) against `inference.generate`, same greedy requests,
same process, in turns; and the export's time and file size.

Usage (also `gpt-jax bench onnx_cost [flags]`; writes benchmarks/results/onnx_cost.json and
.png):
  python benchmarks/onnx_cost.py                        # gpt2 shape, batch 1 and 8
  python benchmarks/onnx_cost.py --preset tiny --batches 1 --rounds 1 --new-tokens 16

(Named onnx_cost, not onnx: run as a file, this folder comes first on sys.path, and a
benchmarks/onnx.py would be imported in place of the `onnx` package.)

Random weights (GPT-2's initialization), float32, greedy, no EOS: every row generates
--new-tokens tokens after a --prompt-len-token prompt. Each configuration runs
  onnxruntime   `onnx_runner.generate` on the exported graph: a prefill call, then one call
                per token with the dense KV cache fed back (the host loop in numpy);
  generate      `inference.generate` (the CPU attention kernel, decode-layout weights);
both compiled or loaded first, then timed over --rounds rounds in turn. Decode tokens/s is
batch * (new_tokens - 1) over the time after the first token: the runner times its prefill
call itself; for `generate` it is a 1-token call's time, measured in the same round. Each
figure is the median of its rounds. The two engines' tokens are compared (greedy: equal up
to a near-tie's float rounding; the first step where they part, if any, is reported).
Whole-call tokens/s (prefill included, batch * new_tokens over the call) are given beside.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from gpt_jax import GPTConfig, init_params
from gpt_jax.params import decode_layout
from inference import SamplingParams, generate, onnx_export, onnx_runner

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a file or by `gpt-jax bench`
from export_cost import _first_difference  # noqa: E402
from speed import interleaved, save  # noqa: E402


def export(config: GPTConfig, params, folder: Path) -> tuple[Path, dict]:
    """Export and write the graph and its JSON; returns the path and the export's figures."""
    tick = time.perf_counter()
    model = onnx_export.export_onnx(params, config)
    out = folder / "model.onnx"
    onnx_export.write_onnx(model, out, config, eos_token_ids=(), source="random",
                           tokenizer_note=lambda out: None)
    export_s = time.perf_counter() - tick
    size = sum(p.stat().st_size for p in folder.glob("model.onnx*") if p.suffix != ".json")
    return out, {"export_s": export_s, "file_mb": size / 1e6}


def measure(config, layout, model: Path, batch: int, prompt_len: int,
            new_tokens: int, rounds: int, threads: int) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, prompt_len).tolist() for _ in range(batch)]
    session, description = onnx_runner.load(model, threads)
    outputs, whole = {}, {"onnxruntime": [], "generate": []}  # whole: seconds per call

    def run_onnx():
        tokens, timings = onnx_runner.generate(session, description, prompts, new_tokens)
        outputs["onnxruntime"] = tokens
        whole["onnxruntime"].append(timings["prefill_s"] + timings["decode_s"])
        return timings["decode_s"]

    def run_generate():
        tick = time.perf_counter()
        generate(layout, config, prompts, SamplingParams(temperature=0.0, max_new_tokens=1))
        first_s = time.perf_counter() - tick
        tick = time.perf_counter()
        out = generate(layout, config, prompts,
                       SamplingParams(temperature=0.0, max_new_tokens=new_tokens))
        outputs["generate"] = [o.tokens for o in out]
        whole["generate"].append(time.perf_counter() - tick)
        return whole["generate"][-1] - first_s

    runs = {"onnxruntime": run_onnx, "generate": run_generate}
    for run in runs.values():  # compile / warm up
        run()
    for seconds in whole.values():  # the warm-up calls are not figures
        seconds.clear()
    times = interleaved(runs, rounds)
    decode = {name: batch * (new_tokens - 1) / statistics.median(t)
              for name, t in times.items()}
    call = {name: batch * new_tokens / statistics.median(t) for name, t in whole.items()}
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
            "onnx_decode_tok_s": decode["onnxruntime"],
            "generate_decode_tok_s": decode["generate"],
            "onnx_vs_generate": decode["onnxruntime"] / decode["generate"],
            "onnx_call_tok_s": call["onnxruntime"], "generate_call_tok_s": call["generate"],
            "same_tokens": outputs["onnxruntime"] == outputs["generate"],
            "first_difference": _first_difference(outputs["onnxruntime"],
                                                  outputs["generate"]),
            "ort_threads": threads}


def plot(ax, rows):
    """Decode tokens/s of both engines per batch, as bars."""
    x = np.arange(len(rows))
    for i, (key, label) in enumerate([("onnx_decode_tok_s", "ONNX Runtime + runner"),
                                      ("generate_decode_tok_s", "gpt-jax generate")]):
        ax.bar(x + (i - 0.5) * 0.4, [r[key] for r in rows], 0.4, label=label)
    ax.set_xticks(x, [f"{r['preset']}\nbatch {r['batch']}" for r in rows])
    ax.set_ylabel("decode tokens/s")
    ax.legend()


def main(argv=None):
    p = argparse.ArgumentParser(prog="gpt-jax bench onnx_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="ONNX Runtime intra-op threads")
    args = p.parse_args(argv)
    if importlib.util.find_spec("jax2onnx") is None:
        raise SystemExit("gpt-jax bench onnx_cost: needs jax2onnx (README, \"Export to ONNX\")")

    config = GPTConfig.preset(args.preset)
    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    layout = jax.jit(decode_layout)(params)  # as LLM and Engine hold them
    with tempfile.TemporaryDirectory() as folder:
        model, cost = export(config, params, Path(folder))
        print(f"export: {cost['export_s']:.1f} s, {cost['file_mb']:.1f} MB", flush=True)
        rows = []
        for batch in args.batches:
            rows.append({"preset": args.preset, **measure(
                config, layout, model, batch, args.prompt_len, args.new_tokens,
                args.rounds, args.threads), **cost})
            print(rows[-1], flush=True)
    save("onnx_cost", rows, plot, {"rounds": args.rounds, "platform": jax.default_backend()})


if __name__ == "__main__":
    main()
