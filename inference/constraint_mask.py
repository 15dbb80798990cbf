"""Structured output inside the compiled loop: the automata of the rows in flight as device
arrays (`ConstraintArrays`, one table per row, padded to size buckets), the logit mask and
the state advance of one step.

Each row carries its automaton state (`DecodeState.constraint`, int32 `[B]`). A step masks
the logits (-inf for every token the row's state has no transition for) before any other
sampling rule; a row's EOS ids are live exactly in accepting states. After sampling, the row
moves to the token's next state, and a row whose new state accepts and has no live token has
finished (finish "stop"). A row without a constraint gets a one-state table in which every
token is live, so a batch mixing constrained and free rows runs one program; a batch without
any constraint passes no arrays at all (`SamplingArrays.constraint` None) and compiles none
of this.

Shapes: B and V of `gpt_jax.model`, E a row's EOS ids (`inference.stopping`), and here S the
states and C the token classes of the widest table (`inference.constraints`), each padded to
a power of two (`bucket`) so few programs compile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from inference.constraints import Automaton
from inference.buckets import bucket
from inference.stopping import UNUSED
from inference.transfer import to_device

# smallest padded S and C: small tables (a choice, a flat schema) share one program, and at
# 2 bytes an entry they are small beside a row's [V] token classes
MIN_STATES, MIN_CLASSES = 64, 32
BANKS_KEPT = 8  # device copies of recent row mixes (a server's batch changes slowly)


@struct.dataclass
class ConstraintArrays:
    token_class: jax.Array  # [B, V] int16, each token's class in the row's table
    next_state: jax.Array  # [B, S, C] int16, next state per (state, class); -1 = dead
    accepting: jax.Array  # [B, S] bool, the output so far is complete
    ends: jax.Array  # [B, S] bool, accepting with no live token: the row has finished


_FREE = Automaton(token_class=np.zeros(1, np.int32), next_state=np.zeros((1, 1), np.int32),
                  accepting=np.ones(1, bool))  # a row without a constraint: everything live


@functools.lru_cache(maxsize=BANKS_KEPT)
def constraint_arrays(automata: tuple[Automaton | None, ...],
                      vocab_size: int) -> ConstraintArrays | None:
    """The rows' tables on the device (None when no row has a constraint: the loop then
    compiles without them). Cached by the rows' automata (compiled ones are shared), so a
    batch that keeps its mix uploads nothing."""
    if all(a is None for a in automata):
        return None
    tables = [_FREE if a is None else a for a in automata]
    S = bucket(max(t.next_state.shape[0] for t in tables), MIN_STATES)
    C = bucket(max(t.next_state.shape[1] for t in tables), MIN_CLASSES)
    B = len(tables)
    token_class = np.zeros((B, vocab_size), np.int16)  # `constraints.MAX_SIZE` fits
    next_state = np.full((B, S, C), -1, np.int16)
    accepting, ends = np.zeros((B, S), bool), np.zeros((B, S), bool)
    for b, t in enumerate(tables):
        s, c = t.next_state.shape
        if t is not _FREE:  # the free table's class 0 is every token
            token_class[b] = t.token_class
        next_state[b, :s, :c] = t.next_state
        accepting[b, :s], ends[b, :s] = t.accepting, t.ends
    return ConstraintArrays(*to_device((token_class, next_state, accepting, ends)))


def warmup_arrays(automata, max_slots: int, vocab_size: int) -> list[ConstraintArrays]:
    """One `[max_slots]` bank per table size a program is compiled for: the smallest (a
    choice, a flat schema) and each of `automata`'s (`Engine.warmup` runs each through
    prefill and decode, so the first constrained request compiles nothing)."""
    banks = {}
    for table in (_FREE, *automata):
        bank = constraint_arrays((table,) * max_slots, vocab_size)
        banks.setdefault(bank.next_state.shape, bank)
    return list(banks.values())


def device_bytes(arrays: ConstraintArrays) -> int:
    """Bytes per row of the tables on the device."""
    return sum(x.nbytes for x in jax.tree.leaves(arrays)) // arrays.token_class.shape[0]


def _next_states(arrays: ConstraintArrays, state_B) -> jax.Array:
    """int32 `[B, V]`: each token's next state from the row's state (-1 = dead)."""
    row_BC = jnp.take_along_axis(arrays.next_state, state_B[:, None, None], axis=1)[:, 0]
    return jnp.take_along_axis(row_BC, arrays.token_class, axis=1)


def mask_logits(logits_BV, arrays: ConstraintArrays, state_B, stop_token_ids_BE):
    """`logits_BV` with -inf for every token the row's automaton cannot take next; the row's
    EOS ids (`stop_token_ids_BE`, UNUSED-padded) are live iff its state accepts."""
    B, V = logits_BV.shape
    live_BV = _next_states(arrays, state_B) >= 0
    ids_BE = jnp.where(stop_token_ids_BE != UNUSED, stop_token_ids_BE, V)  # V: dropped
    eos_BV = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], ids_BE].set(True, mode="drop")
    accepting_B = jnp.take_along_axis(arrays.accepting, state_B[:, None], axis=1)
    return jnp.where(jnp.where(eos_BV, accepting_B, live_BV), logits_BV, -jnp.inf)


def advance(arrays: ConstraintArrays, state_B, token_B, active_B):
    """`(state_B, ended_B)`: each `active_B` row's state after `token_B` (a token with no
    transition, an EOS id, leaves it) and whether the row has now finished (its new state
    accepts and has no live token)."""
    row_BC = jnp.take_along_axis(arrays.next_state, state_B[:, None, None], axis=1)[:, 0]
    class_B = jnp.take_along_axis(arrays.token_class, token_B[:, None], axis=1)[:, 0]
    after_B = jnp.take_along_axis(row_BC, class_B[:, None], axis=1)[:, 0]
    state_B = jnp.where(active_B & (after_B >= 0), after_B, state_B)
    ended_B = jnp.take_along_axis(arrays.ends, state_B[:, None], axis=1)[:, 0]
    return state_B, active_B & ended_B
