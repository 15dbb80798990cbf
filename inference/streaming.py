"""One HTTP completion request in flight: its engine requests' outputs, answered at once as
one OpenAI response (`InFlight.collect`) or as a stream of Server-Sent Events, a chunk per
new text and `[DONE]` last (`InFlight.events`); a client that goes away has its requests
aborted."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from fastapi import Request
from fastapi.responses import Response

from inference import api
from inference.detokenize import RequestOutput


class InFlight:
    """The outputs of one HTTP request's engine requests (`request_ids`, one per prompt, `n`
    samples each), arriving on `results` as `(prompt index, RequestOutput or error)`, turned
    into an OpenAI response or stream of chunks in `shape` (`api.CompletionShape` or
    `api.ChatShape`). `release(unfinished)` is called once, on `close`: it frees the
    admission count and aborts the `unfinished` request ids."""

    def __init__(self, body: api.CompletionRequest | api.ChatRequest, cid: str, model: str,
                 tokenizer, request_ids: list[str], prompt_tokens: int, n: int,
                 results: asyncio.Queue, release: Callable[[list[str]], None],
                 shape=api.CompletionShape):
        self.body, self.cid, self.model, self.tokenizer = body, cid, model, tokenizer
        self.shape = shape
        self.request_ids, self.prompt_tokens, self.n = request_ids, prompt_tokens, n
        self.results, self.release = results, release
        self.samples = len(request_ids) * n
        self.created = int(time.time())
        self.done: set[int] = set()  # choice indices finished
        self.closed = False

    def close(self) -> None:
        """Abort what has not finished and release the admission count (once)."""
        if self.closed:
            return
        self.closed = True
        self.release(self.request_ids if len(self.done) < self.samples else [])

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
        completion = sum(len(o.token_ids) for o in outs.values())
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def _logprobs(self, out: RequestOutput, start: int, text_offset: int) -> dict | None:
        if not self.shape.wants_logprobs(self.body):
            return None
        return self.shape.logprobs(self.tokenizer, out, start, text_offset)

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
        choices = [self.shape.choice(k, outs[k], outs[k].text,
                                     self._logprobs(outs[k], 0, 0), chunk=False)
                   for k in range(self.samples)]
        return api.completion_object(self.cid, self.created, self.model, choices,
                                     self.shape.object) | {"usage": self._usage(outs)}

    async def events(self, first):
        """SSE data: a chat stream's opening chunk per choice (its role), a chunk per
        output with new text (the finish reason on a choice's last), then a usage chunk
        when asked, then [DONE]."""
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        sent_tokens: dict[int, int] = {}
        # a choice's next token's text_offset: the characters of the tokens sent, not of the
        # text sent (text that might start a stop string is held back, its tokens are not)
        offsets: dict[int, int] = {}
        outs: dict[int, RequestOutput] = {}
        item = first
        try:
            openings = [self.shape.opening(k) for k in range(self.samples)]
            for opening in filter(None, openings):
                yield {"data": json.dumps(self._chunk([opening], include_usage))}
            while True:
                try:
                    k, out = self._record(item, outs)
                except Exception as error:  # the engine failed: say so in the stream
                    yield {"data": json.dumps(api.APIError(
                        500, f"the engine failed: {error!r}", type_="server_error").body())}
                    break
                start = sent_tokens.get(k, 0)
                wants_logprobs = self.shape.wants_logprobs(self.body)
                if out.new_text or out.finished or (wants_logprobs
                                                    and len(out.token_ids) > start):
                    logprobs = self._logprobs(out, start, offsets.get(k, 0))
                    if logprobs is not None:
                        offsets[k] = offsets.get(k, 0) + self.shape.offset_after(logprobs)
                    chunk = self.shape.choice(k, out, out.new_text or "", logprobs, chunk=True)
                    sent_tokens[k] = len(out.token_ids)
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
        chunk = api.completion_object(self.cid, self.created, self.model, choices,
                                      self.shape.chunk_object)
        return chunk | ({"usage": None} if with_null_usage else {})


async def started(events):
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
