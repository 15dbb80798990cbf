"""The thread that owns the serving `Engine` (it is not thread-safe): it alternates between
taking commands (add the prompts of one HTTP request, abort some) from a queue and calling
`Engine.step()`, and hands every `RequestOutput` (or error) to its submission's `deliver`,
which the HTTP side makes `loop.call_soon_threadsafe` onto its asyncio queue."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Callable

from inference import compile_cache
from inference.detokenize import RequestOutput
from inference.engine import Engine
from inference.metrics import Metrics
from inference.sampling_params import SamplingParams


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


def say_first_use(before: compile_cache.Programs, after: compile_cache.Programs,
                  seconds: float) -> None:
    """One line when a step compiled (or loaded) programs: a request used one the start-up
    warmup did not prepare (a structured-output request without --warmup-json-object, a
    speculative one, --no-warmup), and every running request waited for it."""
    compiled, loaded = after.compiled - before.compiled, after.loaded - before.loaded
    if compiled or loaded:
        print(f"gpt-jax serve: a step compiled {compiled} and loaded {loaded} programs on "
              f"first use ({seconds:.1f} s; every running request waited): a request used a "
              "program the start-up warmup did not prepare", flush=True)


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
                before, tick = compile_cache.programs(), time.monotonic()
                try:
                    outputs = self.engine.step()
                except BaseException as error:  # a bug: fail every request, refuse new ones
                    self.error = error
                    for sub in self.live.values():
                        sub.deliver(error)
                    raise
                say_first_use(before, compile_cache.programs(), time.monotonic() - tick)
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
