"""Stop conditions: EOS ids, token stop sequences and length limits inside the compiled
loop; stop strings on text, on the host between compiled chunks.

A row finishes after the step that emits one of its EOS ids (the EOS token is kept and
counted), when its output ends with one of its token stop sequences (the output is cut
before the sequence), or when it has produced `max_new_tokens`. Stop strings need text, so
`inference.llm` decodes each row between chunks, finds the first point where the text
contains a stop string (`find_stop`), cuts the text before it and marks the row finished.
While a row runs, a streamed delta holds back any tail that could still grow into a stop
string (`held_back`).

`min_tokens` (vLLM's meaning) holds every stop off until a row has generated that many
tokens: while `step < min_tokens` its EOS ids' logits are -inf, so none is sampled
(`ban_early_eos`, as vLLM's min-tokens logits processor), and a token stop sequence or stop
string counts only when the token that completes it has index >= min_tokens (vLLM checks
stop strings only past the first min_tokens tokens' text: `find_stop(after=...)`). So every
stop comes after the first min_tokens tokens, and an output ended by an EOS holds at least
min_tokens + 1 tokens; one cut before a stop sequence or string may hold fewer, since the
match may start inside them. `max_new_tokens` still ends the row (`SamplingParams` refuses
min_tokens > max_new_tokens).

Shapes: B and V of `gpt_jax.model`, and here E, a row's EOS ids; a row's token stop
sequences (`n_sequences`) and their length (`seq_len`, also the width of the recent tokens
they are matched against) are counted in words.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from inference.transfer import to_device

# finish codes, as stored in the decode state
RUNNING, EOS, STOP, LENGTH = 0, 1, 2, 3
FINISH_REASONS = {EOS: "eos", STOP: "stop", LENGTH: "length"}

UNUSED = -1  # padding in the id arrays below; never equal to a token
BEFORE_START = -2  # fills a row's recent-token window before its first token


def _width(n: int) -> int:
    """Array width for n entries: a multiple of 4, at least 4 (few shapes, few compiles)."""
    return max(4, -(-n // 4) * 4)


@struct.dataclass
class StopArrays:
    max_new_tokens: jax.Array  # [B] int32, most tokens each row may generate
    stop_token_ids: jax.Array  # [B, E] int32, EOS ids per row, padded with UNUSED
    # [B, n_sequences, seq_len] int32, token stop sequences, right-aligned, UNUSED-padded
    stop_sequences: jax.Array
    min_tokens: jax.Array  # [B] int32, no stop before a row's step reaches it; 0 = off

    @classmethod
    def from_params(cls, rows, widths=(0, 0, 0)):
        """Arrays for these rows' SamplingParams (see `from_lists`)."""
        return cls.from_lists([r.max_new_tokens for r in rows], [r.stop_token_ids for r in rows],
                              [r.stop_sequences for r in rows], widths,
                              min_tokens=[r.min_tokens for r in rows])

    @classmethod
    def from_lists(cls, max_new_tokens: list[int], stop_token_ids: list[tuple[int, ...]],
                   stop_sequences: list[tuple[tuple[int, ...], ...]], widths=(0, 0, 0),
                   min_tokens: list[int] | None = None):
        """Arrays for these rows, `(E, n_sequences, seq_len)` wide: `widths` or, where
        larger, what the rows need (`needed_widths`). `min_tokens` defaults to 0 (off) for
        every row."""
        E, n_sequences, seq_len = np.maximum(widths, needed_widths(stop_token_ids,
                                                                   stop_sequences))
        ids = np.full((len(stop_token_ids), E), UNUSED, np.int32)
        for row, row_ids in enumerate(stop_token_ids):
            ids[row, : len(row_ids)] = row_ids
        sequences = np.full((len(stop_sequences), n_sequences, seq_len), UNUSED, np.int32)
        for row, row_sequences in enumerate(stop_sequences):
            for q, sequence in enumerate(row_sequences):
                sequences[row, q, seq_len - len(sequence):] = sequence
        return cls(
            max_new_tokens=to_device(np.array(max_new_tokens, np.int32)),
            stop_token_ids=to_device(ids),
            stop_sequences=to_device(sequences),
            min_tokens=to_device(np.array(min_tokens or [0] * len(max_new_tokens), np.int32)),
        )


def needed_widths(stop_token_ids, stop_sequences) -> tuple[int, int, int]:
    """`(E, n_sequences, seq_len)`: EOS ids, token stop sequences and their longest length
    per row, each rounded up to a multiple of 4 (few shapes, few compiles)."""
    return (_width(max(map(len, stop_token_ids), default=0)),
            _width(max(map(len, stop_sequences), default=0)),
            _width(max((len(q) for row in stop_sequences for q in row), default=0)))


def is_eos(tokens_B: jax.Array, stop_token_ids_BE: jax.Array) -> jax.Array:
    """bool `[B]`: the token is one of its row's EOS ids."""
    return (tokens_B[:, None] == stop_token_ids_BE).any(-1)


def ban_early_eos(logits_BV: jax.Array, step_B: jax.Array, stops: StopArrays) -> jax.Array:
    """`logits_BV` with the EOS ids of every row whose `step_B` (tokens generated so far) is
    below its `min_tokens` set to -inf, so no EOS is sampled there (vLLM's min-tokens logits
    processor). Other rows and tokens are unchanged; UNUSED id slots touch nothing."""
    B, V = logits_BV.shape
    early_B1 = (step_B < stops.min_tokens)[:, None]
    ids_BE = stops.stop_token_ids
    # V is past the vocabulary: dropped by the scatter (UNUSED, -1, would wrap to V - 1)
    ids_BE = jnp.where(early_B1 & (ids_BE != UNUSED), ids_BE, V)
    banned_BV = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], ids_BE].set(
        True, mode="drop")
    return jnp.where(banned_BV, -jnp.inf, logits_BV)


def matched_stop_length(recent: jax.Array, stop_sequences: jax.Array) -> jax.Array:
    """int32 `[B]`: length of the longest token stop sequence the row's output ends with, 0 if
    none. `recent` (`[B, seq_len]`) holds the row's last seq_len tokens (BEFORE_START where
    the output is shorter), so a sequence never matches across the prompt boundary;
    `stop_sequences` is `StopArrays.stop_sequences`."""
    used = stop_sequences != UNUSED  # [B, n_sequences, seq_len]
    same = stop_sequences == recent[:, None, :]
    matched = (same | ~used).all(-1) & used.any(-1)  # [B, n_sequences]
    return jnp.where(matched, used.sum(-1), 0).max(-1).astype(jnp.int32)


def find_stop(text: str, stops: tuple[str, ...], after: int = 0) -> tuple[int, int] | None:
    """The first point where `text` contains a stop string: `(start, end)` of the occurrence
    that ends earliest (ties: the one that starts earliest), or None. This is what checking
    after every character would find, so the answer does not depend on how the text arrived.
    Only occurrences that end past character `after` count (min_tokens: `after` is the length
    of the first min_tokens tokens' text); one may start before it.
    """
    hits = [(i + len(s), i) for s in stops
            if (i := text.find(s, max(0, after - len(s) + 1))) >= 0]
    if not hits:
        return None
    end, start = min(hits)
    return start, end


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` could be the start of a stop string, and so
    must not be shown yet when streaming."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
