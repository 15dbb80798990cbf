"""Causal self-attention over whole sequences, forward and backward, as CPU kernels
(`causal_attention.cc`, XLA FFI custom calls): the training path's attention, used by
`gpt_jax.attention.attend_causal` when the program runs on CPU.

Why: XLA:CPU runs causal attention as ~35 small ops per layer (forward and backward: the
score dots, mask selects, the softmax's reductions, transposes between them), each a pass
over every head's `[T, T]` scores, and computes the masked half too. The kernels take one
(row, kv head) at a time with its keys and values in cache, skip the masked half, and
recompute the probabilities in the backward from the forward's log-sum-exp (FlashAttention-2,
Dao 2023). On GPU and TPU the XLA path runs (`jax.lax.platform_dependent`).

Built, cached and registered by `gpt_jax.kernels.builder` on first use; if they cannot be
built, a warning says why and XLA's path runs; `GPT_JAX_CPU_KERNEL=0` turns them off, as does
`gpt_jax.kernels.portable()`.

Shapes: the letters of `gpt_jax.model`, and G, query heads per kv head (`gpt_jax.attention`).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp

from gpt_jax import kernels
from gpt_jax.kernels import builder

SOURCE = Path(__file__).with_name("causal_attention.cc")
FORWARD, BACKWARD = "gpt_jax_causal_attention_fwd", "gpt_jax_causal_attention_bwd"
HEAD_DIMS = (32, 64, 128)  # the head dims the kernels are compiled for


@functools.cache
def available() -> bool:
    """Whether the kernels are built and registered with XLA:CPU (built on the first call).
    False, with a warning naming the cause, when they cannot be built; False without one
    when `GPT_JAX_CPU_KERNEL=0`."""
    return builder.register(
        SOURCE, {FORWARD: "GptJaxCausalAttentionForward",
                 BACKWARD: "GptJaxCausalAttentionBackward"},
        "CPU causal attention kernel", "XLA's attention")


def use_kernel(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> bool:
    """Whether a program traced now computes this attention with the kernels on CPU: q, k
    and v float32, a head dim in `HEAD_DIMS`, the kernels `available()` and no
    `gpt_jax.kernels.portable()` context active."""
    return (all(x.dtype == jnp.float32 for x in (q_BTNH, k_BTKH, v_BTKH))
            and q_BTNH.shape[-1] in HEAD_DIMS and not kernels.in_portable()
            and available())


def _check_shapes(q_BTNH, k_BTKH, v_BTKH) -> None:
    """Raises ValueError unless q is `[B, T, N, H]` and k, v are `[B, T, K, H]` with K
    dividing N and H in `HEAD_DIMS`, naming the shapes."""
    q, k, v = q_BTNH.shape, k_BTKH.shape, v_BTKH.shape
    if not (len(q) == len(k) == 4 and k == v and (k[0], k[1], k[3]) == (q[0], q[1], q[3])
            and k[2] >= 1 and q[2] % k[2] == 0 and q[3] in HEAD_DIMS):
        raise ValueError(f"causal attention kernel: q {q}, k {k}, v {v}; q must be [B, T, N, "
                         f"H] and k, v [B, T, K, H] with K dividing N, H in {HEAD_DIMS}")


def _xla_forward(q_BTNH, k_BTKH, v_BTKH):
    """The kernels' forward in XLA ops, `(out_BTNH, lse_BNT)`: the rule by which they are
    differentiated past the first order."""
    B, T, N, H = q_BTNH.shape
    K = k_BTKH.shape[2]
    q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
    scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BTKH) / math.sqrt(H)
    scores_BKGTS = jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores_BKGTS, -1e30)
    lse_BKGT = jax.nn.logsumexp(scores_BKGTS, axis=-1)
    probs_BKGTS = jnp.exp(scores_BKGTS - lse_BKGT[..., None])
    out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BTKH)
    return out_BTKGH.reshape(B, T, N, H), lse_BKGT.reshape(B, N, T)


@jax.custom_jvp
def _forward(q_BTNH, k_BTKH, v_BTKH):
    """`(out_BTNH, lse_BNT)` from the forward kernel."""
    _check_shapes(q_BTNH, k_BTKH, v_BTKH)
    B, T, N, _ = q_BTNH.shape
    call = jax.ffi.ffi_call(FORWARD, (jax.ShapeDtypeStruct(q_BTNH.shape, jnp.float32),
                                      jax.ShapeDtypeStruct((B, N, T), jnp.float32)),
                            vmap_method="sequential")
    return tuple(call(q_BTNH, k_BTKH, v_BTKH))


@_forward.defjvp
def _forward_jvp(primals, tangents):
    return _forward(*primals), jax.jvp(_xla_forward, primals, tangents)[1]


def _xla_backward(q_BTNH, k_BTKH, v_BTKH, d_out_BTNH):
    _, vjp = jax.vjp(lambda *qkv: _xla_forward(*qkv)[0], q_BTNH, k_BTKH, v_BTKH)
    return vjp(d_out_BTNH)


@jax.custom_jvp
def _backward(q_BTNH, k_BTKH, v_BTKH, lse_BNT, d_out_BTNH):
    """`(d_q, d_k, d_v)` from the backward kernel."""
    call = jax.ffi.ffi_call(BACKWARD, (jax.ShapeDtypeStruct(q_BTNH.shape, jnp.float32),
                                       jax.ShapeDtypeStruct(k_BTKH.shape, jnp.float32),
                                       jax.ShapeDtypeStruct(v_BTKH.shape, jnp.float32)),
                            vmap_method="sequential")
    return tuple(call(q_BTNH, k_BTKH, v_BTKH, lse_BNT, d_out_BTNH))


@_backward.defjvp
def _backward_jvp(primals, tangents):
    # lse is a function of q and k: differentiated through those alone.
    q, k, v, _, d_out = primals
    tq, tk, tv, _, td = tangents
    return _backward(*primals), jax.jvp(_xla_backward, (q, k, v, d_out), (tq, tk, tv, td))[1]


@jax.custom_vjp
def causal_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(H)) v with the causal mask (query t sees keys 0..t), on CPU; call
    only when `use_kernel(q_BTNH, k_BTKH, v_BTKH)`.

    Args:
      q_BTNH: float32 queries `[B, T, N, H]`, H in `HEAD_DIMS`.
      k_BTKH, v_BTKH: float32 keys and values `[B, T, K, H]`, K dividing N (query head n
        reads kv head n // (N // K)).
    Returns:
      float32 `[B, T, N, H]`, equal to `gpt_jax.attention.attend` with a causal mask to float
      rounding. The gradient is the backward kernel; past the first order (a Hessian-vector
      product) the kernels are differentiated as the same attention in XLA ops, when the
      attention is traced directly or in unrolled layers (as the training loss runs them).
      Inside a `lax.scan` that carries its input (`gpt_jax.model.forward` over stacked
      layers), JAX inlines those rules when it first differentiates the scan and then
      refuses the second derivative ("The FFI call ... cannot be differentiated"): take it
      over `gpt_jax.params.unstack_layers(params)` or with `GPT_JAX_CPU_KERNEL=0`. Under
      `jax.vmap` the kernels run once per mapped element.
    Raises:
      ValueError: shapes other than the above (when traced).
    """
    return _forward(q_BTNH, k_BTKH, v_BTKH)[0]


def _causal_attention_fwd(q_BTNH, k_BTKH, v_BTKH):
    out_BTNH, lse_BNT = _forward(q_BTNH, k_BTKH, v_BTKH)
    return out_BTNH, (q_BTNH, k_BTKH, v_BTKH, lse_BNT)


def _causal_attention_bwd(residuals, d_out_BTNH):
    return _backward(*residuals, d_out_BTNH.astype(jnp.float32))


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)
