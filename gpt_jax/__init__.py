"""gpt_jax: a pure-functional decoder-only transformer in JAX (GPT-2 and the Llama family)."""

from gpt_jax.cache import PagedKVCache, cache_bytes, init_cache
from gpt_jax.config import GPTConfig
from gpt_jax.hf import load_hf, load_hf_gpt2, save_hf, save_hf_gpt2
from gpt_jax.model import forward
from gpt_jax.params import init_params, param_count
from gpt_jax.tokenizer import BPETokenizer, CharTokenizer

__all__ = [
    "BPETokenizer", "CharTokenizer", "GPTConfig", "PagedKVCache", "cache_bytes", "forward", "init_cache",
    "init_params", "load_hf", "load_hf_gpt2", "param_count", "save_hf", "save_hf_gpt2",
]
