"""One request checked against the model, before any work starts: the validation boundary
above `SamplingParams` (which checks each field alone, `inference.sampling_params`).

`generate` (through `inference.generation.validate`), `Engine.add_request` (through
`check_engine_request`, which first checks what the engine itself needs) and the server
each call `check_request`. A failure is a `RequestError` carrying the field, the value, what
is allowed, an OpenAI-style code (`context_length_exceeded` for a request past the model's
context) and which request it was (`request`: a prompt's index or a request id), with the
"crop" remedy as a `Hint`: each front words it its own way, nobody edits the message.
"""

from __future__ import annotations

import numbers

import numpy as np

from gpt_jax.cache import pages_for
from gpt_jax.config import GPTConfig
from inference.constraints import automaton
from inference.errors import Hint, RequestError
from inference.sampling_params import SamplingParams

# What a request past the context could ask for instead (`SamplingParams.context_overflow`).
CROP = Hint("context_overflow", "crop", "to predict each token from the last max_seq_len")
EMPTY = "at least one token (pass bos_token_id to inference.generate to start empty prompts " \
        "from BOS)"


def check_request(config: GPTConfig, prompt, sampling: SamplingParams, *,
                  request: int | str, bos_token_id: int | None = None,
                  page_size: int | None = None, num_pages: int | None = None,
                  tokenizer=None) -> list[int]:
    """Every check of one request (`prompt`, token ids, with its `sampling`) against the
    model, and with `num_pages` against a page pool of that many pages of `page_size`.
    Returns the prompt as a list of ints: an empty one started from `bos_token_id` when
    given, a "crop" one cropped to its last max_seq_len tokens (nanoGPT's
    `idx[:, -block_size:]`).

    A request's `context_overflow` (None: "error") says what a request longer than the
    model's context does: under "crop" a prompt longer than config.max_seq_len is cropped
    and max_new_tokens may take it past the context; under "error" neither is allowed.

    Raises:
      RequestError (field, value, allowed, code; `request` names it): a token id that is not
        an integer or is outside [0, vocab_size); an empty prompt without a BOS id; a
        stop_token_ids, stop_sequences or logit_bias id outside the vocabulary; logprobs
        above vocab_size; under "error", a prompt length + max_new_tokens above
        max_seq_len (code "context_length_exceeded", hint "crop"); more pages than the pool
        has; a structured-output constraint without a `tokenizer`, or one that cannot be
        compiled over its tokens (`inference.constraints.automaton`, which caches it).
    """
    prompt = _token_ids(prompt, sampling, request, bos_token_id)
    V = config.vocab_size
    for field, what, ids in (
            ("prompt", "token id", prompt),
            ("stop_token_ids", "{field} id", sampling.stop_token_ids),  # {field}: each
            ("stop_sequences", "{field} id", [t for q in sampling.stop_sequences  # front's
                                              for t in q]),                   # name
            ("logit_bias", "{field} id", [t for t, _ in sampling.logit_bias])):
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise RequestError(field, bad[0], f"[0, {V}) (the model's vocab_size is {V})",
                               owner="", request=request, problem=f"{{request}}: {what} "
                               "{value!r}", lead=" is outside ")
    if sampling.logprobs is not None and sampling.logprobs > V:
        raise RequestError("logprobs", sampling.logprobs, f"[0, {V}]", owner="",
                           request=request, problem="{request}: {field}={value!r} asks for "
                           "more alternatives than the vocabulary has")
    automaton(sampling, tokenizer, V, request)
    prompt = _fit_context(config, prompt, sampling, request)
    if num_pages is not None:
        _fit_pool(config, len(prompt), sampling, request, page_size, num_pages)
    return prompt


def encode_text(tokenizer, text: str, request: int | str) -> list[int]:
    """The token ids of a text prompt; for empty text, the tokens the tokenizer adds (its
    BOS: vLLM's prompt "" is then [BOS]). Raises RequestError (field "prompt", naming
    `request`) when there are none: empty text and a tokenizer that adds no BOS."""
    ids = tokenizer.encode(text)
    if not ids:
        raise RequestError("prompt", text, "at least one token", owner="", request=request,
                           problem="{request} is empty: the text {value!r:.40} encodes to no "
                           "tokens (this tokenizer adds no BOS)", lead="; a prompt needs ")
    return ids


def check_engine_request(engine, request_id: str, prompt, sampling: SamplingParams | None):
    """Every check of one request to `engine` (an `inference.Engine`, `Engine.check_request`),
    before anything is queued (the engine keeps serving the others): the engine's own (the
    request id, text and stop strings need the tokenizer, the prompt's type, a draft model
    for speculative="draft"), then `check_request` (the model's vocabulary and context, the
    page pool). Returns `(prompt, sampling)`: the prompt as a list of token ids (text
    encoded; a "crop" prompt cropped to max_seq_len) and the sampling parameters (default
    ones for None). Raises RequestError naming the request, or TypeError for sampling that
    is not SamplingParams."""
    if not isinstance(request_id, str):
        raise RequestError("request_id", request_id, "strings", code="invalid_type",
                           owner="", problem="{field}={value!r} is not a str")
    if request_id in engine.scheduler.requests:
        raise RequestError("request_id", request_id, "an id not in the engine", owner="",
                           problem="{field} {value!r} is already in the engine")
    sampling = SamplingParams() if sampling is None else sampling
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
    needs = "a tokenizer: pass one to the Engine"
    if isinstance(prompt, str):
        if engine.tokenizer is None:
            raise RequestError("prompt", prompt, "token ids", owner="", request=request_id,
                               problem="{request}: a text prompt needs " + needs)
        prompt = encode_text(engine.tokenizer, prompt, request_id)
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if sampling.stop and engine.tokenizer is None:
        raise RequestError("stop", sampling.stop, "no stop strings without a tokenizer",
                           owner="", request=request_id,
                           problem="{request}: stop strings need " + needs)
    listed = isinstance(prompt, (list, tuple))
    if not listed or (not prompt and sampling.max_new_tokens > 0):
        raise RequestError("prompt", prompt, "a non-empty list of token ids (or text, "
                           "with a tokenizer)", code="invalid_value" if listed
                           else "invalid_type", owner="", request=request_id,
                           lead="; a prompt is ",
                           problem="{request}: the prompt is {value!r:.40}")
    if sampling.speculative == "draft" and engine.draft is None:
        raise RequestError("speculative", "draft", "'ngram' or None without a draft model",
                           owner="", request=request_id, problem="{request}: "
                           "speculative='draft' needs a draft model and this engine has none "
                           "(gpt-jax serve/generate/chat: --draft-run-dir DIR or "
                           "--draft-hf-checkpoint DIR; Python: LLM(..., draft=...) or "
                           "Engine(..., draft=...))")
    prompt = check_request(engine.config, prompt, sampling, request=request_id,
                           page_size=engine.page_size, num_pages=engine.num_pages,
                           tokenizer=engine.tokenizer)
    return prompt, sampling


def _token_ids(prompt, sampling: SamplingParams, request, bos_token_id) -> list[int]:
    """The prompt as a list of ints (an empty one: `[bos_token_id]`, or [] when nothing is
    generated). A numpy or jax array of ids is taken as its list."""
    prompt = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    not_ints = [t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
    if not_ints:
        raise RequestError("prompt", not_ints[0], "integer token ids", code="invalid_type",
                           owner="", request=request,
                           problem="{request}: token id {value!r} is not an integer")
    if prompt:
        return [int(t) for t in prompt]
    if bos_token_id is None and sampling.max_new_tokens > 0:
        raise RequestError("prompt", [], EMPTY, owner="", request=request,
                           problem="{request} is empty", lead="; a prompt needs ")
    return [] if bos_token_id is None else [int(bos_token_id)]


def _fit_context(config: GPTConfig, prompt: list[int], sampling: SamplingParams,
                 request) -> list[int]:
    """The prompt, cropped under "crop"; under "error", RequestError for a request that
    outgrows max_seq_len."""
    C, n, m = config.max_seq_len, len(prompt), sampling.max_new_tokens
    if sampling.overflow("error") == "crop":
        return prompt[-C:]
    if n >= C:  # whatever max_new_tokens: say so
        raise RequestError("prompt", n, f"prompt length + {{max_new_tokens}} {m} at most {C}",
                           code="context_length_exceeded", owner="", request=request,
                           hint=CROP, problem="{request}: prompt length {value} leaves no "
                           f"room for a new token in the model's max_seq_len {C}")
    if n + m > C:
        raise RequestError("max_new_tokens", m, f"a sum of at most {C}",
                           code="context_length_exceeded", owner="", request=request,
                           hint=CROP, problem=f"{{request}}: prompt length {n} + {{field}} "
                           f"{{value}} = {n + m} exceeds the model's max_seq_len {C}")
    return prompt


def _fit_pool(config: GPTConfig, n: int, sampling: SamplingParams, request, page_size: int,
              num_pages: int) -> None:
    """RequestError for a request that needs more pages than the pool has (at most
    max_seq_len tokens are cached: a "crop" request past it reads its window)."""
    m = sampling.max_new_tokens
    need = pages_for(min(n + m, config.max_seq_len), page_size)
    if need > num_pages:
        raise RequestError("max_new_tokens", m, f"at most {num_pages} pages", owner="",
                           request=request, problem=f"{{request}}: prompt length {n} + "
                           f"{{field}} {{value}} needs {need} pages of {page_size} tokens, "
                           f"but the page pool has {num_pages}")
