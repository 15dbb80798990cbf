"""The model's forward over new tokens with a dense past KV cache as explicit inputs and
outputs: the one function `gpt-jax export --format onnx` converts (`inference.onnx_export`).

It is the step a Hugging Face Optimum decoder export exposes, in Optimum's names and layout,
so ONNX Runtime, TensorRT and the tools written for those exports run it in a host loop
(`inference/onnx_runner.py`): prefill with an empty past, then one token at a time, each
call's `present` fed back as the next call's `past`.

  input_ids           int32 [B, T]         the new tokens
  attention_mask      int32 [B, P + T]     1 for a real token, 0 for padding, over the past
                                           and the new tokens
  position_ids        int32 [B, T]         each new token's position in its own sequence
  past_key_values.l.key / .value  float32 [B, K, P, H]   layer l's cached keys (rotated at
                                           their positions, with rotary embeddings) and values
  -> logits           float32 [B, T, V]
     present.l.key / .value       float32 [B, K, P + T, H]   the past with the new ones after

P is the past length (0 at prefill). The indices are int32 where Optimum has int64
(`inference.onnx_export.INDEX_DTYPE`). Query t sees key s iff `attention_mask[b, s]` and
s <= P + t; a query that sees no key (a padding query) gets zeros, never NaN. Token and
learned position ids are clamped to the table (an ONNX Gather refuses an id out of range).

The body is `gpt_jax.model`'s own (`block`, `embed_tokens`, `lm_head`, the q/k/v and output
projections) with `gpt_jax.attention.attend` as the attention: every op is a plain XLA op, no
kernel and no loop, which is what an ONNX converter can express. Params are the plain
(training) layout: `decode_layout`'s output-major products hold an optimization barrier and
choose their orientation by a static row count, which symbolic batch and length axes do not
have.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gpt_jax.attention import attend
from gpt_jax.config import GPTConfig
from gpt_jax.layers import norm
from gpt_jax.model import _merge_heads, _project_qkv, block, embed_tokens
from gpt_jax.params import Params, unstack_layers


def input_names(config: GPTConfig) -> list[str]:
    """The step's inputs in order (Optimum's names)."""
    past = [f"past_key_values.{layer}.{kind}" for layer in range(config.n_layers)
            for kind in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past]


def output_names(config: GPTConfig) -> list[str]:
    """The step's outputs in order (Optimum's names)."""
    present = [f"present.{layer}.{kind}" for layer in range(config.n_layers)
               for kind in ("key", "value")]
    return ["logits", *present]


def _attention(p: Params, h_BTD, config: GPTConfig, *, past_k, past_v, positions_BT, mask_BTS):
    """Attention of the T new tokens over the past and themselves. Returns
    `(out [B, T, D], (present_k, present_v) [B, K, P + T, H])`."""
    q_BTNH, k_BTKH, v_BTKH = _project_qkv(p, h_BTD, positions_BT, config, concatenate=False)
    # lax's concatenate: jax2onnx 0.17.1's jnp.concatenate gives a symbolic axis the first
    # operand's length (P), not the sum (P + T)
    k_BKSH = jax.lax.concatenate([past_k, jnp.swapaxes(k_BTKH, 1, 2)], dimension=2)
    v_BKSH = jax.lax.concatenate([past_v, jnp.swapaxes(v_BTKH, 1, 2)], dimension=2)
    out_BTNH = jax.vmap(attend)(q_BTNH, jnp.swapaxes(k_BKSH, 1, 2),
                                jnp.swapaxes(v_BKSH, 1, 2), mask_BTS)
    return _merge_heads(p, out_BTNH), (k_BKSH, v_BKSH)


def step(params: Params, config: GPTConfig, input_ids, attention_mask, position_ids, *past):
    """The forward over T new tokens of B sequences with a dense past (see the module
    docstring for the arguments, the masking and the outputs).

    Args:
      params: the plain (training) layout, stacked or not, float32.
      past: L pairs `past_k, past_v` `[B, K, P, H]`, layer by layer.
    Returns:
      `(logits [B, T, V], present_0_k, present_0_v, ...)`.
    """
    T = input_ids.shape[1]
    P = past[0].shape[2]
    ids_BT = jnp.clip(input_ids.astype(jnp.int32), 0, config.vocab_size - 1)
    positions_BT = position_ids.astype(jnp.int32)
    if config.positions == "learned":
        positions_BT = jnp.clip(positions_BT, 0, config.max_seq_len - 1)
    # key s is visible to query t iff it is real and not after it (the past comes first)
    # (iotas and expand_dims, not jnp.arange and [:, None]: jax2onnx gives an arange over a
    # symbolic length a shape of its own, and jax's indexing cannot take that either)
    causal_TS = (jax.lax.broadcasted_iota(jnp.int32, (T, P + T), 1)
                 <= P + jax.lax.broadcasted_iota(jnp.int32, (T, P + T), 0))
    mask_BTS = jnp.expand_dims(attention_mask.astype(bool), 1) & jnp.expand_dims(causal_TS, 0)
    x_BTD = embed_tokens(params, ids_BT, positions_BT, config)
    present = []
    for layer, p in enumerate(unstack_layers(params)["blocks"]):
        def attention_fn(p_attn, h_BTD, config, layer=layer):
            return _attention(p_attn, h_BTD, config, past_k=past[2 * layer],
                              past_v=past[2 * layer + 1], positions_BT=positions_BT,
                              mask_BTS=mask_BTS)
        x_BTD, (k_BKSH, v_BKSH) = block(p, x_BTD, attention_fn, config)
        present += [k_BKSH, v_BKSH]
    return (_logits(params, x_BTD, config), *present)


def _logits(params: Params, x_BTD, config: GPTConfig):
    """`gpt_jax.model.lm_head` as a plain product with the table's transpose: its
    `OutputMajor` product picks an orientation by the row count, which a symbolic B * T
    cannot answer; and as an einsum ONNX Runtime transposed the `[V, D]` table every call
    (91% of a step). Float32 `[B, T, V]`."""
    h_BTD = norm(params["ln_f"], x_BTD, config)
    table_VD = params["wte" if config.tie_embeddings else "lm_head"]
    return jnp.matmul(h_BTD, table_VD.T)
