"""Inference: jitted prefill and decode step, and the generation loop as one XLA program.

Prefill and decode are written for one sequence (`gpt_jax.model.transformer` on one cache
row; in the generation loop, `gpt_jax.model.decode_paged` on one row of a paged cache) and
`jax.vmap`ped over a padded batch, so every row has its own length, write index and
positions, and a row's output never depends on the other rows.

`generate` runs the whole token loop inside one jitted program: a `lax.scan` over a chunk of
steps inside a `lax.while_loop` that exits once every row has finished. A request with
`n > 1` is prefilled once: the prompt rows are prefilled, then their cache rows, logits and
prompt history are repeated (`take_rows`) into one decode row per sample. The loop takes the
model as two functions (`prefill_fn`, `step_fn`), so `naive_generate` (inference.naive) runs
the same loop, sampler and stop logic with full recomputation instead of a cache.

Bounded compilation: prompt length, batch size and max_new_tokens are padded to power-of-two
buckets, and sampling parameters are traced arrays, so a new program is compiled only for a
new bucket. `compile_counts()` reports how many programs each entry point has compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import secrets
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import gpt_jax.model
from gpt_jax.cache import CACHE_BATCH_AXES, KVCache, split_pages
from gpt_jax.config import GPTConfig
from gpt_jax.model import Params, decode_layout, decode_paged, lm_head, transformer
from gpt_jax.params import check_params
from inference import stopping
from inference.sampling import MAX_LOGPROBS, SamplingArrays, SamplingParams, sample

CHUNK = 8  # decode steps per scan chunk; the loop may stop early at chunk boundaries
MIN_PROMPT_BUCKET = 16


# ----------------------------------------------------------------------------- model steps


def _prefill_row(params, tokens_T, length, cache, bound, *, config, padding_side):
    if padding_side == "left":  # move the real tokens to the front: positions start at 0
        tokens_T = jnp.roll(tokens_T, length - tokens_T.shape[0])
    x_TD, cache = transformer(params, tokens_T, cache, config, n_valid=length, bound=bound)
    return lm_head(params, x_TD[jnp.maximum(length - 1, 0)], config), cache


def _decode_row(params, token, advance, cache, bound, *, config):
    x_TD, cache = transformer(params, token[None], cache, config,
                              n_valid=advance.astype(jnp.int32), bound=bound)
    return lm_head(params, x_TD[0], config), cache


def _decode_paged_row(params, token, advance, cache, bound, *, config):
    x_D, cache = decode_paged(params, token, cache, config, advance, bound)
    return lm_head(params, x_D, config), cache


@struct.dataclass
class LoopCache:
    """The KV cache as the generation loop carries it: KVCache's fields, batch axis first.

    vmap's batching rules move a mapped axis to the front before any dynamic slice or
    scatter, so a cache carried as `[L, B, K, S, H]` would be transposed (copied whole) on
    every decode step. Batch-major, the per-row reads and the write of the new token touch
    only those slots, in place. Prefill writes it whole (`[B, L, K, S, H]`); the decode loop
    carries it paged (`page`).
    """

    k: jax.Array | tuple  # [B, L, K, S, H] keys, or per layer a tuple of [B, K, P, H] pages
    v: jax.Array | tuple  # values, as k
    lengths: jax.Array  # [B] int32, slots written per row
    overflow: jax.Array  # [B] bool, a write past the last slot was refused


def _vmap_rows(row_fn, cache, *batched):
    """vmap `row_fn(params, *batched_rows, cache_row, bound)` over the rows of a KVCache or
    LoopCache. `bound` is the longest row's length, passed unmapped: every row reads the
    same cache blocks, so the attention loop has one trip count (the live length)."""
    loop = isinstance(cache, LoopCache)
    cache_type, cache_axes = (LoopCache, 0) if loop else (KVCache, CACHE_BATCH_AXES)

    def run(*args):
        *rest, c, bound = args
        logits, c = row_fn(*rest, KVCache(k=c.k, v=c.v, lengths=c.lengths, overflow=c.overflow),
                           bound)
        return logits, cache_type(k=c.k, v=c.v, lengths=c.lengths, overflow=c.overflow)

    in_axes = (None,) + (0,) * (len(batched) - 1) + (cache_axes, None)
    return jax.vmap(run, in_axes=in_axes, out_axes=(0, cache_axes))(
        *batched, cache, cache.lengths.max()
    )


def _prefill(params, config, tokens_BT, lengths_B, cache, padding_side="right"):
    row = functools.partial(_prefill_row, config=config, padding_side=padding_side)
    return _vmap_rows(row, cache, params, tokens_BT, lengths_B)


def _decode(params, config, tokens_B, cache, advance_B):
    row = functools.partial(_decode_row, config=config)
    return _vmap_rows(row, cache, params, tokens_B, advance_B)


@functools.partial(jax.jit, static_argnames=("config", "padding_side"))
def prefill(params: Params, config: GPTConfig, tokens_BS, lengths_B, cache: KVCache,
            padding_side: str = "right"):
    """Run padded prompts into the cache. Returns `(logits_BV, cache)`.

    Args:
      tokens_BS: int32 prompts padded to a common length S; row b's real tokens are its
        first `lengths_B[b]` (`padding_side="right"`) or its last (`"left"`).
      lengths_B: int32 real prompt lengths, >= 1.
      cache: written from each row's current length (0 for a fresh cache).
    Returns:
      float32 next-token logits `[B, V]` at each row's last real token, and the cache with
      `lengths` advanced by `lengths_B`. A write past the cache end is refused and flagged
      in `cache.overflow` (check bounds before calling; `generate` does).
    """
    return _prefill(params, config, tokens_BS, lengths_B, cache, padding_side)


@functools.partial(jax.jit, static_argnames="config")
def decode_step(params: Params, config: GPTConfig, tokens_B, cache: KVCache):
    """Feed one token per row at its current length. Returns `(logits_BV, cache)`, float32
    logits `[B, V]` and the cache with every row's length advanced by one."""
    return _decode(params, config, tokens_B, cache, jnp.ones(tokens_B.shape, bool))


# ----------------------------------------------------------------------------- the loop


@struct.dataclass
class DecodeState:
    model: KVCache | struct.PyTreeNode  # the cache (or, for naive decoding, the sequences)
    logits: jax.Array  # [B, V] float32, next-token logits
    tokens: jax.Array  # [B, N] int32, generated tokens; pad_id after a row's end
    logprobs: jax.Array  # [B, N] float32, model log-prob of each token (0 if none asked, R = 0)
    top_ids: jax.Array  # [B, N, R] int32, most likely alternatives per step (R = 0 if off)
    top_logprobs: jax.Array  # [B, N, R] float32, their log-probs
    step: jax.Array  # [] int32, index of the next token to generate
    done: jax.Array  # [B] bool, row has finished
    finish: jax.Array  # [B] int32, stopping.RUNNING / EOS / STOP / LENGTH
    num_tokens: jax.Array  # [B] int32, output tokens (EOS kept, a token stop sequence cut)
    recent: jax.Array  # [B, M] int32, last M generated tokens (stopping.BEFORE_START before)
    prompt_seen: jax.Array  # [B, V] bool, token occurs among the row's real prompt tokens
    output_counts: jax.Array  # [B, V] int32, occurrences among the generated tokens


StepFn = Callable  # (tokens_B, model_state, advance_B) -> (logits_BV, model_state)


def prompt_seen(tokens_PT, lengths_P, vocab_size: int):
    """bool `[P, V]`: the token occurs among the row's real prompt tokens (never padding)."""
    P, T = tokens_PT.shape
    real_PT = jnp.arange(T)[None, :] < lengths_P[:, None]
    return jnp.zeros((P, vocab_size), jnp.int32).at[jnp.arange(P)[:, None], tokens_PT].add(real_PT) > 0


def take_rows(model, source_B):
    """Decode row b of the model state is prefill row `source_B[b]`: the n samples of one
    prompt share its prefill. The batch axis is 0 of every leaf, except a KVCache's k and v."""
    axes = CACHE_BATCH_AXES if isinstance(model, KVCache) else jax.tree.map(lambda _: 0, model)
    return jax.tree.map(lambda x, axis: jnp.take(x, source_B, axis=axis), model, axes)


def init_state(model, logits_BV, seen_BV, stops, *, n_steps, n_top) -> DecodeState:
    B, V = logits_BV.shape
    done_B = stops.max_new_tokens <= 0
    return DecodeState(
        model=model,
        logits=logits_BV,
        tokens=jnp.zeros((B, n_steps), jnp.int32),
        logprobs=jnp.zeros((B, n_steps), jnp.float32),
        top_ids=jnp.zeros((B, n_steps, n_top), jnp.int32),
        top_logprobs=jnp.zeros((B, n_steps, n_top), jnp.float32),
        step=jnp.zeros((), jnp.int32),
        done=done_B,
        finish=jnp.where(done_B, stopping.LENGTH, stopping.RUNNING),
        num_tokens=jnp.zeros((B,), jnp.int32),
        recent=jnp.full((B, stops.stop_sequences.shape[-1]), stopping.BEFORE_START, jnp.int32),
        prompt_seen=seen_BV,
        output_counts=jnp.zeros((B, V), jnp.int32),
    )


def decode_one(state: DecodeState, step_fn: StepFn, rows: SamplingArrays,
               stops: stopping.StopArrays, pad_id: int) -> DecodeState:
    """Sample one token per running row, record it, then feed it to the model.

    Stop checks, in order: an EOS id (kept), a token stop sequence the output now ends with
    (cut: `num_tokens` drops its length), `max_new_tokens`. A finished row stops changing:
    it records pad_id, adds nothing to its counts or log-probs, and its cache length no
    longer advances.
    """
    i, B = state.step, state.done.shape[0]
    running_B = ~state.done
    token_B = sample(state.logits, rows, state.prompt_seen, state.output_counts, i, pad_id)
    token_B = jnp.where(running_B, token_B, pad_id)

    if state.top_ids.shape[-1]:  # some row asked for log-probs (see `pack`)
        logprobs_BV = jax.nn.log_softmax(state.logits, axis=-1)
        token_logprob_B = jnp.take_along_axis(logprobs_BV, token_B[:, None], axis=-1)[:, 0]
        top_logprobs_BR, top_ids_BR = jax.lax.top_k(logprobs_BV, state.top_ids.shape[-1])
    else:  # none did: skip the [B, V] log-softmax (~3% of a gpt2 batch-32 step)
        token_logprob_B = jnp.zeros((B,), jnp.float32)
        top_logprobs_BR, top_ids_BR = state.top_logprobs[:, 0], state.top_ids[:, 0]

    num_tokens_B = state.num_tokens + running_B
    recent_BM = jnp.where(
        running_B[:, None],
        jnp.concatenate([state.recent[:, 1:], token_B[:, None]], axis=1),
        state.recent,
    )
    eos_B = running_B & stopping.is_eos(token_B, stops.stop_token_ids)
    stop_len_B = jnp.where(running_B & ~eos_B,
                           stopping.matched_stop_length(recent_BM, stops.stop_sequences), 0)
    stop_B = stop_len_B > 0
    full_B = running_B & (num_tokens_B >= stops.max_new_tokens)
    finish_B = jnp.select([eos_B, stop_B, full_B],
                          [stopping.EOS, stopping.STOP, stopping.LENGTH], state.finish)
    done_B = state.done | eos_B | stop_B | full_B

    # Always feed (finished rows do not advance): a lax.cond skipping the step once every
    # row is done made XLA copy the whole KV cache in both branches on every step.
    logits_BV, model = step_fn(token_B, state.model, ~done_B)
    return state.replace(
        model=model,
        logits=logits_BV,
        tokens=state.tokens.at[:, i].set(token_B),
        logprobs=state.logprobs.at[:, i].set(jnp.where(running_B, token_logprob_B, 0.0)),
        top_ids=state.top_ids.at[:, i].set(top_ids_BR),
        top_logprobs=state.top_logprobs.at[:, i].set(top_logprobs_BR),
        step=i + 1,
        done=done_B,
        finish=finish_B,
        num_tokens=num_tokens_B - stop_len_B,
        recent=recent_BM,
        output_counts=state.output_counts.at[jnp.arange(B), token_B].add(running_B.astype(jnp.int32)),
    )


def decode_chunk(state, step_fn, rows, stops, pad_id, chunk=CHUNK) -> DecodeState:
    """`chunk` decode steps as one `lax.scan`."""
    body = lambda s, _: (decode_one(s, step_fn, rows, stops, pad_id), None)  # noqa: E731
    return jax.lax.scan(body, state, None, length=chunk)[0]


def decode_loop(state, step_fn, rows, stops, pad_id) -> DecodeState:
    """Scan chunks inside a `lax.while_loop` until every row has finished."""
    return jax.lax.while_loop(
        lambda s: ~s.done.all(),
        lambda s: decode_chunk(s, step_fn, rows, stops, pad_id),
        state,
    )


# ------------------------------------------------------------------- the cached model pair


def page(cache: LoopCache) -> LoopCache:
    """The cache with each layer's k and v split into pages of ATTENTION_BLOCK slots
    (`gpt_jax.cache.split_pages`; one copy, after prefill): the decode loop's layout, where
    attention hands live pages to its matmuls whole. Cutting blocks out of one buffer
    instead copied every live block on every step, and with them a defensive copy of the
    whole cache: removing both halved the gpt2 batch-32 step (408 -> 189 ms)."""
    def pages(buf_BLKSH):
        return tuple(split_pages(buf_BLKSH[:, layer], gpt_jax.model.ATTENTION_BLOCK, axis=2)
                     for layer in range(buf_BLKSH.shape[1]))

    return cache.replace(k=pages(cache.k), v=pages(cache.v))


def cached_model(params, config, capacity, cache_dtype):
    """`(prefill_fn, step_fn)` over a batch-major KV cache (`LoopCache`) of `capacity`
    slots per row. The weights take the decode layout once here, outside the decode loop."""
    params = decode_layout(params)

    def prefill_fn(tokens_BT, lengths_B):
        B = tokens_BT.shape[0]
        shape = (B, config.n_layers, config.kv_heads, capacity, config.head_dim)
        cache = LoopCache(k=jnp.zeros(shape, cache_dtype), v=jnp.zeros(shape, cache_dtype),
                          lengths=jnp.zeros((B,), jnp.int32), overflow=jnp.zeros((B,), bool))
        logits_BV, cache = _prefill(params, config, tokens_BT, lengths_B, cache)
        return logits_BV, page(cache)

    def step_fn(tokens_B, cache, advance_B):
        row = functools.partial(_decode_paged_row, config=config)
        return _vmap_rows(row, cache, params, tokens_B, advance_B)

    return prefill_fn, step_fn


def _start(params, config, tokens_PT, lengths_P, source_B, stops, *, capacity, n_steps, n_top,
           model_fns, cache_dtype):
    prefill_fn, _ = model_fns(params, config, capacity, cache_dtype)
    logits_PV, model = prefill_fn(tokens_PT, lengths_P)
    seen_PV = prompt_seen(tokens_PT, lengths_P, logits_PV.shape[-1])
    return init_state(take_rows(model, source_B), jnp.take(logits_PV, source_B, axis=0),
                      jnp.take(seen_PV, source_B, axis=0), stops, n_steps=n_steps, n_top=n_top)


_STATIC = ("config", "capacity", "n_steps", "n_top", "model_fns", "cache_dtype", "pad_id")


@functools.partial(jax.jit, static_argnames=_STATIC)
def generate_program(params, config, tokens_PT, lengths_P, source_B, rows, stops, *, capacity,
                     n_steps, n_top, model_fns, cache_dtype, pad_id):
    """Prefill and the whole decode loop, as one compiled program."""
    state = _start(params, config, tokens_PT, lengths_P, source_B, stops, capacity=capacity,
                   n_steps=n_steps, n_top=n_top, model_fns=model_fns, cache_dtype=cache_dtype)
    _, step_fn = model_fns(params, config, capacity, cache_dtype)
    return decode_loop(state, step_fn, rows, stops, pad_id)


@functools.partial(jax.jit, static_argnames=tuple(s for s in _STATIC if s != "pad_id"))
def start_program(params, config, tokens_PT, lengths_P, source_B, stops, *, capacity, n_steps,
                  n_top, model_fns, cache_dtype):
    """Prefill and the initial decode state (the first half of a streamed generation)."""
    return _start(params, config, tokens_PT, lengths_P, source_B, stops, capacity=capacity,
                  n_steps=n_steps, n_top=n_top, model_fns=model_fns, cache_dtype=cache_dtype)


@functools.partial(jax.jit, static_argnames=("config", "capacity", "model_fns", "cache_dtype",
                                             "pad_id"), donate_argnames="state")
def chunk_program(params, config, state, rows, stops, *, capacity, model_fns, cache_dtype, pad_id):
    """One chunk of decode steps (streaming runs this in a host loop). `state` is donated:
    the KV cache is updated in place, not copied on every call, and the `state` passed in
    must not be used again."""
    _, step_fn = model_fns(params, config, capacity, cache_dtype)
    return decode_chunk(state, step_fn, rows, stops, pad_id)


def compile_counts() -> dict[str, int]:
    """Programs compiled so far by each jitted entry point (their jit cache sizes)."""
    fns = {"prefill": prefill, "decode_step": decode_step, "generate": generate_program,
           "start": start_program, "chunk": chunk_program}
    return {name: fn._cache_size() for name, fn in fns.items()}


# ----------------------------------------------------------------------------- host side


@dataclasses.dataclass
class Completion:
    """One generated sequence."""

    tokens: list[int]  # generated token ids (an EOS that ended the row included)
    finish_reason: str  # "eos", "stop" or "length"
    # The request's seed: passed back in SamplingParams (same n) it repeats the sample. With
    # n > 1 the request's completions are its samples 0..n-1 in order, and sample k draws from
    # that seed folded with k (`sampling.row_keys`): all n share the seed, not the draws.
    seed: int
    logprobs: list[float] | None = None  # model log-prob of each token (raw logits)
    top_logprobs: list[dict[int, float]] | None = None  # the `logprobs` most likely per step


@dataclasses.dataclass(frozen=True)
class Batch:
    """Validated requests packed into bucketed arrays: one prefill row per request, one
    decode row per sample."""

    tokens_PT: np.ndarray  # [P, T] int32, right-padded prompts, one row per request
    lengths_P: np.ndarray  # [P] int32
    source_B: np.ndarray  # [B] int32, the prefill row each decode row starts from
    rows: SamplingArrays
    stops: stopping.StopArrays
    requests: tuple[SamplingParams, ...]  # per real row
    seeds: tuple[int, ...]  # per real row
    n_real: int  # rows before batch padding
    capacity: int  # KV cache slots per row
    n_steps: int  # token buffer length (bucketed max_new_tokens)
    n_top: int  # alternatives recorded per step


def _bucket(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, n - 1).bit_length())


def _expand_sampling(prompts, sampling) -> list[SamplingParams]:
    if sampling is None:
        sampling = SamplingParams()
    if isinstance(sampling, SamplingParams):
        return [sampling] * len(prompts)
    sampling = list(sampling)
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    for s in sampling:
        if not isinstance(s, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(s).__name__}")
    return sampling


def length_groups(lengths: list[int], max_batch_size: int) -> list[list[int]]:
    """Indices of requests grouped by length: sorted by (length, index), cut into batches of
    at most `max_batch_size`. Neighbours in length share prompt buckets, so a batch pads
    little and its compiled programs are reused by the next."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return [order[i: i + max_batch_size] for i in range(0, len(order), max_batch_size)]


def validate(config: GPTConfig, prompts, sampling, bos_token_id=None):
    """Check every request before any work starts. Returns `(prompts, sampling)` lists.

    Raises:
      ValueError: a token id that is not an integer or is outside [0, vocab_size); an empty
        prompt without a BOS id;
        a prompt length + max_new_tokens above config.max_seq_len (both numbers named);
        a stop_token_id or stop_sequences id outside the vocabulary.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of token-id lists")
    sampling = _expand_sampling(prompts, sampling)
    V = config.vocab_size
    out = []
    for index, (prompt, sp) in enumerate(zip(prompts, sampling)):
        not_ints = [t for t in prompt
                    if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if not_ints:
            raise ValueError(f"prompt {index}: token id {not_ints[0]!r} is not an integer")
        prompt = [int(t) for t in prompt]
        if not prompt:
            if bos_token_id is None and sp.max_new_tokens > 0:
                raise ValueError(
                    f"prompt {index} is empty; a prompt needs at least one token (pass "
                    "bos_token_id to inference.generate to start empty prompts from BOS)"
                )
            prompt = [] if bos_token_id is None else [int(bos_token_id)]
        ids = prompt + list(sp.stop_token_ids) + [t for q in sp.stop_sequences for t in q]
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt {index}: token id {bad[0]} is outside [0, {V})")
        if len(prompt) + sp.max_new_tokens > config.max_seq_len:
            raise ValueError(
                f"prompt {index}: prompt length {len(prompt)} + max_new_tokens "
                f"{sp.max_new_tokens} = {len(prompt) + sp.max_new_tokens} exceeds the "
                f"model's max_seq_len {config.max_seq_len}"
            )
        out.append(prompt)
    return out, sampling


def pack(config: GPTConfig, prompts, sampling, pad_id: int = 0) -> Batch:
    """Expand `n` (decode rows share their request's prefill row), draw missing seeds, and
    pad prompts, rows and steps to buckets."""
    rows, source, seeds, index = [], [], [], []
    for p, sp in enumerate(sampling):
        seed = sp.seed if sp.seed is not None else secrets.randbits(32)
        for k in range(sp.n):
            rows.append(sp), source.append(p), seeds.append(seed), index.append(k)
    n_real = len(rows)
    P, B = _bucket(len(prompts)), _bucket(n_real)
    T = min(config.max_seq_len, _bucket(max(map(len, prompts)), MIN_PROMPT_BUCKET))
    n_steps = _bucket(max(r.max_new_tokens for r in rows), CHUNK)
    capacity = min(config.max_seq_len, T + n_steps)
    tokens = np.full((P, T), pad_id, np.int32)
    lengths = np.ones((P,), np.int32)
    for p, prompt in enumerate(prompts):
        tokens[p, : len(prompt)] = prompt
        lengths[p] = len(prompt)
    filler = SamplingParams(max_new_tokens=0, seed=0)
    padded = rows + [filler] * (B - n_real)
    want_logprobs = any(r.logprobs is not None for r in rows)
    return Batch(
        tokens_PT=tokens,
        lengths_P=lengths,
        source_B=np.array(source + [0] * (B - n_real), np.int32),
        rows=SamplingArrays.from_params(padded, seeds + [0] * (B - n_real), index + [0] * (B - n_real)),
        stops=stopping.StopArrays.from_lists(
            [r.max_new_tokens for r in padded], [r.stop_token_ids for r in padded],
            [r.stop_sequences for r in padded],
        ),
        requests=tuple(rows),
        seeds=tuple(seeds),
        n_real=n_real,
        capacity=capacity,
        n_steps=n_steps,
        n_top=MAX_LOGPROBS if want_logprobs else 0,
    )


def fetch(state: DecodeState) -> DecodeState:
    """The decode state on the host, without the model and the per-vocabulary arrays."""
    return jax.device_get(state.replace(model=None, logits=None, prompt_seen=None,
                                        output_counts=None))


def unpack_row(batch: Batch, b: int, host: DecodeState, n: int, finish_reason: str) -> Completion:
    """Decode row b's first n tokens (and, if asked, their log-probs) as a Completion."""
    sp = batch.requests[b]
    completion = Completion(tokens=host.tokens[b, :n].tolist(), finish_reason=finish_reason,
                            seed=batch.seeds[b])
    if sp.logprobs is not None:
        completion.logprobs = host.logprobs[b, :n].tolist()
        completion.top_logprobs = [
            dict(zip(host.top_ids[b, i, : sp.logprobs].tolist(),
                     host.top_logprobs[b, i, : sp.logprobs].tolist()))
            for i in range(n)
        ]
    return completion


def unpack(batch: Batch, state: DecodeState) -> list[Completion]:
    """Turn the final decode state into one Completion per real row."""
    host = fetch(state)
    return [
        unpack_row(batch, b, host, int(host.num_tokens[b]),
                   stopping.FINISH_REASONS[int(host.finish[b])])
        for b in range(batch.n_real)
    ]


def mark_stopped(state: DecodeState, rows: list[int]) -> DecodeState:
    """Finish the given rows with reason STOP (a stop string found on the host between
    chunks): from the next chunk on they generate nothing."""
    stopped_B = jnp.zeros(state.done.shape, bool).at[jnp.asarray(rows, jnp.int32)].set(True)
    return state.replace(done=state.done | stopped_B,
                         finish=jnp.where(stopped_B, stopping.STOP, state.finish))


def run(params, config, prompts, sampling, *, model_fns, bos_token_id=None, pad_id=0,
        cache_dtype=jnp.float32) -> list[Completion]:
    """Validate, pack, run one compiled generation program, unpack."""
    check_params(params, config)
    prompts, sampling = validate(config, prompts, sampling, bos_token_id)
    if any(sp.stop for sp in sampling):
        raise ValueError("stop strings need a tokenizer: use inference.LLM for them")
    if all(sp.max_new_tokens == 0 for sp in sampling):  # nothing to do: compile nothing
        return [Completion([], "length", sp.seed or 0) for sp in sampling for _ in range(sp.n)]
    batch = pack(config, prompts, sampling, pad_id)
    state = generate_program(
        params, config, jnp.asarray(batch.tokens_PT), jnp.asarray(batch.lengths_P),
        jnp.asarray(batch.source_B), batch.rows, batch.stops, capacity=batch.capacity, n_steps=batch.n_steps, n_top=batch.n_top,
        model_fns=model_fns, cache_dtype=cache_dtype, pad_id=pad_id,
    )
    return unpack(batch, state)


def generate(params: Params, config: GPTConfig, prompts, sampling=None, *, bos_token_id=None,
             pad_id: int = 0, cache_dtype=jnp.float32) -> list[Completion]:
    """Generate from a batch of token-id prompts with a KV cache, in one compiled program.

    Args:
      prompts: list of token-id lists, any lengths.
      sampling: one SamplingParams for all prompts, or one per prompt (default greedy-free
        SamplingParams()). A request with n > 1 gives n consecutive Completions.
      bos_token_id: an empty prompt starts from this token; without it an empty prompt
        raises ValueError (unless its max_new_tokens is 0, which returns []).
      pad_id: the token recorded after a row has finished.
    Returns:
      One Completion per prompt and sample, in input order.
    Raises:
      ValueError: before anything is compiled, for any invalid request (see `validate`) or
        params whose shapes do not match `config` (see `gpt_jax.params.check_params`).
    """
    return run(params, config, prompts, sampling, model_fns=cached_model,
               bos_token_id=bos_token_id, pad_id=pad_id, cache_dtype=cache_dtype)
