"""Sampling: pure functions on `[B, V]` logits with per-row parameters as traced arrays.

Every row of a batch carries its own temperature, top-k, top-p, min-p, penalties and seed,
so one compiled program serves any mix of greedy and sampled requests and changing a value
never recompiles.

Order of the transforms (the order of Hugging Face's default logits processors and vLLM's
sampler):
  0. `logit_bias` (OpenAI API): each row's bias `[V]` added to its raw logits, before anything
     else. (Before that, `inference.decode.sample_and_record` sets a row's EOS logits to -inf
     while the row is inside its `min_tokens`: `inference.stopping.ban_early_eos`.)
  1. penalties on the biased logits: repetition (CTRL, Keskar et al. 2019: divide a positive
     logit, multiply a negative one, once per seen token, prompt and output), then presence
     and frequency (OpenAI API: subtract `presence` once and `frequency` x count, output
     tokens only);
  2. temperature 0 is greedy: argmax of the penalized logits, no division on that path;
  3. temperature scaling, after subtracting the row maximum so tiny temperatures stay finite;
  4. top-k (k = 0 or k >= V is off), then top-p / nucleus (Holtzman et al. 2020) on the
     renormalized top-k distribution, then min-p (Nguyen et al. 2024) relative to the most
     likely token. Each filter always keeps the most likely token, so no row is ever empty.
Why this order: penalties first, because they change which tokens are likely and must act
on what the model said, not on a distribution already cut down (a penalized token may fall
out of the top-k, which is the point). Greedy reads the penalized logits, so temperature 0
is exactly the limit of temperature -> 0. Temperature before the filters, because top-p and
min-p are statements about the distribution actually sampled from ("the smallest set
holding 90% of what we draw from"); top-k is the same either way. Top-k before top-p, so
top-p measures mass among the k candidates (the Hugging Face and vLLM convention, which
users carry over). Min-p last: its threshold is a ratio to the top token, which every filter
keeps, so renormalizing after top-k and top-p leaves it unchanged (it is computed on the
same probabilities as top-p).

The three filters each keep a prefix of the tokens sorted by logit, so they share one stable
descending sort per row (ties are broken by token id); the kept set is scattered back to
vocabulary order and sampling draws from the masked, unsorted logits. A row's draw therefore
depends only on its own logits and key, never on whether other rows filter.

A row whose logits are all -inf or NaN (a finished or padded row) returns `pad_id`, and its
NaN never reaches other rows.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from inference.sampling_params import SamplingParams
from inference.transfer import to_device

if TYPE_CHECKING:
    from inference.constraint_mask import ConstraintArrays


@struct.dataclass
class SamplingArrays:
    """Per-row sampling parameters as arrays, so changing them never recompiles."""

    temperature: jax.Array  # [B] float32, 0 = greedy
    top_k: jax.Array  # [B] int32, 0 = off
    top_p: jax.Array  # [B] float32, 1 = off
    min_p: jax.Array  # [B] float32, 0 = off
    repetition_penalty: jax.Array  # [B] float32, 1 = off
    presence_penalty: jax.Array  # [B] float32, 0 = off
    frequency_penalty: jax.Array  # [B] float32, 0 = off
    seed: jax.Array  # [B] uint32, the request's seed
    prompt_hash: jax.Array  # [B] uint32, `prompt_hash` of the request's prompt
    sample_index: jax.Array  # [B] int32, which of the request's n samples this row is
    logprobs: jax.Array  # [B] int32, alternatives to record per token; -1 = no log-probs
    logit_bias: jax.Array  # [B, V] float32, added to the raw logits; 0 = off
    # the rows' structured-output tables (inference.constraint_mask); None: no row has one
    constraint: ConstraintArrays | None = None

    @classmethod
    def from_params(cls, rows: list[SamplingParams], seeds: list[int], sample_index: list[int],
                    prompt_hashes: list[int], vocab_size: int):
        """The arrays of these rows (`[B]` each, `logit_bias` `[B, vocab_size]`). Token ids
        in `logit_bias` must be below vocab_size (`inference.validation.check_request`
        checks)."""
        def col(name, dtype):
            return to_device(np.array([getattr(r, name) for r in rows], dtype))

        return cls(
            temperature=col("temperature", np.float32),
            top_k=col("top_k", np.int32),
            top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32),
            repetition_penalty=col("repetition_penalty", np.float32),
            presence_penalty=col("presence_penalty", np.float32),
            frequency_penalty=col("frequency_penalty", np.float32),
            seed=to_device(np.array(seeds, np.uint32)),
            prompt_hash=to_device(np.array(prompt_hashes, np.uint32)),
            sample_index=to_device(np.array(sample_index, np.int32)),
            logprobs=to_device(np.array([-1 if r.logprobs is None else r.logprobs
                                         for r in rows], np.int32)),
            logit_bias=dense_logit_bias(rows, vocab_size),
        )


    @classmethod
    def of_defaults(cls, batch: int, vocab_size: int):
        """`batch` rows of `SamplingParams()`'s defaults, seed, prompt hash and sample index
        0. An exported program builds its rows from these (made outside its trace) with
        `.replace` of the fields it takes as inputs."""
        zeros = [0] * batch
        return cls.from_params([SamplingParams()] * batch, zeros, zeros, zeros, vocab_size)


def _zero_bias(batch: int, vocab_size: int) -> jax.Array:
    """Zeros on the devices of the mesh set now (`jax.set_mesh`; an engine on a mesh runs
    inside its own), one cached array per shape and mesh: an array placed for one mesh is
    refused by a program on another."""
    return _zeros_on(batch, vocab_size, jax.sharding.get_mesh())


@functools.lru_cache(maxsize=16)
def _zeros_on(batch: int, vocab_size: int, mesh) -> jax.Array:
    return jnp.zeros((batch, vocab_size), jnp.float32)  # immutable: safe to share


def dense_logit_bias(rows: list[SamplingParams], vocab_size: int) -> jax.Array:
    """float32 `[B, vocab_size]`: each row's `logit_bias` at its token ids, 0 elsewhere.
    When no row has a bias, one cached device array of zeros per shape (no `[B, V]` copy or
    fill dispatched on each engine step)."""
    if not any(r.logit_bias for r in rows):
        return _zero_bias(len(rows), vocab_size)
    bias = np.zeros((len(rows), vocab_size), np.float32)
    for b, r in enumerate(rows):
        for token_id, value in r.logit_bias:
            bias[b, token_id] = value
    return to_device(bias)


def apply_penalties(
    logits_BV, prompt_seen_BV, output_counts_BV, repetition_B, presence_B, frequency_B
):
    """Repetition, presence and frequency penalties (see the module docstring).

    Args:
      logits_BV: float32 logits. prompt_seen_BV: bool, token occurs in the prompt (real
        tokens only, never padding). output_counts_BV: int32 occurrences in the output so far.
    """
    in_output_BV = output_counts_BV > 0
    rep_B1 = repetition_B[:, None]
    penalized_BV = jnp.where(logits_BV > 0, logits_BV / rep_B1, logits_BV * rep_B1)
    logits_BV = jnp.where(prompt_seen_BV | in_output_BV, penalized_BV, logits_BV)
    return (
        logits_BV
        - presence_B[:, None] * in_output_BV
        - frequency_B[:, None] * output_counts_BV
    )


def apply_temperature(logits_BV, temperature_B):
    """Subtract the row maximum and divide by the temperature; greedy rows (0) divide by 1."""
    safe_B = jnp.where(temperature_B > 0, temperature_B, 1.0)
    shifted_BV = logits_BV - logits_BV.max(-1, keepdims=True)
    return shifted_BV / safe_B[:, None]


def top_p_keep(sorted_probs_BV, top_p_B):
    """Nucleus mask on probabilities sorted in descending order: keep a token iff the
    probability of the tokens before it is below top_p. The most likely token is always
    kept, and top_p >= 1 keeps every token (float rounding of the running sum cannot drop
    the tail).

    With probs [0.5, 0.25, 0.125, 0.125]: top_p 0.5 keeps {0}; 0.51, 0.6 and 0.75 keep
    {0, 1}; 1.0 keeps all.
    """
    B = sorted_probs_BV.shape[0]
    mass_before_BV = jnp.concatenate(
        [jnp.zeros((B, 1), sorted_probs_BV.dtype), jnp.cumsum(sorted_probs_BV, axis=-1)[:, :-1]],
        axis=-1,
    )
    top_p_B1 = top_p_B[:, None]
    return (mass_before_BV < top_p_B1).at[:, 0].set(True) | (top_p_B1 >= 1)


def min_p_keep(sorted_probs_BV, min_p_B):
    """Keep tokens whose probability is at least min_p times the row's largest (the first,
    as the probabilities are sorted in descending order)."""
    return sorted_probs_BV >= min_p_B[:, None] * sorted_probs_BV[:, :1]


def keep_sorted(sorted_logits_BV, top_k_B, top_p_B, min_p_B):
    """bool `[B, V]` over logits sorted in descending order: top-k, then top-p on the
    renormalized top-k distribution, then min-p. Each keeps a prefix, so their AND does; the
    first (most likely) token is always kept, so no setting empties a row."""
    V = sorted_logits_BV.shape[-1]
    k_B1 = jnp.where((top_k_B <= 0) | (top_k_B > V), V, top_k_B)[:, None]
    in_top_k_BV = jnp.arange(V)[None, :] < k_B1
    probs_BV = jax.nn.softmax(jnp.where(in_top_k_BV, sorted_logits_BV, -jnp.inf), axis=-1)
    keep_BV = in_top_k_BV & top_p_keep(probs_BV, top_p_B) & min_p_keep(probs_BV, min_p_B)
    return keep_BV.at[:, 0].set(True)


def filter_logits(logits_BV, top_k_B, top_p_B, min_p_B):
    """Top-k, top-p and min-p with one stable descending sort per row (ties by token id).
    Removed tokens get -inf; the most likely token is always kept.

    Args:
      logits_BV: float32 logits, finite where not already removed (-inf).
      top_k_B: int32, 0 or >= V is off. top_p_B: float32, 1 is off. min_p_B: 0 is off.
    """
    B, V = logits_BV.shape
    order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    keep_sorted_BV = keep_sorted(sorted_BV, top_k_B, top_p_B, min_p_B)
    keep_BV = jnp.zeros((B, V), bool).at[jnp.arange(B)[:, None], order_BV].set(keep_sorted_BV)
    return jnp.where(keep_BV, logits_BV, -jnp.inf)


# Constants of the prompt hash: murmur3's fmix32 multipliers, and the golden-ratio step
# (2**32 / phi) that spreads consecutive positions over the 32-bit range.
_FMIX_1, _FMIX_2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_GOLDEN = np.uint32(0x9E3779B9)


def fmix32(h):
    """murmur3's 32-bit finalizer on a uint32 array (numpy or jax.numpy, wrapping
    arithmetic): a bijection in which every input bit flips about half the output bits."""
    h = h ^ (h >> 16)
    h = h * _FMIX_1
    h = h ^ (h >> 13)
    h = h * _FMIX_2
    return h ^ (h >> 16)


def prompt_hashes(tokens_BT, lengths_B, xp=np):
    """uint32 `[B]`: a 32-bit hash of each row's first `lengths_B[b]` tokens (right-padded
    prompts; whatever lies past a row's length is ignored), computed with `xp` = numpy on
    the host or jax.numpy inside a program, bit for bit the same.

    For the token t at position i: `fmix32(uint32(t) ^ fmix32(i * GOLDEN + 1))`, a
    bijection of the token keyed by its position, so equal tokens at different places
    differ; the real positions' values are summed (wrapping; padding adds 0), the length
    xor'ed in and the sum finalized with `fmix32`, as murmur3 finishes.
    """
    T = tokens_BT.shape[1]
    position_1T = xp.arange(T, dtype=xp.uint32)[None, :]
    real_BT = position_1T < xp.asarray(lengths_B).astype(xp.uint32)[:, None]
    keyed_BT = fmix32(xp.asarray(tokens_BT).astype(xp.uint32) ^ fmix32(position_1T * _GOLDEN
                                                                         + np.uint32(1)))
    total_B = xp.where(real_BT, keyed_BT, np.uint32(0)).sum(axis=1, dtype=xp.uint32)
    return fmix32(total_B ^ xp.asarray(lengths_B).astype(xp.uint32))


def prompt_hash(tokens) -> int:
    """`prompt_hashes` of one prompt (token ids), mixed into its rows' keys so one seed
    given to different prompts does not give them the same noise. An exported program
    (`inference.export`) computes the same hash in its graph from the padded prompt."""
    tokens_1T = np.asarray(tokens, np.int64).reshape(1, -1)
    return int(prompt_hashes(tokens_1T, np.array([tokens_1T.shape[1]]))[0])


def row_keys(seed_B, prompt_hash_B, sample_index_B, step_B):
    """The PRNG key of each row at one step: from the request's own seed, its prompt's hash,
    its sample index and the row's step (a scalar for all rows, or `[B]`), never from the
    row's position in the batch or the moment it joined it."""

    def one(seed, prompt, index, step):
        key = jax.random.fold_in(jax.random.key(seed), prompt)
        return jax.random.fold_in(jax.random.fold_in(key, index), step)

    return jax.vmap(one)(seed_B, prompt_hash_B, sample_index_B,
                         jnp.broadcast_to(step_B, seed_B.shape))


def greedy_tokens(logits_BV: jax.Array) -> jax.Array:
    """int32 [B]: each row's first index of its largest logit, `jnp.argmax`'s choice, as
    two plain reductions (a max, then a min over the indices that reach it): XLA:CPU
    vectorizes those, not argmax's value-and-index reduction (benchmarks/README.md,
    "Sampling parameters"). `sample` maps NaN to -inf before it; a NaN row
    would give V - 1, still a token."""
    V = logits_BV.shape[-1]
    index_BV = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, 1)
    top_B1 = jnp.max(logits_BV, axis=-1, keepdims=True)
    return jnp.min(jnp.where(logits_BV == top_B1, index_BV, V - 1), axis=-1)


def prepare_logits(logits_BV, rows: SamplingArrays, prompt_seen_BV, output_counts_BV):
    """Steps 0-1 of the module docstring on float32 logits: `(penalized_BV, finite_B)`, the
    biased and penalized logits (NaN and a row with no finite value made harmless) and
    whether the row had any finite logit. Greedy reads `penalized_BV`; `scaled_logits`
    goes on from it."""
    logits_BV = logits_BV.astype(jnp.float32)
    finite_B = jnp.isfinite(logits_BV).any(-1)
    logits_BV = jnp.where(finite_B[:, None] & ~jnp.isnan(logits_BV), logits_BV, -jnp.inf)
    logits_BV = jnp.where(finite_B[:, None], logits_BV, 0.0)
    logits_BV = logits_BV + rows.logit_bias  # -inf (a banned token) stays -inf

    any_penalty = (
        (rows.repetition_penalty != 1) | (rows.presence_penalty != 0) | (rows.frequency_penalty != 0)
    ).any()
    logits_BV = jax.lax.cond(
        any_penalty,
        lambda x: apply_penalties(
            x, prompt_seen_BV, output_counts_BV,
            rows.repetition_penalty, rows.presence_penalty, rows.frequency_penalty,
        ),
        lambda x: x,
        logits_BV,
    )
    return logits_BV, finite_B


def scaled_logits(penalized_BV, rows: SamplingArrays):
    """Steps 3-4 of the module docstring: the logits a sampled row draws from
    (`jax.random.categorical`), temperature-scaled and filtered; the filters' sort runs only
    when some sampled row filters."""
    scaled_BV = apply_temperature(penalized_BV, rows.temperature)
    any_filter = (
        (rows.temperature > 0)
        & (((rows.top_k > 0) & (rows.top_k < penalized_BV.shape[-1])) | (rows.top_p < 1)
           | (rows.min_p > 0))
    ).any()
    return jax.lax.cond(
        any_filter,
        lambda x: filter_logits(x, rows.top_k, rows.top_p, rows.min_p),
        lambda x: x,
        scaled_BV,
    )


def sample(logits_BV, rows: SamplingArrays, prompt_seen_BV, output_counts_BV, step, pad_id=0):
    """Choose one token per row. Returns int32 `[B]`.

    Args:
      logits_BV: float32 or bfloat16 logits (computed in float32 here).
      rows: per-row parameters (`rows.logit_bias` is added first).
      prompt_seen_BV, output_counts_BV: history for penalties.
      step: int scalar or `[B]`, index of the token each row is generating (mixed into the
        row's key).
      pad_id: returned for rows whose logits have no finite value.
    """
    logits_BV, finite_B = prepare_logits(logits_BV, rows, prompt_seen_BV, output_counts_BV)
    greedy_B = greedy_tokens(logits_BV)
    sampled_rows_B = rows.temperature > 0

    def draw(logits_BV):
        keys_B = row_keys(rows.seed, rows.prompt_hash, rows.sample_index, step)
        return jax.vmap(jax.random.categorical)(keys_B, scaled_logits(logits_BV, rows)).astype(
            jnp.int32)

    # An all-greedy batch draws no random numbers: the [B, V] Gumbel noise cost as much as
    # the rest of sampling (benchmarks/README.md).
    drawn_B = jax.lax.cond(sampled_rows_B.any(), draw, lambda _: greedy_B, logits_BV)
    tokens_B = jnp.where(sampled_rows_B, drawn_B, greedy_B)
    return jnp.where(finite_B, tokens_B, pad_id)
