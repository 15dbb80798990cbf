r"""`gpt-jax serve`: an OpenAI-compatible HTTP server on the serving `Engine`.

    gpt-jax serve --run-dir runs/shakespeare-char --port 8000
    curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
        -d '{"model": "shakespeare-char", "prompt": "Romeo.\n", "max_tokens": 50}'

or any OpenAI client: `openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY)`.

Endpoints (the OpenAI API reference for /v1/completions, vLLM's server for the extra
sampling fields `top_k`, `min_p`, `repetition_penalty`, `min_tokens`; an EOS sampled ends a
completion with finish_reason "stop", as OpenAI reports it):
  POST /v1/completions       prompt: text, a list of texts, token ids or lists of token ids;
                             `stream: true` answers with Server-Sent Events ending `[DONE]`
  POST /v1/chat/completions  messages rendered with the model's chat template
                             (`inference.chat`; `--chat-template FILE`), the same sampling
                             fields, logprobs in the chat shape; a 400 without a template
  GET  /v1/models, /health, /metrics (Prometheus text format), / (the playground page)

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
field (named, with what is allowed) or a request past the context; 401 for a wrong or missing
key when the server has one; 404 for an unknown model or path; 429 (with Retry-After) when the
queue is full; 503 while the model loads.

Threads: uvicorn's event loop serves HTTP; one engine thread owns the `Engine`
(`inference.engine_loop`), handing every `RequestOutput` to its HTTP request's asyncio queue.
A client that disconnects has its requests aborted, which frees their pages. On SIGTERM
uvicorn stops accepting connections and waits (at most `--shutdown-timeout` seconds) for the
requests in flight to finish; then the command exits 0.

This file is the app: its routes, admission, startup and shutdown; the command (its flags,
the port, signals) is `inference.serve`. The API's
request model, errors and response shapes are `inference.api`; a completion in flight
(collected or streamed) is `inference.streaming`; the metrics are `inference.metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.api import (APIError, ChatRequest, ChatShape, CompletionRequest,
                           CompletionShape, chat_sampling, request_error, to_sampling,
                           validation_error)
from inference.chat import HOW_TO_SUPPLY, ChatTemplate, token_ids
from inference.engine import Engine
from inference.engine_loop import EngineLoop, Submission
from inference.errors import RequestError
from inference.metrics import Metrics
from inference.sampling_params import SamplingParams
from inference.streaming import InFlight, started
from inference.validation import check_request, encode_text

PLAYGROUND = Path(__file__).with_name("playground.html")


# ---------------------------------------------------------------------- the server's state

@dataclasses.dataclass
class ServerConfig:
    model_name: str  # the id clients pass as `model`
    api_key: str | None = None  # None: no key needed
    max_queue: int = 256  # most samples waiting beyond the engine's slots before 429
    eos_token_ids: tuple[int, ...] = ()  # each ends a completion (finish_reason "stop")
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for requests in flight
    max_body_bytes: int = 8 << 20  # a larger request body is refused (413) unread
    allowed_origins: tuple[str, ...] = ()  # CORS: pages on these origins ("*": any) may call
    chat_template: ChatTemplate | None = None  # None: chat completions are refused (400)


class Server:
    """The app's state: the engine loop once loaded, the admission count, the metrics."""

    def __init__(self, load: Callable[[], Engine], cfg: ServerConfig,
                 on_ready: Callable[[], None]):
        self.load, self.cfg, self.on_ready = load, cfg, on_ready
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
            else:
                self.on_ready()
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

    def release(self, samples: int, unfinished: list[str]) -> None:
        """A completion answered or abandoned: its `samples` leave the admission count, and
        its `unfinished` engine requests are aborted."""
        self.outstanding -= samples
        if unfinished and self.loop is not None:
            self.loop.abort(unfinished)

    def admit(self, n_prompts: int, n: int) -> None:
        """Count `n_prompts` x `n` more completions in flight, or raise APIError: 400 for
        more than the server ever takes at once, 429 (Retry-After) while the queue is
        full."""
        samples, capacity = n_prompts * n, self.loop.engine.max_slots + self.cfg.max_queue
        if samples > capacity:
            raise APIError(400, f"{n_prompts} prompts x n={n} = {samples} completions; this "
                                f"server takes at most {capacity} at once", param="n")
        if self.outstanding and self.outstanding + samples > capacity:
            raise APIError(429, f"the queue is full ({self.outstanding} completions in "
                                f"flight, at most {capacity}); retry later",
                           type_="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        self.outstanding += samples


def _prompts(body: CompletionRequest, engine: Engine) -> list[list[int]]:
    """Token ids of each prompt; text as the tokenizer encodes it (`encode_text`: "" is
    [BOS] when the tokenizer adds one, as vLLM takes it). Raises APIError for an empty
    prompt list, a prompt of no tokens, or text that the tokenizer cannot encode."""
    p = body.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and isinstance(p[0], int)):
        p = [p]
    if not p:
        raise APIError(400, "prompt is an empty list; give at least one prompt",
                       param="prompt")
    out = []
    for i, item in enumerate(p):
        if isinstance(item, str):
            try:
                out.append(encode_text(engine.tokenizer, item, i))
            except RequestError as error:
                raise request_error(error) from None
            except (KeyError, ValueError) as error:
                raise APIError(400, f"the prompt cannot be encoded: {error}",
                               param="prompt") from None
        elif not item:
            raise APIError(400, f"prompt {i} is empty; a prompt needs at least one token",
                           param="prompt")
        else:
            out.append(list(item))
    return out


async def _checked_prompts(body: CompletionRequest, engine: Engine,
                           sampling: SamplingParams) -> list[list[int]]:
    """The prompts as token ids, each checked as the engine will check it (`check_request`:
    the vocabulary, the context, the page pool; named by its index). Raises APIError."""
    given = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if engine.tokenizer is None and any(isinstance(p, str) for p in given):
        raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
    prompts = await asyncio.to_thread(_prompts, body, engine)  # long text: off the loop
    try:  # off the loop too: compiling a new structured-output constraint takes seconds
        return await asyncio.to_thread(lambda: [
            check_request(engine.config, p, sampling, request=i, page_size=engine.page_size,
                          num_pages=engine.num_pages, tokenizer=engine.tokenizer)
            for i, p in enumerate(prompts)])
    except RequestError as error:
        raise request_error(error, body) from None


async def _chat_prompt(server: Server, body: ChatRequest,
                       engine: Engine) -> tuple[list[int], list[int]]:
    """The conversation's prompt ids, rendered with the chat template, and the ids that end
    the model's turn (the template's end-of-turn tokens, the EOS). Raises APIError: no
    template, messages the template refuses."""
    template = server.cfg.chat_template
    if template is None:
        raise APIError(400, f"model {server.cfg.model_name!r} has no chat template, so chat "
                            f"completions are not available; {HOW_TO_SUPPLY}; or use "
                            "/v1/completions with a text prompt", param="messages",
                       code="chat_template_missing")

    def render() -> tuple[list[int], list[int]]:
        stops = token_ids(engine.tokenizer, template.end_of_turn_tokens())
        eos = [i for i in server.cfg.eos_token_ids if i not in stops]
        return template.encode(engine.tokenizer, body.messages), stops + eos
    try:
        return await asyncio.to_thread(render)  # long conversations: off the loop
    except RequestError as error:
        raise request_error(error) from None
    except (KeyError, ValueError) as error:  # a character outside a char tokenizer's
        raise APIError(400, f"the rendered conversation cannot be encoded: {error}",
                       param="messages") from None


async def _body(request: Request, limit: int, model=CompletionRequest):
    """The request body, parsed as `model`; APIError 413 as soon as it is known to exceed
    `limit` bytes, 400 for a body that is not a valid request."""
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
    try:
        return model.model_validate_json(b"".join(chunks))
    except ValidationError as error:
        raise validation_error(error, model) from None


def _engine_error(error: BaseException) -> APIError:
    """What the engine thread answered a submission with, as an API error."""
    if isinstance(error, RequestError):
        return request_error(error)
    if isinstance(error, (ValueError, TypeError)):
        return APIError(400, str(error), param="prompt")
    return APIError(500, f"the engine failed: {error!r}", type_="server_error")


# ---------------------------------------------------------------------- the app

def create_app(load: Callable[[], Engine], cfg: ServerConfig,
               on_ready: Callable[[], None] = lambda: None) -> FastAPI:
    """The FastAPI app. `load` builds the Engine (weights, warmup); it runs in a thread at
    startup, and requests get 503 until it returns; then `on_ready` is called (in that
    thread)."""
    server = Server(load, cfg, on_ready)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start_loading()
        yield
        if server.loop is not None:
            server.loop.stop()

    app = FastAPI(title="gpt-jax", lifespan=lifespan)
    app.state.server = server
    if cfg.allowed_origins:  # none: browsers let only the server's own page call it
        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.allowed_origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["Retry-After"])
    _error_handlers(app)
    _info_routes(app, server)
    _completion_routes(app, server)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error, ours, pydantic's, starlette's or a bug, answered in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return error.response()

    @app.exception_handler(Exception)
    async def internal_error(request, error: Exception):
        return APIError(500, f"internal error: {error!r}", type_="server_error").response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, error):
        return validation_error(error).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, error):
        kind = "not_found" if error.status_code == 404 else "invalid_request_error"
        return APIError(error.status_code, f"{request.method} {request.url.path}: "
                                           f"{error.detail}", type_=kind).response()


def _info_routes(app: FastAPI, server: Server) -> None:
    """/health, /metrics, the playground page and the model list."""

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
            "id": server.cfg.model_name, "object": "model", "created": 0,
            "owned_by": "gpt-jax", "max_model_len": engine.config.max_seq_len}]}

    @app.get("/v1/models/{model}")
    async def model(model: str, request: Request):
        listed = (await models(request))["data"][0]
        server.check_model(model)
        return listed


def _completion_routes(app: FastAPI, server: Server) -> None:
    """POST /v1/completions and /v1/chat/completions."""

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        arrival = time.monotonic()
        server.check_key(request)
        engine = server.engine()
        body = await _body(request, server.cfg.max_body_bytes, ChatRequest)
        server.check_model(body.model)
        prompt, stop_ids = await _chat_prompt(server, body, engine)
        sampling = chat_sampling(body, stop_ids,
                                 max(1, engine.config.max_seq_len - len(prompt)))
        try:
            prompt = await asyncio.to_thread(  # a new constraint compiles: off the loop
                check_request, engine.config, prompt, sampling, request=0,
                page_size=engine.page_size, num_pages=engine.num_pages,
                tokenizer=engine.tokenizer)
        except RequestError as error:
            raise request_error(error, body) from None
        server.admit(1, sampling.n)
        return await _answer(server, body, [prompt], sampling, arrival, request, ChatShape)

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        server.check_key(request)
        engine = server.engine()
        body = await _body(request, server.cfg.max_body_bytes)
        server.check_model(body.model)
        sampling = to_sampling(body, server.cfg.eos_token_ids)
        prompts = await _checked_prompts(body, engine, sampling)
        server.admit(len(prompts), sampling.n)
        return await _answer(server, body, prompts, sampling, arrival, request)


async def _answer(server: Server, body: CompletionRequest | ChatRequest,
                  prompts: list[list[int]], sampling: SamplingParams, arrival: float,
                  request: Request, shape=CompletionShape):
    """Hand the admitted prompts to the engine thread, then answer in `shape`: the whole
    completion at once, or a stream of chunks as they come."""
    cid = f"{'chatcmpl' if shape is ChatShape else 'cmpl'}-{uuid.uuid4().hex}"
    results: asyncio.Queue = asyncio.Queue()
    event_loop = asyncio.get_running_loop()
    subs = [Submission(f"{cid}-{i}", p, sampling,
                       lambda item, i=i: event_loop.call_soon_threadsafe(
                           results.put_nowait, (i, item)), arrival)
            for i, p in enumerate(prompts)]
    server.loop.add(subs)
    samples = len(subs) * sampling.n
    flight = InFlight(body, cid, server.cfg.model_name, server.loop.engine.tokenizer,
                      [s.request_id for s in subs], sum(map(len, prompts)), sampling.n,
                      results, lambda unfinished: server.release(samples, unfinished), shape)
    try:
        first = await results.get()
    except BaseException:
        flight.close()
        raise
    if isinstance(first[1], BaseException):
        flight.close()
        raise _engine_error(first[1])
    if body.stream:
        return EventSourceResponse(await started(flight.events(first)), sep="\n",
                                   shutdown_grace_period=server.cfg.shutdown_timeout)
    try:
        return await flight.collect(first, request)
    finally:
        flight.close()
