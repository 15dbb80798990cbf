"""Native CPU kernels (XLA FFI custom calls), shipped as C++ sources and built on first use.

  paged_attention   decode attention over a paged KV cache (`paged_attention.cc`)
  causal_attention  the training path's causal attention, forward and backward
  panel_matmul      matmuls by weights in panels of 16 channels: int8 (`gpt_jax.layers.Int8Weight`)
                    and float32 (`gpt_jax.layers.PanelMajor`)
  few_rows_matmul   float32 products of a few rows (a batch-1 decode step, a verification)
  builder           compile, cache and register them (`common.h` is their shared header)

`gpt_jax.attention` and `gpt_jax.layers` call them through `dispatch` (the kernel on CPU,
XLA's path elsewhere). Besides `GPT_JAX_CPU_KERNEL=0`, every kernel obeys one switch:
programs traced inside `with portable():` call none (a program that leaves this process
cannot call a kernel registered in it).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_PORTABLE = contextvars.ContextVar("gpt_jax_portable", default=False)


@contextlib.contextmanager
def portable():
    """Within this context (this thread or task), programs traced take XLA's paths, which
    every platform and every process can run, instead of this process's CPU kernels
    (`in_portable()` is True; each kernel's `use_kernel()` says False).

    jit caches a traced program by its function and arguments, not by this switch: trace a
    fresh function inside it (as `inference.export` does), or an already traced one comes
    back with whichever path it was traced with."""
    token = _PORTABLE.set(True)
    try:
        yield
    finally:
        _PORTABLE.reset(token)


def in_portable() -> bool:
    """Whether a `portable()` context is active here."""
    return _PORTABLE.get()


def dispatch(use_kernel: bool, kernel, xla, *args):
    """`kernel(*args)` when the program runs on CPU and `use_kernel` (the caller's kernel is
    built, and fits these arguments, outside `portable()`), else `xla(*args)`: the one
    choice of backend. One traced program serves every platform
    (`jax.lax.platform_dependent`); with `use_kernel` False only XLA's path is traced."""
    if use_kernel:
        return jax.lax.platform_dependent(*args, cpu=kernel, default=xla)
    return xla(*args)
