"""Speculative decoding in `Engine`: the chunk program (`engine_speculate`, CHUNK speculative
steps of `inference.speculative` for the first `decode_rows` slots), the Engine's call of it
or of the draft model's (`speculate`), and `SpecSlots`, the host's per-slot settings,
adaptive state and counters.

A row's drafts come from its window of last tokens (`DecodeState.window`, which the Engine
keeps for every row) and its draft length from its adaptive state; neither reads another
row, so a greedy request's tokens never depend on its neighbours. A preempted request
starts drafting afresh when admitted again, and its next token comes with the prefill as
usual: a sampled speculative request then keeps its distribution but not, token for token,
the draws of an uninterrupted run. A "crop" request does not speculate, and a chunk in
which such a request may reach its context runs the plain decode chunk for every row.

Shapes: the letters of `gpt_jax.model`; K the drafts per step, the widest running k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from inference.batching import _first_rows, _put_first_rows, decode_rows
from inference.spec_cost import row_costs
from inference.decode import DecodeState
from inference.draft_engine import engine_draft_speculate
from inference.buckets import bucket
from inference.speculative import (NO_RATE, PAUSE_START, SpecArrays, SpecState,
                                   speculative_chunk, width_of)
from inference.verify import verifier
from inference.transfer import to_device


@functools.partial(jax.jit, static_argnames=("config", "n_rows", "width", "pad_id"),
                   donate_argnames=("state", "spec"))
def engine_speculate(params, config, state: DecodeState, spec: SpecState, page_table, live_B,
                     rows, stops, arrays: SpecArrays, *, n_rows: int, width: int, pad_id: int):
    """CHUNK speculative steps for the first `n_rows` slots (as `batching.engine_decode`:
    rows not `live_B` are finished first), verifying up to `width` drafts per row and step
    within each row's pages. `state` and `spec` are donated. Returns `(state, spec)`."""
    state = state.replace(model=state.model.replace(page_table=page_table),
                          done=state.done | ~live_B)
    first = lambda x: x[:n_rows]  # noqa: E731
    sub = _first_rows(state, n_rows)
    owned_B = (sub.model.page_table >= 0).sum(-1) * sub.model.page_size
    limit_B = jnp.minimum(owned_B, config.max_seq_len)  # positions the row's pages hold
    verify_fn = verifier(params, config)
    row_args = (jax.tree.map(first, rows), jax.tree.map(first, stops),
                jax.tree.map(first, arrays))

    sub, sub_spec = speculative_chunk(sub, jax.tree.map(first, spec), verify_fn, *row_args,
                                      width=width, limit=limit_B, pad_id=pad_id)
    put = lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, 0, axis=0)  # noqa: E731
    return _put_first_rows(state, sub), jax.tree.map(put, spec, sub_spec)


def speculate(engine, running: list, live_B, rows, stops) -> None:
    """One speculative chunk of `engine` (an `inference.Engine`) over its first slots, every
    `running` sequence among them (`live_B`, bool `[max_slots]`), with the slots' sampling
    and stop arrays `rows`, `stops`: `engine_speculate`, or where a row drafts with the
    draft model `draft_engine.engine_draft_speculate`. Replaces the engine's decode state,
    its `SpecSlots` state and its draft's state."""
    width = bucket(width_of([q.sampling for q in running]))  # few programs
    arrays = engine._spec_arrays()
    args = (engine._page_table(), live_B, rows, stops, arrays)
    static = dict(n_rows=decode_rows(max(q.slot for q in running) + 1, engine.max_slots),
                  width=width, pad_id=0)
    if arrays.use_draft is None:
        engine.state, engine.spec.state = engine_speculate(
            engine.params, engine.config, engine.state, engine.spec.state, *args, **static)
    else:
        d = engine.draft
        engine.state, engine.spec.state, d.state = engine_draft_speculate(
            engine.params, engine.config, d.params, d.config, engine.state, engine.spec.state,
            d.state, *args, **static)


@jax.jit
def _restart(state: SpecState, k_max, joining) -> SpecState:
    """`state` with the `joining` slots (bool `[S]`, host array: one program for any set of
    slots) drafting afresh at their `k_max`."""
    return state.replace(k=jnp.where(joining, k_max, state.k),
                         pause=jnp.where(joining, 0, state.pause),
                         backoff=jnp.where(joining, PAUSE_START, state.backoff),
                         rate=jnp.where(joining, NO_RATE, state.rate))


class SpecSlots:
    """The Engine's speculative side: each slot's adaptive state and counters on the
    device (`SpecState`; the counters are totals over every request the slot has held)."""

    def __init__(self, max_slots: int):
        zeros = jnp.zeros((max_slots,), jnp.int32)
        # one buffer per field: the chunk program donates them
        self.state = jax.tree.map(jnp.copy, SpecState.init(SpecArrays(zeros, zeros, zeros)))

    @staticmethod
    def arrays(active, max_slots: int, config, draft_config=None) -> SpecArrays:
        """Per-slot settings of the active sequences of a model of `config` with the draft
        model of `draft_config` (each slot's cost `spec_cost.row_costs`; `use_draft` None
        when none drafts with a draft model); a "crop" request (one that may outgrow the
        context) and a free slot do not speculate."""
        k, lo, hi = (np.zeros(max_slots, np.int32) for _ in range(3))
        use_draft = np.zeros(max_slots, bool)
        for q in active:
            sp = q.sampling
            fits = len(q.prompt) + sp.max_new_tokens <= config.max_seq_len
            k[q.slot] = sp.num_speculative_tokens if sp.speculative and fits else 0
            lo[q.slot], hi[q.slot] = sp.prompt_lookup_min, sp.prompt_lookup_max
            use_draft[q.slot] = sp.speculative == "draft" and fits
        return SpecArrays(*to_device((k, lo, hi)),
                          use_draft=to_device(use_draft) if use_draft.any() else None,
                          # numpy: no staging program
                          cost=row_costs(config, k, draft_config, use_draft))

    def insert(self, slots: list[int], arrays: SpecArrays) -> None:
        """Sequences joining the decode batch at `slots` (new, or preempted and admitted
        again) start drafting afresh."""
        if slots:
            joining = np.zeros(self.state.k.shape, bool)
            joining[slots] = True
            self.state = _restart(self.state, arrays.k_max, joining)

    def warmup(self, arrays: SpecArrays) -> None:
        """Compile `insert`'s program now, with no slot joining (the state is unchanged), so
        the first request does not."""
        self.state = _restart(self.state, arrays.k_max, np.zeros(self.state.k.shape, bool))

    def stats(self) -> dict:
        """Totals over every request so far: drafted and accepted tokens, the acceptance
        rate, and the mean tokens a speculative row emitted per verification."""
        s = jax.device_get(self.state)
        drafted, accepted, verified = (int(x.sum()) for x in (s.drafted, s.accepted,
                                                              s.verifications))
        return {"spec_drafted_tokens": drafted, "spec_accepted_tokens": accepted,
                "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
                "spec_tokens_per_verification": (accepted + verified) / verified
                if verified else 0.0}

