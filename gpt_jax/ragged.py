"""The ragged forward: one flattened batch of N query tokens over the paged KV cache, each
token with its own row (page table) and position, so the decode tokens of running
sequences and the prompt chunks of others run as one forward (stall-free batching:
Sarathi-Serve, Agrawal et al. 2024; vLLM's ragged paged attention).

Per layer, the N tokens' keys and values are written to their pages first (one scatter per
pool), then every token attends over its row's slots [0, position] through the page table
(`gpt_jax.attention.attend_cached`): a token sees the earlier tokens of its own chunk
because they are already stored, and never another row's. The same `gpt_jax.model.block`
body as every other forward; shape letters of `gpt_jax.model`, and N here the flattened
query tokens (`max_pages` in words).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt_jax.attention import attend_cached
from gpt_jax.cache import PagedKVCache
from gpt_jax.config import GPTConfig
from gpt_jax.model import _merge_heads, _project_qkv, block, embed_tokens
from gpt_jax.params import Params, unstack_layers


def _ragged_attention(p: Params, h_ND: jax.Array, config: GPTConfig, k_pool, v_pool,
                      positions_N, page_N, offset_N, table_NM, bound):
    """Store the N tokens' keys and values at `(page_N, offset_N)` (a page >= num_pages:
    not stored), then attend each over its row's slots [0, position]. Returns
    `(out_ND, (k_pool, v_pool))`."""
    q_NNH, k_NKH, v_NKH = _project_qkv(p, h_ND, positions_N, config, concatenate=False)
    store = lambda pool, new: pool.at[page_N, :, offset_N].set(  # noqa: E731
        new.astype(pool.dtype), mode="drop")
    k_pool, v_pool = store(k_pool, k_NKH), store(v_pool, v_NKH)
    attend = jax.vmap(attend_cached, in_axes=(0, None, None, 0, 0, None))
    out_NNH = attend(q_NNH, k_pool, v_pool, table_NM, positions_N + 1, bound)
    return _merge_heads(p, out_NNH.astype(h_ND.dtype)), (k_pool, v_pool)


def ragged_transformer(params: Params, tokens_N, positions_N, table_NM, valid_N,
                       cache: PagedKVCache, config: GPTConfig):
    """Run N query tokens of any rows through all layers, storing their keys and values.

    Args:
      tokens_N: int32 token ids. positions_N: int32, each token's position in its row.
      table_NM: int32 `[N, max_pages]`, each token's row's page table (`kv.NO_PAGE` past
        its pages).
      valid_N: bool, a real token (padding tokens store nothing; their outputs are noise).
      cache: the PagedKVCache whose pools are written (its page table and lengths are not
        read or changed: the caller sets the lengths).
    Returns:
      `(x_ND, cache)`: final hidden states (before the last norm) and the cache with the
      tokens' keys and values stored. A token whose position lies outside its row's pages
      stores nothing (check bounds before calling; `Engine` does).
    """
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
            bound=bound)
        x_ND, (k_pool, v_pool) = block(p, x_ND, attention_fn, config)
        ks.append(k_pool), vs.append(v_pool)
    return x_ND, cache.replace(k=tuple(ks), v=tuple(vs))
