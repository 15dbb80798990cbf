"""The OpenAI API's side of the server: the request bodies (`CompletionRequest`,
`ChatRequest`, bounded by `inference.sampling_params.RANGES`), the field table (`API_FIELDS`, the engine's names ->
the API's), errors in OpenAI's shape (`APIError`, from pydantic's errors and from the
engine's `RequestError`), and the shapes of responses and stream chunks.

A `RequestError` carries its field, value and code, so an API error is a lookup in the
table: no message is read back or edited.
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional, Union

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from inference.detokenize import RequestOutput
from inference.errors import RequestError
from inference.sampling_params import API_MAX_TEMPERATURE, BIAS, RANGES, SamplingParams

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's
API_FIELDS = {"max_new_tokens": "max_tokens"}  # the engine's field names -> the API's


# ---------------------------------------------------------------------- the request

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


def _bounded(default, name: str, **api_bounds):
    """A pydantic Field bounded as SamplingParams bounds the field `name` (`RANGES`), or by
    `api_bounds` where the API differs; a float field refuses NaN and inf (JSON has
    neither, but Python's json writes them). What it allows ("numbers in [0, 2]", "integers
    in [1, 320]") is its `json_schema_extra["allowed"]`, for the errors
    (`validation_error`)."""
    range_ = RANGES[name]
    bounds = {"gt" if range_.low_open else "ge": range_.low}
    if range_.high != math.inf:
        bounds["le"] = range_.high
    bounds |= api_bounds
    finite = {} if range_.integer else {"allow_inf_nan": False}
    kind = "integers" if range_.integer else "numbers"
    return Field(default, **bounds, **finite,
                 json_schema_extra={"allowed": f"{kind} in {_interval(bounds)}"})


def _interval(bounds: dict) -> str:
    """Pydantic bounds (ge or gt, le or none) as an interval: "[0, 2]", "(0, inf)"."""
    number = lambda x: int(x) if float(x).is_integer() else x  # noqa: E731  (2.0 -> 2)
    low = f"[{number(bounds['ge'])}" if "ge" in bounds else f"({number(bounds['gt'])}"
    return f"{low}, {number(bounds['le'])}]" if "le" in bounds else f"{low}, inf)"


class SamplingFields(BaseModel):
    """The sampling fields both request bodies take (OpenAI's, then vLLM's extra ones). A
    field sent as null takes its default. Unknown fields are refused, so a misspelt one is
    named instead of silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "5" or true is not an int

    model: Optional[str] = None
    temperature: Optional[float] = _bounded(1.0, "temperature", le=API_MAX_TEMPERATURE)
    top_p: Optional[float] = _bounded(1.0, "top_p")
    n: Optional[int] = _bounded(1, "n")
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = _bounded(None, "seed")
    presence_penalty: Optional[float] = _bounded(0.0, "presence_penalty")
    frequency_penalty: Optional[float] = _bounded(0.0, "frequency_penalty")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    top_k: Optional[int] = _bounded(0, "top_k", ge=-1)  # vLLM: -1 or 0 = off
    min_p: Optional[float] = _bounded(0.0, "min_p")
    repetition_penalty: Optional[float] = _bounded(1.0, "repetition_penalty")
    min_tokens: Optional[int] = _bounded(0, "min_tokens")
    logit_bias: Optional[dict[str, float]] = None  # OpenAI: token id (as a string) -> bias
    # speculative decoding (`inference.speculative`): "ngram", "draft" (a server started with
    # a draft model, `inference.draft_engine`) or null
    speculative: Optional[str] = None
    num_speculative_tokens: Optional[int] = _bounded(4, "num_speculative_tokens")
    prompt_lookup_min: Optional[int] = _bounded(1, "prompt_lookup_min")
    prompt_lookup_max: Optional[int] = _bounded(3, "prompt_lookup_max")
    # OpenAI's structured output: {"type": "json_schema", "json_schema": {"name", "schema",
    # "strict"}}, {"type": "json_object"} or {"type": "text"} (`constraint_fields`)
    response_format: Optional[Any] = None


class CompletionRequest(SamplingFields):
    """The body of POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = _bounded(16, "max_new_tokens", ge=1)  # vLLM: at least 1
    logprobs: Optional[int] = _bounded(None, "logprobs")
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    guided_json: Union[dict[str, Any], str, None] = None  # vLLM's structured-output extras
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None


CHAT_UNSUPPORTED = {"tools": "tool calling", "tool_choice": "tool calling",
                    "functions": "function calling", "function_call": "function calling",
                    "parallel_tool_calls": "tool calling"}  # field -> what it asks for


class ChatRequest(SamplingFields):
    """The body of POST /v1/chat/completions. Messages are checked by
    `inference.chat.check_messages`; the fields we do not implement (`CHAT_UNSUPPORTED`)
    are accepted here to be refused by name (`chat_sampling`)."""

    messages: list[Any]
    max_tokens: Optional[int] = _bounded(None, "max_new_tokens", ge=1)
    max_completion_tokens: Optional[int] = _bounded(None, "max_new_tokens", ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = _bounded(None, "logprobs")
    tools: Optional[Any] = None
    tool_choice: Optional[Any] = None
    functions: Optional[Any] = None
    function_call: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None


# ---------------------------------------------------------------------- errors

class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


SHAPES = {"prompt": "a string, a list of strings, a list of token ids (integers) or a list "
                    "of lists of token ids",
          "stop": "a non-empty string or a list of them",
          "logit_bias": "an object mapping token ids (strings of digits) to numbers in "
                        f"{BIAS.allowed}"}  # what a field of several shapes may be


# pydantic's error types for a number past a field's bounds
OUT_OF_RANGE = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def validation_error(error: ValidationError | RequestValidationError,
                     model: type[BaseModel] | None = None) -> APIError:
    """The first pydantic error as a 400 naming the field, the value and what is allowed:
    for a number field of `model` (the request's class), what `_bounded` says it allows,
    with the code "invalid_type" for a value that is not a number (as OpenAI's API answers
    `"temperature": "hot"`) and "invalid_value" for one out of range (as `SamplingParams`
    words it)."""
    first = error.errors()[0]
    loc = [str(p) for p in first["loc"] if p != "body"]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}")
    if not loc:
        return APIError(400, "the request body must be a JSON object of completion fields")
    param = loc[0]
    if param in SHAPES:
        return APIError(400, f"{param} must be {SHAPES[param]}", param=param)
    if first["type"] == "missing":
        return APIError(400, f"'{param}' is required", param=param)
    if first["type"] == "extra_forbidden":
        return APIError(400, f"unknown field '{param}'", param=param)
    value = json.dumps(first.get("input"), default=str)[:80]
    info = model.model_fields.get(param) if model is not None else None
    allowed = (info.json_schema_extra or {}).get("allowed") if info is not None else None
    if allowed and first["type"] in ("float_type", "float_parsing"):  # "hot", true, "0.5"
        return APIError(400, f"{param}={value} is not a number; allowed: {allowed}",
                        param=param, code="invalid_type")
    if allowed and first["type"] in ("int_type", "int_parsing", "int_from_float"):
        return APIError(400, f"{param}={value} is not an integer; allowed: {allowed}",
                        param=param, code="invalid_type")
    if allowed and first["type"] == "finite_number":  # NaN, Infinity
        return APIError(400, f"{param}={value} is not a finite number; allowed: {allowed}",
                        param=param)
    if allowed and first["type"] in OUT_OF_RANGE:  # as SamplingParams words it
        return APIError(400, f"{param}={value} is out of range; allowed: {allowed}",
                        param=param, code="invalid_value")
    return APIError(400, f"{param}={value} is invalid: {first['msg']}", param=param)


def request_error(error: RequestError, body=None) -> APIError:
    """A 400 naming the field, and every field its message mentions, as the API does (no
    hint: a request to the server cannot crop), with the error's code; a structured-output
    field by the name `body` gave it (`constraint_names`)."""
    names = API_FIELDS | constraint_names(body)
    param = names.get(error.field, error.field)
    return APIError(400, error.message(param, names, setting=None), param=param,
                    code=error.code)


GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice"}


def constraint_names(body) -> dict[str, str]:
    """The API's names of the request's structured-output fields (engine name -> API's)."""
    if getattr(body, "response_format", None) is not None:
        return {"json_schema": "response_format", "json_object": "response_format"}
    return {ours: api for api, ours in GUIDED.items() if getattr(body, api, None) is not None}


def constraint_fields(body) -> dict:
    """The SamplingParams structured-output fields of a request: from `response_format`
    (OpenAI) or vLLM's `guided_json`, `guided_regex`, `guided_choice`. Raises APIError for a
    response_format of another shape."""
    fields = {ours: getattr(body, api) for api, ours in GUIDED.items()
              if getattr(body, api, None) is not None}
    spec = body.response_format
    if spec is None or (isinstance(spec, dict) and spec.get("type") == "text"):
        return fields
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "json_object":
        return {**fields, "json_object": True}
    schema = spec.get("json_schema") if kind == "json_schema" else None
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
        raise APIError(400, f"response_format={spec!r:.80} is not one of {{'type': "
                            "'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}, "
                            "{'type': 'json_object'}, {'type': 'text'}",
                       param="response_format")
    return {**fields, "json_schema": schema["schema"]}


def to_sampling(body: CompletionRequest, eos_token_ids: tuple[int, ...]) -> SamplingParams:
    """SamplingParams of a completion request. Raises APIError for a field we do not
    support."""
    if body.echo:
        raise APIError(400, "echo=true is not supported; the prompt is not returned",
                       param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported (no insertion models)", param="suffix")
    n = 1 if body.n is None else body.n
    if body.best_of not in (None, n):
        raise APIError(400, f"best_of={body.best_of} is not supported; only best_of = n "
                            f"({n})", param="best_of")
    return _sampling(body, body.max_tokens, body.logprobs,
                     list(eos_token_ids))


def chat_sampling(body: ChatRequest, stop_token_ids: list[int],
                  default_max_tokens: int) -> SamplingParams:
    """SamplingParams of a chat request: `max_completion_tokens` (or the older
    `max_tokens`; else `default_max_tokens`), `logprobs` with `top_logprobs` alternatives,
    the template's end-of-turn `stop_token_ids`. Raises APIError naming a field we do not
    implement."""
    for field, feature in CHAT_UNSUPPORTED.items():
        if getattr(body, field) is not None:
            raise APIError(400, f"{field} is not supported: this server does not implement "
                                f"{feature}", param=field, code="unsupported_field")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens)
                       if m is not None), default_max_tokens)
    return _sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                     stop_token_ids)


def _sampling(body: CompletionRequest | ChatRequest, max_tokens: int | None,
              logprobs: int | None, stop_token_ids: list[int]) -> SamplingParams:
    """The SamplingParams fields both requests share. Raises APIError."""
    n = 1 if body.n is None else body.n
    pick = lambda value, default: default if value is None else value  # noqa: E731
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise APIError(400, f"logit_bias key {key!r} is not a token id; allowed: token ids "
                                "as strings of digits", param="logit_bias")
        bias[int(key)] = value
    try:
        return SamplingParams(
            temperature=pick(body.temperature, 1.0), top_p=pick(body.top_p, 1.0),
            top_k=max(0, pick(body.top_k, 0)), min_p=pick(body.min_p, 0.0),
            repetition_penalty=pick(body.repetition_penalty, 1.0),
            presence_penalty=pick(body.presence_penalty, 0.0),
            frequency_penalty=pick(body.frequency_penalty, 0.0), seed=body.seed,
            max_new_tokens=pick(max_tokens, 16), n=n, logprobs=logprobs,
            stop=[body.stop] if isinstance(body.stop, str) else (body.stop or []),
            stop_token_ids=stop_token_ids,
            min_tokens=pick(body.min_tokens, 0), logit_bias=bias, **constraint_fields(body),
            speculative=body.speculative,
            num_speculative_tokens=pick(body.num_speculative_tokens, 4),
            prompt_lookup_min=pick(body.prompt_lookup_min, 1),
            prompt_lookup_max=pick(body.prompt_lookup_max, 3))
    except RequestError as error:
        raise request_error(error, body) from None


# ---------------------------------------------------------------------- responses

def completion_object(cid: str, created: int, model: str, choices: list[dict],
                      object_: str = "text_completion") -> dict:
    """A completion object (`object_`: "text_completion", "chat.completion" or a chunk's):
    the response, or one chunk of a stream."""
    return {"id": cid, "object": object_, "created": created, "model": model,
            "choices": choices}


def choice(index: int, out: RequestOutput, text: str, logprobs: dict | None) -> dict:
    """One choice of a completion (or of a chunk: `text` new, finish_reason once done)."""
    return {"index": index, "text": text, "logprobs": logprobs,
            "finish_reason": FINISH_REASONS[out.finish_reason] if out.finished else None}


def logprobs(tokenizer, out: RequestOutput, start: int, text_offset: int) -> dict:
    """OpenAI's completion logprobs of out.token_ids[start:] (token strings as decoded)."""
    decode = tokenizer.decode
    ids = out.token_ids[start:]
    tokens = [decode([t]) for t in ids]
    offsets = [text_offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": out.logprobs[start:],
            "top_logprobs": [top_by_text(decode, top) for top in out.top_logprobs[start:]],
            "text_offset": offsets}


class CompletionShape:
    """The shapes of /v1/completions' answer: its objects, choices and logprobs."""

    object = chunk_object = "text_completion"

    @staticmethod
    def wants_logprobs(body) -> bool:
        return body.logprobs is not None

    @staticmethod
    def choice(index: int, out: RequestOutput, text: str, logprobs: dict | None,
               chunk: bool) -> dict:
        return choice(index, out, text, logprobs)

    @staticmethod
    def logprobs(tokenizer, out: RequestOutput, start: int, text_offset: int) -> dict:
        return logprobs(tokenizer, out, start, text_offset)

    @staticmethod
    def offset_after(logprobs: dict) -> int:
        """How far the next chunk's text_offset moves past this chunk's tokens."""
        return sum(map(len, logprobs["tokens"]))

    @staticmethod
    def opening(index: int) -> dict | None:
        return None  # a completion stream starts with text


class ChatShape:
    """The shapes of /v1/chat/completions' answer: a message (a delta in a stream, the
    first carrying the role) and logprobs as `{"content": [{token, logprob, bytes,
    top_logprobs}]}`."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    @staticmethod
    def wants_logprobs(body) -> bool:
        return bool(body.logprobs)

    @staticmethod
    def choice(index: int, out: RequestOutput, text: str, logprobs: dict | None,
               chunk: bool) -> dict:
        message = ({"content": text} if text else {}) if chunk else \
            {"role": "assistant", "content": text}
        return {"index": index, "delta" if chunk else "message": message,
                "logprobs": logprobs,
                "finish_reason": FINISH_REASONS[out.finish_reason] if out.finished else None}

    @staticmethod
    def logprobs(tokenizer, out: RequestOutput, start: int, text_offset: int) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text = tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [
            entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top.items()]}
            for t, lp, top in zip(out.token_ids[start:], out.logprobs[start:],
                                  out.top_logprobs[start:])]}

    @staticmethod
    def offset_after(logprobs: dict) -> int:
        return 0  # chat logprobs have no text offsets

    @staticmethod
    def opening(index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}


def top_by_text(decode, top: dict[int, float]) -> dict[str, float]:
    """A step's most likely tokens (id -> logprob) keyed by their text, as OpenAI's
    top_logprobs are. Several tokens can decode to one text (a byte-level BPE shows each
    part of a UTF-8 character as "\\ufffd"): the best of them is kept."""
    by_text: dict[str, float] = {}
    for token, logprob in top.items():
        text = decode([token])
        if logprob > by_text.get(text, -math.inf):
            by_text[text] = logprob
    return by_text
