"""Speculative decoding inside the compiled decode loop: n-gram (prompt lookup) proposal,
verification of the drafts against the target model's distribution, and each row's
adaptive draft length.

One speculative step per row: propose up to k tokens by finding the row's last n tokens
earlier in its prompt and output and copying what followed them (prompt lookup decoding,
Saxena 2023; vLLM's `NgramProposer`), feed the last sampled token and the drafts (k + 1
positions) through the cache in one forward (`inference.verify`), then decide every
position at once (`choose_positions`, one pass over B * T rows) as if the drafts before it
were accepted, the only case in which its token counts: position j's distribution p is the
target's after every sampling transform of `inference.sampling` (logit_bias, min_tokens,
penalties counting the drafts before j, temperature, top-k/p, min-p), and a drafted token x
drawn from q is accepted with
probability min(1, p(x)/q(x)); the first rejection emits a token from the residual
max(0, p - q), normalized, and a run of accepted drafts ends with one token from p
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM decoding with speculative sampling"). The emitted
tokens are then distributed as without speculation. For an n-gram draft q is one-hot at x:
accept with probability p(x), else draw from p without x. A greedy row's p is one-hot at
its argmax, so it emits exactly the tokens of greedy decoding. The row emits its accepted
drafts and the token at the first refusal (or after the last draft), each recorded in order
as decoding records one (`inference.decode.record_token`): EOS, stop sequences,
max_new_tokens and log-probs (from the target's raw logits) act inside an accepted run
exactly as they would token by token, and a row that stops there emits nothing after.

Random draws come from the row's key at the token's step (`sampling.row_keys`: seed,
prompt hash, sample index, step): a position without a draft draws exactly as
non-speculative sampling does; the acceptance test and the residual draw use that key
folded with 1 and 2. Rows decide alone: drafts, acceptance and draft length read only the
row's own tokens.

Adaptive draft length: a row starts at its `num_speculative_tokens`; a verification that
accepts every draft raises k by one (up to that), one that accepts none lowers it by one;
at zero the row pauses drafting for PAUSE_START steps, doubling (to PAUSE_MAX) while its
drafts keep failing, then tries k = 1 again. Cost-aware: the row also pauses (at least
PAUSE_START steps, longer the more a verification would lose: see `adapt`) when the tokens
it expects from a verification at its recent acceptance rate (`spec_cost.expected_tokens`)
do not beat what a verification costs in decode steps (`SpecArrays.cost`,
`spec_cost.verify_cost`), and probes again after the pause. A chunk step where no row
drafts runs the plain decode step (`inference.verify.verifier`).

Shapes: the letters of `gpt_jax.model`, W a row's window of its last tokens
(`inference.decode`), and here G the n-gram length and K the drafts per step (the batch's
widest k, static).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from inference import stopping
from inference.spec_cost import expected_tokens, row_costs
from inference.decode import CHUNK, DecodeState, record_token, sample_and_record
from inference.sampling import greedy_tokens, prepare_logits, row_keys, scaled_logits
from inference.sampling_params import MAX_NGRAM
from inference.transfer import to_device

PAUSE_START = 8  # steps a row waits before drafting again, the first time its k reaches 0
PAUSE_MAX = 256  # the longest wait, reached by doubling while drafts keep failing
RATE_DECAY = 0.5  # weight of the previous acceptance rate in the row's running average
PROBE_LOSS = 0.05  # an unprofitable row waits until a probe costs at most this share of it
NO_RATE = -1.0  # a row's acceptance rate before its first verification (which it always tries)


@struct.dataclass
class SpecArrays:
    """Per-row speculative decoding settings as arrays (traced: no recompile per value)."""

    k_max: jax.Array  # [B] int32, the row's num_speculative_tokens; 0 = not speculative
    ngram_min: jax.Array  # [B] int32, shortest n-gram to match
    ngram_max: jax.Array  # [B] int32, longest n-gram to match
    # [B] bool, the row drafts with the draft model (`inference.draft`), not n-grams; None:
    # no row does
    use_draft: jax.Array | None = None
    # [B] float32, what a round of the row's k costs in steps of the row not drafting
    # (`spec_cost.row_costs`: a verification, and a draft model's steps); a row drafts while
    # it expects more tokens per round. 1: only failing drafts stop it
    cost: jax.Array | float = 1.0

    @classmethod
    def from_params(cls, rows, config, draft_config=None):
        """The arrays of these rows' SamplingParams for a model of `config` and the draft
        model of `draft_config` (each row's cost `spec_cost.row_costs`; `use_draft` None
        when no row drafts with a draft model)."""
        ks = [r.num_speculative_tokens if r.speculative else 0 for r in rows]
        col = lambda f: to_device(np.array([f(r) for r in rows], np.int32))  # noqa: E731
        drafted = [r.speculative == "draft" for r in rows]
        return cls(k_max=to_device(np.array(ks, np.int32)),
                   ngram_min=col(lambda r: r.prompt_lookup_min),
                   ngram_max=col(lambda r: r.prompt_lookup_max),
                   use_draft=to_device(np.array(drafted)) if any(drafted) else None,
                   cost=to_device(row_costs(config, ks, draft_config, drafted)))


def width_of(rows) -> int:
    """K, the drafts a step verifies per row: the widest speculative row's k (0: none)."""
    return max((r.num_speculative_tokens for r in rows if r.speculative), default=0)


@struct.dataclass
class SpecState:
    """Each row's draft length and counters."""

    k: jax.Array  # [B] int32, drafts to propose at the next step (adaptive)
    pause: jax.Array  # [B] int32, steps left before the row drafts again
    backoff: jax.Array  # [B] int32, the next pause
    drafted: jax.Array  # [B] int32, drafted tokens verified
    accepted: jax.Array  # [B] int32, of those, accepted
    verifications: jax.Array  # [B] int32, steps in which the row verified drafts
    steps: jax.Array  # [B] int32, forward steps the row ran
    # [B] float32, running average of the share of drafts accepted per verification
    # (RATE_DECAY), the first verification's share alone; NO_RATE before it
    rate: jax.Array

    @classmethod
    def init(cls, arrays: SpecArrays):
        zeros = jnp.zeros_like(arrays.k_max)
        return cls(k=arrays.k_max, pause=zeros, backoff=jnp.full_like(zeros, PAUSE_START),
                   drafted=zeros, accepted=zeros, verifications=zeros, steps=zeros,
                   rate=jnp.full_like(zeros, NO_RATE, jnp.float32))


def ngram_propose(window_BW, n_hist_B, ngram_min_B, ngram_max_B, width: int):
    """Prompt lookup: for each row, the longest n in [ngram_min, ngram_max] whose last n
    tokens occur earlier in its history, and the (up to `width`) tokens that followed the
    latest such occurrence.

    Args:
      window_BW: int32, each row's last W tokens, the newest last (right-aligned).
      n_hist_B: int32, how many of them are the row's (the rest, on the left, is padding).
    Returns:
      `(drafts_BK, available_B)`: int32 `[B, width]` drafted tokens, and how many of them
      are real (0: no match).
    """
    B, W = window_BW.shape
    at_W = jnp.arange(W)
    best_B, found_B = jnp.zeros((B,), jnp.int32), jnp.zeros((B,), bool)
    for n in range(MAX_NGRAM, 0, -1):  # longest first: the first size that matches wins
        match_BW = (at_W[None, :] >= W - n_hist_B[:, None]) & (at_W[None, :] + n < W)
        for j in range(n):  # token i + j equals the suffix's token j
            shifted_BW = jnp.pad(window_BW[:, j:], ((0, 0), (0, j)), constant_values=-1)
            match_BW &= shifted_BW == window_BW[:, W - n + j][:, None]
        latest_B = jnp.max(jnp.where(match_BW, at_W[None, :], -1), axis=-1)
        use_B = ~found_B & (latest_B >= 0) & (ngram_min_B <= n) & (n <= ngram_max_B)
        best_B = jnp.where(use_B, latest_B + n, best_B)  # where the continuation starts
        found_B |= use_B
    at_BK = best_B[:, None] + jnp.arange(width)[None, :]
    drafts_BK = jnp.take_along_axis(window_BW, jnp.clip(at_BK, 0, W - 1), axis=1)
    available_B = jnp.where(found_B, jnp.minimum(W - best_B, width), 0)
    return drafts_BK.astype(jnp.int32), available_B.astype(jnp.int32)


def residual_probs(p_V, q_V):
    """The residual distribution after a rejected draft, unnormalized: max(0, p - q)."""
    return jnp.maximum(p_V - q_V, 0.0)


def verify_draft(key, scaled_V, draft, has_draft, q_V):
    """One sampled row's token at one position: without a draft, a draw from `scaled_V`
    with `key` (exactly `sampling.sample`'s draw); with one, the draft accepted with
    probability min(1, p(x)/q(x)), else a draw from `residual_probs` (p = softmax of
    `scaled_V`, q = `q_V`, the draft's distribution). Returns int32 scalar."""
    plain = jax.random.categorical(key, scaled_V)
    p_V = jax.nn.softmax(scaled_V)
    u = jax.random.uniform(jax.random.fold_in(key, 1))
    accept = u * q_V[draft] < p_V[draft]
    residual = jax.random.categorical(jax.random.fold_in(key, 2),
                                      jnp.log(residual_probs(p_V, q_V)))
    return jnp.where(has_draft, jnp.where(accept, draft, residual), plain).astype(jnp.int32)


def choose(step_B, seen_BV, counts_BV, logits_BV, draft_B, has_B, q_BV, rows, stops,
           pad_id):
    """The token each row emits at step `step_B` (with `seen_BV` its prompt's tokens and
    `counts_BV` its output's counts so far), from the target's raw `logits_BV` after every
    sampling transform (as `decode.sample_and_record` samples), given its draft `draft_B`
    where `has_B` (drawn from `q_BV`). A greedy row emits its argmax (so a draft is
    accepted iff it is that). Returns int32 `[B]`."""
    logits_BV = stopping.ban_early_eos(logits_BV, step_B, stops)
    penalized_BV, finite_B = prepare_logits(logits_BV, rows, seen_BV, counts_BV)
    greedy_B = greedy_tokens(penalized_BV)
    sampled_B = rows.temperature > 0

    def draw(penalized_BV):
        keys_B = row_keys(rows.seed, rows.prompt_hash, rows.sample_index, step_B)
        return jax.vmap(verify_draft)(keys_B, scaled_logits(penalized_BV, rows), draft_B,
                                      has_B, q_BV)

    drawn_B = jax.lax.cond(sampled_B.any(), draw, lambda _: greedy_B, penalized_BV)
    return jnp.where(finite_B, jnp.where(sampled_B, drawn_B, greedy_B), pad_id)


def choose_positions(state: DecodeState, logits_BTV, drafts_BT, has_BT, q_BTV, rows, stops,
                     pad_id):
    """`choose` at every fed position at once, as if each row's drafts before it were
    accepted (the only case in which its token is emitted): position j is the row's step
    + j, its output counts those of the state plus drafts 0..j-1. One pass over the B * T
    positions instead of T passes over B rows. Returns int32 `[B, T]`."""
    B, T, V = logits_BTV.shape
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    per_position = lambda x: jnp.repeat(x, T, axis=0)  # noqa: E731
    before_BTV = jnp.cumsum(jax.nn.one_hot(drafts_BT, V, dtype=jnp.int32), axis=1) \
        - jax.nn.one_hot(drafts_BT, V, dtype=jnp.int32)  # drafts 0..j-1 of position j
    step_BT = state.step[:, None] + jnp.arange(T)[None, :]
    tokens = choose(flat(step_BT), per_position(state.prompt_seen),
                    flat(state.output_counts[:, None, :] + before_BTV), flat(logits_BTV),
                    flat(drafts_BT), flat(has_BT), flat(q_BTV),
                    jax.tree.map(per_position, rows.replace(constraint=None)),
                    jax.tree.map(per_position, stops), pad_id)
    return tokens.reshape(B, T)


def room_lengths(state: DecodeState, spec: SpecState, stops, k_B, limit):
    """How many of `k_B` drafts each row verifies: at most its adaptive k (none while
    paused or finished), one less than the tokens it may still emit, and what fits below
    `limit` (int or `[B]`: positions its cache holds)."""
    room_B = jnp.minimum(stops.max_new_tokens - state.num_tokens,
                         limit - state.model.lengths) - 1
    k_B = jnp.minimum(jnp.minimum(spec.k, k_B), room_B)
    return jnp.where(~state.done & (spec.pause == 0), jnp.maximum(k_B, 0), 0)


def draft_lengths(state: DecodeState, spec: SpecState, arrays: SpecArrays, stops, width: int,
                  limit):
    """`(drafts_BK, k_B)`: each running row's n-gram drafts and how many to verify
    (`room_lengths`, and at most the match's length)."""
    n_hist_B = jnp.minimum(state.window.shape[1], state.model.lengths + 1)
    drafts_BK, available_B = ngram_propose(state.window, n_hist_B, arrays.ngram_min,
                                           arrays.ngram_max, width)
    return drafts_BK, room_lengths(state, spec, stops, available_B, limit)


def adapt(spec: SpecState, arrays: SpecArrays, k_B, accepted_B, ran_B) -> SpecState:
    """The counters and next draft length after a step that verified `k_B` drafts per row
    and accepted `accepted_B` (see the module docstring). A row that failed every draft at
    k = 1 pauses for its backoff; one whose expected tokens per verification at its next k
    and running acceptance rate are at most `arrays.cost` (unprofitable) pauses for its
    backoff or, if longer, until the probe's expected loss (cost - expected tokens, in
    steps) is PROBE_LOSS of the wait, at most PAUSE_MAX; the backoff doubles after either.
    Reads only the row's own values."""
    verified_B = k_B > 0
    all_B, none_B = verified_B & (accepted_B == k_B), verified_B & (accepted_B == 0)
    k_next_B = jnp.where(all_B, jnp.minimum(spec.k + 1, arrays.k_max),
                         jnp.where(none_B, spec.k - 1, spec.k))
    share_B = accepted_B / jnp.maximum(k_B, 1)
    average_B = jnp.where(spec.rate >= 0, RATE_DECAY * spec.rate + (1 - RATE_DECAY) * share_B,
                          share_B)
    rate_B = jnp.where(verified_B, average_B, spec.rate)
    loss_B = arrays.cost - expected_tokens(rate_B, jnp.maximum(k_next_B, 0))
    failed_B = none_B & (k_next_B <= 0)
    unprofitable_B = verified_B & (loss_B > 0)
    stopped_B = failed_B | unprofitable_B
    wait_B = jnp.where(unprofitable_B, jnp.maximum(
        spec.backoff, jnp.ceil(loss_B / PROBE_LOSS).astype(jnp.int32)), spec.backoff)
    return spec.replace(
        k=jnp.where(failed_B, jnp.minimum(1, arrays.k_max), k_next_B),
        pause=jnp.where(stopped_B, jnp.minimum(wait_B, PAUSE_MAX),
                        jnp.maximum(spec.pause - ran_B, 0)),
        backoff=jnp.where(stopped_B, jnp.minimum(2 * spec.backoff, PAUSE_MAX),
                          jnp.where(accepted_B > 0, PAUSE_START, spec.backoff)),
        drafted=spec.drafted + k_B, accepted=spec.accepted + accepted_B,
        verifications=spec.verifications + verified_B, steps=spec.steps + ran_B, rate=rate_B)


def speculative_step(state: DecodeState, spec: SpecState, verify_fn, rows, stops,
                     arrays: SpecArrays, *, width: int, limit, pad_id: int):
    """One speculative step for every running row: propose n-gram drafts
    (`draft_lengths`), then `verify_drafts`. Returns `(state, spec)`."""
    drafts_BK, k_B = draft_lengths(state, spec, arrays, stops, width, limit)
    state, spec, _ = verify_drafts(state, spec, verify_fn, rows, stops, arrays, drafts_BK, k_B,
                                   None, width=width, pad_id=pad_id)
    return state, spec


def verify_drafts(state: DecodeState, spec: SpecState, verify_fn, rows, stops,
                  arrays: SpecArrays, drafts_BK, k_B, q_BKV, *, width: int, pad_id: int):
    """Verify each running row's first `k_B` drafts `drafts_BK` (int32 `[B, width]`) in one
    forward (`verify_fn`, `inference.verify.verifier`), emit and record the accepted drafts
    and one more token, set the row's cache length to what it emitted. `q_BKV`: float32
    `[B, width, V]`, the distribution each draft was drawn from (None: n-gram drafts, q
    one-hot). Returns `(state, spec, emitted_B)`, emitted_B int32 the tokens each row
    emitted."""
    running_B = ~state.done
    lengths_B = state.model.lengths
    fed_BT = jnp.concatenate([state.next_token[:, None], drafts_BK], axis=1)
    logits_BTV, cache = verify_fn(fed_BT, state.model, jnp.where(running_B, k_B + 1, 0))
    V = logits_BTV.shape[-1]
    drafts_BT = jnp.pad(drafts_BK, ((0, 0), (0, 1)))  # position `width` has no draft
    has_BT = jnp.arange(width + 1)[None, :] < k_B[:, None]
    q_BTV = jax.nn.one_hot(drafts_BT, V) if q_BKV is None else \
        jnp.pad(q_BKV, ((0, 0), (0, 1), (0, 0)))  # position `width`: no draft

    def choose_first(T):  # the first T positions' tokens, padded to width + 1
        tokens_BT = choose_positions(state, logits_BTV[:, :T], drafts_BT[:, :T], has_BT[:, :T],
                                     q_BTV[:, :T], rows, stops, pad_id)
        return jnp.pad(tokens_BT, ((0, 0), (0, width + 1 - T)), constant_values=pad_id)

    # a step in which no row drafts decides position 0 only, as a decode step does
    tokens_BT = jax.lax.cond((k_B > 0).any(), lambda: choose_first(width + 1),
                             lambda: choose_first(1))
    # drafts accepted before the first refusal: the row emits those and one token more
    run_B = jnp.cumprod((has_BT & (tokens_BT == drafts_BT)).astype(jnp.int32), axis=1).sum(1)

    def position(carry):  # record the emitted tokens in order, while some row's run goes on
        j, state, alive_B, emitted_B = carry
        state = record_token(state, tokens_BT[:, j], logits_BTV[:, j], alive_B, rows, stops,
                             pad_id)
        return j + 1, state, alive_B & (j < run_B) & ~state.done, emitted_B + alive_B

    # a loop, not unrolled: one copy of the record code to compile, and it stops at the
    # last position any row reached; the cache stays outside it
    _, state, _, emitted_B = jax.lax.while_loop(
        lambda c: c[2].any(), position,
        (0, state.replace(model=None), running_B, jnp.zeros_like(k_B)))
    cache = cache.replace(lengths=jnp.where(running_B, lengths_B + emitted_B, cache.lengths))
    # a row that stopped inside its run emitted only accepted drafts
    accepted_B = jnp.minimum(run_B, emitted_B)
    return (state.replace(model=cache), adapt(spec, arrays, k_B, accepted_B, running_B),
            emitted_B)


def plain_step(state: DecodeState, spec: SpecState, verify_fn, rows, stops, pad_id: int):
    """One decode step of every running row, no row drafting: the verification's one-token
    forward (`verify_fn` fed one token per row) and `decode.sample_and_record`, as
    `inference.decode.decode_one` runs it, without the speculative step's proposal and
    bookkeeping. The rows' pauses count down. Returns `(state, spec)`."""
    running_B = ~state.done
    logits_BTV, cache = verify_fn(state.next_token[:, None], state.model,
                                  running_B.astype(jnp.int32))
    state = sample_and_record(state.replace(model=cache), logits_BTV[:, 0], running_B, rows,
                              stops, pad_id)
    return state, spec.replace(pause=jnp.maximum(spec.pause - running_B, 0),
                               steps=spec.steps + running_B)


def speculative_chunk(state: DecodeState, spec: SpecState, verify_fn, rows, stops,
                      arrays: SpecArrays, *, width: int, limit, pad_id: int):
    """CHUNK steps (`lax.scan`): speculative steps, or plain decode steps (`plain_step`)
    when no running row can draft within the chunk (each is paused for CHUNK steps or
    more, or does not speculate), so rows that stopped drafting pay a decode step's cost,
    not a speculative step's. Returns `(state, spec)`."""
    def step(carry, _):
        return speculative_step(*carry, verify_fn, rows, stops, arrays, width=width,
                                limit=limit, pad_id=pad_id), None

    def plain(carry, _):
        return plain_step(*carry, verify_fn, rows, stops, pad_id), None

    idle = (state.done | (arrays.k_max == 0) | (spec.pause >= CHUNK)).all()
    return jax.lax.cond(idle, lambda c: jax.lax.scan(plain, c, None, length=CHUNK)[0],
                        lambda c: jax.lax.scan(step, c, None, length=CHUNK)[0], (state, spec))


def speculative_loop(state: DecodeState, spec: SpecState, verify_fn, rows, stops,
                     arrays: SpecArrays, *, width: int, limit, pad_id: int):
    """Chunks of CHUNK steps (`speculative_chunk`) inside a `lax.while_loop` until every
    row has finished, as `inference.decode.decode_loop`. Returns `(state, spec)`."""
    return jax.lax.while_loop(
        lambda c: ~c[0].done.all(),
        lambda c: speculative_chunk(*c, verify_fn, rows, stops, arrays, width=width,
                                    limit=limit, pad_id=pad_id), (state, spec))


def with_counts(completions, requests, spec: SpecState):
    """`completions` (one per decode row, in order) with each speculative request's counts
    from the host copy of the final `spec` (`generation.Completion.speculation`)."""
    for b, (completion, sp) in enumerate(zip(completions, requests)):
        if sp.speculative:
            completion.speculation = {"drafted": int(spec.drafted[b]),
                                      "accepted": int(spec.accepted[b]),
                                      "steps": int(spec.steps[b])}
    return completions
