"""inference: prefill, decode, the generation loop, sampling and stopping."""

from gpt_jax.cache import KVCache, cache_bytes, init_cache
from inference.engine import Completion, compile_counts, decode_step, generate, prefill
from inference.llm import LLM
from inference.naive import naive_generate
from inference.sampling import SamplingParams

__all__ = [
    "LLM", "Completion", "KVCache", "SamplingParams", "cache_bytes", "compile_counts", "decode_step",
    "generate", "init_cache", "naive_generate", "prefill",
]
