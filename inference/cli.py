"""Generate text from a trained run.

Usage:
  python -m inference.cli --run-dir runs/shakespeare-char --prompt "Romeo.\n" --prompt "Ham.\n"
  gpt-jax generate --run-dir runs/shakespeare-char --prompt "Juliet.\n" --temperature 0.8

`\\n` in a prompt is a newline. With --report, also prints the prefill time, decode
tokens/s and the KV cache size of the batch.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax.cache import cache_bytes, init_cache
from inference.engine import pack, prefill, validate
from inference.llm import LLM
from inference.sampling import SamplingParams


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs/shakespeare-char", help="training run directory")
    p.add_argument("--prompt", action="append", help="text prompt (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--report", action="store_true", help="print timing and KV cache size")
    return p.parse_args(argv)


def report(llm: LLM, prompts: list[str], sampling: SamplingParams) -> None:
    """Time prefill alone and the whole generation (both compiled first), and print the
    KV cache size of the batch with its formula."""
    config = llm.config
    token_prompts, per_prompt = validate(config, [llm.tokenizer.encode(p) for p in prompts], sampling)
    batch = pack(config, token_prompts, per_prompt)
    B, S = batch.tokens_PT.shape[0], batch.capacity
    tokens, lengths = jnp.asarray(batch.tokens_PT), jnp.asarray(batch.lengths_P)

    def run_prefill():
        cache = init_cache(config, B, S, llm.cache_dtype)
        return jax.block_until_ready(prefill(llm.params, config, tokens, lengths, cache))

    run_prefill()
    tick = time.perf_counter()
    run_prefill()
    prefill_s = time.perf_counter() - tick
    llm.generate(prompts, sampling)  # compile
    tick = time.perf_counter()
    outputs = llm.generate(prompts, sampling)
    total_s = time.perf_counter() - tick
    new_tokens = sum(len(o.tokens) for o in outputs)
    itemsize = np.dtype(llm.cache_dtype).itemsize
    print(f"prefill: {prefill_s * 1e3:.1f} ms for {len(prompts)} prompts "
          f"(padded to {batch.tokens_PT.shape[1]} tokens)")
    print(f"decode: {new_tokens} tokens in {total_s - prefill_s:.2f} s = "
          f"{new_tokens / (total_s - prefill_s):,.0f} tokens/s (batch {len(prompts)})")
    print(f"KV cache: 2 x n_layers {config.n_layers} x batch {B} x seq_len {S} x n_heads "
          f"{config.kv_heads} x head_dim {config.head_dim} x {itemsize} bytes = "
          f"{cache_bytes(config, B, S, llm.cache_dtype):,} bytes")


def main(argv=None):
    args = parse_args(argv)
    prompts = [p.replace("\\n", "\n") for p in (args.prompt or ["\n"])]
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, max_new_tokens=args.max_new_tokens)
    llm = LLM.from_checkpoint(args.run_dir)
    for prompt, out in zip(prompts, llm.generate(prompts, sampling)):
        print("=" * 72)
        print(prompt + out.text)
    print("=" * 72)
    if args.report:
        report(llm, prompts, sampling)


if __name__ == "__main__":
    main()
