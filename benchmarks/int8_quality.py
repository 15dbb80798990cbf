"""int8 weights against float32: validation loss, logit error against its stated bound, and
greedy agreement, for a trained run and for GPT-2's shape.

Usage (also `gpt-jax bench int8_quality [flags]`; writes benchmarks/results/int8_quality.json):
  python benchmarks/int8_quality.py --run-dir runs/shakespeare-char
  python benchmarks/int8_quality.py --run-dir runs/shakespeare-char --no-gpt2

The run: its validation loss over the batches its training evaluated (the run's own split
and seed, so the float32 figure is the `val_loss` training reported), float32 and int8
(`gpt_jax.params.quantize`); the logit error (over the rms of the float32 logits, each
position's mean removed: a shift changes no probability), overall against the bound
`gpt_jax.params.quantization_error` derives (eps) and per position; and greedy continuations of
prompts from the validation split, float32 against int8: how many tokens agree before the
first difference. GPT-2's shape (124M, random weights, as in the speed benchmarks): the
logit error on random tokens and how often the top token agrees.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax import GPTConfig, checkpoint, forward, init_params
from gpt_jax.params import quantization_error, quantize
from inference import SamplingParams, generate

RESULTS = Path(__file__).resolve().parent / "results"


def logit_errors(logits, reference) -> dict:
    """Error of `logits` against `reference` `[..., V]` (each position's mean removed), over
    the rms of the reference logits: overall (the rms over all positions, the quantity
    `quantization_error` bounds) and per position (its mean, 99th percentile and largest;
    the largest single logit error over its position's rms), and top-1 agreement."""
    ref = np.asarray(reference, np.float64).reshape(-1, reference.shape[-1])
    err = np.asarray(logits, np.float64).reshape(ref.shape) - ref
    err -= err.mean(-1, keepdims=True)
    scale = np.sqrt(np.square(ref - ref.mean(-1, keepdims=True)).mean(-1))
    per_position = np.sqrt(np.square(err).mean(-1)) / scale
    return {"rms_error_over_rms": float(np.sqrt(np.square(err).mean() / np.square(scale).mean())),
            "position_rms_error_over_rms_mean": float(per_position.mean()),
            "position_rms_error_over_rms_p99": float(np.quantile(per_position, 0.99)),
            "position_rms_error_over_rms_max": float(per_position.max()),
            "max_error_over_position_rms": float((np.abs(err).max(-1) / scale).max()),
            "max_abs_error": float(np.abs(err).max()),
            "logits_rms": float(np.sqrt(np.square(scale).mean())),
            "top1_agreement": float((np.argmax(logits, -1).ravel() == np.argmax(ref, -1)).mean())}


def run_quality(run_dir: str, prompts: int, new_tokens: int) -> dict:
    from training import data
    from training.config import TrainConfig
    from training.run_dir import load_corpus

    config, params, tokenizer = checkpoint.load_params(run_dir)
    saved = json.loads((Path(run_dir) / "train_config.json").read_text())
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__})
    ids = np.asarray(tokenizer.encode(load_corpus(cfg)), np.int32)
    _, val = data.split(ids, cfg.val_fraction)
    block = cfg.block_size or config.max_seq_len
    quantized = quantize(params, "int8")
    losses = {"float32": [], "int8": []}
    logits_f32, logits_int8 = [], []
    for i in range(cfg.eval_batches):  # the batches training evaluated
        x, y = data.get_batch(val, cfg.batch_size, block, cfg.seed + 1, i)
        for name, p in (("float32", params), ("int8", quantized)):
            logits = np.asarray(forward(p, jnp.asarray(x), config), np.float64)
            logp = logits - logits.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            losses[name].append(float(-np.take_along_axis(logp, y[..., None], -1).mean()))
            (logits_f32 if name == "float32" else logits_int8).append(logits)
    starts = np.random.default_rng(0).integers(0, len(val) - block, prompts)
    prompt_len = block - new_tokens
    prompt_ids = [val[s:s + prompt_len].tolist() for s in starts]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    want = [o.tokens for o in generate(params, config, prompt_ids, greedy)]
    got = [o.tokens for o in generate(quantized, config, prompt_ids, greedy)]
    agree = [next((i for i, (a, b) in enumerate(zip(w, g)) if a != b), len(w))
             for w, g in zip(want, got)]
    gaps = []  # float32's top-2 logit gap where a sequence first differs
    for p, w, k in zip(prompt_ids, want, agree):
        if k < new_tokens:
            logits = np.asarray(forward(params, jnp.asarray([p + w[:k]]), config))[0, -1]
            top2 = np.sort(logits)[-2:]
            gaps.append(float(top2[1] - top2[0]))
    return {"run_dir": run_dir, "config": dataclasses.asdict(config),
            "val_batches": cfg.eval_batches,
            "val_positions": cfg.eval_batches * cfg.batch_size * block,
            "val_loss_float32": float(np.mean(losses["float32"])),
            "val_loss_int8": float(np.mean(losses["int8"])),
            **logit_errors(np.concatenate(logits_int8), np.concatenate(logits_f32)),
            "eps": quantization_error(params, quantized),
            "greedy_prompts": prompts, "greedy_new_tokens": new_tokens,
            "greedy_equal_sequences": sum(a == new_tokens for a in agree),
            "greedy_tokens_before_first_difference": agree,
            "greedy_float32_top2_gap_at_first_difference": gaps,
            "example": {"prompt": tokenizer.decode(prompt_ids[0]),
                        "float32": tokenizer.decode(want[0]), "int8": tokenizer.decode(got[0])}}


def gpt2_quality(sequences: int, length: int) -> dict:
    config = GPTConfig.preset("gpt2")
    params = init_params(config, jax.random.key(0))
    quantized = quantize(params, "int8")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size,
                                                           (sequences, length)))
    reference = np.asarray(forward(params, tokens, config), np.float64)
    logits = np.asarray(forward(quantized, tokens, config), np.float64)
    return {"preset": "gpt2", "weights": "random (init_params, key 0)", "positions":
            sequences * length, **logit_errors(logits, reference),
            "eps": quantization_error(params, quantized)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="gpt-jax bench int8_quality",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--run-dir", default="runs/shakespeare-char")
    parser.add_argument("--prompts", type=int, default=32, help="greedy prompts from val")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--no-gpt2", dest="gpt2", action="store_false")
    parser.add_argument("--tag", default="", help="suffix of the result file name (--tag=-x)")
    args = parser.parse_args(argv)
    record = {"benchmark": "int8_quality", "jax": jax.__version__,
              "run": run_quality(args.run_dir, args.prompts, args.new_tokens)}
    if args.gpt2:
        record["gpt2"] = gpt2_quality(2, 128)
    for name in ("run", "gpt2"):
        if name in record:
            shown = {k: v for k, v in record[name].items() if not isinstance(v, (dict, list))}
            print(name, json.dumps(shown, indent=1))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"int8_quality{args.tag}.json"
    path.write_text(json.dumps(record, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
