"""Stop conditions: EOS ids and length limits inside the compiled loop; stop strings on text.

A row finishes after the step that emits one of its EOS ids (the EOS token is kept and
counted) or when it has produced `max_new_tokens`. Stop strings need text, so they are
checked on the host between compiled chunks (`inference.llm`), and the output is cut before
the first stop string.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# finish codes, as stored in the decode state
RUNNING, EOS, STOP, LENGTH = 0, 1, 2, 3
FINISH_REASONS = {EOS: "eos", STOP: "stop", LENGTH: "length"}


@struct.dataclass
class StopArrays:
    max_new_tokens: jax.Array  # [B] int32, most tokens each row may generate
    stop_token_ids: jax.Array  # [B, E] int32, EOS ids per row, padded with -1

    @classmethod
    def from_lists(cls, max_new_tokens: list[int], stop_token_ids: list[tuple[int, ...]]):
        width = max(4, -(-max(map(len, stop_token_ids), default=0) // 4) * 4)  # bounded shapes
        ids = np.full((len(stop_token_ids), width), -1, np.int32)
        for row, row_ids in enumerate(stop_token_ids):
            ids[row, : len(row_ids)] = row_ids
        return cls(
            max_new_tokens=jnp.asarray(np.array(max_new_tokens, np.int32)),
            stop_token_ids=jnp.asarray(ids),
        )


def is_eos(tokens_B: jax.Array, stop_token_ids_BE: jax.Array) -> jax.Array:
    """bool `[B]`: the token is one of its row's EOS ids."""
    return (tokens_B[:, None] == stop_token_ids_BE).any(-1)


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Index in `text` of the earliest stop string that begins at or after `start`, or None."""
    hits = [i for s in stops if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


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
