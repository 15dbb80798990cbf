"""inference: prefill, decode, the generation loop, the serving engine, sampling and stopping."""

from gpt_jax.cache import PagedKVCache, cache_bytes, init_cache
from inference.engine import (Completion, Engine, RequestOutput, compile_counts, decode_step,
                              generate, prefill)
from inference.llm import LLM
from inference.naive import naive_generate
from inference.sampling import SamplingParams

__all__ = [
    "LLM", "Completion", "Engine", "PagedKVCache", "RequestOutput", "SamplingParams",
    "cache_bytes", "compile_counts", "decode_step", "generate", "init_cache", "naive_generate",
    "prefill",
]
