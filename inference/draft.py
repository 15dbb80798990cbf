"""Speculative decoding with a draft model (`SamplingParams(speculative="draft")`): a second,
smaller model with the same tokenizer proposes the k drafts that `inference.speculative`
verifies, inside the same compiled chunk.

The draft model has its own paged KV cache (`DraftState.cache`): pools shaped by its own
layers and heads, indexed by the target's page table, so a row's draft keys and values live
in the same page numbers as its target ones and follow it through the scheduler's pages.
The draft's cache is prefilled with the prompt as the target's is. At each step a drafting
row runs k draft decode steps (`propose`, a `lax.fori_loop`): the first feeds the row's
last sampled token (and, after a step that accepted every draft, the last draft, which the
draft's cache has not seen: `DraftState.lag`), each next one feeds the draft just drawn.
Draft j is drawn from q, the draft model's distribution after the same sampling transforms
the target's p gets at that position (`draft_distribution`: min_tokens, logit_bias,
penalties counting the drafts before it, temperature, top-k/p, min-p; one-hot at the argmax
for a greedy row), with the row's key at that step folded with 3 (the target's draws use it
plain and folded with 1 and 2). Verification is `inference.speculative.verify_drafts` with
that q in place of an n-gram's one-hot: accept with probability min(1, p/q), on refusal
draw from the normalized max(0, p - q) (Leviathan et al. 2023; Chen et al. 2023), so the
output is distributed as without speculation, and a greedy row emits exactly its greedy
tokens. After it, the draft's cache length is set to the tokens emitted (`sync`): what it
holds past them is overwritten later.

A row paused by the adaptive draft length (`inference.speculative.adapt`) still feeds its
token to the draft model each step (one draft decode step, not k), so that its draft cache
stays in step with its output. Rows drafting with n-grams and rows not speculating share
the chunk: the draft's forward runs over every row of the batch, and stores only drafting
rows' keys and values. A batch without a drafting row runs no draft model at all
(`generation.run`, `spec_engine.speculate` pick the n-gram programs).

Shapes: the letters of `gpt_jax.model`, K the drafts per step (the batch's widest k).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from gpt_jax.cache import PagedKVCache
from gpt_jax.config import GPTConfig
from gpt_jax.params import decode_layout
from inference import stopping
from inference.decode import CHUNK, DecodeState
from inference.sampling import greedy_tokens, prepare_logits, row_keys, scaled_logits
from inference.speculative import (SpecArrays, SpecState, draft_lengths, room_lengths,
                                   verify_drafts)
from inference.verify import run_verify

DRAFT_KEY = 3  # a draft's draw uses the row's key at its step folded with this


def check_draft(config: GPTConfig, draft_config: GPTConfig, tokenizer=None,
                draft_tokenizer=None) -> None:
    """Refuse a draft model that cannot draft for this target: another vocabulary size, or
    another tokenizer (`gpt_jax.tokenizer`: the same kind and tokens, checked when both are
    given), or a shorter context (its cache shares the target's page tables and positions).

    Raises:
      ValueError: naming both models' values.
    """
    if draft_config.vocab_size != config.vocab_size:
        raise ValueError(f"the draft model's vocab_size {draft_config.vocab_size} differs from "
                         f"the target's {config.vocab_size}: a draft model needs the target's "
                         "tokenizer")
    if tokenizer is not None and draft_tokenizer is not None \
            and _vocabulary(tokenizer) != _vocabulary(draft_tokenizer):
        raise ValueError(f"the draft model's tokenizer ({_describe(draft_tokenizer)}) differs "
                         f"from the target's ({_describe(tokenizer)}): a draft model needs the "
                         "target's tokenizer")
    if draft_config.max_seq_len < config.max_seq_len:
        raise ValueError(f"the draft model's max_seq_len {draft_config.max_seq_len} is shorter "
                         f"than the target's {config.max_seq_len}: it must be at least that")


def _vocabulary(tokenizer):
    """What two tokenizers must share to be the same: their kind and every token."""
    if hasattr(tokenizer, "chars"):  # CharTokenizer
        return "char", tuple(tokenizer.chars)
    if hasattr(tokenizer, "tokenizer"):  # BPETokenizer over a `tokenizers.Tokenizer`
        return "bpe", tuple(sorted(tokenizer.tokenizer.get_vocab(with_added_tokens=True).items()))
    return type(tokenizer).__name__, tokenizer.vocab_size


def _describe(tokenizer) -> str:
    kind = getattr(tokenizer, "kind", type(tokenizer).__name__)
    return f"{kind}, {tokenizer.vocab_size} tokens"


@struct.dataclass
class DraftState:
    """The draft model's side of the decode state."""

    cache: PagedKVCache  # its KV cache; a drafting row's length is the target's, or one less
    lag: jax.Array  # [B] int32, 1: its cache lacks the token before the row's next_token
    pending: jax.Array  # [B] int32, that token (the last draft of a fully accepted step)

    @classmethod
    def init(cls, cache: PagedKVCache):
        zeros = jnp.zeros_like(cache.lengths)
        return cls(cache=cache, lag=zeros, pending=zeros)


def drafter(draft_params, draft_config: GPTConfig):
    """`draft_fn(tokens_BT, cache, n_valid_B) -> (logits_BTV, cache)`: the draft model fed
    at each row's length (`inference.verify.run_verify`), its weights laid out once."""
    params = decode_layout(draft_params)
    return lambda tokens_BT, cache, n_valid_B: run_verify(params, draft_config, tokens_BT,
                                                          cache, n_valid_B)


def draft_distribution(logits_BV, step_B, seen_BV, counts_BV, rows, stops):
    """The draft token of each row at step `step_B` and q, the distribution it is drawn
    from: the draft model's float32 `logits_BV` after the sampling transforms of
    `inference.speculative.choose` (with `seen_BV` the prompt's tokens and `counts_BV` the
    output's counts before it), drawn with the row's key folded with DRAFT_KEY; a greedy
    row's q is one-hot at its argmax. Returns `(token_B int32, q_BV float32)`."""
    logits_BV = stopping.ban_early_eos(logits_BV, step_B, stops)
    penalized_BV, _ = prepare_logits(logits_BV, rows, seen_BV, counts_BV)
    greedy_B = greedy_tokens(penalized_BV)
    sampled_B = rows.temperature > 0
    scaled_BV = scaled_logits(penalized_BV, rows)
    keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(
        row_keys(rows.seed, rows.prompt_hash, rows.sample_index, step_B), DRAFT_KEY)
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, scaled_BV)
    token_B = jnp.where(sampled_B, drawn_B, greedy_B).astype(jnp.int32)
    q_BV = jnp.where(sampled_B[:, None], jax.nn.softmax(scaled_BV, axis=-1),
                     jax.nn.one_hot(greedy_B, logits_BV.shape[-1]))
    return token_B, q_BV


def propose(draft: DraftState, draft_fn, state: DecodeState, rows, stops, k_B, feed_B,
            width: int):
    """Each `feed_B` row's `k_B` drafts from the draft model: the first draft step feeds its
    pending token (where `draft.lag`) and its next_token, each of the next `k_B - 1` feeds
    the draft just drawn. A feeding row with `k_B` 0 runs the first step only (its cache
    keeps up). Returns `(drafts_BK int32, q_BKV float32, draft)`, the draft's cache holding
    `max(k_B, 1)` more tokens in feeding rows."""
    B = k_B.shape[0]
    first_BT = jnp.where(draft.lag[:, None] > 0,
                         jnp.stack([draft.pending, state.next_token], 1),
                         jnp.stack([state.next_token, state.next_token], 1))
    logits_BTV, cache = draft_fn(first_BT, draft.cache, jnp.where(feed_B, draft.lag + 1, 0))
    logits_BV = jnp.take_along_axis(logits_BTV, draft.lag[:, None, None], axis=1)[:, 0]
    token_B, q_BV = draft_distribution(logits_BV, state.step, state.prompt_seen,
                                       state.output_counts, rows, stops)
    V = q_BV.shape[-1]
    drafts_BK = jnp.zeros((B, width), jnp.int32).at[:, 0].set(token_B)
    q_BKV = jnp.zeros((B, width, V), jnp.float32).at[:, 0].set(q_BV)

    def step(j, carry):  # draft j from draft j - 1
        cache, drafts_BK, q_BKV, counts_BV, token_B = carry
        counts_BV = counts_BV + jax.nn.one_hot(token_B, V, dtype=jnp.int32)
        logits_B1V, cache = draft_fn(token_B[:, None], cache,
                                     (feed_B & (j < k_B)).astype(jnp.int32))
        token_B, q_BV = draft_distribution(logits_B1V[:, 0], state.step + j, state.prompt_seen,
                                           counts_BV, rows, stops)
        return (cache, drafts_BK.at[:, j].set(token_B), q_BKV.at[:, j].set(q_BV), counts_BV,
                token_B)

    cache, drafts_BK, q_BKV, _, _ = jax.lax.fori_loop(
        1, jnp.minimum(jnp.max(jnp.where(feed_B, k_B, 0)), width), step,
        (cache, drafts_BK, q_BKV, state.output_counts, token_B))
    return drafts_BK, q_BKV, draft.replace(cache=cache)


def sync(draft: DraftState, lengths_B, k_B, emitted_B, drafts_BK, feed_B) -> DraftState:
    """The draft's state after verification emitted `emitted_B` tokens of rows that were at
    `lengths_B` and fed `max(k_B, 1)` tokens to the draft: its cache keeps the emitted ones
    it holds; when every draft was accepted it lacks the last draft, which it is fed at the
    next step (`lag`, `pending`)."""
    held_B = jnp.maximum(k_B, 1)
    lag_B = (emitted_B > held_B).astype(jnp.int32)
    pending_B = jnp.take_along_axis(drafts_BK, jnp.maximum(k_B - 1, 0)[:, None], axis=1)[:, 0]
    lengths_B = lengths_B + jnp.minimum(emitted_B, held_B)
    return DraftState(
        cache=draft.cache.replace(lengths=jnp.where(feed_B, lengths_B, draft.cache.lengths)),
        lag=jnp.where(feed_B, lag_B, draft.lag), pending=jnp.where(feed_B, pending_B,
                                                                   draft.pending))


def draft_step(state: DecodeState, spec: SpecState, draft: DraftState, verify_fn, draft_fn,
               rows, stops, arrays: SpecArrays, *, width: int, limit, pad_id: int):
    """One speculative step: rows with `arrays.use_draft` draft with the draft model
    (`propose`), the other speculative rows with n-grams, then all verify at once
    (`inference.speculative.verify_drafts`). Returns `(state, spec, draft)`."""
    use_B = arrays.use_draft
    ngram_BK, ngram_k_B = draft_lengths(state, spec, arrays, stops, width, limit)
    k_B = jnp.where(use_B, room_lengths(state, spec, stops, width, limit), ngram_k_B)
    feed_B = use_B & ~state.done
    model_BK, q_BKV, draft = propose(draft, draft_fn, state, rows, stops, k_B, feed_B, width)
    drafts_BK = jnp.where(use_B[:, None], model_BK, ngram_BK)
    q_BKV = jnp.where(use_B[:, None, None], q_BKV,
                      jax.nn.one_hot(ngram_BK, q_BKV.shape[-1], dtype=q_BKV.dtype))
    lengths_B = state.model.lengths
    state, spec, emitted_B = verify_drafts(state, spec, verify_fn, rows, stops, arrays,
                                           drafts_BK, k_B, q_BKV, width=width, pad_id=pad_id)
    return state, spec, sync(draft, lengths_B, k_B, emitted_B, drafts_BK, feed_B)


def draft_loop(state: DecodeState, spec: SpecState, draft: DraftState, verify_fn, draft_fn,
               rows, stops, arrays: SpecArrays, *, width: int, limit, pad_id: int):
    """Chunks of CHUNK `draft_step`s (`lax.scan`) inside a `lax.while_loop` until every row
    has finished, as `inference.speculative.speculative_loop`. Returns `(state, spec)`."""
    def step(carry, _):
        return draft_step(*carry, verify_fn, draft_fn, rows, stops, arrays, width=width,
                          limit=limit, pad_id=pad_id), None

    state, spec, _ = jax.lax.while_loop(
        lambda c: ~c[0].done.all(), lambda c: jax.lax.scan(step, c, None, length=CHUNK)[0],
        (state, spec, draft))
    return state, spec
