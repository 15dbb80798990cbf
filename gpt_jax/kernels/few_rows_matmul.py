"""Float32 matmul of a few rows by an output-major weight as a CPU kernel
(`few_rows_matmul.cc`, an XLA FFI custom call), used by `gpt_jax.layers.OutputMajor.matmul`
on CPU for the products of a forward traced within `rows_per_call(B)` (verifying
speculative drafts: `inference.verify`) when a call's rows, B sequences times the rows of
each, are 2 to `MAX_ROWS` and the weight has at most `MAX_WEIGHT_FLOATS`.

Why: XLA:CPU (jax 0.10) emits a one-row product (a decode step's) inline, but hands a
product of a few rows to XNNPACK on its thread pool; for a small model, whose weights stay
in cache, that costs several times the inline product, so a verification of 5 positions
cost 4-8 decode steps (benchmarks/README.md, "Speculative decoding"). The kernel reads each
weight row once for up to 8 rows, on the calling thread. With more rows (a batch of
sequences), or weights read from memory (the GPT-2 shape), XNNPACK's product on the thread
pool was faster as measured (benchmarks/README.md, "Third pass: a few-rows kernel and a
cost-aware off-switch"), so the kernel is not used there.

Built, cached and registered by `gpt_jax.kernels.builder` on first use; if it cannot be
built, a warning says why and XLA's product runs; `GPT_JAX_CPU_KERNEL=0` turns it off, and
programs traced inside `gpt_jax.kernels.portable()` never use it.

Shapes: a product's rows M, inputs I and outputs O, as in `gpt_jax.layers`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from gpt_jax import kernels
from gpt_jax.kernels import builder

SOURCE = Path(__file__).with_name("few_rows_matmul.cc")
TARGET = "gpt_jax_few_rows_matmul"
MAX_ROWS = 8  # rows of a call (sequences times rows per sequence) the kernel is used for
MAX_WEIGHT_FLOATS = 1 << 17  # the largest weight it is used for (512 KB: stays in L2 cache)
_SEQUENCES = contextvars.ContextVar("gpt_jax_few_rows_sequences", default=0)


@contextlib.contextmanager
def rows_per_call(sequences: int):
    """Within this context, products traced per sequence (under a vmap over `sequences`
    rows) may use the kernel (`use_kernel`); outside it they never do."""
    token = _SEQUENCES.set(sequences)
    try:
        yield
    finally:
        _SEQUENCES.reset(token)


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (built on the first call).
    False, with a warning naming the cause, when it cannot be built; False without one when
    `GPT_JAX_CPU_KERNEL=0`."""
    return builder.register(SOURCE, {TARGET: "GptJaxFewRowsMatmul"},
                            "CPU few-rows matmul kernel", "XLA's matmul")


def use_kernel(x_MI: jax.Array, w_OI: jax.Array) -> bool:
    """Whether a product of `x_MI` by `w_OI` traced now calls the kernel on CPU: within
    `rows_per_call`, several float32 rows per sequence and at most MAX_ROWS in all, float32
    weights of at most MAX_WEIGHT_FLOATS, the kernel `available()`, no
    `gpt_jax.kernels.portable()` context."""
    sequences = _SEQUENCES.get()
    return (sequences > 0 and 1 < x_MI.shape[0] and x_MI.shape[0] * sequences <= MAX_ROWS
            and w_OI.size <= MAX_WEIGHT_FLOATS and x_MI.dtype == jnp.float32
            and w_OI.dtype == jnp.float32 and not kernels.in_portable() and available())


def few_rows_matmul(x_MI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """`x @ w^T` on CPU: float32 `[M, I]` by float32 `[O, I]` -> float32 `[M, O]`, each output
    summed in float32 (eight partial sums, then their total), so it equals XLA's product to
    float rounding. Call only when `use_kernel`. Under `jax.vmap` `x` gains the batch axis,
    the shared weight a leading axis of 1 (`vmap_method="expand_dims"`: never copied per
    row), and one call runs every row of the batch."""
    M, O = x_MI.shape[0], w_OI.shape[0]
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, O), jnp.float32),
                            vmap_method="expand_dims")
    return call(x_MI, w_OI)
