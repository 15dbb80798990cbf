"""The static generation driver: `generate` checks every request (`validate`, with
`inference.validation.check_request`), packs the batch into bucketed arrays (`pack`), runs
prefill and the whole token loop as one compiled program (`generation`) and unpacks one
`Completion` per sample.

The program: prefill with the first token, then a `lax.scan` over a chunk of steps inside a
`lax.while_loop` that exits once every row has finished (`inference.decode`). A request with
`n > 1` is prefilled once, into the pages of its first sample's row; the other samples' rows
get a copy of those pages. The program takes the model as two functions (`model_fns`:
`prefill_fn`, `step_fn`), so `naive_generate` (inference.naive) runs the same loop, sampler
and stop logic with full recomputation instead of a cache.

Bounded compilation: prompt length, batch size and max_new_tokens are padded to power-of-two
buckets, and sampling parameters are traced arrays, so a new program is compiled only for a
new bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax import tensor_parallel
from gpt_jax.config import GPTConfig
from gpt_jax.params import Params, check_params, decode_layout
from inference import stopping
from inference import draft as draft_model
from inference import speculative
from inference.constraint_mask import constraint_arrays
from inference.constraints import automaton
from inference.decode import (CHUNK, DecodeState, decode_loop, init_state, prompt_seen,
                              prompt_window, sample_and_record)
from inference.sampling import SamplingArrays, prompt_hash
from inference.sampling_params import MAX_LOGPROBS, SamplingParams
from inference.buckets import MIN_PROMPT_BUCKET, bucket
from inference.steps import cached_model
from inference.transfer import to_device
from inference.verify import verifier
from inference.validation import check_request


def _start(params, config, prompt_tokens, prompt_lengths, source_B, rows, stops, *, capacity,
           n_steps, n_top, model_fns, cache_dtype, forked, pad_id, spec_width=0):
    """Prefill, and the first token of every row sampled from the prefill's logits. The
    rows keep a window of their last tokens where one may outgrow the context or drafts
    are looked up in it (`spec_width`)."""
    prefill_fn, _ = model_fns(params, config, capacity, cache_dtype)
    logits_BV, model = prefill_fn(prompt_tokens, prompt_lengths, source_B, forked)
    seen_by_prompt = prompt_seen(prompt_tokens, prompt_lengths, logits_BV.shape[-1])
    width = config.max_seq_len if capacity > config.max_seq_len or spec_width else 0
    window_by_prompt = prompt_window(prompt_tokens, prompt_lengths, width, pad_id)
    state = init_state(model, jnp.take(seen_by_prompt, source_B, axis=0), stops,
                       jnp.take(window_by_prompt, source_B, axis=0), n_steps=n_steps,
                       n_top=n_top, pad_id=pad_id)
    return sample_and_record(state, logits_BV, ~state.done, rows, stops, pad_id)


_STATIC = ("config", "capacity", "n_steps", "n_top", "model_fns", "cache_dtype", "pad_id",
           "forked")


def generation(params, config, prompt_tokens, prompt_lengths, source_B, rows, stops, *, capacity,
               n_steps, n_top, model_fns, cache_dtype, pad_id, forked) -> DecodeState:
    """Prefill and the whole decode loop, traceable: `generate_program` jits it and
    `inference.export` exports it. Returns the final DecodeState."""
    state = _start(params, config, prompt_tokens, prompt_lengths, source_B, rows, stops,
                   capacity=capacity, n_steps=n_steps, n_top=n_top, model_fns=model_fns,
                   cache_dtype=cache_dtype, forked=forked, pad_id=pad_id)
    _, step_fn = model_fns(params, config, capacity, cache_dtype)
    return decode_loop(state, step_fn, rows, stops, pad_id)


# Prefill and the whole decode loop, as one compiled program.
generate_program = jax.jit(generation, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=_STATIC + ("spec_width",))
def speculative_program(params, config, prompt_tokens, prompt_lengths, source_B, rows, stops,
                        spec: speculative.SpecArrays, *, capacity, n_steps, n_top, model_fns,
                        cache_dtype, pad_id, forked, spec_width):
    """`generation` with the loop of speculative steps (`inference.speculative`), verifying
    `spec_width` (K > 0) drafts per step over the cached model. Returns `(DecodeState,
    speculative.SpecState)`."""
    state = _start(params, config, prompt_tokens, prompt_lengths, source_B, rows, stops,
                   capacity=capacity, n_steps=n_steps, n_top=n_top, model_fns=model_fns,
                   cache_dtype=cache_dtype, forked=forked, pad_id=pad_id, spec_width=spec_width)
    return speculative.speculative_loop(
        state, speculative.SpecState.init(spec), verifier(params, config), rows, stops, spec,
        width=spec_width, limit=capacity, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=_STATIC + ("spec_width", "draft_config"))
def draft_program(params, config, draft_params, draft_config, prompt_tokens, prompt_lengths,
                  source_B, rows, stops, spec: speculative.SpecArrays, *, capacity, n_steps,
                  n_top, model_fns, cache_dtype, pad_id, forked, spec_width):
    """`speculative_program` with a draft model (`inference.draft`), prefilled with the
    prompts into its own cache of the same page layout. Returns `(DecodeState,
    speculative.SpecState)`."""
    state = _start(params, config, prompt_tokens, prompt_lengths, source_B, rows, stops,
                   capacity=capacity, n_steps=n_steps, n_top=n_top, model_fns=model_fns,
                   cache_dtype=cache_dtype, forked=forked, pad_id=pad_id, spec_width=spec_width)
    draft_prefill, _ = model_fns(draft_params, draft_config, capacity, cache_dtype)
    _, draft_cache = draft_prefill(prompt_tokens, prompt_lengths, source_B, forked)
    return draft_model.draft_loop(
        state, speculative.SpecState.init(spec), draft_model.DraftState.init(draft_cache),
        verifier(params, config), draft_model.drafter(draft_params, draft_config), rows, stops,
        spec, width=spec_width, limit=capacity, pad_id=pad_id)


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
    # a speculative row's counts: "drafted" tokens verified, of them "accepted", "steps"
    # (forward passes; tokens per step = len(tokens) / steps)
    speculation: dict[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class Batch:
    """Validated requests packed into bucketed arrays: one prefill row per request, one
    decode row per sample."""

    prompt_tokens: np.ndarray  # [prompts, T] int32, right-padded, one row per request
    prompt_lengths: np.ndarray  # [prompts] int32
    source_B: np.ndarray  # [B] int32, the prefill row each decode row starts from
    rows: SamplingArrays
    stops: stopping.StopArrays
    requests: tuple[SamplingParams, ...]  # per real row
    seeds: tuple[int, ...]  # per real row
    n_real: int  # rows before batch padding
    capacity: int  # tokens a row can reach; past max_seq_len only when a row may "crop"
    n_steps: int  # token buffer length (bucketed max_new_tokens)
    n_top: int  # alternatives recorded per step
    forked: bool  # some prompt has n > 1 rows (they copy its prefilled pages)
    spec: speculative.SpecArrays  # per row: speculative decoding
    spec_width: int  # drafts verified per step (0: no speculative row, or a row may "crop")


def _expand_sampling(prompts, sampling) -> list[SamplingParams]:
    if sampling is None:
        sampling = SamplingParams()
    if isinstance(sampling, SamplingParams):
        return [sampling] * len(prompts)
    if not isinstance(sampling, (list, tuple)):  # a dict's keys would be taken for params
        raise TypeError(f"sampling must be a SamplingParams or a list of them (one per "
                        f"prompt), got {type(sampling).__name__}")
    sampling = list(sampling)
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    for s in sampling:
        if not isinstance(s, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(s).__name__}")
    return sampling


def validate(config: GPTConfig, prompts, sampling, bos_token_id=None, tokenizer=None):
    """Check every request before any work starts (`inference.validation.check_request`,
    each named by its index). Returns `(prompts, sampling)` lists: the prompts as token-id
    lists (started from BOS, cropped, as `check_request` returns them), a SamplingParams
    each.

    Raises:
      RequestError (a ValueError): as `check_request` says.
      TypeError, ValueError: prompts that are not a list, sampling that is not
        SamplingParams or not one per prompt.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a list of token-id lists")
    sampling = _expand_sampling(prompts, sampling)
    return [check_request(config, prompt, sp, request=index, bos_token_id=bos_token_id,
                          tokenizer=tokenizer)
            for index, (prompt, sp) in enumerate(zip(prompts, sampling))], sampling


def pack(config: GPTConfig, prompts, sampling, pad_id: int = 0, tokenizer=None,
         draft_config=None) -> Batch:
    """Expand `n` (decode rows share their request's prefill row), draw missing seeds, and
    pad prompts, rows and steps to buckets; the rows' structured-output tables (compiled
    with `tokenizer`, cached) go with their sampling arrays; speculative rows' costs count
    the draft model of `draft_config` (`spec_cost.round_cost`)."""
    rows, source, seeds, index = [], [], [], []
    for p, sp in enumerate(sampling):
        seed = sp.seed if sp.seed is not None else secrets.randbits(32)
        for k in range(sp.n):
            rows.append(sp), source.append(p), seeds.append(seed), index.append(k)
    n_real = len(rows)
    P, B = bucket(len(prompts)), bucket(n_real)
    T = min(config.max_seq_len, bucket(max(map(len, prompts)), MIN_PROMPT_BUCKET))
    n_steps = bucket(max(r.max_new_tokens for r in rows), CHUNK)
    outgrows = any(len(prompts[p]) + r.max_new_tokens > config.max_seq_len  # only "crop" rows
                   for p, r in zip(source, rows))
    capacity = T + n_steps if outgrows else min(config.max_seq_len, T + n_steps)
    tokens = np.full((P, T), pad_id, np.int32)
    lengths = np.ones((P,), np.int32)
    for p, prompt in enumerate(prompts):
        tokens[p, : len(prompt)] = prompt
        lengths[p] = len(prompt)
    filler = SamplingParams(max_new_tokens=0, seed=0)
    padded = rows + [filler] * (B - n_real)
    want_logprobs = any(r.logprobs is not None for r in rows)
    return Batch(
        prompt_tokens=tokens,
        prompt_lengths=lengths,
        source_B=np.array(source + [0] * (B - n_real), np.int32),
        rows=SamplingArrays.from_params(
            padded, seeds + [0] * (B - n_real), index + [0] * (B - n_real),
            [prompt_hash(prompts[p]) for p in source] + [0] * (B - n_real), config.vocab_size,
        ).replace(constraint=constraint_arrays(tuple(
            [automaton(r, tokenizer, config.vocab_size) for r in rows] + [None] * (B - n_real)),
            config.vocab_size)),
        stops=stopping.StopArrays.from_params(padded),
        requests=tuple(rows),
        seeds=tuple(seeds),
        n_real=n_real,
        capacity=capacity,
        n_steps=n_steps,
        n_top=min(MAX_LOGPROBS, config.vocab_size) if want_logprobs else 0,
        forked=n_real > len(prompts),
        spec=speculative.SpecArrays.from_params(padded, config, draft_config),
        spec_width=0 if outgrows else speculative.width_of(rows),
    )


def fetch(state: DecodeState) -> DecodeState:
    """The decode state on the host, without the model and the per-vocabulary arrays."""
    return jax.device_get(state.replace(model=None, prompt_seen=None,
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


def run(params, config, prompts, sampling, *, model_fns, bos_token_id=None, pad_id=0,
        cache_dtype=jnp.float32, tokenizer=None, draft=None) -> list[Completion]:
    """Validate, pack, run one compiled generation program, unpack."""
    check_params(params, config)
    if draft is not None:
        check_params(*draft)
        draft_model.check_draft(config, draft[1])
    prompts, sampling = validate(config, prompts, sampling, bos_token_id, tokenizer)
    if draft is None and any(sp.speculative == "draft" for sp in sampling):
        raise ValueError("speculative='draft' needs a draft model: generate(..., "
                         "draft=(params, config))")
    if any(sp.stop for sp in sampling):
        raise ValueError("stop strings need a tokenizer: use inference.LLM for them")
    if all(sp.max_new_tokens == 0 for sp in sampling):  # nothing to do: compile nothing
        return [Completion([], "length", sp.seed or 0) for sp in sampling for _ in range(sp.n)]
    batch = pack(config, prompts, sampling, pad_id, tokenizer,
                 None if draft is None else draft[1])
    args = (params, config, *to_device((batch.prompt_tokens, batch.prompt_lengths,
                                      batch.source_B)), batch.rows, batch.stops)
    static = dict(capacity=batch.capacity, n_steps=batch.n_steps, n_top=batch.n_top,
                  model_fns=model_fns, cache_dtype=cache_dtype, pad_id=pad_id,
                  forked=batch.forked)
    # speculation verifies over the paged cache; the naive reference runs token by token
    if not batch.spec_width or model_fns is not cached_model:
        return unpack(batch, generate_program(*args, **static))
    if batch.spec.use_draft is not None:
        state, spec = draft_program(params, config, draft[0], draft[1], *args[2:], batch.spec,
                                    spec_width=batch.spec_width, **static)
    else:
        state, spec = speculative_program(*args, batch.spec, spec_width=batch.spec_width,
                                          **static)
    return speculative.with_counts(unpack(batch, state), batch.requests, jax.device_get(spec))


def generate(params: Params, config: GPTConfig, prompts, sampling=None, *, bos_token_id=None,
             pad_id: int = 0, cache_dtype=jnp.float32, mesh=None,
             tokenizer=None, draft=None) -> list[Completion]:
    """Generate from a batch of token-id prompts with a KV cache, in one compiled program.

    Args:
      params: weights in either layout (stacked, `gpt_jax.params.decode_layout`), or int8
        (`gpt_jax.params.quantize(params, "int8")`). Stacked ones are laid out inside the
        program on every call (a copy of every weight; its cost: benchmarks/README.md, the
        int8 section's "suspected re-layout"): to call it repeatedly, lay them out once
        (`jax.jit(decode_layout)(params)`, as `inference.LLM` does).
      prompts: list of token-id lists, any lengths.
      sampling: one SamplingParams for all prompts, or one per prompt (default greedy-free
        SamplingParams()). A request with n > 1 gives n consecutive Completions.
      bos_token_id: an empty prompt starts from this token; without it an empty prompt
        raises ValueError (unless its max_new_tokens is 0, which returns []).
      pad_id: the token recorded after a row has finished.
      mesh: a `jax.sharding.Mesh` with a "model" axis: the program runs tensor-parallel
        over it (`gpt_jax.tensor_parallel`; the same tokens as on one device).
      tokenizer: the model's tokenizer (`gpt_jax.tokenizer`), which structured output
        (`SamplingParams.json_schema`, `regex`, `choice`, `json_object`) needs.
      draft: `(params, config)` of a draft model with the target's vocabulary and at least
        its max_seq_len (`inference.draft.check_draft`), which `speculative="draft"`
        requests draft with.
    Returns:
      One Completion per prompt and sample, in input order.
    Raises:
      ValueError: before anything is compiled, for any invalid request (see `validate`),
        params whose shapes do not match `config` (see `gpt_jax.params.check_params`), or
        a mesh the model's heads do not fit (`gpt_jax.tensor_parallel.check_mesh`).
    """
    if mesh is not None:
        if draft is not None:
            raise ValueError("generate(draft=...) does not run tensor-parallel: pass mesh=None")
        check_params(params, config)
        params, config = tensor_parallel.shard_params(jax.jit(decode_layout)(params), config,
                                                      mesh)
        with jax.set_mesh(mesh):
            return generate(params, config, prompts, sampling, bos_token_id=bos_token_id,
                            pad_id=pad_id, cache_dtype=cache_dtype, tokenizer=tokenizer)
    return run(params, config, prompts, sampling, model_fns=cached_model,
               bos_token_id=bos_token_id, pad_id=pad_id, cache_dtype=cache_dtype,
               tokenizer=tokenizer, draft=draft)
