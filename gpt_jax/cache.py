"""The paged KV cache: one pool of pages per layer shared by all decode slots, page tables,
lengths; an immutable pytree written with bounds checks.

Layout (PagedAttention, Kwon et al. 2023, "Efficient Memory Management for Large Language
Model Serving with PagedAttention"): each layer's keys and values live in a pool of
`num_pages` pages of `page_size` (P) consecutive token slots, `[num_pages, K, P, H]`. A
decode slot (a row of the batch) owns a list of pages, its page table row: slot b's token
at position t lives in page `page_table[b, t // P]`, at offset `t % P`. Pages are handed out
by the host (`inference.scheduler`), so KV memory follows the live tokens, not batch x
max_seq_len; a page can be shared by several slots (a common prompt prefix), read-only.
Head-major within a page: the P slots of one kv head are contiguous, so attention reads a
page of a head as one `[P, H]` block.

Model code reads the pool unbatched (every row of a `jax.vmap` sees the whole pool and its
own page table row) and returns its new keys and values; `write` then stores all rows' new
entries into the pools in one scatter. JAX clamps or drops out-of-range indices silently, so
`write` checks every position against the slot's pages: a row whose write does not fit is
refused whole (nothing stored, its length unchanged) and flagged in `overflow`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gpt_jax.config import GPTConfig

NO_PAGE = -1  # a page table entry with no page behind it


@struct.dataclass
class PagedKVCache:
    k: tuple[jax.Array, ...]  # per layer [num_pages, K, P, H] key pages, shared by all slots
    v: tuple[jax.Array, ...]  # per layer [num_pages, K, P, H] value pages
    page_table: jax.Array  # [B, max_pages] int32, each slot's pages in order; NO_PAGE = none
    lengths: jax.Array  # [B] int32, tokens written per slot (its next write position)
    overflow: jax.Array  # [B] bool, a write past the slot's pages was refused

    @property
    def page_size(self) -> int:
        """P, token slots per page (static: part of the arrays' shapes)."""
        return self.k[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]


# vmap axes for a PagedKVCache whose slots are mapped over: the pools are shared (unmapped).
CACHE_ROW_AXES = PagedKVCache(k=None, v=None, page_table=0, lengths=0, overflow=0)


def pages_for(n_tokens: int, page_size: int) -> int:
    """Pages that hold `n_tokens` token slots."""
    return -(-n_tokens // page_size)


def empty_cache(config: GPTConfig, num_pages: int, batch_size: int, max_pages: int,
                page_size: int, dtype=jnp.float32) -> PagedKVCache:
    """A pool of `num_pages` zeroed pages and `batch_size` slots with no pages yet.

    Raises:
      ValueError: a size is not positive.
    """
    sizes = dict(num_pages=num_pages, batch_size=batch_size, max_pages=max_pages,
                 page_size=page_size)
    bad = {name: size for name, size in sizes.items() if size <= 0}
    if bad:
        raise ValueError(f"the KV cache needs positive sizes, got {bad}")
    shape = (num_pages, config.kv_heads, page_size, config.head_dim)
    pool = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers))  # noqa: E731
    return PagedKVCache(k=pool(), v=pool(),
                        page_table=jnp.full((batch_size, max_pages), NO_PAGE, jnp.int32),
                        lengths=jnp.zeros((batch_size,), jnp.int32),
                        overflow=jnp.zeros((batch_size,), bool))


def init_cache(config: GPTConfig, batch_size: int, max_len: int, dtype=jnp.float32,
               page_size: int = 16) -> PagedKVCache:
    """A cache whose `batch_size` slots each own `ceil(max_len / page_size)` pages of their
    own (slot b: pages b * n .. b * n + n - 1): a static batch, as `inference.generate` runs.

    Raises:
      ValueError: `batch_size`, `max_len` or `page_size` is not positive.
    """
    if batch_size <= 0 or max_len <= 0 or page_size <= 0:
        raise ValueError(f"init_cache needs batch_size, max_len and page_size > 0, got "
                         f"{batch_size}, {max_len} and {page_size}")
    per_slot = pages_for(max_len, page_size)
    cache = empty_cache(config, batch_size * per_slot, batch_size, per_slot, page_size, dtype)
    table = jnp.arange(batch_size * per_slot, dtype=jnp.int32).reshape(batch_size, per_slot)
    return cache.replace(page_table=table)


def cache_bytes(config: GPTConfig, num_pages: int, page_size: int, dtype=jnp.float32) -> int:
    """Bytes of the page pools: 2 (k and v) x n_layers x num_pages x page_size x n_kv_heads x
    head_dim x bytes_per_element."""
    itemsize = np.dtype(dtype).itemsize
    return (2 * config.n_layers * num_pages * page_size * config.kv_heads * config.head_dim
            * itemsize)


def write_targets(page_table: jax.Array, lengths_B: jax.Array, n_valid_B: jax.Array,
                  n_new: int, num_pages: int, page_size: int):
    """Where the `n_new` new tokens of each slot go: `(page_BT, offset_BT, ok_B)`.

    Token t of slot b takes position `lengths_B[b] + t`; only the first `n_valid_B[b]` are
    stored. `ok_B` is False for a slot with a valid position outside its pages (past the
    table, or a NO_PAGE entry); such a slot's targets, and every padding token's, are
    `num_pages` (out of range: a `mode="drop"` scatter stores nothing there).
    """
    max_pages = page_table.shape[1]
    position_BT = lengths_B[:, None] + jnp.arange(n_new)[None, :]
    valid_BT = jnp.arange(n_new)[None, :] < n_valid_B[:, None]
    index_BT = position_BT // page_size
    in_table_BT = (index_BT >= 0) & (index_BT < max_pages)
    page_BT = jnp.take_along_axis(page_table, jnp.clip(index_BT, 0, max_pages - 1), axis=1)
    fits_BT = in_table_BT & (page_BT >= 0) & (page_BT < num_pages)
    ok_B = (fits_BT | ~valid_BT).all(-1)
    store_BT = valid_BT & ok_B[:, None]
    return jnp.where(store_BT, page_BT, num_pages), position_BT % page_size, ok_B


def write(cache: PagedKVCache, k_LBTKH, v_LBTKH, n_valid_B, after=None) -> PagedKVCache:
    """Store T new keys and values per slot at positions lengths..lengths+n_valid-1 and
    advance the lengths: one scatter per layer pool (in place when the pool is donated or
    carried through a loop).

    Args:
      k_LBTKH, v_LBTKH: per layer, `[B, T, K, H]` new keys / values of every slot.
      n_valid_B: int32 `[B]`, real tokens among the T (0: the slot writes nothing).
      after: an array computed from every read of the pools that must come before this
        write (the logits). The scatter's indices are made to depend on it without changing
        them, so XLA runs those reads first and updates the pools in place; without a data
        dependency it copied every pool to keep its old value for a late read (two pool
        copies per layer per decode step: benchmarks/README.md, "One paged cache").
    Returns:
      The cache. A slot whose tokens do not all fit its pages stores none of them, keeps
      its length and gets `overflow` set.
    Raises:
      ValueError: with concrete (not traced) lengths, a slot whose write does not fit; the
        message names the slot, its length and its capacity.
    """
    T = k_LBTKH[0].shape[1]
    page_BT, offset_BT, ok_B = write_targets(cache.page_table, cache.lengths, n_valid_B, T,
                                             cache.num_pages, cache.page_size)
    if not isinstance(ok_B, jax.core.Tracer) and not bool(np.all(ok_B)):
        b = int(np.argmin(np.asarray(ok_B)))
        owned = int((np.asarray(cache.page_table[b]) >= 0).sum())
        raise ValueError(
            f"KV cache write of {int(n_valid_B[b])} token(s) at position {int(cache.lengths[b])} "
            f"of slot {b} is out of range: the slot has {owned} page(s) of "
            f"{cache.page_size} = {owned * cache.page_size} token slots")

    if after is not None:  # min(page, num_pages + isnan) == page: a dependency, no change
        page_BT = jnp.minimum(page_BT, cache.num_pages + jnp.isnan(after.sum()).astype(jnp.int32))

    def scatter(pool, new_BTKH):  # pool: [num_pages, K, P, H]
        return pool.at[page_BT, :, offset_BT].set(new_BTKH.astype(pool.dtype), mode="drop")

    return cache.replace(
        k=tuple(map(scatter, cache.k, k_LBTKH)),
        v=tuple(map(scatter, cache.v, v_LBTKH)),
        lengths=jnp.where(ok_B, cache.lengths + n_valid_B, cache.lengths).astype(jnp.int32),
        overflow=cache.overflow | ~ok_B,
    )


def copy_pages(cache: PagedKVCache, sources: jax.Array, targets: jax.Array) -> PagedKVCache:
    """Pages `sources` copied onto pages `targets` (int32, one entry per copied page) in
    every layer (copy-on-write of a shared page before it is written). Targets of
    `num_pages` or more are skipped."""
    def copy(pool):  # [num_pages, K, P, H]
        return pool.at[targets].set(pool[jnp.clip(sources, 0)], mode="drop")

    return cache.replace(k=tuple(map(copy, cache.k)), v=tuple(map(copy, cache.v)))
