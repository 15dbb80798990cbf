"""The jitted device steps over the paged KV cache: the prefill and decode row functions,
`run_rows`, which vmaps them over a padded batch, the public `prefill` and `decode_step`,
the window forward of a row past its context, and the cached model pair that the decode
loop (`inference.decode`) runs.

Prefill and decode are written for one sequence (`gpt_jax.model.transformer` on one row of a
`PagedKVCache`: its page table and length, the shared page pools read only) and `jax.vmap`ped
over a padded batch, so every row has its own length, write position and positions, and a
row's output never depends on the other rows. The new keys and values of all rows are then
stored with one scatter per layer (`gpt_jax.cache.write`).

Past the context (`SamplingParams.context_overflow="crop"`): a row whose cache holds
max_seq_len tokens is predicted from its last max_seq_len tokens run from position 0, as
nanoGPT's `sample` crops (`window_logits`, inside the same step); learned absolute
positions leave nothing in the cache reusable there, so such a row costs a forward over the
window per token, while rows below the context keep decoding from the cache.

Shapes: the letters of `gpt_jax.model`, and here R, the rows a call runs among the cache's
B slots (`slots_R`), and W, a row's window of its last tokens (`inference.decode`); prompts
and pages are counted in words.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gpt_jax import cache as kv
from gpt_jax.cache import CACHE_ROW_AXES, PagedKVCache
from gpt_jax.config import GPTConfig
from gpt_jax.kernels import few_rows_matmul as few_rows_kernel
from gpt_jax.model import forward_last, lm_head
from gpt_jax.params import Params, decode_layout
from gpt_jax.tensor_parallel import constrain_cache, transformer

PAGE_SIZE = 16  # token slots per KV page, unless a caller chooses another


def _prefill_row(params, tokens_T, n_valid, cache_row, bound, *, config, padding_side):
    if padding_side == "left":  # move the real tokens to the front: positions start at 0
        tokens_T = jnp.roll(tokens_T, n_valid - tokens_T.shape[0])
    x_TD, new_kv = transformer(params, tokens_T, cache_row, config, bound)
    return lm_head(params, x_TD[jnp.maximum(n_valid - 1, 0)], config), new_kv


def _decode_row(params, token, cache_row, bound, *, config):
    x_TD, new_kv = transformer(params, token[None], cache_row, config, bound)
    return lm_head(params, x_TD[0], config), new_kv


def _select(cache: PagedKVCache, slots_R) -> PagedKVCache:
    """The rows `slots_R` of the cache (pools shared); a slot past the last is an empty row."""
    take = lambda x, fill: jnp.take(x, slots_R, axis=0, mode="fill", fill_value=fill)  # noqa: E731
    return cache.replace(page_table=take(cache.page_table, kv.NO_PAGE),
                         lengths=take(cache.lengths, 0), overflow=take(cache.overflow, False))


def _merge(cache: PagedKVCache, slots_R, rows: PagedKVCache) -> PagedKVCache:
    """`cache` with the pools of `rows` and, at `slots_R`, its lengths and overflow flags."""
    put = lambda x, y: x.at[slots_R].set(y, mode="drop")  # noqa: E731
    return cache.replace(k=rows.k, v=rows.v, lengths=put(cache.lengths, rows.lengths),
                         overflow=put(cache.overflow, rows.overflow))


def run_rows(row_fn, params, cache: PagedKVCache, tokens, n_valid_B, *batched, slots=None):
    """vmap `row_fn(params, tokens_row, *batched_rows, cache_row, bound)` over the rows of the
    cache (or the rows `slots` of it), then store every row's first `n_valid_B` new keys and
    values. `bound`, the longest row's length, is passed unmapped: every row reads the same
    pages, so the attention loop has one trip count (the live length).
    Returns `(logits, cache)`."""
    rows = cache if slots is None else _select(cache, slots)
    in_axes = (None, 0) + (0,) * len(batched) + (CACHE_ROW_AXES, None)
    logits, (k_LBTKH, v_LBTKH) = jax.vmap(row_fn, in_axes=in_axes)(
        params, tokens, *batched, rows, rows.lengths.max())
    rows = constrain_cache(kv.write(rows, k_LBTKH, v_LBTKH, n_valid_B, after=logits))
    return logits, (rows if slots is None else _merge(cache, slots, rows))


def run_prefill(params, config, tokens_BT, lengths_B, cache, slots=None, padding_side="right"):
    row = functools.partial(_prefill_row, config=config, padding_side=padding_side)
    return run_rows(row, params, cache, tokens_BT, lengths_B, lengths_B, slots=slots)


def run_decode(params, config, tokens_B, cache, advance_B):
    row = functools.partial(_decode_row, config=config)
    with few_rows_kernel.rows_per_call(tokens_B.shape[0]):  # few rows: the CPU kernel
        return run_rows(row, params, cache, tokens_B, advance_B.astype(jnp.int32))


def window_logits(params, config, window_BW, past_B, logits_BV, slots_R=None):
    """`logits_BV` with each `past_B` row's replaced by the logits of its window
    `window_BW[b]` run from position 0 (`gpt_jax.model.forward_last`): nanoGPT's `sample`,
    which crops the sequence to its last `block_size` tokens (`idx_cond =
    idx[:, -block_size:]`) before every step. With learned absolute positions every token
    of the window moves to a new position at each step, so nothing cached can be reused:
    each past row costs a forward over W tokens per token.
    Only the rows `slots_R` (int32 `[R]`, out-of-range entries padding) are computed, all
    rows by default; the forward runs only on steps where some row is past.

    Args:
      window_BW: int32, each row's last W (= max_seq_len) tokens, the newest last.
      past_B: bool, the row's context is full (its cache holds max_seq_len tokens).
      logits_BV: float32, the rows' logits from the cache.
    Returns:
      float32 `[B, V]`.
    """
    slots_R = jnp.arange(past_B.shape[0]) if slots_R is None else slots_R

    def run(logits_BV):
        take = lambda x, fill: jnp.take(x, slots_R, axis=0, mode="fill", fill_value=fill)  # noqa: E731
        past_R = take(past_B, False)
        window_RV = forward_last(params, take(window_BW, 0), config)
        window_RV = jnp.where(past_R[:, None], window_RV, take(logits_BV, 0.0))
        return logits_BV.at[slots_R].set(window_RV, mode="drop")

    return jax.lax.cond(past_B.any(), run, lambda x: x, logits_BV)


def run_step(params, config, tokens_B, cache, advance_B, window_BW=None, slots_R=None):
    """One decode step over the cache; a row whose context is full (only a
    `context_overflow="crop"` request gets there) is not written to the cache but predicted
    from its window instead (`window_logits`; skipped when `window_BW` is None or has no
    columns, or `slots_R` is empty). Returns `(logits_BV, cache)`."""
    past_B = cache.lengths >= config.max_seq_len
    logits_BV, cache = run_decode(params, config, tokens_B, cache, advance_B & ~past_B)
    if window_BW is not None and window_BW.shape[1] and (slots_R is None or slots_R.shape[0]):
        logits_BV = window_logits(params, config, window_BW, advance_B & past_B, logits_BV,
                                  slots_R)
    return logits_BV, cache


@functools.partial(jax.jit, static_argnames=("config", "padding_side"))
def prefill(params: Params, config: GPTConfig, tokens_BT, lengths_B, cache: PagedKVCache,
            slots=None, padding_side: str = "right"):
    """Run padded prompts (or prompt chunks) into the cache. Returns `(logits_BV, cache)`.

    Args:
      tokens_BT: int32 tokens padded to a common length T; row b's real tokens are its
        first `lengths_B[b]` (`padding_side="right"`) or its last (`"left"`).
      lengths_B: int32 real token counts, >= 1.
      cache: a PagedKVCache; row b's tokens are written from its slot's current length (0
        for a fresh slot; a later chunk of a prompt continues where the last one ended and
        attends to it through the pages).
      slots: int32 `[B]`, the cache slot of each row (default: row b is slot b); a slot
        past the last is a padding row that writes nothing.
    Returns:
      float32 next-token logits `[B, V]` at each row's last real token, and the cache with
      those slots' lengths advanced. A slot whose tokens do not fit its pages writes none
      and is flagged in `cache.overflow` (check bounds before calling; `generate` and
      `Engine` do).
    """
    return run_prefill(params, config, tokens_BT, lengths_B, cache, slots, padding_side)


@functools.partial(jax.jit, static_argnames="config")
def decode_step(params: Params, config: GPTConfig, tokens_B, cache: PagedKVCache):
    """Feed one token per slot at its current length. Returns `(logits_BV, cache)`, float32
    logits `[B, V]` and the cache with every slot's length advanced by one."""
    return run_decode(params, config, tokens_B, cache, jnp.ones(tokens_B.shape, bool))


def fork_pages(cache: PagedKVCache, source_B) -> PagedKVCache:
    """Row b continues the sequence of row `source_B[b]` (the n samples of one prompt): a row
    whose source is another row gets a copy of that row's pages and its length. Rows own
    equal page runs (`gpt_jax.cache.init_cache`)."""
    B = cache.page_table.shape[0]
    copied_B = source_B != jnp.arange(B)
    targets = jnp.where(copied_B[:, None], cache.page_table, cache.num_pages)  # [B, max_pages]
    cache = kv.copy_pages(cache, cache.page_table[source_B].reshape(-1), targets.reshape(-1))
    return cache.replace(lengths=cache.lengths[source_B])


def cached_model(params, config, capacity, cache_dtype):
    """`(prefill_fn, step_fn)` over a paged KV cache whose rows own `capacity` token slots
    each, at most max_seq_len (`gpt_jax.cache.init_cache`); `capacity` is the longest a row
    can grow, past max_seq_len only for "crop" requests. `prefill_fn(prompt_tokens,
    prompt_lengths, source_B, forked)` (int32 `[prompts, T]` right-padded and `[prompts]`;
    row b decodes prompt `source_B[b]`) prefills the prompts into the first decode row of
    each and, when `forked` (static: some prompt has n > 1), copies their pages to the other
    rows of the same prompt. `step_fn` predicts a row whose cache is full from its window
    (`run_step`). The weights take the decode layout once here, outside the decode loop."""
    params = decode_layout(params)
    capacity = min(capacity, config.max_seq_len)

    def prefill_fn(prompt_tokens, prompt_lengths, source_B, forked):
        n_prompts, B = prompt_tokens.shape[0], source_B.shape[0]
        cache = init_cache_rows(config, B, capacity, cache_dtype)
        if not forked:  # row p is prompt p (rows past the prompts are padding)
            logits, cache = run_prefill(params, config, prompt_tokens, prompt_lengths, cache)
            return logits[source_B], cache
        # each prompt's first decode row (B: a prompt no row decodes), where it is prefilled
        first_row = jnp.full((n_prompts,), B, jnp.int32).at[source_B].min(
            jnp.arange(B, dtype=jnp.int32))
        logits, cache = run_prefill(params, config, prompt_tokens, prompt_lengths, cache,
                                    first_row)  # logits: [prompts, V]
        return logits[source_B], fork_pages(cache, first_row[source_B])

    def step_fn(tokens_B, cache, advance_B, window_BW=None):
        return run_step(params, config, tokens_B, cache, advance_B, window_BW)

    return prefill_fn, step_fn


def init_cache_rows(config, batch_size, capacity, cache_dtype) -> PagedKVCache:
    """`gpt_jax.cache.init_cache` with pages of PAGE_SIZE slots (fewer for a short capacity)."""
    return kv.init_cache(config, batch_size, capacity, cache_dtype,
                         page_size=min(PAGE_SIZE, capacity))
