"""The KV cache: an immutable pytree of keys and values, written with bounds checks.

Arrays are `[L, B, K, S, H]` (layers, batch, kv heads, cache slots, head dim) with per-row
lengths `[B]`. Head-major: a block of slots of one head is contiguous, so attention reads it
straight into its matmul, with no transpose. Model code sees one row at a time (`jax.vmap`
over axis 1 of `k`/`v`, axis 0 of `lengths`), so a row's write index is its own length.

JAX clamps out-of-range `dynamic_slice` / `dynamic_update_slice` starts silently. Every
write and read here therefore checks its window: with concrete indices (eager) a bad window
raises `ValueError`; under `jit` the write is dropped, the read returns zeros, and an `ok`
flag comes back so the caller can record it (`KVCache.overflow`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gpt_jax.config import GPTConfig


@struct.dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, H] keys
    v: jax.Array  # [L, B, K, S, H] values
    lengths: jax.Array  # [B] int32, slots written (the next write index) per row
    overflow: jax.Array  # [B] bool, a write past the last slot was refused for this row

    @property
    def capacity(self) -> int:
        """S, slots per row."""
        return self.k.shape[3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]


# vmap axes for a KVCache whose rows are mapped over: the batch axis of every field.
CACHE_BATCH_AXES = KVCache(k=1, v=1, lengths=0, overflow=0)


def init_cache(config: GPTConfig, batch_size: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache of `max_len` slots per row.

    Raises:
      ValueError: `batch_size` or `max_len` is not positive.
    """
    if batch_size <= 0 or max_len <= 0:
        raise ValueError(
            f"init_cache needs batch_size > 0 and max_len > 0, got {batch_size} and {max_len}"
        )
    shape = (config.n_layers, batch_size, config.kv_heads, max_len, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        overflow=jnp.zeros((batch_size,), bool),
    )


def cache_bytes(config: GPTConfig, batch_size: int, seq_len: int, dtype=jnp.float32) -> int:
    """Bytes of the cache arrays: 2 (k and v) x n_layers x batch x seq_len x n_kv_heads x
    head_dim x bytes_per_element."""
    itemsize = np.dtype(dtype).itemsize
    return 2 * config.n_layers * batch_size * seq_len * config.kv_heads * config.head_dim * itemsize


def _window_ok(start, size: int, capacity: int, what: str):
    """True iff [start, start + size) lies inside [0, capacity); raises when start is concrete."""
    if not isinstance(start, jax.core.Tracer):
        start_int = int(start)
        if start_int < 0 or start_int + size > capacity:
            raise ValueError(
                f"KV cache {what} of {size} slot(s) at index {start_int} is out of range: "
                f"the cache has {capacity} slots, so the start must be in [0, {capacity - size}]"
            )
    return (start >= 0) & (start + size <= capacity)


def write(buf_KSH: jax.Array, new_TKH: jax.Array, start) -> tuple[jax.Array, jax.Array]:
    """Write the T new keys (or values) `new_TKH` into slots [start, start + T) of one row's
    cache `buf_KSH`.

    Returns `(buf_KSH, ok)`. When the window does not fit, the buffer comes back unchanged and
    `ok` is False (under jit) or `ValueError` is raised (concrete `start`).
    """
    size, capacity = new_TKH.shape[0], buf_KSH.shape[1]
    ok = _window_ok(start, size, capacity, "write")
    safe_start = jnp.where(ok, start, 0)
    # A refused write stores back what is already there, so nothing is clamped over.
    old_KTH = jax.lax.dynamic_slice_in_dim(buf_KSH, safe_start, size, axis=1)
    new_KTH = jnp.where(ok, jnp.swapaxes(new_TKH, 0, 1).astype(buf_KSH.dtype), old_KTH)
    return jax.lax.dynamic_update_slice_in_dim(buf_KSH, new_KTH, safe_start, axis=1), ok


def read(buf_KSH: jax.Array, start, size: int) -> tuple[jax.Array, jax.Array]:
    """Read slots [start, start + size) of one row's cache `buf_KSH`.

    Returns `(window_KTH, ok)`: zeros and False for an out-of-range window under jit;
    `ValueError` for a concrete `start`.
    """
    ok = _window_ok(start, size, buf_KSH.shape[1], "read")
    window = jax.lax.dynamic_slice_in_dim(buf_KSH, jnp.where(ok, start, 0), size, axis=1)
    return jnp.where(ok, window, jnp.zeros_like(window)), ok


# ------------------------------------------------------------------------------ pages
#
# The generation loop keeps each layer's cache as a tuple of pages: separate buffers of
# `page` consecutive slots, `[K, P, H]` per row (the last page may be shorter). Attention
# then hands a live page straight to its matmuls. A block cut out of one `[.., S, ..]` buffer
# is a slice, which XLA:CPU copies before every matmul that reads it (at batch 32 the copies
# took as long as the attention itself); a page is a whole buffer, and is never copied.


def page_spans(capacity: int, page: int) -> list[tuple[int, int]]:
    """`(first slot, size)` of each page of a `capacity`-slot row: `page` slots each, the
    last one shorter when `page` does not divide `capacity`."""
    return [(lo, min(page, capacity - lo)) for lo in range(0, capacity, page)]


def split_pages(buf_KSH: jax.Array, page: int, axis: int = 1) -> tuple[jax.Array, ...]:
    """The slots of `buf_KSH` (along `axis`) as a tuple of pages (copies, made once)."""
    return tuple(jax.lax.slice_in_dim(buf_KSH, lo, lo + size, axis=axis)
                 for lo, size in page_spans(buf_KSH.shape[axis], page))


def write_page_slot(pages_KPH: tuple[jax.Array, ...], new_1KH: jax.Array, start):
    """Write ONE new key (or value) `new_1KH` into slot `start` of a row's paged cache.

    Returns `(pages, ok)`: every page is written (the page holding `start` gets the new
    entry, the others their own slot back), so the update is the same for every row of a
    vmapped batch; `ok` is False when `start` lies outside the row (nothing changes), and a
    concrete out-of-range `start` raises ValueError.
    """
    capacity = sum(p.shape[1] for p in pages_KPH)
    ok = _window_ok(start, 1, capacity, "write")
    new_KH = new_1KH[0]
    written, lo = [], 0
    for page_KPH in pages_KPH:
        size = page_KPH.shape[1]
        here = ok & (start >= lo) & (start < lo + size)
        slot = jnp.clip(start - lo, 0, size - 1)
        old_KH = jax.lax.dynamic_index_in_dim(page_KPH, slot, axis=1, keepdims=False)
        entry_KH = jnp.where(here, new_KH.astype(page_KPH.dtype), old_KH)
        written.append(jax.lax.dynamic_update_index_in_dim(page_KPH, entry_KH, slot, axis=1))
        lo += size
    return tuple(written), ok
