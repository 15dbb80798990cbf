"""Causal self-attention over whole sequences, forward and backward, as CPU kernels
(`cpu_causal_attention.cc`, XLA FFI custom calls): the training path's attention, used by
`gpt_jax.model.causal_self_attention` when the program runs on CPU.

Why: XLA:CPU runs causal attention as ~35 small ops per layer (forward and backward: the
score dots, mask selects, the softmax's reductions, transposes between them), each a pass
over every head's `[T, T]` scores, and computes the masked half too. The kernels take one
(row, kv head) at a time with its keys and values in cache, skip the masked half, and
recompute the probabilities in the backward from the forward's log-sum-exp (FlashAttention-2,
Dao 2023). On GPU and TPU the XLA path runs (`jax.lax.platform_dependent`).

Built, cached and registered by `gpt_jax.cpu_kernels` on first use; if it cannot be built, a
warning says why and XLA's path runs; `GPT_JAX_CPU_KERNEL=0` turns it off, as does
`cpu_kernels.portable()`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from gpt_jax import cpu_kernels

SOURCE = Path(__file__).with_name("cpu_causal_attention.cc")
FORWARD, BACKWARD = "gpt_jax_causal_attention_fwd", "gpt_jax_causal_attention_bwd"
HEAD_DIMS = (32, 64, 128)  # the head dims the kernels are compiled for


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered with XLA:CPU (built on the first call).
    False, with a warning naming the cause, when they cannot be built; False without one
    when `GPT_JAX_CPU_KERNEL=0`."""
    return cpu_kernels.register(
        SOURCE, {FORWARD: "GptJaxCausalAttentionForward",
                 BACKWARD: "GptJaxCausalAttentionBackward"},
        "CPU causal attention kernel", "XLA's attention")


def use_kernel(q_BTNH: jax.Array) -> bool:
    """Whether a program traced now computes the attention of these queries with the kernels
    on CPU: float32, a head dim in `HEAD_DIMS`, the kernels `available()` and no
    `cpu_kernels.portable()` context active."""
    return (q_BTNH.dtype == jnp.float32 and q_BTNH.shape[-1] in HEAD_DIMS
            and not cpu_kernels.in_portable() and available())


def _forward(q_BTNH, k_BTKH, v_BTKH):
    B, T, N, _ = q_BTNH.shape
    call = jax.ffi.ffi_call(FORWARD, (jax.ShapeDtypeStruct(q_BTNH.shape, jnp.float32),
                                      jax.ShapeDtypeStruct((B, N, T), jnp.float32)),
                            vmap_method="sequential")
    return call(q_BTNH, k_BTKH, v_BTKH)


@jax.custom_vjp
def causal_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(H)) v with the causal mask (query t sees keys 0..t), on CPU; call
    only when `use_kernel(q_BTNH)`.

    Args:
      q_BTNH: float32 queries `[B, T, N, H]`, H in `HEAD_DIMS`.
      k_BTKH, v_BTKH: float32 keys and values `[B, T, K, H]`, K dividing N (query head n
        reads kv head n // (N // K)).
    Returns:
      float32 `[B, T, N, H]`, equal to `gpt_jax.model.attend` with a causal mask to float
      rounding; differentiable (the backward is the second kernel). Under `jax.vmap` the
      kernels run once per mapped element.
    """
    return _forward(q_BTNH, k_BTKH, v_BTKH)[0]


def _causal_attention_fwd(q_BTNH, k_BTKH, v_BTKH):
    out_BTNH, lse_BNT = _forward(q_BTNH, k_BTKH, v_BTKH)
    return out_BTNH, (q_BTNH, k_BTKH, v_BTKH, out_BTNH, lse_BNT)


def _causal_attention_bwd(residuals, d_out_BTNH):
    q_BTNH, k_BTKH, v_BTKH, _, _ = residuals
    call = jax.ffi.ffi_call(BACKWARD, (jax.ShapeDtypeStruct(q_BTNH.shape, jnp.float32),
                                       jax.ShapeDtypeStruct(k_BTKH.shape, jnp.float32),
                                       jax.ShapeDtypeStruct(v_BTKH.shape, jnp.float32)),
                            vmap_method="sequential")
    return tuple(call(*residuals, d_out_BTNH.astype(jnp.float32)))


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)
