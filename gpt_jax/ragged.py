"""The ragged forward: one flattened batch of N query tokens over the paged KV cache, each
token with its own row (page table) and position, so the decode tokens of running
sequences and the prompt chunks of others run as one forward (stall-free batching:
Sarathi-Serve, Agrawal et al. 2024; vLLM's ragged paged attention).

Per layer, the N tokens' keys and values are written to their pages first (one scatter per
pool), then every token attends over its row's slots [0, position] through the page table:
a decode token alone (`gpt_jax.attention.attend_cached`), a prompt chunk's tokens in blocks
of QUERY_BLOCK, each block reading its row's pages before it once (`attend_paged`) and its
own keys causally; a block sees the earlier blocks of its chunk because they are already
stored, and never another row's. The same `gpt_jax.model.block`
body as every other forward; shape letters of `gpt_jax.model`, and N here the flattened
query tokens (`max_pages` in words).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt_jax.attention import attend_cached, attend_paged
from gpt_jax.cache import PagedKVCache
from gpt_jax.config import GPTConfig
from gpt_jax.model import _merge_heads, _project_qkv, block, embed_tokens
from gpt_jax.params import Params, unstack_layers


QUERY_BLOCK = 16  # prompt tokens per query block: one row's, sharing one read of its pages


def _ragged_attention(p: Params, h_ND: jax.Array, config: GPTConfig, k_pool, v_pool,
                      positions_N, page_N, offset_N, table_NM, bound, n_single: int):
    """Store the N tokens' keys and values at `(page_N, offset_N)` (a page >= num_pages:
    not stored), then attend: each of the first `n_single` tokens alone over its row's slots
    [0, position] (`attend_cached`: the decode kernel on CPU), each following block of
    QUERY_BLOCK tokens of one row over its pages before the block and causally among
    itself (`attend_paged`: one read of the pages per block, not per token). Returns
    `(out_ND, (k_pool, v_pool))`."""
    q_NNH, k_NKH, v_NKH = _project_qkv(p, h_ND, positions_N, config, concatenate=False)
    k_NKH, v_NKH = k_NKH.astype(k_pool.dtype), v_NKH.astype(v_pool.dtype)
    store = lambda pool, new: pool.at[page_N, :, offset_N].set(new, mode="drop")  # noqa: E731
    k_pool, v_pool = store(k_pool, k_NKH), store(v_pool, v_NKH)
    S, Q = n_single, QUERY_BLOCK
    single = jax.vmap(attend_cached, in_axes=(0, None, None, 0, 0, None))(
        q_NNH[:S], k_pool, v_pool, table_NM[:S], positions_N[:S] + 1, bound)
    blocks = lambda x: x[S:].reshape(-1, Q, *x.shape[1:])  # noqa: E731
    attend = jax.vmap(attend_paged, in_axes=(0, 0, 0, None, None, 0, 0, None))
    out_MQNH = attend(blocks(q_NNH), blocks(k_NKH), blocks(v_NKH), k_pool, v_pool,
                      table_NM[S::Q], positions_N[S::Q], bound)
    out_NNH = jnp.concatenate([single.astype(out_MQNH.dtype),
                               out_MQNH.reshape(-1, *out_MQNH.shape[2:])])
    return _merge_heads(p, out_NNH.astype(h_ND.dtype)), (k_pool, v_pool)


def ragged_transformer(params: Params, tokens_N, positions_N, table_NM, valid_N,
                       cache: PagedKVCache, config: GPTConfig, n_single: int):
    """Run N query tokens of any rows through all layers, storing their keys and values.

    Args:
      tokens_N: int32 token ids. positions_N: int32, each token's position in its row.
        The first `n_single` (static) are single tokens (decode rows); the rest come in
        blocks of QUERY_BLOCK tokens of one row at consecutive positions (a prompt chunk
        padded to a whole block: padding after the real tokens).
      table_NM: int32 `[N, max_pages]`, each token's row's page table (`kv.NO_PAGE` past
        its pages).
      valid_N: bool, a real token (padding tokens store nothing; their outputs are noise).
      cache: the PagedKVCache whose pools are written (its page table and lengths are not
        read or changed: the caller sets the lengths).
    Returns:
      `(x_ND, cache)`: final hidden states (before the last norm) and the cache with the
      tokens' keys and values stored. A token whose position lies outside its row's pages
      stores nothing (check bounds before calling; `Engine` does).
    Raises:
      ValueError: N - n_single not a multiple of QUERY_BLOCK.
    """
    if (tokens_N.shape[0] - n_single) % QUERY_BLOCK:
        raise ValueError(f"ragged_transformer: {tokens_N.shape[0]} tokens less n_single="
                         f"{n_single} must be whole blocks of {QUERY_BLOCK}")
    num_pages, P = cache.num_pages, cache.page_size
    index_N = positions_N // P
    page_N = jnp.take_along_axis(table_NM, jnp.clip(index_N, 0, table_NM.shape[1] - 1)[:, None],
                                 axis=1)[:, 0]
    stored_N = valid_N & (index_N < table_NM.shape[1]) & (page_N >= 0)
    page_N = jnp.where(stored_N, page_N, num_pages)
    bound = jnp.where(valid_N, positions_N + 1, 0).max()  # the longest row read
    x_ND = embed_tokens(params, tokens_N, positions_N, config)
    ks, vs = [], []
    for layer, p in enumerate(unstack_layers(params)["blocks"]):
        attention_fn = functools.partial(
            _ragged_attention, k_pool=cache.k[layer], v_pool=cache.v[layer],
            positions_N=positions_N, page_N=page_N, offset_N=positions_N % P, table_NM=table_NM,
            bound=bound, n_single=n_single)
        x_ND, (k_pool, v_pool) = block(p, x_ND, attention_fn, config)
        ks.append(k_pool), vs.append(v_pool)
    return x_ND, cache.replace(k=tuple(ks), v=tuple(vs))
