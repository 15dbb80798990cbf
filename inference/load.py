"""Loading a model for any command (`gpt-jax generate`, `serve`, `export`): the flags that
say where it comes from and how it runs, and the loaders that read them."""

from __future__ import annotations

import argparse

from gpt_jax import checkpoint
from gpt_jax.config import GPTConfig
from gpt_jax.params import QUANTIZE
from inference.llm import DTYPES


def add_model_args(p: argparse.ArgumentParser, quantize: bool = True) -> None:
    """--run-dir or --hf-checkpoint (one of them: argparse refuses both), --dtype and (when
    `quantize`) --quantize: where the model comes from (`load_model`) and how it runs."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--run-dir", default="runs/shakespeare-char",
                        help="training run directory (default: %(default)s)")
    source.add_argument("--hf-checkpoint", metavar="DIR",
                        help="a Hugging Face directory (config.json + model.safetensors) of "
                             "GPT-2, Llama, Qwen2, Qwen3 or Mistral instead of --run-dir; text "
                             "goes through its tokenizer (tokenizer.json, or vocab.json + "
                             "merges.txt)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="weights and KV cache dtype (bfloat16 halves the bytes read per step)")
    if quantize:
        p.add_argument("--quantize", choices=QUANTIZE, default=None,
                       help="int8: weight-only int8, a float32 scale per output channel, "
                            "quantized at load (a quarter of float32's weight bytes per step; "
                            "activations float32; --dtype is then the KV cache's)")


def load_model(args):
    """`(params, config, tokenizer, eos_token_ids)` of the --hf-checkpoint directory (its
    tokenizer may be None; every EOS id of config.json and generation_config.json), else of
    the --run-dir run (no EOS ids).

    Raises:
      FileNotFoundError, ValueError: as `gpt_jax.checkpoint.load_params` and
        `gpt_jax.hf.load_hf` do.
    """
    if not args.hf_checkpoint:
        config, params, tokenizer = checkpoint.load_params(args.run_dir)
        return params, config, tokenizer, ()
    from gpt_jax.hf import load_hf, load_hf_eos_token_ids, load_hf_tokenizer

    config, params = load_hf(args.hf_checkpoint)
    return (params, config, load_hf_tokenizer(args.hf_checkpoint),
            load_hf_eos_token_ids(args.hf_checkpoint))


def load_config(args) -> GPTConfig:
    """The GPTConfig of `load_model`'s model, without reading the weights (to check flags
    against it first). Raises FileNotFoundError, ValueError naming the directory."""
    if not args.hf_checkpoint:
        return checkpoint.load_config(args.run_dir)
    from gpt_jax.hf import load_hf_config

    return load_hf_config(args.hf_checkpoint)
