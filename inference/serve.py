"""`gpt-jax serve`, the command: its flags, the port taken before anything loads, the model
loaded, then uvicorn serving the app (`inference.server`) on that port. It prints "ready"
once uvicorn listens and the engine serves; SIGTERM (or Ctrl-C) drains the requests in
flight (at most `--shutdown-timeout` seconds) and exits 0; while the model still loads or
compiles, it stops at once with one line (exit 143, or 130 for Ctrl-C)."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import sys
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable

import jax
import uvicorn

from gpt_jax import tensor_parallel
from gpt_jax.cache import cache_bytes, pages_for
from inference import compile_cache, exported, multihost
from inference.chat import ChatTemplate
from inference.draft_engine import add_draft_args, load_draft
from inference.engine import Engine
from inference.load import add_model_args, load_config, load_model
from inference.sampling_params import SamplingParams
from inference.server import ServerConfig, create_app
from inference.steps import PAGE_SIZE


def parse_origins(values: list[str] | None) -> tuple[str, ...]:
    """The origins of `--allowed-origins` values (repeated, or comma-separated). Raises
    ValueError for one that is not `*` or `scheme://host[:port]` (a browser's Origin header
    has no path, so "http://a.test/" would never match)."""
    origins = tuple(o.strip() for value in values or [] for o in value.split(",") if o.strip())
    for origin in origins:
        parts = urllib.parse.urlsplit(origin)
        if origin != "*" and not (parts.scheme and parts.netloc and origin.endswith(
                parts.netloc)):
            raise ValueError(f"--allowed-origins {origin!r} is not an origin; allowed: "
                             "scheme://host[:port] (no path), or * for any")
    return origins


# Default page pool of `serve`: this many sequences of the model's context (the Engine's own
# default, every slot holding its context, would be 4x the memory at serve's 64 slots).
POOL_SEQUENCES = 16

DESCRIPTION = r"""An OpenAI-compatible HTTP server for a trained run (--run-dir) or a Hugging Face
directory (--hf-checkpoint):

  gpt-jax serve --run-dir runs/shakespeare-char --port 8000
  curl 127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "shakespeare-char", "prompt": "Romeo.\n", "max_tokens": 50}'

or any OpenAI client: openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=KEY).
Endpoints: POST /v1/completions and /v1/chat/completions (streaming too), GET /v1/models,
/health (503 while the model loads), /metrics (Prometheus) and / (a playground page).
It prints "ready" once it serves; SIGTERM or Ctrl-C lets the requests in flight finish
(at most --shutdown-timeout seconds) and exits 0."""


class _HelpWithDefaults(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each flag's default after its help, where there is
    one to say (not None or False, and not already in the help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or \
                "default" in text:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpt-jax serve", description=DESCRIPTION,
                                formatter_class=_HelpWithDefaults)
    add_model_args(p)
    add_draft_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the run or checkpoint "
                        "directory's name)")
    p.add_argument("--max-slots", type=int, default=64,
                   help="samples decoded at once (they share the page pool)")
    p.add_argument("--max-prefill-tokens", type=int, default=256,
                   help="most prompt tokens per prefill call, over all the prompts it "
                        "prefills (a long prompt goes in over several calls, at most "
                        f"{Engine.__init__.__kwdefaults__['prefill_chunk_tokens']} tokens of it "
                        "a call)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help=f"KV page pool size in bytes (default: {POOL_SEQUENCES} sequences of "
                        "the model's context, or --max-slots if fewer; the slots share it)")
    p.add_argument("--mixed-steps", action="store_true",
                   help="prefill prompt chunks inside the running requests' decode chunks "
                        "(one program per row and token bucket; not with --tensor-parallel)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="most completions waiting beyond the slots before 429")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (default: none)")
    p.add_argument("--allowed-origins", action="append", metavar="ORIGINS",
                   help="origins (scheme://host[:port], comma-separated or repeated; * for "
                        "any) whose browser pages may call the server (CORS); default: none, "
                        "only the server's own page")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for requests in flight")
    p.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template for /v1/chat/completions (default: the model "
                        "directory's chat_template.jinja or tokenizer_config.json's)")
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N devices (tensor parallelism: heads and MLP "
                        "width per device, KV pages by kv head; on CPU the host is split into "
                        "N devices)")
    multihost.add_flags(p)
    p.add_argument("--no-warmup", action="store_true",
                   help="compile each program on first use instead of before serving "
                        "(speculative decoding's and structured output's programs compile "
                        "on first use in any case, except json_object's with "
                        "--warmup-json-object; the log says when a step compiled)")
    p.add_argument("--warmup-json-object", action="store_true",
                   help="also compile response_format json_object for the served tokenizer "
                        "(tens of seconds over a 50k vocabulary, once: kept in "
                        "~/.cache/gpt-jax/constraints) and the engine's constrained programs")
    compile_cache.add_flag(p)
    return p.parse_args(argv)


def main(argv=None) -> None:
    """`gpt-jax serve ARGV`: the flags checked, the port taken, the model loaded, then the
    app served until SIGTERM or Ctrl-C."""
    args = parse_args(argv)
    for name, low, high in (("max_slots", 1, None), ("max_prefill_tokens", 1, None),
                            ("max_queue", 0, None),
                            ("port", 1, 65535), ("tensor_parallel", 1, None)):
        value = getattr(args, name)
        if value < low or (high is not None and value > high):
            allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise SystemExit(f"gpt-jax serve: --{name.replace('_', '-')} must be {allowed}, "
                             f"got {value}")
    if args.shutdown_timeout < 0:
        raise SystemExit(f"gpt-jax serve: --shutdown-timeout must be >= 0 (seconds), got "
                         f"{args.shutdown_timeout:g}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise SystemExit(f"gpt-jax serve: --served-model-name {args.served_model_name!r} is "
                         "empty; allowed: the model id clients send, or no flag for the "
                         "directory's name")
    source = Path(args.hf_checkpoint or args.run_dir)
    if not source.is_dir():
        raise SystemExit(f"gpt-jax serve: {source} is not a directory")
    check_kv_cache_bytes(args)
    multihost.check_flags(args)
    try:
        origins = parse_origins(args.allowed_origins)
    except ValueError as error:
        raise SystemExit(f"gpt-jax serve: {error}") from None
    cfg = ServerConfig(model_name=args.served_model_name or source.resolve().name,
                       api_key=args.api_key, max_queue=args.max_queue,
                       shutdown_timeout=args.shutdown_timeout, allowed_origins=origins)
    cfg.chat_template = _chat_template(args.chat_template, source)
    loaded = threading.Event()  # set once the loading thread is done, whatever its end
    previous = {sig: signal.signal(sig, _stop_handler(loaded))  # uvicorn's own while it
                for sig in (signal.SIGTERM, signal.SIGINT)}     # runs, then again
    try:
        _serve(args, cfg, source, loaded)
    finally:  # a caller in this process (a test) gets its own handlers back
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve(args: argparse.Namespace, cfg: ServerConfig, source: Path,
           loaded: threading.Event) -> None:
    """Take the port, load the model, serve until SIGTERM or Ctrl-C; `loaded` is set once
    the loading thread is done (the programs compiled, or failed)."""
    leader = not args.process_id  # process 0 (or the only one) serves HTTP
    # before the model loads: a port in use stops here
    sock = listen(args.host, args.port) if leader else None
    if args.tensor_parallel > 1:  # a CPU host as N devices (before JAX starts; only CPU's)
        jax.config.update("jax_num_cpu_devices",
                          args.tensor_parallel // multihost.processes(args))
    channel = multihost.start(args)  # several processes: jax.distributed joined
    cache = None if args.no_compile_cache else compile_cache.enable()
    engine, cfg.eos_token_ids = _engine(args, source)
    if not leader:
        return multihost.follow(engine, channel)
    if channel is not None:
        multihost.lead(engine, channel)
    store = (None if cache is None or args.tensor_parallel > 1  # artifacts: one-device programs
             else exported.attach(engine, cache / "exported"))

    def load() -> Engine:
        """Compile the engine's programs (the slow part) while /health answers 503."""
        try:
            if not args.no_warmup:
                print(f"gpt-jax serve: preparing the engine's programs ({args.max_slots} "
                      "slots: compiled, or loaded from the compilation cache); /health "
                      "answers 503 until they are ready", flush=True)
                tick, before = time.monotonic(), compile_cache.programs()
                engine.warmup(constraints=[SamplingParams(json_object=True)]
                              if args.warmup_json_object else ())
                after = compile_cache.programs()
                print(f"gpt-jax serve: {after.loaded - before.loaded} programs loaded from "
                      f"cache, {after.compiled - before.compiled} compiled in "
                      f"{time.monotonic() - tick:.1f} s" + ("" if store is None else
                      f" ({store.loaded} exported programs read, {store.exported} written)"),
                      flush=True)
            return engine
        finally:
            loaded.set()

    listening = threading.Event()

    def ready() -> None:  # the engine serves (in the loading thread): say so once uvicorn does
        listening.wait()
        print(f"gpt-jax serve: {cfg.model_name} ready on http://{args.host}:{args.port}",
              flush=True)

    config = uvicorn.Config(create_app(load, cfg, on_ready=ready), host=args.host,
                            port=args.port, log_level="warning",
                            timeout_graceful_shutdown=args.shutdown_timeout + 5)
    try:
        _Uvicorn(config, on_listening=listening.set, drain_s=args.shutdown_timeout).run(
            sockets=[sock])
    finally:
        if channel is not None:  # drained (or failed): the followers exit too
            channel.send(multihost.STOP)


def _stop_handler(loaded: threading.Event) -> Callable[[int, object], None]:
    """The SIGTERM and Ctrl-C handler outside uvicorn's run, which re-raises the signal it
    drained under it. While the model loads (in this thread before uvicorn starts, in the
    loading thread after), one line, then exit 128 + the signal's number at once, skipping
    the interpreter's shutdown: with the loading thread inside XLA's compiler, that shutdown
    crashed the process (a new user's trial: exit 139, or 134 "FATAL: exception not
    rethrown"). Once loaded, nothing: uvicorn drained, and the command exits 0."""
    def handler(sig: int, frame) -> None:
        if not loaded.is_set():
            print(f"gpt-jax serve: {signal.Signals(sig).name} while the model was loading; "
                  "stopped", file=sys.stderr, flush=True)
            os._exit(128 + sig)
    return handler


def check_kv_cache_bytes(args: argparse.Namespace) -> None:
    """Stop the command, naming the flag, when --kv-cache-bytes holds no KV page of the
    model (its config alone read), before the weights load."""
    if args.kv_cache_bytes is None:
        return
    try:
        page = cache_bytes(load_config(args), 1, PAGE_SIZE, args.dtype)
    except (OSError, ValueError) as error:
        raise SystemExit(f"gpt-jax serve: {error}") from None
    if args.kv_cache_bytes < page:
        raise SystemExit(f"gpt-jax serve: --kv-cache-bytes {args.kv_cache_bytes} holds no KV "
                         f"page; one page of {PAGE_SIZE} tokens takes {page} bytes")


def _chat_template(path: str | None, source: Path) -> ChatTemplate | None:
    """The --chat-template file (with the model directory's special tokens), else the model
    directory's template, else None. A template that cannot be read or parsed stops the
    command."""
    try:
        return ChatTemplate.load(source, path)
    except (OSError, ValueError) as error:
        raise SystemExit(f"gpt-jax serve: the chat template: {error}") from None


def _engine(args: argparse.Namespace, source: Path) -> tuple[Engine, tuple[int, ...]]:
    """The engine of the model `args` name, and its EOS ids. A model that cannot load stops
    the command here, before the server listens."""
    try:
        params, config, tokenizer, eos = load_model(args)
        if tokenizer is None:
            raise ValueError(f"{source} has no tokenizer")
        return Engine(params, config, tokenizer, **engine_sizes(args, config),
                      cache_dtype=args.dtype,
                      quantize=args.quantize, mesh=_mesh(args.tensor_parallel),
                      mixed_steps=args.mixed_steps,
                      draft=load_draft(args, config, tokenizer)), eos
    except (OSError, ValueError, ImportError) as error:  # ImportError: a .bin without torch
        raise SystemExit(f"gpt-jax serve: {error}") from error


def engine_sizes(args: argparse.Namespace, config) -> dict:
    """The Engine's sizes from the flags: --max-slots, --max-prefill-tokens and the page
    pool, --kv-cache-bytes or else pages for POOL_SEQUENCES sequences of the model's context
    (at most --max-slots of them): more slots than that share the pages, admitted while the
    pages last (vLLM's max_num_seqs beside its memory budget)."""
    sizes = {"max_slots": args.max_slots, "max_prefill_tokens": args.max_prefill_tokens}
    if args.kv_cache_bytes is not None:
        return sizes | {"kv_cache_bytes": args.kv_cache_bytes}
    contexts = min(args.max_slots, POOL_SEQUENCES)
    return sizes | {"num_pages": contexts * pages_for(config.max_seq_len, PAGE_SIZE)}


def _mesh(n: int):
    """The --tensor-parallel mesh over the first n devices (None for 1). Raises ValueError
    when there are fewer."""
    return None if n == 1 else tensor_parallel.make_mesh(n)


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on host:port, which uvicorn serves once the app starts. Taken
    first, before anything loads or compiles, so that a port in use stops the command at
    once (uvicorn, binding after the warmup had begun, aborted the process). Raises
    SystemExit naming the port."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    except OSError as error:
        raise SystemExit(f"gpt-jax serve: cannot listen on {host}:{port}: {error}") from None
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as error:
        sock.close()
        why = "is in use" if error.errno == errno.EADDRINUSE else \
            f"cannot be listened on: {error.strerror}"
        raise SystemExit(f"gpt-jax serve: port {port} on {host} {why}") from None
    return sock


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, calling `on_listening` once it serves its sockets.

    It re-raises the SIGTERM or Ctrl-C it drained for under the handlers it found: `main`
    leaves them ignored, so a drained shutdown exits 0 (by the signal, it was 143)."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[], None],
                 drain_s: float):
        super().__init__(config)
        self.on_listening, self.drain_s = on_listening, drain_s

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_listening()

    def handle_exit(self, sig: int, frame) -> None:
        """uvicorn's signal handler, after one line on the first signal: what the server does
        now (an operator saw nothing between SIGTERM and the exit)."""
        if not self.should_exit:
            print(f"gpt-jax serve: {signal.Signals(sig).name}: draining (no new connections; "
                  f"the requests in flight finish, for at most {self.drain_s:g} s), then "
                  "exiting", flush=True)
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    main()
