"""The GPT-2 model math, as pure functions of `(params, inputs, cache)`.

Architecture (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners";
layout of the released GPT-2 code): learned token and position embeddings, pre-LayerNorm
blocks of causal multi-head self-attention and a GELU (tanh approximation) MLP, a final
LayerNorm, and an output projection tied to the token embedding. Key/value heads may be
fewer than query heads (grouped-query attention, Ainslie et al. 2023).

Shape alphabet, used in einsum strings and variable suffixes everywhere in this project:
  B batch, T query length, S cache/key length, D d_model, N query heads, K kv heads,
  G query heads per kv head (N = K * G), H head dim, F MLP hidden width, V vocab, L layers.

One code path serves training and inference: `transformer` runs T new tokens of one sequence
against that sequence's KV cache, writing their keys and values at the row's current length.
`forward` runs a whole batch from an empty cache; `inference.engine` vmaps prefill and decode
over padded batches. Definitions go from leaves to root.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from gpt_jax import cache as kv
from gpt_jax.config import GPTConfig

# Masked scores get a large finite negative, never -inf: exp() gives 0 and no NaN appears.
MASK_VALUE = -1e30

Params = dict  # nested dict of arrays; layer weights are stacked along a leading L axis


def _lead(bias: jax.Array, x: jax.Array) -> jax.Array:
    """`bias` with leading unit axes added, to broadcast against `x` explicitly."""
    return bias.reshape((1,) * (x.ndim - bias.ndim) + bias.shape)


def layer_norm(p: Params, x_TD: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (Ba et al. 2016), computed in float32."""
    x32 = x_TD.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * _lead(p["scale"], y) + _lead(p["bias"], y)).astype(x_TD.dtype)


def mlp(p: Params, x_TD: jax.Array) -> jax.Array:
    """GPT-2 MLP: D -> F, GELU (tanh approximation), F -> D."""
    h_TF = x_TD @ p["w_in"]
    h_TF = jax.nn.gelu(h_TF + _lead(p["b_in"], h_TF), approximate=True)
    out_TD = h_TF @ p["w_out"]
    return out_TD + _lead(p["b_out"], out_TD)


def attend(q_TNH: jax.Array, k_SKH: jax.Array, v_SKH: jax.Array, mask_TS: jax.Array) -> jax.Array:
    """Scaled dot-product attention (Vaswani et al. 2017) with grouped kv heads.

    Args:
      q_TNH: queries. k_SKH, v_SKH: keys and values (K divides N).
      mask_TS: bool, True where query t may attend to key s.
    Returns:
      [T, N, H] in the dtype of `v_SKH`. Scores and softmax are float32; a query whose keys
      are all masked gets zeros, never NaN.
    """
    T, N, H = q_TNH.shape
    K = k_SKH.shape[1]
    q_TKGH = q_TNH.reshape(T, K, N // K, H)
    scores_KGTS = jnp.einsum(
        "TKGH,SKH->KGTS", q_TKGH, k_SKH, preferred_element_type=jnp.float32
    ) / math.sqrt(H)
    scores_KGTS = jnp.where(mask_TS[None, None], scores_KGTS, MASK_VALUE)
    probs_KGTS = jax.nn.softmax(scores_KGTS, axis=-1)
    probs_KGTS = jnp.where(mask_TS.any(-1)[None, None, :, None], probs_KGTS, 0.0)
    out_TKGH = jnp.einsum("KGTS,SKH->TKGH", probs_KGTS.astype(v_SKH.dtype), v_SKH)
    return out_TKGH.reshape(T, N, H)


def attention(
    p: Params, x_TD: jax.Array, k_SKH: jax.Array, v_SKH: jax.Array, start: jax.Array
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """Causal self-attention of T new tokens at positions start..start+T-1 of one sequence.

    Writes the new keys and values into slots [start, start + T) of the row's cache, then
    attends over the cache: slot s is visible to the token at position p iff s <= p, so
    unwritten slots and slots holding padding (always after the last real token) are never
    read. Returns `(out_TD, (k_SKH, v_SKH, ok))`, `ok` False if the write did not fit.
    """
    q_TNH = jnp.einsum("TD,DNH->TNH", x_TD, p["w_q"]) + p["b_q"][None]
    k_TKH = jnp.einsum("TD,DKH->TKH", x_TD, p["w_k"]) + p["b_k"][None]
    v_TKH = jnp.einsum("TD,DKH->TKH", x_TD, p["w_v"]) + p["b_v"][None]
    k_SKH, ok = kv.write(k_SKH, k_TKH, start)
    v_SKH, _ = kv.write(v_SKH, v_TKH, start)
    query_pos_T = start + jnp.arange(x_TD.shape[0])
    key_pos_S = jnp.arange(k_SKH.shape[0])
    mask_TS = key_pos_S[None, :] <= query_pos_T[:, None]
    out_TNH = attend(q_TNH, k_SKH, v_SKH, mask_TS).astype(x_TD.dtype)
    out_TD = jnp.einsum("TNH,NHD->TD", out_TNH, p["w_o"]) + p["b_o"][None]
    return out_TD, (k_SKH, v_SKH, ok)


def block(p: Params, x_TD, k_SKH, v_SKH, start, config: GPTConfig):
    """One pre-LayerNorm transformer block. Returns `(x_TD, (k_SKH, v_SKH, ok))`."""
    attn_TD, new_cache = attention(
        p["attn"], layer_norm(p["ln1"], x_TD, config.layer_norm_eps), k_SKH, v_SKH, start
    )
    x_TD = x_TD + attn_TD
    x_TD = x_TD + mlp(p["mlp"], layer_norm(p["ln2"], x_TD, config.layer_norm_eps))
    return x_TD, new_cache


def transformer(
    params: Params,
    tokens_T: jax.Array,
    cache: kv.KVCache,
    config: GPTConfig,
    n_valid: jax.Array | int | None = None,
) -> tuple[jax.Array, kv.KVCache]:
    """Run T new tokens of ONE sequence through all layers, against that row's cache.

    Args:
      tokens_T: int token ids; the first `n_valid` are real, the rest padding.
      cache: one row of a KVCache (k, v `[L, S, K, H]`, scalar `lengths`, `overflow`). The
        tokens take positions lengths..lengths+T-1 and are written to those slots.
      n_valid: real tokens among the T (default all); the row's length advances by this.
    Returns:
      `(x_TD, cache)`: final hidden states (before the last LayerNorm) and the updated row.
    """
    start = cache.lengths
    positions_T = start + jnp.arange(tokens_T.shape[0])
    x_TD = params["wte"][tokens_T] + params["wpe"][positions_T]

    def step(x_TD, layer):
        p, k_SKH, v_SKH = layer
        x_TD, (k_SKH, v_SKH, ok) = block(p, x_TD, k_SKH, v_SKH, start, config)
        return x_TD, (k_SKH, v_SKH, ok)

    x_TD, (k_LSKH, v_LSKH, ok_L) = jax.lax.scan(step, x_TD, (params["blocks"], cache.k, cache.v))
    n_valid = tokens_T.shape[0] if n_valid is None else n_valid
    ok = ok_L.all()
    new_cache = cache.replace(
        k=k_LSKH,
        v=v_LSKH,
        lengths=jnp.where(ok, start + n_valid, start).astype(jnp.int32),
        overflow=cache.overflow | ~ok,
    )
    return x_TD, new_cache


def lm_head(params: Params, x_TD: jax.Array, config: GPTConfig) -> jax.Array:
    """Final LayerNorm and the tied output projection. Returns float32 logits `[..., V]`."""
    h = layer_norm(params["ln_f"], x_TD, config.layer_norm_eps)
    return jnp.einsum("...D,VD->...V", h, params["wte"], preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames="config")
def forward(params: Params, tokens_BT: jax.Array, config: GPTConfig) -> jax.Array:
    """Full causal forward pass, no cache kept: the training path and the reference.

    Args:
      tokens_BT: int32 token ids, T <= config.max_seq_len.
    Returns:
      float32 logits `[B, T, V]`; logits[:, t] predict token t + 1.
    Raises:
      ValueError: T exceeds `config.max_seq_len` (positions would run off the table).
    """
    B, T = tokens_BT.shape
    if T > config.max_seq_len:
        raise ValueError(
            f"sequence length {T} exceeds config.max_seq_len={config.max_seq_len}"
        )
    cache = kv.init_cache(config, B, T, dtype=params["wte"].dtype)
    run_row = functools.partial(transformer, config=config)
    x_BTD, _ = jax.vmap(run_row, in_axes=(None, 0, kv.CACHE_BATCH_AXES))(params, tokens_BT, cache)
    return lm_head(params, x_BTD, config)
