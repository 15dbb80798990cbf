"""inference: prefill, decode, the generation loop, the serving engine, sampling and stopping.

The public names load on first use (PEP 562), so that `import inference.scheduler` (the
host-side policy, tested without a model) does not import JAX.
"""

import importlib

_HOMES = {
    "PagedKVCache": "gpt_jax.cache", "cache_bytes": "gpt_jax.cache", "init_cache": "gpt_jax.cache",
    "Completion": "inference.generation", "generate": "inference.generation",
    "prefill": "inference.steps", "decode_step": "inference.steps",
    "Engine": "inference.engine", "compile_counts": "inference.engine",
    "RequestOutput": "inference.detokenize", "LLM": "inference.llm",
    "naive_generate": "inference.naive", "SamplingParams": "inference.sampling_params",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'inference' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
