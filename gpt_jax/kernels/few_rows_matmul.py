"""Float32 matmul of a few rows by output-major weights as a CPU kernel
(`few_rows_matmul.cc`, an XLA FFI custom call), used by `gpt_jax.layers.OutputMajor` on CPU
for the products of a forward traced within `rows_per_call(B)` (the decode step,
`inference.steps.run_decode`, one row per sequence; the verification of speculative drafts,
`inference.verify`, a few per sequence) where `use_kernel` says: a decode step at batch 1
whose weights are read from memory, and a verification's 2 to `MAX_ROWS` rows in all over
weights that stay in cache. Several weights that multiply the same input (a layer's q, k and
v, or gate and up) go in one call (`few_rows_matmuls`), whose threads share the channels of
all of them; the weights keep their `[O, I]` layout. Where `inference_params` lays the large
float32 block matrices out in panels (`gpt_jax.layers.PanelMajor`, on CPU), the panel kernel
runs those; this one then runs the output projection by the embedding table `[V, D]` and
the `OutputMajor` matrices left (a verification's small ones, `generate` on plain
`decode_layout` params).

Why: a product of so few rows is bound by reading its weights, or for weights in cache by
its calls. XLA:CPU (jax 0.10) emits a one-row product (a decode step's at batch 1) inline on
the calling thread, so a weight read from memory is read by one core of the machine: the
kernel spreads the channels of such weights over XLA's intra-op thread pool and the calling
thread, so every core reads weights (benchmarks/README.md, "Roofline"). XLA hands a product
of 2 to 8 rows to XNNPACK on its thread pool, several times the cost of the inline one for a
small model whose weights stay in cache (benchmarks/README.md, "Speculative decoding"): the
kernel reads each weight row once for all the rows, on the calling thread (a call whose
weights fit in cache). Where it is not used, XLA's product was as fast or faster as
measured (benchmarks/README.md, "The decode step on both cores"): a one-row product of
weights in cache (a small model's decode step), and 2 to 8 rows of weights read from memory
(a decode step at batch 2 to 8, a verification of the GPT-2 shape), where XNNPACK already
runs on the thread pool.

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
MAX_CACHED_FLOATS = 1 << 17  # weights this small (512 KB) stay in cache (see use_kernel)
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


def use_kernel(x_MI: jax.Array, ws_OI: list[jax.Array]) -> bool:
    """Whether the products of `x_MI` by each of `ws_OI` traced now call the kernel on CPU
    (as one call): within `rows_per_call`, float32 operands, the kernel `available()`, no
    `gpt_jax.kernels.portable()` context, and either one row in all with more than
    MAX_CACHED_FLOATS weights in all (read from memory: a decode step at batch 1), or 2 to
    MAX_ROWS rows in all with each weight at most MAX_CACHED_FLOATS (in cache: a small
    model's verification)."""
    rows = _SEQUENCES.get() * x_MI.shape[0]
    if rows == 1:
        fits = sum(w.size for w in ws_OI) > MAX_CACHED_FLOATS
    else:
        fits = 1 < rows <= MAX_ROWS and all(w.size <= MAX_CACHED_FLOATS for w in ws_OI)
    return (fits and x_MI.dtype == jnp.float32 and all(w.dtype == jnp.float32 for w in ws_OI)
            and not kernels.in_portable() and available())


def few_rows_matmul(x_MI: jax.Array, w_OI: jax.Array) -> jax.Array:
    """`x @ w^T` on CPU: float32 `[M, I]` by float32 `[O, I]` -> float32 `[M, O]`, each output
    summed in float32 (vector partial sums, then their total), so it equals XLA's product to
    float rounding. Call only when `use_kernel`. Under `jax.vmap` `x` gains the batch axis,
    the shared weight a leading axis of 1 (`vmap_method="expand_dims"`: never copied per
    row), and one call runs every row of the batch."""
    return few_rows_matmuls(x_MI, [w_OI])[0]


def few_rows_matmuls(x_MI: jax.Array, ws_OI: list[jax.Array]) -> list[jax.Array]:
    """`[few_rows_matmul(x_MI, w) for w in ws_OI]` in one kernel call, whose threads share
    the channels of all the weights: `[M, O_k]` per weight."""
    M = x_MI.shape[0]
    shapes = tuple(jax.ShapeDtypeStruct((M, w.shape[0]), jnp.float32) for w in ws_OI)
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="expand_dims")
    return list(call(x_MI, *ws_OI))
