"""Attention: causal attention over whole sequences (the training path and the reference),
attention of new tokens over a sequence's pages of the KV cache (online softmax over blocks
of pages), and the one backend choice each makes (`gpt_jax.kernels.dispatch`: a CPU kernel
on CPU where it is built, XLA's path elsewhere). Scaled dot-product attention (Vaswani et
al. 2017) with grouped kv heads (Ainslie et al. 2023): query head n reads kv head
n // G. Shape letters as in `gpt_jax.model`, and two of this file's: G = N // K query heads
per kv head, Q = T * G queries of one kv head (the decode kernel's rows).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gpt_jax import cache as kv
from gpt_jax import kernels
from gpt_jax.kernels import causal_attention as causal_kernel
from gpt_jax.kernels import paged_attention as paged_kernel

# Masked scores get a large finite negative, never -inf: exp() gives 0 and no NaN appears.
MASK_VALUE = -1e30

# Keys per attention block: decode reads ceil(live length / block) blocks of the cache, and
# prefill scores are at most [T, block] per head at a time.
ATTENTION_BLOCK = 128

# New tokens per row up to which a CPU program reads the cached pages with the decode kernel
# (its T * G queries per kv head in one pass over the pages): a decode step (T = 1) and a
# speculative verification (T = k + 1, `inference.verify`); longer prefill chunks take
# XLA's blockwise path, whose matrix products suit many queries.
KERNEL_MAX_NEW_TOKENS = 16


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


def _online_softmax_block(state, q_TKGH, k_KSH, v_KSH, mask_TS):
    """Fold one block of keys into a running softmax (Milakov & Gimelshein 2018, "Online
    normalizer calculation for softmax"; as in FlashAttention, Dao et al. 2022).

    `state` is `(max_KGT, sum_KGT, acc_KGTH)`, float32: the running row maximum of the
    scores, the sum of exp(score - max), and the exp-weighted sum of values. Masked keys add
    exactly zero, so a block with no visible key leaves the state unchanged.
    """
    max_KGT, sum_KGT, acc_KGTH = state
    scores_KGTS = jnp.einsum(
        "TKGH,KSH->KGTS", q_TKGH, k_KSH, preferred_element_type=jnp.float32
    ) / math.sqrt(q_TKGH.shape[-1])
    scores_KGTS = jnp.where(mask_TS[None, None], scores_KGTS, MASK_VALUE)
    new_max_KGT = jnp.maximum(max_KGT, scores_KGTS.max(-1))
    probs_KGTS = jnp.where(mask_TS[None, None], jnp.exp(scores_KGTS - new_max_KGT[..., None]), 0.0)
    rescale_KGT = jnp.exp(max_KGT - new_max_KGT)
    acc_KGTH = acc_KGTH * rescale_KGT[..., None] + jnp.einsum(
        "KGTS,KSH->KGTH", probs_KGTS.astype(v_KSH.dtype), v_KSH,
        preferred_element_type=jnp.float32,
    )
    return new_max_KGT, sum_KGT * rescale_KGT + probs_KGTS.sum(-1), acc_KGTH


def _prefix_state_xla(q_TKGH, k_pool, v_pool, page_table, length, bound):
    """The online-softmax state of queries `q_TKGH` over cache slots [0, length) of one
    row's pages, reading the pages below `bound` (>= length) in blocks of ATTENTION_BLOCK
    slots: each block's pages are gathered from the pools by the row's page table.

    `bound` is the trip count's source: a Python int (static loop) or a traced scalar shared
    by a vmapped batch (a `while_loop`: the work follows the live length, not the capacity).
    """
    num_pages, K, P, H = k_pool.shape
    max_pages, T = page_table.shape[0], q_TKGH.shape[0]
    per_block = max(1, min(max_pages, ATTENTION_BLOCK // P))
    table = jnp.pad(page_table, (0, -max_pages % per_block), constant_values=kv.NO_PAGE)

    def gather(pool, ids):  # [per_block, K, P, H] pages -> [K, per_block * P, H] slots
        pages = pool[jnp.clip(ids, 0, num_pages - 1)]
        return jnp.swapaxes(pages, 0, 1).reshape(K, per_block * P, H)

    def body(i, state):
        ids = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block)
        slot_S = i * per_block * P + jnp.arange(per_block * P)
        live_S = (slot_S < length) & jnp.repeat(ids >= 0, P)
        # Masked slots may hold anything (another request's old entries): zero them, as a
        # NaN there would survive a zero probability.
        v_KSH = jnp.where(live_S[None, :, None], gather(v_pool, ids), 0)
        mask_TS = jnp.broadcast_to(live_S[None], (T, per_block * P))
        return _online_softmax_block(state, q_TKGH, gather(k_pool, ids), v_KSH, mask_TS)

    block_slots = per_block * P
    if isinstance(bound, int):
        n_blocks = -(-min(bound, max_pages * P) // block_slots)
    else:
        n_blocks = -(-jnp.minimum(bound, max_pages * P) // block_slots)
    return jax.lax.fori_loop(0, n_blocks, body, _init_softmax(q_TKGH))


def _prefix_state_kernel(q_TKGH, k_pool, v_pool, page_table, length):
    """`_prefix_state_xla`'s state from the CPU kernel (`gpt_jax.kernels.paged_attention`), which
    reads exactly slots [0, length): the normalized output, its log-sum-exp as the running
    maximum and a total of one (zero for an empty prefix)."""
    T, K, G, H = q_TKGH.shape
    q_KQH = jnp.einsum("TKGH->KTGH", q_TKGH).reshape(K, T * G, H)
    out_KQH, lse_KQ = paged_kernel.paged_decode_attention(q_KQH, k_pool, v_pool, page_table,
                                                          length)
    lse_KGT = jnp.einsum("KTG->KGT", lse_KQ.reshape(K, T, G))
    acc_KGTH = jnp.einsum("KTGH->KGTH", out_KQH.reshape(K, T, G, H))
    total_KGT = jnp.broadcast_to(jnp.where(length > 0, 1.0, 0.0), lse_KGT.shape)
    return lse_KGT, total_KGT, acc_KGTH


def attend_paged(q_TNH, k_TKH, v_TKH, k_pool, v_pool, page_table, length, bound):
    """Causal attention of T new queries at positions length..length+T-1 of one sequence.

    The keys are the row's cached slots [0, length), found through its page table in the
    layer's pools `[num_pages, K, P, H]` (`gpt_jax.cache`), then the T new keys themselves
    (causal among themselves). Blockwise online softmax: no `[T, S]` score matrix is formed.
    A decode step or a speculative verification (T <= KERNEL_MAX_NEW_TOKENS) on CPU reads
    the pages with a kernel on all cores that touches exactly the live slots
    (`gpt_jax.kernels.paged_attention`; XLA:CPU's own dots run on one thread); elsewhere,
    for longer prefill chunks, where the kernel cannot be built, or inside
    `gpt_jax.kernels.portable()`, XLA's blockwise path reads the pages below `bound` (>= length,
    shared by a vmapped batch).
    Equal (to float rounding) to `attend` over the whole sequence with the causal mask.

    Returns:
      `[T, N, H]` in the dtype of `v_TKH`; float32 softmax; a query with no visible key
      gets zeros.
    """
    T, N, H = q_TNH.shape
    K = k_TKH.shape[1]
    q_TKGH = q_TNH.reshape(T, K, N // K, H)
    args = (q_TKGH, k_pool, v_pool, page_table, length)
    xla = lambda *args: _prefix_state_xla(*args, bound)  # noqa: E731
    # a static bound of 0 (no cached slot to read): XLA's loop runs no block, and stays
    # differentiable (the kernel is not)
    empty = isinstance(bound, int) and bound <= 0
    use_kernel = T <= KERNEL_MAX_NEW_TOKENS and not empty and paged_kernel.use_kernel()
    state = kernels.dispatch(use_kernel, _prefix_state_kernel, xla, *args)
    return _softmax_output(_attend_new(state, q_TKGH, k_TKH, v_TKH)).astype(v_TKH.dtype)


def attend_cached(q_NH, k_pool, v_pool, page_table, length, bound):
    """Attention of ONE query (its N heads) over slots [0, length) of one row's pages, its
    own key already stored among them (the ragged forward, `gpt_jax.ragged`, writes every
    new key before attending). The CPU kernel where `attend_paged`'s decode step uses it,
    else XLA's blockwise path below `bound`. Returns `[N, H]` float32; zeros for length 0."""
    N, H = q_NH.shape
    K = k_pool.shape[1]
    q_TKGH = q_NH.reshape(1, K, N // K, H)
    xla = lambda *args: _prefix_state_xla(*args, bound)  # noqa: E731
    state = kernels.dispatch(paged_kernel.use_kernel(), _prefix_state_kernel, xla,
                             q_TKGH, k_pool, v_pool, page_table, length)
    return _softmax_output(state)[0]


def _attend_new(state, q_TKGH, k_TKH, v_TKH):
    """Fold in the T new keys themselves, causally (key j visible to query t iff j <= t),
    in blocks of ATTENTION_BLOCK keys so no [T, T] score matrix is ever formed."""
    T = q_TKGH.shape[0]
    block = min(ATTENTION_BLOCK, T)
    query_T = jnp.arange(T)
    k_KTH, v_KTH = jnp.swapaxes(k_TKH, 0, 1), jnp.swapaxes(v_TKH, 0, 1)

    def body(j, state):
        lo = j * block
        first = jnp.minimum(lo, T - block)
        k_KSH = jax.lax.dynamic_slice_in_dim(k_KTH, first, block, axis=1)
        v_KSH = jax.lax.dynamic_slice_in_dim(v_KTH, first, block, axis=1)
        key_S = first + jnp.arange(block)
        mask_TS = (key_S[None, :] >= lo) & (key_S[None, :] <= query_T[:, None])
        return _online_softmax_block(state, q_TKGH, k_KSH, v_KSH, mask_TS)

    n_blocks = -(-T // block)
    return body(0, state) if n_blocks == 1 else jax.lax.fori_loop(0, n_blocks, body, state)


def _init_softmax(q_TKGH):
    """The empty online-softmax state for queries `q_TKGH` (see `_online_softmax_block`)."""
    T, K, G, H = q_TKGH.shape
    return (jnp.full((K, G, T), MASK_VALUE, jnp.float32), jnp.zeros((K, G, T), jnp.float32),
            jnp.zeros((K, G, T, H), jnp.float32))


def _softmax_output(state) -> jax.Array:
    """Attention output `[T, N, H]` float32 from a final online-softmax state: the weighted
    sum over the softmax total; zeros for a query that saw no key."""
    _, sum_KGT, acc_KGTH = state
    out_KGTH = jnp.where(sum_KGT[..., None] > 0,
                         acc_KGTH / jnp.maximum(sum_KGT, 1e-30)[..., None], 0.0)
    K, G, T, H = out_KGTH.shape
    return jnp.einsum("KGTH->TKGH", out_KGTH).reshape(T, K * G, H)


def attend_causal(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """`attend` of each query t to keys 0..t of its own row: `[B, T, N, H]`, dtype of v.

    On CPU, float32 with a head dim the kernels are built for, the forward and backward run
    as `gpt_jax.kernels.causal_attention` kernels (the nanogpt-cpu train step ~40 -> ~36
    ms); elsewhere, or where they cannot be built, or inside `gpt_jax.kernels.portable()`, XLA's
    `attend` runs (`_attend_causal_xla`).
    """
    return kernels.dispatch(causal_kernel.use_kernel(q_BTNH, k_BTKH, v_BTKH),
                            causal_kernel.causal_attention, _attend_causal_xla,
                            q_BTNH, k_BTKH, v_BTKH)


def _attend_causal_xla(q_BTNH, k_BTKH, v_BTKH):
    T = q_BTNH.shape[1]
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    return jax.vmap(attend, in_axes=(0, 0, 0, None))(q_BTNH, k_BTKH, v_BTKH, causal_TS)
