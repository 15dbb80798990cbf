r"""Generate text from a trained run or a Hugging Face directory.

Usage:
  python -m inference.cli --run-dir runs/shakespeare-char --prompt "Romeo.\n" --prompt "Ham.\n"
  gpt-jax generate --run-dir runs/shakespeare-char --prompt "Juliet.\n" --temperature 0.8
  gpt-jax generate --hf-checkpoint DIR --prompt "Hello" --temperature 0
  gpt-jax generate --hf-checkpoint DIR --prompt-ids 464,2068 --prompt-ids 40
  gpt-jax generate --run-dir runs/big --speculative draft --draft-run-dir runs/small

Every SamplingParams field is a flag. Past the model's context each token is predicted from
the last max_seq_len tokens, as nanoGPT's sample.py does (--context-overflow crop, the
default; error refuses such a request). Text is printed as it streams (one completion after
another); --json instead prints one JSON list, a completion per prompt and sample, with
tokens, text, finish reason, what repeats it (seed, n, sample_index: `--seed SEED --n N`
gives the same samples, this one at sample_index) and (with --logprobs N) log-probabilities.

`\\n` in a prompt or stop string is a newline. With --report, also prints the prefill time,
decode tokens/s and the KV cache size of the batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax.cache import cache_bytes, pages_for
from inference import compile_cache
from inference.generation import generate, pack, validate
from inference.draft_engine import add_draft_args, read_draft
from inference.llm import LLM, with_stop_ids
from inference.load import add_model_args
from inference.sampling_flags import (DEFAULT_MAX_NEW_TOKENS, add_sampling_args, ids_arg,
                                      refusal, sampling_from_args)
from inference.sampling_params import SamplingParams
from inference.steps import init_cache_rows, prefill


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpt-jax generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompt", action="append", help="text prompt (repeatable)")
    p.add_argument("--prompt-ids", type=ids_arg, action="append", default=[], metavar="IDS",
                   help="token-id prompt, comma-separated (repeatable): prints the generated "
                        "ids, one comma-separated line per completion")
    add_sampling_args(p)
    add_draft_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of streamed text")
    p.add_argument("--report", action="store_true", help="print timing and KV cache size")
    compile_cache.add_flag(p)
    return p.parse_args(argv)


# The flag that sets each SamplingParams field (`sampling_from_args`): errors name the flag.
def print_stream(llm: LLM, prompts: list[str], sampling: SamplingParams, out=None) -> None:
    """Print completions (to `out`, default stdout) one after another, each as it streams;
    the text of a later completion is kept until the ones before it have finished."""
    out = out or sys.stdout
    total, rule = len(prompts) * sampling.n, "=" * 72 + "\n"
    unprinted: dict[int, str] = {}  # completion index -> text not yet printed
    finished: set[int] = set()
    current = 0
    out.write(rule + prompts[0])
    for delta in llm.stream(prompts, sampling):
        unprinted[delta.index] = unprinted.get(delta.index, "") + delta.text
        if delta.completion:
            finished.add(delta.index)
        while current < total:
            out.write(unprinted.pop(current, ""))
            if current not in finished:
                break
            current += 1
            out.write("\n" + (rule + prompts[current // sampling.n] if current < total else ""))
        out.flush()
    out.write(rule)


def completions_json(prompts: list[str], sampling: SamplingParams, outputs) -> str:
    """One JSON list: per completion its prompt, text, tokens, finish reason, what repeats it
    (`--seed SEED --n N` gives the prompt's N samples again, this one at `sample_index`: the
    samples share the seed, sample k drawing from it folded with k) and, when asked,
    log-probabilities (top alternatives keyed by token id)."""
    return json.dumps([
        {"prompt": prompts[i // sampling.n], "text": o.text, "tokens": o.tokens,
         "finish_reason": o.finish_reason, "seed": o.seed, "n": sampling.n,
         "sample_index": i % sampling.n, "logprobs": o.logprobs,
         "top_logprobs": o.top_logprobs}
        for i, o in enumerate(outputs)
    ], indent=1)


def report(llm: LLM, prompts: list[str], sampling: SamplingParams, file=None) -> None:
    """Time prefill alone and the whole generation of the batch again (both compiled first,
    no progress bars), and print the KV cache size of the batch with its formula (to `file`,
    default stdout)."""
    config = llm.config
    token_prompts, per_prompt = validate(config, [llm.tokenizer.encode(p) for p in prompts],
                                         sampling, tokenizer=llm.tokenizer)
    batch = pack(config, token_prompts, per_prompt)
    B, S = batch.prompt_tokens.shape[0], min(batch.capacity, config.max_seq_len)  # cache slots
    tokens, lengths = jnp.asarray(batch.prompt_tokens), jnp.asarray(batch.prompt_lengths)

    def run_prefill():
        cache = init_cache_rows(config, B, S, llm.cache_dtype)
        return jax.block_until_ready(prefill(llm.params, config, tokens, lengths, cache))

    print("timing: the same batch again, compiled first (texts not shown)", file=file)
    run_prefill()
    tick = time.perf_counter()
    run_prefill()
    prefill_s = time.perf_counter() - tick
    llm.generate(prompts, sampling, progress=False)  # compile
    tick = time.perf_counter()
    outputs = llm.generate(prompts, sampling, progress=False)
    total_s = time.perf_counter() - tick
    new_tokens = sum(len(o.tokens) for o in outputs)
    itemsize = np.dtype(llm.cache_dtype).itemsize
    print(f"prefill: {prefill_s * 1e3:.1f} ms for {len(prompts)} prompts "
          f"(padded to {batch.prompt_tokens.shape[1]} tokens)", file=file)
    print(f"decode: {new_tokens} tokens in {total_s - prefill_s:.2f} s = "
          f"{new_tokens / (total_s - prefill_s):,.0f} tokens/s (batch {len(prompts)})",
          file=file)
    page_size = init_cache_rows(config, 1, S, llm.cache_dtype).page_size
    num_pages = B * pages_for(S, page_size)
    print(f"KV cache: 2 x n_layers {config.n_layers} x pages {num_pages} (batch {B} x "
          f"{pages_for(S, page_size)} per row) x page_size {page_size} x n_kv_heads "
          f"{config.kv_heads} x head_dim {config.head_dim} x {itemsize} bytes = "
          f"{cache_bytes(config, num_pages, page_size, llm.cache_dtype):,} bytes", file=file)


def load_llm(args) -> LLM:
    """The --run-dir run (`LLM.from_checkpoint`) or the --hf-checkpoint directory
    (`LLM.from_pretrained`: its tokenizer and EOS ids) as an LLM, with the --draft-run-dir or
    --draft-hf-checkpoint draft model (`read_draft`; checked by `LLM`) if given.

    Raises:
      SystemExit: both --prompt and --prompt-ids; text prompts for a Hugging Face directory
        without a tokenizer.
    """
    if args.prompt and args.prompt_ids:
        raise SystemExit("gpt-jax generate: give --prompt or --prompt-ids, not both")
    draft = read_draft(args)
    if not args.hf_checkpoint:
        return LLM.from_checkpoint(args.run_dir, dtype=args.dtype, quantize=args.quantize,
                                   draft=draft)
    llm = LLM.from_pretrained(args.hf_checkpoint, dtype=args.dtype, quantize=args.quantize,
                              draft=draft)
    if llm.tokenizer is None and not args.prompt_ids:
        raise SystemExit(f"gpt-jax generate: {args.hf_checkpoint} has no tokenizer "
                         f"(tokenizer.json, or vocab.json + merges.txt); pass --prompt-ids")
    return llm


def print_token_ids(llm: LLM, prompts: list[tuple[int, ...]], sampling: SamplingParams) -> None:
    """Generate from token-id prompts; one comma-separated line of ids per completion.

    Raises:
      SystemExit: an invalid request (a token id outside the vocabulary, too long a prompt).
    """
    try:
        outputs = generate(llm.params, llm.config, [list(p) for p in prompts],
                           with_stop_ids(sampling, list(llm.eos_token_ids)), draft=llm.draft)
    except ValueError as error:
        raise refusal(error) from None
    for out in outputs:
        print(",".join(map(str, out.tokens)))


def main(argv=None):
    args = parse_args(argv)
    prompts = [p.replace("\\n", "\n") for p in (args.prompt or ["\n"])]
    if args.no_compile_cache:
        compile_cache.disable()  # the LLM's default is on
    try:
        sampling = sampling_from_args(args)  # every flag checked before loading
        llm = load_llm(args)
        encoded = [] if args.prompt_ids else [llm.tokenizer.encode(p) for p in prompts]
        if not all(encoded):  # --prompt "": [BOS] with a tokenizer that adds one, as vLLM
            raise SystemExit("gpt-jax generate: --prompt is empty and the model's tokenizer "
                             "adds no BOS; give a non-empty --prompt (the text the model "
                             "continues), or no --prompt to start from a newline")
        if args.max_new_tokens is None and args.context_overflow == "error":  # what fits
            longest = max(len(p) for p in args.prompt_ids or encoded)
            sampling = dataclasses.replace(sampling, max_new_tokens=max(  # >= 1: a full
                1, min(DEFAULT_MAX_NEW_TOKENS, llm.config.max_seq_len - longest)))  # prompt errs
        # Check every request before printing anything, so a bad one is a one-line error.
        if not args.prompt_ids:
            validate(llm.config, encoded, sampling, tokenizer=llm.tokenizer)
    except (ValueError, OSError, ImportError) as error:  # ImportError: a .bin without torch
        raise refusal(error) from None
    if args.prompt_ids:
        return print_token_ids(llm, args.prompt_ids, sampling)
    if args.json:
        print(completions_json(prompts, sampling, llm.generate(prompts, sampling)))
    else:
        print_stream(llm, prompts, sampling)
    if args.report:  # after --json, on stderr: stdout stays one JSON document
        report(llm, prompts, sampling, file=sys.stderr if args.json else None)


if __name__ == "__main__":
    main()
