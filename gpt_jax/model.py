"""The model: ONE transformer block body and the forward passes built from it, as pure
functions of `(params, inputs, cache)`.

Architecture: a pre-norm decoder. GPT-2 (Radford et al. 2019, "Language Models are
Unsupervised Multitask Learners"; layout of the released GPT-2 code): learned token and
position embeddings, blocks of causal multi-head self-attention and a GELU (tanh
approximation) MLP, a final LayerNorm, and an output projection tied to the token
embedding. The Llama family (Touvron et al. 2023; Qwen2/3, Mistral, SmolLM) differs only in
values of `GPTConfig` that the same body reads: RMSNorm, rotary positions applied to the
queries and keys (so the cache stores rotated keys and attention never sees positions),
gated SiLU MLP, biases present or not, per-head q/k RMSNorm (Qwen3), untied output. Key/value
heads may be fewer than query heads (grouped-query attention, Ainslie et al. 2023).

Shape alphabet, used in einsum strings and variable suffixes everywhere in this project:
  B batch, T query length, S cache/key length, D d_model, N query heads, K kv heads,
  H head dim, V vocab, L layers, P page size.
A few letters belong to the files that use them, declared there, each with this one
meaning: `gpt_jax.layers` a matrix product's rows M, inputs I, outputs O, the MLP width F;
`gpt_jax.attention` G query heads per kv head, Q queries of one kv head; `inference.steps`
and `batching` R the rows a call runs among the slots; `inference.decode` W a row's window
of its last tokens; `inference.naive` C the context (max_seq_len); `inference.stopping` E a
row's EOS ids; `training.step` A micro-batches. Other axes are named in words (`max_pages`,
`num_pages`, `n_blocks`, `n_steps`, prompts).

The layers are `gpt_jax.layers`, the attention cores `gpt_jax.attention`; this file chooses
the attention of each forward and runs `block` with it:
  `transformer`   T new tokens of ONE sequence against that sequence's pages of the paged KV
                  cache (`gpt_jax.cache.PagedKVCache`, read only), returning their keys and
                  values for the caller to store (`gpt_jax.cache.write`); `inference` vmaps
                  it as prefill (T tokens) and as the decode step (T = 1) over padded batches;
  `forward`       whole sequences with no cache and causal attention: the training path, and
                  the reference the cached path is tested against;
  `forward_last`  `forward` at the last position only (the crop window's next token).
Every function takes any parameter layout of `gpt_jax.params` (stacked for training,
`decode_layout`, quantized). Definitions go from leaves to root.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt_jax import cache as kv
from gpt_jax.attention import attend, attend_causal, attend_paged
from gpt_jax.config import GPTConfig
from gpt_jax.layers import as_weight, embed, linear, mlp, norm, rms_norm, rope
from gpt_jax.params import Params, unstack_layers


def _project_heads(x_TD: jax.Array, w_DNH, b_NH: jax.Array | None, n_heads: int) -> jax.Array:
    """`x @ w + b` as one `[..., D] @ [D, N*H]` matmul, reshaped to `n_heads` heads."""
    out = linear(x_TD, w_DNH, None if b_NH is None else b_NH.reshape(-1))
    return out.reshape(*x_TD.shape[:-1], n_heads, -1)


def _position_heads(p: Params, x, positions_T, config: GPTConfig, name: str):
    """Query or key heads `x` `[..., T, heads, H]` (`name` "q" or "k") made position-aware
    as the config says: per-head RMSNorm (`qk_norm`, Qwen3), then rotary embeddings at
    absolute `positions_T` (`positions` "rope"); learned positions leave them as they are."""
    if config.qk_norm:
        x = rms_norm(p[f"{name}_norm"], x, config.layer_norm_eps)
    return rope(x, positions_T, config) if config.positions == "rope" else x


def _project_qkv(p: Params, x_TD: jax.Array, positions_T, config: GPTConfig, concatenate: bool):
    """`(q [..., N, H], k [..., K, H], v [..., K, H])` of `x_TD` at `positions_T`, as the
    weights' layout runs three products of one input (`gpt_jax.layers.Weight.linears`;
    `concatenate` for the training path, where the rows dwarf the weights); q and k
    position-aware (`_position_heads`)."""
    names = ("q", "k", "v")
    ws = [as_weight(p[f"w_{n}"]) for n in names]
    bs = [p.get(f"b_{n}") for n in names]
    x_MI = x_TD.reshape(-1, x_TD.shape[-1])
    outs = type(ws[0]).linears(x_MI, ws, [None if b is None else b.reshape(-1) for b in bs],
                               concatenate)
    heads = (config.n_heads, config.kv_heads, config.kv_heads)
    q, k, v = (out.reshape(*x_TD.shape[:-1], n, -1) for out, n in zip(outs, heads))
    return (_position_heads(p, q, positions_T, config, "q"),
            _position_heads(p, k, positions_T, config, "k"), v)


def _merge_heads(p: Params, out_TNH: jax.Array) -> jax.Array:
    """The output projection: `[..., N, H]` -> `[..., D]` as one [N*H, D] matmul (so XLA never
    transposes w_o to match the output)."""
    N, H = out_TNH.shape[-2:]
    return linear(out_TNH.reshape(*out_TNH.shape[:-2], N * H), as_weight(p["w_o"], in_axes=2),
                  p.get("b_o"))


def _paged_attention(p: Params, h_TD: jax.Array, config: GPTConfig, k_pool, v_pool, page_table,
                     length, bound):
    """Causal self-attention of T new tokens at positions length..length+T-1 of one sequence,
    against its cached slots in the layer's pools (read only, see `attend_paged`). Three
    products, no per-call weight concatenation (int8: one kernel call). Returns
    `(out_TD, (k_TKH, v_TKH))`: the new keys (rotated at their absolute positions, with
    rotary embeddings) and values in the cache's dtype, to store."""
    positions_T = length + jnp.arange(h_TD.shape[-2])
    q_TNH, k_TKH, v_TKH = _project_qkv(p, h_TD, positions_T, config, concatenate=False)
    k_TKH, v_TKH = k_TKH.astype(k_pool.dtype), v_TKH.astype(v_pool.dtype)
    out_TNH = attend_paged(q_TNH, k_TKH, v_TKH, k_pool, v_pool, page_table, length, bound)
    return _merge_heads(p, out_TNH.astype(h_TD.dtype)), (k_TKH, v_TKH)


def _causal_attention(p: Params, h_BTD: jax.Array, config: GPTConfig):
    """Causal self-attention over whole sequences at positions 0..T-1, no cache: `[B, T, D]`
    -> `([B, T, D], None)`. Forms the `[T, T]` scores per head (`attend_causal`), which at
    training lengths is cheaper than the blockwise loop of `attend_paged` and
    differentiates as one program."""
    positions_T = jnp.arange(h_BTD.shape[1])
    q_BTNH, k_BTKH, v_BTKH = _project_qkv(p, h_BTD, positions_T, config, concatenate=True)
    return _merge_heads(p, attend_causal(q_BTNH, k_BTKH, v_BTKH)), None


def _last_query_attention(p: Params, h_BTD: jax.Array, config: GPTConfig):
    """`_causal_attention` at the last position only: keys and values of every position, the
    query of the last one (which sees every key). Returns `([B, 1, D], None)`."""
    T = h_BTD.shape[1]
    q_B1NH = _project_heads(h_BTD[:, -1:], p["w_q"], p.get("b_q"), config.n_heads)
    q_B1NH = _position_heads(p, q_B1NH, jnp.array([T - 1]), config, "q")
    k_BTKH = _project_heads(h_BTD, p["w_k"], p.get("b_k"), config.kv_heads)
    k_BTKH = _position_heads(p, k_BTKH, jnp.arange(T), config, "k")
    v_BTKH = _project_heads(h_BTD, p["w_v"], p.get("b_v"), config.kv_heads)
    every_1T = jnp.ones((1, T), bool)
    out_B1NH = jax.vmap(attend, in_axes=(0, 0, 0, None))(q_B1NH, k_BTKH, v_BTKH, every_1T)
    return _merge_heads(p, out_B1NH), None


def block(p: Params, x_TD: jax.Array, attention_fn, config: GPTConfig):
    """One pre-norm transformer block over `x_TD` `[..., T, D]`, the one body of every
    forward and every family (the config chooses the norm, the MLP and what attention does
    with positions). `attention_fn(p_attn, h_TD, config) -> (out, extra)` is its attention;
    `out` covers the last of x's positions (all of them, but for `forward_last`'s last
    block, which queries only the last), and the residual stream goes on at those. Returns
    `(x, extra)`."""
    attn_TD, extra = attention_fn(p["attn"], norm(p["ln1"], x_TD, config), config)
    x_TD = x_TD[..., x_TD.shape[-2] - attn_TD.shape[-2]:, :] + attn_TD
    return x_TD + mlp(p["mlp"], norm(p["ln2"], x_TD, config), config), extra


def embed_tokens(params: Params, tokens, positions, config: GPTConfig) -> jax.Array:
    """The residual stream's start: token embeddings, plus the learned position table's rows
    at `positions` (broadcast against the tokens) when positions are learned; rotary
    positions enter in attention instead."""
    x = embed(params["wte"], tokens)
    return x + embed(params["wpe"], positions) if config.positions == "learned" else x


def transformer(params: Params, tokens_T: jax.Array, cache: kv.PagedKVCache, config: GPTConfig,
                bound: jax.Array | int | None = None):
    """Run T new tokens of ONE sequence through all layers, against that sequence's cache.

    The cache is only read (only its live pages, see `attend_paged`); the new keys and
    values of every layer come back for the caller to store for all rows at once
    (`gpt_jax.cache.write`), since the page pools are shared by the rows of a batch. The
    layers run as an unrolled loop (`unstack_layers`).

    Args:
      tokens_T: int token ids at positions `cache.lengths`..+T-1 (padding after the real
        ones is harmless: nothing reads it, and the caller stores only the real ones).
      cache: ONE row's view of a PagedKVCache: the shared pools (`k`, `v`), its page table
        row and scalar `lengths` (see `gpt_jax.cache.CACHE_ROW_AXES`).
      bound: an upper bound on `cache.lengths` shared by every row of a vmapped batch (the
        batch maximum, passed unmapped), so every row reads the same number of pages; a
        Python int makes the loop static. Default: the row's own length.
    Returns:
      `(x_TD, (k_LTKH, v_LTKH))`: final hidden states (before the last LayerNorm), and per
      layer the T new keys and values `[T, K, H]` in the cache's dtype.
    """
    start = cache.lengths
    positions_T = start + jnp.arange(tokens_T.shape[0])
    x_TD = embed_tokens(params, tokens_T, positions_T, config)
    bound = start if bound is None else bound
    new_k, new_v = [], []
    for layer, p in enumerate(unstack_layers(params)["blocks"]):
        attention_fn = functools.partial(_paged_attention, k_pool=cache.k[layer],
                                         v_pool=cache.v[layer], page_table=cache.page_table,
                                         length=start, bound=bound)
        x_TD, (k_TKH, v_TKH) = block(p, x_TD, attention_fn, config)
        new_k.append(k_TKH), new_v.append(v_TKH)
    return x_TD, (tuple(new_k), tuple(new_v))


def lm_head(params: Params, x_TD: jax.Array, config: GPTConfig) -> jax.Array:
    """Final norm and the output projection: tied (`wte` `[V, D]`) or not (`lm_head`
    `[V, D]`), either plain or its `Int8Weight`. Returns float32 logits `[..., V]`."""
    h_TD = norm(params["ln_f"], x_TD, config)
    out = as_weight(params["wte" if config.tie_embeddings else "lm_head"], in_axes=-1)
    logits_MV = out.matmul(h_TD.reshape(-1, h_TD.shape[-1]), preferred_element_type=jnp.float32)
    return logits_MV.reshape(*h_TD.shape[:-1], logits_MV.shape[-1])


def _blocks_full(params: Params, tokens_BT: jax.Array, config: GPTConfig, n_blocks: int):
    """Embeddings at positions 0..T-1 and the first `n_blocks` blocks over whole sequences
    (`[B, T, D]`): a `lax.scan` over stacked layers, a loop over unstacked ones. Raises
    ValueError for T past `config.max_seq_len`."""
    B, T = tokens_BT.shape
    if T > config.max_seq_len:
        raise ValueError(
            f"sequence length {T} exceeds config.max_seq_len={config.max_seq_len}"
        )
    x_BTD = embed_tokens(params, tokens_BT, jnp.arange(T)[None], config)

    def step(x_BTD, p):
        return block(p, x_BTD, _causal_attention, config)[0], None

    blocks = params["blocks"]
    if isinstance(blocks, tuple):  # unstacked (see unstack_layers): unrolled
        for p in blocks[:n_blocks]:
            x_BTD, _ = step(x_BTD, p)
    elif n_blocks:
        first = blocks if n_blocks == config.n_layers else jax.tree.map(
            lambda w: w[:n_blocks], blocks)
        x_BTD, _ = jax.lax.scan(step, x_BTD, first)
    return x_BTD


@functools.partial(jax.jit, static_argnames="config")
def forward(params: Params, tokens_BT: jax.Array, config: GPTConfig) -> jax.Array:
    """Full causal forward pass, no cache kept: the training path and the reference that the
    cached path (`transformer`) is tested against.

    Args:
      tokens_BT: int32 token ids, T <= config.max_seq_len.
    Returns:
      float32 logits `[B, T, V]`; logits[:, t] predict token t + 1.
    Raises:
      ValueError: T exceeds `config.max_seq_len` (positions would run off the table).
    """
    return lm_head(params, _blocks_full(params, tokens_BT, config, config.n_layers), config)


@functools.partial(jax.jit, static_argnames="config")
def forward_last(params: Params, tokens_BT: jax.Array, config: GPTConfig) -> jax.Array:
    """`forward(params, tokens_BT, config)[:, -1]`, the next-token logits of each sequence,
    computing the last block at the last position only (the blocks below at every
    position, for its keys and values). What nanoGPT's `sample` runs on its cropped window
    (`idx[:, -block_size:]`) each step; `inference.steps.window_logits` runs it.

    Args:
      tokens_BT: int32 token ids at positions 0..T-1, T <= config.max_seq_len.
    Returns:
      float32 logits `[B, V]`.
    Raises:
      ValueError: T exceeds `config.max_seq_len`.
    """
    x_BTD = _blocks_full(params, tokens_BT, config, config.n_layers - 1)
    blocks = params["blocks"]
    last = blocks[-1] if isinstance(blocks, tuple) else jax.tree.map(lambda w: w[-1], blocks)
    x_B1D, _ = block(last, x_BTD, _last_query_attention, config)
    return lm_head(params, x_B1D[:, 0], config)
