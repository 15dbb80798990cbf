"""A draft model in `Engine` (`Engine(..., draft=(params, config))`): `EngineDraft`, the
draft model's weights, paged cache and per-slot state, its prefill program
(`draft_prefill`) and the speculative chunk program with it (`engine_draft_speculate`);
and the command-line flags that load one (`add_draft_args`, `read_draft`, `load_draft`:
`gpt-jax serve | generate | chat --draft-run-dir DIR | --draft-hf-checkpoint DIR`).

The draft's page pools have the target's page count and size and are indexed by the same
page table (`Engine._page_table`), so a slot's draft keys and values follow its pages
through admission, preemption and prefix caching. Every prefill call of the Engine also
prefills the draft (any request may draft, and a prompt page shared by prefix caching then
holds the draft's keys and values too). At each speculative chunk a slot's draft cache
length is taken from the target's (minus the slot's `lag`, `inference.draft.DraftState`).
A slot whose draft cache misses tokens (only where a plain decode chunk ran a drafting
request: a "crop" request near the context in the same chunk) drafts from stale keys and
values: its drafts are accepted less often, its tokens are unchanged (verification decides
them from the target alone).

Shapes: the letters of `gpt_jax.model`.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from gpt_jax import cache as kv
from gpt_jax import checkpoint
from gpt_jax.config import GPTConfig
from gpt_jax.params import check_params, inference_params
from inference.batching import PrefillBatch, _first_rows, _put_first_rows
from inference.decode import CHUNK, DecodeState
from inference.draft import DraftState, check_draft, draft_step, drafter
from inference.speculative import SpecArrays, SpecState
from inference.steps import run_prefill
from inference.verify import verifier


@functools.partial(jax.jit, static_argnames="draft_config", donate_argnames="draft")
def draft_prefill(draft_params, draft_config, draft: DraftState, page_table,
                  batch: PrefillBatch) -> DraftState:
    """The Engine's prefill call (`batching.engine_prefill`) on the draft model: one chunk
    per row into its slot's draft pages at `batch.start`; the rows' slots have no lag.
    `draft` is donated."""
    cache = draft.cache.replace(page_table=page_table)
    cache = cache.replace(lengths=cache.lengths.at[batch.slot].set(batch.start, mode="drop"))
    _, cache = run_prefill(draft_params, draft_config, batch.tokens, batch.n_valid, cache,
                           batch.slot)
    return draft.replace(cache=cache, lag=draft.lag.at[batch.slot].set(0, mode="drop"))


def _first_draft_rows(draft: DraftState, n: int) -> DraftState:
    """Rows 0..n-1 of `draft` (the pools stay whole)."""
    first = lambda x: x[:n]  # noqa: E731
    cache = draft.cache.replace(page_table=first(draft.cache.page_table),
                                lengths=first(draft.cache.lengths),
                                overflow=first(draft.cache.overflow))
    return DraftState(cache=cache, lag=first(draft.lag), pending=first(draft.pending))


def _put_first_draft_rows(draft: DraftState, rows: DraftState) -> DraftState:
    put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis=0)  # noqa: E731
    cache = draft.cache.replace(k=rows.cache.k, v=rows.cache.v,
                                lengths=put(draft.cache.lengths, rows.cache.lengths),
                                overflow=put(draft.cache.overflow, rows.cache.overflow))
    return DraftState(cache=cache, lag=put(draft.lag, rows.lag),
                      pending=put(draft.pending, rows.pending))


@functools.partial(jax.jit, static_argnames=("config", "draft_config", "n_rows", "width",
                                             "pad_id"),
                   donate_argnames=("state", "spec", "draft"))
def engine_draft_speculate(params, config, draft_params, draft_config, state: DecodeState,
                           spec: SpecState, draft: DraftState, page_table, live_B, rows, stops,
                           arrays: SpecArrays, *, n_rows: int, width: int, pad_id: int):
    """`spec_engine.engine_speculate` with the draft model: CHUNK `inference.draft.draft_step`s
    for the first `n_rows` slots. `state`, `spec` and `draft` are donated. Returns `(state,
    spec, draft)`."""
    state = state.replace(model=state.model.replace(page_table=page_table),
                          done=state.done | ~live_B)
    draft = draft.replace(cache=draft.cache.replace(
        page_table=page_table, lengths=state.model.lengths - draft.lag))
    first = lambda x: x[:n_rows]  # noqa: E731
    sub = _first_rows(state, n_rows)
    owned_B = (sub.model.page_table >= 0).sum(-1) * sub.model.page_size
    limit_B = jnp.minimum(owned_B, config.max_seq_len)  # positions the row's pages hold
    verify_fn, draft_fn = verifier(params, config), drafter(draft_params, draft_config)
    row_args = (jax.tree.map(first, rows), jax.tree.map(first, stops),
                jax.tree.map(first, arrays))

    def step(carry, _):
        return draft_step(*carry, verify_fn, draft_fn, *row_args, width=width, limit=limit_B,
                          pad_id=pad_id), None

    sub, sub_spec, sub_draft = jax.lax.scan(
        step, (sub, jax.tree.map(first, spec), _first_draft_rows(draft, n_rows)), None,
        length=CHUNK)[0]
    put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis=0)  # noqa: E731
    return (_put_first_rows(state, sub), jax.tree.map(put, spec, sub_spec),
            _put_first_draft_rows(draft, sub_draft))


class EngineDraft:
    """The Engine's draft model: weights laid out as the target's (`inference_params`), an
    empty paged cache of the target's pool shape, and each slot's `DraftState`.

    Raises:
      ValueError: params that do not match `draft_config`, or a draft that cannot draft for
        `config` (`inference.draft.check_draft`).
    """

    def __init__(self, draft, config: GPTConfig, *, num_pages: int, max_slots: int,
                 max_pages: int, page_size: int, dtype, quantize):
        params, self.config = draft
        check_params(params, self.config)
        check_draft(config, self.config)
        self.params = inference_params(params, self.config, dtype, quantize)
        # one buffer per field: the programs donate them
        self.state = jax.tree.map(jnp.copy, DraftState.init(kv.empty_cache(
            self.config, num_pages, max_slots, max_pages, page_size, dtype)))

    def prefill(self, page_table, batch: PrefillBatch) -> None:
        self.state = draft_prefill(self.params, self.config, self.state, page_table, batch)


def add_draft_args(p: argparse.ArgumentParser) -> None:
    """--draft-run-dir or --draft-hf-checkpoint (one of them): the draft model of
    `speculative="draft"` requests (`load_draft`)."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--draft-run-dir", metavar="DIR", default=None,
                        help="a training run directory whose model drafts for "
                             "speculative='draft' requests (same tokenizer as the model)")
    source.add_argument("--draft-hf-checkpoint", metavar="DIR", default=None,
                        help="a Hugging Face directory whose model drafts instead (same "
                             "tokenizer as the model)")


def read_draft(args):
    """`(params, config, tokenizer)` of the --draft-run-dir or --draft-hf-checkpoint model
    (the tokenizer None for a Hugging Face directory without one), not yet checked against
    a target, or None without either flag.

    Raises:
      FileNotFoundError, ValueError: as `gpt_jax.checkpoint.load_params` and
        `gpt_jax.hf.load_hf` do.
    """
    if args.draft_run_dir:
        draft_config, params, draft_tokenizer = checkpoint.load_params(args.draft_run_dir)
    elif args.draft_hf_checkpoint:
        from gpt_jax.hf import load_hf, load_hf_tokenizer

        draft_config, params = load_hf(args.draft_hf_checkpoint)
        draft_tokenizer = load_hf_tokenizer(args.draft_hf_checkpoint)
    else:
        return None
    return params, draft_config, draft_tokenizer


def load_draft(args, config: GPTConfig, tokenizer):
    """`(params, config)` of the --draft-run-dir or --draft-hf-checkpoint model (`read_draft`),
    checked against the served model's `config` and `tokenizer` (`inference.draft.check_draft`),
    or None without either flag.

    Raises:
      FileNotFoundError, ValueError: as `read_draft` and `check_draft` do.
    """
    draft = read_draft(args)
    if draft is None:
        return None
    check_draft(config, draft[1], tokenizer, draft[2])
    return draft[:2]
