"""Matmuls by weights in panels of sixteen output channels, `[ceil(O / 16), I, 16]`, as a CPU
kernel (`panel_matmul.cc`, an XLA FFI custom call; two targets): int8 weights with a float32
scale per channel (`gpt_jax.layers.Int8Weight`, through `gpt_jax.layers.int8_matmul`), and
float32 weights (`gpt_jax.layers.PanelMajor`, the CPU decode layout of
`gpt_jax.params.inference_params`), when the program runs on CPU.

Why int8: given `x @ (w_int8 * scale)`, XLA:CPU (jax 0.10) compiles a convert fusion that writes
the whole int8 matrix out as a float32 copy, then runs its float32 dot on that copy
(`wrapped_convert` feeding `dot` in the compiled HLO): a decode step, bound by reading the
weights, would read and write more bytes than float32 weights alone. The kernel reads the
int8 bytes once, widening them in registers (AVX2 + FMA where the CPU has them), over XLA's
intra-op thread pool. On GPU and TPU the XLA path runs (`jax.lax.platform_dependent`).

Why float32 panels: XLA:CPU's products of 2 to 16 rows by `[O, I]` weights (a decode step of
a few sequences, an engine's running slots) reach ~60% of the cores' multiply-add rate, and
the few-rows kernel's dot-product form over `[O, I]` rows less (its horizontal sums and
short rows). Over panels the kernel's outer-product form (each broadcast input times a
panel's 16 channels, no horizontal sums) runs those products faster at 2 to 16 rows and as
fast at 1 and 32 (benchmarks/README.md, "Float32 panels").

Built, cached and registered by `gpt_jax.kernels.builder` on first use; if it cannot be
built, a warning says why and the XLA path runs; `GPT_JAX_CPU_KERNEL=0` turns it off, and
programs traced inside `gpt_jax.kernels.portable()` never use it.

Shapes: a product's rows M, inputs I and outputs O, as in `gpt_jax.layers`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from gpt_jax import kernels
from gpt_jax.kernels import builder

SOURCE = Path(__file__).with_name("panel_matmul.cc")
TARGET = "gpt_jax_int8_matmul"
F32_TARGET = "gpt_jax_f32_panel_matmul"


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (built on the first call).
    False, with a warning naming the cause, when it cannot be built; False without one when
    `GPT_JAX_CPU_KERNEL=0`."""
    return builder.register(SOURCE, {TARGET: "GptJaxInt8Matmul", F32_TARGET: "GptJaxF32PanelMatmul"},
                            "CPU panel matmul kernel", "XLA's matmuls")


def use_kernel() -> bool:
    """Whether a program traced now calls the kernel on CPU: it is `available()` and no
    `gpt_jax.kernels.portable()` context is active."""
    return not kernels.in_portable() and available()


def int8_matmul(x_MI: jax.Array, values: jax.Array, scale_O: jax.Array) -> jax.Array:
    """`x @ w^T` for the int8 weight `w[o, i] = values[o // 16, i, o % 16] * scale[o]` on CPU:
    float32 `[M, I]` by int8 panels `[ceil(O / 16), I, 16]` (`gpt_jax.layers.Int8Weight`) with a
    float32 scale per output channel `[O]` -> float32 `[M, O]`. Call only when `available()`.

    Each output is `scale[o] * sum_i x[m, i] w[o, i]`, summed in float32 with fused
    multiply-adds, so it equals the XLA path to float rounding.
    Under `jax.vmap` `x` gains the batch axis, the shared weights a leading axis of 1
    (`vmap_method="expand_dims"`: never copied per row), and the kernel runs every row of
    the batch in one call. Batching over the weights themselves is not supported (the
    kernel fails with "must be shared by all rows").
    """
    return int8_matmuls(x_MI, [(values, scale_O)])[0]


def int8_matmuls(x_MI: jax.Array, weights) -> list[jax.Array]:
    """`int8_matmul` of one input by several weights (`[(values, scale_O), ...]`) in one
    kernel call, whose threads share the panels of all of them: `[M, O_k]` per weight.
    (A layer's q, k and v projections: 3 calls made 1, fewer waits for the slower thread.)
    """
    M = x_MI.shape[0]
    shapes = tuple(jax.ShapeDtypeStruct((M, scale.shape[0]), jnp.float32) for _, scale in weights)
    call = jax.ffi.ffi_call(TARGET, shapes, vmap_method="expand_dims")
    operands = [a for values, scale in weights for a in (values, scale.astype(jnp.float32))]
    return list(call(x_MI.astype(jnp.float32), *operands))


def f32_panel_matmuls(x_MI: jax.Array, panels: list[jax.Array]) -> list[jax.Array]:
    """`x @ w^T` for float32 weights `w[o, i] = panels[o // 16, i, o % 16]`, float32 `[M, I]`
    by each of `panels` `[O / 16, I, 16]` -> `[M, O]` per weight, in one kernel call whose
    threads share the panels of all of them (`gpt_jax.layers.PanelMajor`). Summed in float32
    with fused multiply-adds, so equal to XLA's product to float rounding. Call only when
    `available()`; vmapped as `int8_matmul`."""
    M = x_MI.shape[0]
    shapes = tuple(jax.ShapeDtypeStruct((M, p.shape[0] * 16), jnp.float32) for p in panels)
    call = jax.ffi.ffi_call(F32_TARGET, shapes, vmap_method="expand_dims")
    return list(call(x_MI, *panels))
