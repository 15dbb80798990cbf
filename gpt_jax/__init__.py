"""gpt_jax: a pure-functional GPT-2 style model in JAX."""

from gpt_jax.cache import KVCache, cache_bytes, init_cache
from gpt_jax.config import GPTConfig
from gpt_jax.model import forward
from gpt_jax.params import init_params, param_count
from gpt_jax.tokenizer import CharTokenizer

__all__ = [
    "CharTokenizer", "GPTConfig", "KVCache", "cache_bytes", "forward", "init_cache",
    "init_params", "param_count",
]
