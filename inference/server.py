r"""`gpt-jax serve`: an OpenAI-compatible HTTP server on the serving `Engine`.

    gpt-jax serve --run-dir runs/shakespeare-char --port 8000
    curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "shakespeare-char", "prompt": "ROMEO:", "max_tokens": 50}'

or any OpenAI client: `openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)`.

Endpoints (the OpenAI API reference for /v1/completions, vLLM's server for the extra
sampling fields `top_k`, `min_p`, `repetition_penalty`, `min_tokens`; an EOS sampled ends a
completion with finish_reason "stop", as OpenAI reports it):
  POST /v1/completions       prompt: text, a list of texts, token ids or lists of token ids;
                             `stream: true` answers with Server-Sent Events ending `[DONE]`
  POST /v1/chat/completions  a 400 error: these models have no chat template
  GET  /v1/models, /health, /metrics (Prometheus text format), / (the playground page)

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
field (named, with what is allowed) or a request past the context; 401 for a wrong or missing
key when the server has one; 404 for an unknown model or path; 429 (with Retry-After) when the
queue is full; 503 while the model loads.

Threads: uvicorn's event loop serves HTTP; one engine thread owns the `Engine` (it is not
thread-safe) and alternates between taking commands (add a request, abort one) from a queue
and calling `Engine.step()`, handing every `RequestOutput` to its HTTP request's asyncio queue
with `loop.call_soon_threadsafe`. A client that disconnects has its requests aborted, which
frees their pages. On SIGTERM uvicorn stops accepting connections and waits (at most
`--shutdown-timeout` seconds) for the requests in flight to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import queue
import secrets
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, Union

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.detokenize import RequestOutput
from inference.engine import Engine
from inference.errors import RequestError
from inference.load import add_model_args, load_model
from inference.sampling_params import API_MAX_TEMPERATURE, RANGES, SamplingParams
from inference.validation import check_request

PLAYGROUND = Path(__file__).with_name("playground.html")
WINDOW_S = 10.0  # the generation_tokens_per_second window
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}  # ours -> OpenAI's


# ---------------------------------------------------------------------- request and errors

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


def _bounded(default, name: str, **api_bounds):
    """A pydantic Field bounded as SamplingParams bounds the field `name` (`RANGES`), or by
    `api_bounds` where the API differs."""
    range_ = RANGES[name]
    bounds = {"gt" if range_.low_open else "ge": range_.low}
    if range_.high != math.inf:
        bounds["le"] = range_.high
    return Field(default, **(bounds | api_bounds))


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions (OpenAI's fields, then vLLM's extra ones). A field
    sent as null takes its default. Unknown fields are refused, so a misspelt one is named
    instead of silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "5" or true is not an int

    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = _bounded(16, "max_new_tokens")
    temperature: Optional[float] = _bounded(1.0, "temperature", le=API_MAX_TEMPERATURE)
    top_p: Optional[float] = _bounded(1.0, "top_p")
    n: Optional[int] = _bounded(1, "n")
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = _bounded(None, "seed")
    logprobs: Optional[int] = _bounded(None, "logprobs")
    presence_penalty: Optional[float] = _bounded(0.0, "presence_penalty")
    frequency_penalty: Optional[float] = _bounded(0.0, "frequency_penalty")
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    echo: Optional[bool] = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    user: Optional[str] = None
    top_k: Optional[int] = _bounded(0, "top_k", ge=-1)  # vLLM: -1 or 0 = off
    min_p: Optional[float] = _bounded(0.0, "min_p")
    repetition_penalty: Optional[float] = _bounded(1.0, "repetition_penalty")
    min_tokens: Optional[int] = _bounded(0, "min_tokens")
    logit_bias: Optional[dict[str, float]] = None  # OpenAI: token id (as a string) -> bias


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = \
            status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


SHAPES = {"prompt": "a string, a list of strings, a list of token ids (integers) or a list "
                    "of lists of token ids",
          "stop": "a non-empty string or a list of them",
          "logit_bias": "an object mapping token ids (strings of digits) to numbers in "
                        "[-100, 100]"}  # what a field of several shapes may be


def _validation_error(error: ValidationError | RequestValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field, the value and what is allowed."""
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
    return APIError(400, f"{param}={value} is invalid: {first['msg']}", param=param)


API_FIELDS = {"max_new_tokens": "max_tokens"}  # the engine's field names -> the API's


def _request_error(error: RequestError) -> APIError:
    """A 400 naming the field, and every field its message mentions, as the API does (no
    hint: a request to the server cannot crop), with the error's code."""
    param = API_FIELDS.get(error.field, error.field)
    return APIError(400, error.message(param, API_FIELDS, setting=None), param=param,
                    code=error.code)


def to_sampling(body: CompletionRequest, eos_token_id: int | None) -> SamplingParams:
    """SamplingParams of a request. Raises APIError for a field we do not support."""
    if body.echo:
        raise APIError(400, "echo=true is not supported; the prompt is not returned",
                       param="echo")
    if body.suffix:
        raise APIError(400, "suffix is not supported (no insertion models)", param="suffix")
    n = 1 if body.n is None else body.n
    if body.best_of not in (None, n):
        raise APIError(400, f"best_of={body.best_of} is not supported; only best_of = n "
                            f"({n})", param="best_of")
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
            max_new_tokens=pick(body.max_tokens, 16), n=n, logprobs=body.logprobs,
            stop=[body.stop] if isinstance(body.stop, str) else (body.stop or []),
            stop_token_ids=[] if eos_token_id is None else [eos_token_id],
            min_tokens=pick(body.min_tokens, 0), logit_bias=bias)
    except RequestError as error:
        raise _request_error(error) from None


# ---------------------------------------------------------------------- the engine thread

@dataclasses.dataclass(eq=False)
class Submission:
    """One prompt of an HTTP request, as one engine request of `n` samples."""

    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    deliver: Callable[[object], None]  # called on the engine thread: RequestOutput or error
    arrival: float  # time.monotonic() when the HTTP request arrived
    first_token: dict[int, float] = dataclasses.field(default_factory=dict)  # sample -> time
    finished: int = 0  # samples finished


class Metrics:
    """The server's Prometheus metrics, in a registry of their own (vLLM's names, with the
    gpt_jax: prefix)."""

    def __init__(self):
        prom.disable_created_metrics()  # no *_created series beside each counter
        r = self.registry = prom.CollectorRegistry()
        g = lambda name, doc: prom.Gauge(f"gpt_jax:{name}", doc, registry=r)  # noqa: E731
        self.running = g("num_requests_running", "samples being prefilled or decoded")
        self.waiting = g("num_requests_waiting", "samples waiting for a slot")
        self.pages_used = g("kv_pages_used", "KV cache pages in use")
        self.pages_free = g("kv_pages_free", "KV cache pages free")
        self.pages_total = g("kv_pages_total", "KV cache pages in the pool")
        self.hit_rate = g("prefix_cache_hit_rate",
                          "prompt tokens reused from cached pages / prompt tokens, since start")
        self.recent: list[tuple[float, int]] = []  # (time, tokens) of each step, last 10 s
        g("generation_tokens_per_second", "generated tokens per second over the last 10 s"
          ).set_function(self._tokens_per_s)
        self.prompt_tokens = prom.Counter("gpt_jax:prompt_tokens", "prompt tokens admitted",
                                          registry=r)
        self.generation_tokens = prom.Counter("gpt_jax:generation_tokens", "tokens generated",
                                              registry=r)
        self.finished = prom.Counter("gpt_jax:request_success", "samples finished",
                                     ["finished_reason"], registry=r)
        self.ttft = prom.Histogram(
            "gpt_jax:time_to_first_token_seconds", "request arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tpot = prom.Histogram(
            "gpt_jax:time_per_output_token_seconds", "per sample: (finish - first token) / "
            "(tokens - 1)", buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r)

    def update(self, stats: dict, page_size: int, now: float, new_tokens: int) -> None:
        self.running.set(stats["running"] + stats["prefilling"])
        self.waiting.set(stats["waiting"])
        self.pages_used.set(stats["pages_in_use"])
        self.pages_free.set(stats["free_pages"])
        self.pages_total.set(stats["total_pages"])
        reused = stats["prefix_cache_hits"] * page_size
        self.hit_rate.set(reused / max(1, reused + stats["prefilled_tokens"]))
        self.generation_tokens.inc(new_tokens)
        if new_tokens:  # a new list, so a scrape on another thread reads a whole one
            self.recent = [(t, k) for t, k in self.recent if now - t <= WINDOW_S] + \
                [(now, new_tokens)]

    def _tokens_per_s(self) -> float:
        now = time.monotonic()
        return sum(k for t, k in self.recent if now - t <= WINDOW_S) / WINDOW_S


class EngineLoop:
    """The thread that owns the Engine: commands in through a queue, outputs out through
    each submission's `deliver`."""

    def __init__(self, engine: Engine, metrics: Metrics):
        self.engine, self.metrics = engine, metrics
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.live: dict[str, Submission] = {}
        self.error: BaseException | None = None  # set if a step failed: the server is broken
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def add(self, group: list[Submission]) -> None:
        """Add the prompts of one HTTP request, all or none (an error goes to the first's
        `deliver`, before any output)."""
        self.commands.put(("add", group))

    def abort(self, request_ids: list[str]) -> None:
        self.commands.put(("abort", request_ids))

    def stop(self) -> None:
        self.commands.put(("stop", None))
        self.thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            busy = self.engine.has_unfinished_requests()
            try:
                command = self.commands.get(block=not busy, timeout=None)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    return
                self._apply(*command)
                try:
                    command = self.commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except BaseException as error:  # a bug: fail every request, refuse new ones
                    self.error = error
                    for sub in self.live.values():
                        sub.deliver(error)
                    raise
                self._deliver(outputs)

    def _apply(self, kind: str, arg) -> None:
        if kind == "add":
            added = []
            try:
                for sub in arg:
                    self.engine.add_request(sub.request_id, sub.prompt, sub.sampling)
                    added.append(sub)
            except Exception as error:  # a bad request (or a bug): that request fails only
                for sub in added:
                    self.engine.abort(sub.request_id)
                arg[0].deliver(error)
                return
            for sub in added:
                self.live[sub.request_id] = sub
                self.metrics.prompt_tokens.inc(len(sub.prompt))
        else:
            for request_id in arg:
                if self.live.pop(request_id, None) is not None:
                    self.engine.abort(request_id)
        self.metrics.update(self.engine.stats(), self.engine.page_size, time.monotonic(), 0)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            sub = self.live.get(out.request_id)
            if sub is None:
                continue
            if out.token_ids and out.sample_index not in sub.first_token:
                sub.first_token[out.sample_index] = now
                self.metrics.ttft.observe(now - sub.arrival)
            if out.finished:
                self.metrics.finished.labels(out.finish_reason).inc()
                if len(out.token_ids) > 1:
                    self.metrics.tpot.observe((now - sub.first_token[out.sample_index])
                                              / (len(out.token_ids) - 1))
                sub.finished += 1
                if sub.finished == sub.sampling.n:
                    del self.live[out.request_id]
            sub.deliver(out)
        self.metrics.update(self.engine.stats(), self.engine.page_size, now,
                            sum(len(o.new_token_ids) for o in outputs))


# ---------------------------------------------------------------------- the app

@dataclasses.dataclass
class ServerConfig:
    model_name: str  # the id clients pass as `model`
    api_key: str | None = None  # None: no key needed
    max_queue: int = 256  # most samples waiting beyond the engine's slots before 429
    eos_token_id: int | None = None  # ends a completion (finish_reason "stop") when sampled
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for requests in flight
    max_body_bytes: int = 8 << 20  # a larger request body is refused (413) unread


class Server:
    """The app's state: the engine loop once loaded, the admission count, the metrics."""

    def __init__(self, load: Callable[[], Engine], cfg: ServerConfig):
        self.load, self.cfg = load, cfg
        self.metrics = Metrics()
        prom.Gauge("gpt_jax:num_completions_in_flight", "completions (prompts x n) accepted "
                   "and not yet answered: what --max-queue bounds",
                   registry=self.metrics.registry).set_function(lambda: self.outstanding)
        self.loop: EngineLoop | None = None
        self.load_error: BaseException | None = None
        self.outstanding = 0  # samples accepted and not finished (event-loop thread only)

    def start_loading(self) -> None:
        def load():
            try:
                self.loop = EngineLoop(self.load(), self.metrics)
            except BaseException as error:  # reported by /health and every request
                self.load_error = error
                print(f"gpt-jax serve: the model failed to load: {error!r}", file=sys.stderr,
                      flush=True)
        threading.Thread(target=load, name="load-model", daemon=True).start()

    def engine(self) -> Engine:
        """The engine, or APIError 503 while loading (or 500 if loading or a step failed)."""
        if self.load_error is not None:
            raise APIError(500, f"the model failed to load: {self.load_error}",
                           type_="server_error")
        if self.loop is None:
            raise APIError(503, "the model is loading; retry shortly", type_="service_unavailable",
                           headers={"Retry-After": "2"})
        if self.loop.error is not None:
            raise APIError(500, f"the engine failed: {self.loop.error!r}",
                           type_="server_error")
        return self.loop.engine

    def check_key(self, request: Request) -> None:
        if self.cfg.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.cfg.api_key}".encode()):
            raise APIError(401, "incorrect or missing API key: send 'Authorization: Bearer "
                                "KEY' with the server's --api-key", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.cfg.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                                f"{self.cfg.model_name!r}", param="model",
                           code="model_not_found")


def _prompts(body: CompletionRequest, engine: Engine) -> list[list[int]]:
    """Token ids of each prompt. Raises APIError for an empty prompt list or text that the
    tokenizer cannot encode."""
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise APIError(400, "prompt is an empty list; give at least one prompt",
                       param="prompt")
    out = []
    for item in p:
        if not item:
            raise APIError(400, "a prompt is empty; each prompt needs at least one token",
                           param="prompt")
        if isinstance(item, str):
            try:
                out.append(engine.tokenizer.encode(item))
            except (KeyError, ValueError) as error:
                raise APIError(400, f"the prompt cannot be encoded: {error}",
                               param="prompt") from None
        else:
            out.append(list(item))
    return out


def _logprobs(engine: Engine, out: RequestOutput, start: int, text_offset: int) -> dict:
    """OpenAI's completion logprobs of out.token_ids[start:] (token strings as decoded)."""
    decode = engine.tokenizer.decode
    ids = out.token_ids[start:]
    tokens = [decode([t]) for t in ids]
    offsets = [text_offset + sum(map(len, tokens[:i])) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": out.logprobs[start:],
            "top_logprobs": [{decode([t]): lp for t, lp in top.items()}
                             for top in out.top_logprobs[start:]],
            "text_offset": offsets}


def create_app(load: Callable[[], Engine], cfg: ServerConfig) -> FastAPI:
    """The FastAPI app. `load` builds the Engine (weights, warmup); it runs in a thread at
    startup, and requests get 503 until it returns."""
    server = Server(load, cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start_loading()
        yield
        if server.loop is not None:
            server.loop.stop()

    app = FastAPI(title="gpt-jax", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return error.response()

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return APIError(500, f"internal error: {error!r}", type_="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, error):
        return _validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error):
        kind = "not_found" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, f"{request.method} {request.url.path}: "
                                           f"{error.detail}", type_=kind).response()

    @app.get("/health")
    async def health():
        server.engine()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(prom.generate_latest(server.metrics.registry),
                        media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        return HTMLResponse(PLAYGROUND.read_text())

    @app.get("/v1/models")
    async def models(request: Request):
        server.check_key(request)
        engine = server.engine()
        return {"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": 0, "owned_by": "gpt-jax",
            "max_model_len": engine.config.max_seq_len}]}

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request):
        listed = (await models(request))["data"][0]
        server.check_model(model)
        return listed

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        server.check_key(request)
        raise APIError(400, f"model {cfg.model_name!r} has no chat template, so chat "
                            "completions are not available; use /v1/completions with a text "
                            "prompt", param="messages", code="chat_template_missing")

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        server.check_key(request)
        engine = server.engine()
        raw = await _body(request, cfg.max_body_bytes)
        try:
            body = CompletionRequest.model_validate_json(raw)
        except ValidationError as error:
            raise _validation_error(error) from None
        server.check_model(body.model)
        sampling = to_sampling(body, cfg.eos_token_id)
        if engine.tokenizer is None and not isinstance(body.prompt, list):
            raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
        prompts = await asyncio.to_thread(_prompts, body, engine)  # long text: off the loop
        try:  # as the engine will check each: vocabulary, context, page pool
            for i, p in enumerate(prompts):
                check_request(engine.config, p, sampling, request=i,
                              page_size=engine.page_size, num_pages=engine.num_pages)
        except RequestError as error:
            raise _request_error(error) from None
        samples = len(prompts) * sampling.n
        capacity = engine.max_slots + cfg.max_queue
        if samples > capacity:
            raise APIError(400, f"{len(prompts)} prompts x n={sampling.n} = {samples} "
                                f"completions; this server takes at most {capacity} at once",
                           param="n")
        if server.outstanding and server.outstanding + samples > capacity:
            raise APIError(429, f"the queue is full ({server.outstanding} completions in "
                                f"flight, at most {capacity}); retry later",
                           type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})

        cid = f"cmpl-{uuid.uuid4().hex}"
        results: asyncio.Queue = asyncio.Queue()
        event_loop = asyncio.get_running_loop()
        subs = [Submission(f"{cid}-{i}", p, sampling,
                           lambda item, i=i: event_loop.call_soon_threadsafe(
                               results.put_nowait, (i, item)), arrival)
                for i, p in enumerate(prompts)]
        server.outstanding += samples
        server.loop.add(subs)
        context = _Completion(server, engine, body, cid, subs, results, samples)
        try:
            first = await results.get()
        except BaseException:
            context.close()
            raise
        if isinstance(first[1], BaseException):
            context.close()
            error = first[1]
            if isinstance(error, RequestError):
                raise _request_error(error)
            if isinstance(error, (ValueError, TypeError)):
                raise APIError(400, str(error), param="prompt")
            raise APIError(500, f"the engine failed: {error!r}", type_="server_error")
        if body.stream:
            return EventSourceResponse(await _started(context.events(first)), sep="\n",
                                       shutdown_grace_period=cfg.shutdown_timeout)
        try:
            return await context.collect(first, request)
        finally:
            context.close()

    return app


async def _body(request: Request, limit: int) -> bytes:
    """The request body, or APIError 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body is {declared} bytes; at most {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _started(events):
    """`events` with its first item already taken: a started generator that is never resumed
    (the client left before the response began) is closed when collected, so its `finally`
    (abort, release) runs; one never started would skip it."""
    head = await events.__anext__()

    async def chained():
        try:
            yield head
            async for event in events:
                yield event
        finally:
            await events.aclose()
    return chained()


async def _unless_disconnected(awaitable, request: Request):
    """The awaitable's result, or None (cancelling it) if the client disconnects first."""
    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
    return work.result() if work.done() and not work.cancelled() else None


class _Completion:
    """One HTTP completion request in flight: its engine requests' outputs, turned into an
    OpenAI response or stream of chunks."""

    def __init__(self, server: Server, engine: Engine, body: CompletionRequest, cid: str,
                 subs: list[Submission], results: asyncio.Queue, samples: int):
        self.server, self.engine, self.body, self.cid = server, engine, body, cid
        self.subs, self.results, self.samples = subs, results, samples
        self.n = subs[0].sampling.n
        self.created = int(time.time())
        self.done: set[int] = set()  # choice indices finished
        self.closed = False

    def close(self) -> None:
        """Abort what has not finished and release the admission count (once)."""
        if self.closed:
            return
        self.closed = True
        self.server.outstanding -= self.samples
        if len(self.done) < self.samples and self.server.loop is not None:
            self.server.loop.abort([s.request_id for s in self.subs])

    def _record(self, item, outs: dict[int, RequestOutput]) -> tuple[int, RequestOutput]:
        """An engine output `(prompt index, RequestOutput)` (an error is raised) as its choice
        index (prompts in order, the n samples of each consecutively, as OpenAI orders
        choices), kept in `outs` and marked done when finished."""
        i, out = item
        if isinstance(out, BaseException):
            raise out
        k = i * self.n + out.sample_index
        outs[k] = out
        if out.finished:
            self.done.add(k)
        return k, out

    def _usage(self, outs: dict[int, RequestOutput]) -> dict:
        prompt = sum(len(s.prompt) for s in self.subs)
        completion = sum(len(o.token_ids) for o in outs.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def collect(self, first, request: Request) -> dict | Response:
        """Wait for every choice (aborting if the client goes away) and answer at once."""
        outs: dict[int, RequestOutput] = {}
        item = first
        while True:
            self._record(item, outs)
            if len(self.done) == self.samples:
                break
            item = await _unless_disconnected(self.results.get(), request)
            if item is None:
                return Response(status_code=499)  # nobody reads it; close() aborts
        want = self.body.logprobs is not None
        choices = [{"index": k, "text": outs[k].text,
                    "logprobs": _logprobs(self.engine, outs[k], 0, 0) if want else None,
                    "finish_reason": FINISH_REASONS[outs[k].finish_reason]}
                   for k in range(self.samples)]
        return {"id": self.cid, "object": "text_completion", "created": self.created,
                "model": self.server.cfg.model_name, "choices": choices,
                "usage": self._usage(outs)}

    async def events(self, first):
        """SSE data: a chunk per output with new text (the finish reason on a choice's last),
        then a usage chunk when asked, then [DONE]."""
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        want = self.body.logprobs is not None
        sent_tokens: dict[int, int] = {}
        sent_chars: dict[int, int] = {}
        outs: dict[int, RequestOutput] = {}
        item = first
        try:
            while True:
                try:
                    k, out = self._record(item, outs)
                except Exception as error:  # the engine failed: say so in the stream
                    yield {"data": json.dumps({"error": {
                        "message": f"the engine failed: {error!r}", "type": "server_error",
                        "param": None, "code": None}})}
                    break
                start = sent_tokens.get(k, 0)
                if out.new_text or out.finished or (want and len(out.token_ids) > start):
                    chunk = {"index": k, "text": out.new_text or "",
                             "logprobs": _logprobs(self.engine, out, start,
                                                   sent_chars.get(k, 0)) if want else None,
                             "finish_reason": FINISH_REASONS[out.finish_reason]
                             if out.finished else None}
                    sent_tokens[k] = len(out.token_ids)
                    sent_chars[k] = sent_chars.get(k, 0) + len(out.new_text or "")
                    yield {"data": json.dumps(self._chunk([chunk], include_usage))}
                if len(self.done) == self.samples:
                    break
                item = await self.results.get()
            if include_usage:
                yield {"data": json.dumps(self._chunk([], False) | {"usage": self._usage(outs)})}
            yield {"data": "[DONE]"}
        finally:  # finished, or the client went away (the generator is closed or cancelled)
            self.close()

    def _chunk(self, choices: list[dict], with_null_usage: bool) -> dict:
        chunk = {"id": self.cid, "object": "text_completion", "created": self.created,
                 "model": self.server.cfg.model_name, "choices": choices}
        return chunk | ({"usage": None} if with_null_usage else {})


# ---------------------------------------------------------------------- command line

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpt-jax serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the run or checkpoint "
                        "directory's name)")
    p.add_argument("--max-slots", type=int, default=16, help="samples decoded at once")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV page pool size in bytes (default: every slot can hold the "
                        "model's context)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="most completions waiting beyond the slots before 429")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: none)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight")
    p.add_argument("--no-warmup", action="store_true",
                   help="compile each program on first use instead of before serving")
    return p.parse_args(argv)


def main(argv=None) -> None:
    import uvicorn

    args = parse_args(argv)
    for name, low, high in (("max_slots", 1, None), ("max_queue", 0, None),
                            ("port", 1, 65535)):
        value = getattr(args, name)
        if value < low or (high is not None and value > high):
            allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise SystemExit(f"gpt-jax serve: --{name.replace('_', '-')} must be {allowed}, "
                             f"got {value}")
    source = Path(args.hf_checkpoint or args.run_dir)
    if not source.is_dir():
        raise SystemExit(f"gpt-jax serve: {source} is not a directory")
    cfg = ServerConfig(model_name=args.served_model_name or source.resolve().name,
                       api_key=args.api_key, max_queue=args.max_queue,
                       shutdown_timeout=args.shutdown_timeout)
    try:  # a model that cannot load stops here, before the server listens
        params, config, tokenizer, eos = load_model(args)
        if tokenizer is None:
            raise ValueError(f"{source} has no tokenizer")
        engine = Engine(params, config, tokenizer, max_slots=args.max_slots,
                        kv_cache_bytes=args.kv_cache_bytes, cache_dtype=args.dtype,
                        quantize=args.quantize)
    except (OSError, ValueError) as error:
        raise SystemExit(f"gpt-jax serve: {error}") from error
    cfg.eos_token_id = eos

    def load() -> Engine:
        """Compile the engine's programs (the slow part) while /health answers 503."""
        if not args.no_warmup:
            print(f"gpt-jax serve: compiling the engine's programs ({args.max_slots} slots); "
                  "/health answers 503 until they are ready", flush=True)
            tick = time.monotonic()
            compiled = engine.warmup()
            print(f"gpt-jax serve: {compiled} programs compiled in "
                  f"{time.monotonic() - tick:.0f} s", flush=True)
        print(f"gpt-jax serve: {cfg.model_name} ready on http://{args.host}:{args.port}",
              flush=True)
        return engine

    uvicorn.run(create_app(load, cfg), host=args.host, port=args.port,
                timeout_graceful_shutdown=args.shutdown_timeout + 5, log_level="warning")


if __name__ == "__main__":
    main()
