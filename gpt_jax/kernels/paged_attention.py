"""Decode attention over a paged KV cache as a CPU kernel (`paged_attention.cc`, an XLA FFI
custom call), used by `gpt_jax.attention.attend_paged` when the program runs on CPU.

Why: XLA:CPU computes one query's attention over the cache as batched matrix-vector dots
on ONE thread, at about half the memory bandwidth two cores reach, and reads whole pages
(benchmarks/README.md, "Decode attention on both cores"). The kernel spreads the
(row, kv head) pairs over XLA's intra-op thread pool and reads exactly each row's live
slots, page by page through the row's page table. On GPU and TPU the XLA path runs
(`jax.lax.platform_dependent`).

The kernel is built from source on first use, cached and registered by
`gpt_jax.kernels.builder` (shared with the other kernels); if it cannot be built, a warning
says why and the XLA path runs; `GPT_JAX_CPU_KERNEL=0` turns it off. Programs traced inside
`gpt_jax.kernels.portable()` never use it: a program that leaves this process (`jax.export`,
`inference.export`) cannot call a kernel registered here.

Shapes: the letters of `gpt_jax.model`, and G, query heads per kv head (`gpt_jax.attention`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from gpt_jax import kernels
from gpt_jax.kernels import builder

SOURCE = Path(__file__).with_name("paged_attention.cc")
TARGET = "gpt_jax_paged_decode_attention"


def library_path(command: list[str] | None = None) -> Path:
    """Where the built kernel lives (see `gpt_jax.kernels.builder.library_path`)."""
    return builder.library_path(SOURCE, command)


def build(timeout: float = builder.BUILD_TIMEOUT_S) -> Path:
    """Compile the kernel unless already built; its path (see `gpt_jax.kernels.builder.build`,
    which names the errors raised)."""
    return builder.build(SOURCE, timeout)


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (built on the first call).
    False, with a warning naming the cause, when it cannot be built; False without one when
    `GPT_JAX_CPU_KERNEL=0`."""
    return builder.register(SOURCE, {TARGET: "GptJaxPagedDecodeAttention"},
                            "CPU attention kernel", "XLA's attention")


def use_kernel() -> bool:
    """Whether a program traced now calls the kernel on CPU: it is `available()` and no
    `gpt_jax.kernels.portable()` context is active."""
    return not kernels.in_portable() and available()


def paged_decode_attention(q_KGH: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           page_table: jax.Array, length) -> tuple[jax.Array, jax.Array]:
    """Attention of G queries per kv head over slots [0, length) of one row's pages, on CPU.
    Call only when `available()`.

    Args:
      q_KGH: queries, `[K, G, H]` (any float dtype; computed in float32).
      k_pool, v_pool: `[num_pages, K, P, H]` page pools shared by all rows (`gpt_jax.cache`),
        float32 or bfloat16.
      page_table: int32 `[max_pages]`, the row's pages in order (a negative entry ends the row).
      length: int scalar, slots to attend; 0 gives zeros, past the row's pages all of them.
    Returns:
      `(out_KGH, lse_KG)`, float32: softmax(q k^T / sqrt(H)) v with a float32 softmax, and
      the log of its denominator (`gpt_jax.attention.MASK_VALUE` for a row with no slot).
    Under `jax.vmap` the row arguments gain the batch axis, the shared pools a leading axis
    of 1 (`vmap_method="expand_dims"`: never copied per row), and the kernel runs the whole
    batch in one call.
    """
    K, G, _ = q_KGH.shape
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(q_KGH.shape, jnp.float32),
                                     jax.ShapeDtypeStruct((K, G), jnp.float32)),
                            vmap_method="expand_dims")
    return call(q_KGH.astype(jnp.float32), jnp.asarray(length, jnp.int32),
                jnp.asarray(page_table, jnp.int32), k_pool, v_pool)
