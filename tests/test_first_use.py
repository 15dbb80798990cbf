"""A server step that compiles says so (a new user's trial: a request whose program the
start-up warmup did not prepare, a speculative one or json_object without
--warmup-json-object, held every running request for 10-12 s with nothing in the log)."""

import os
import re
import select
import signal
import subprocess
import sys
import time

import httpx2 as httpx

from conftest import free_port
from inference.compile_cache import Programs
from inference.engine_loop import say_first_use
from live_server import save_run

LINE = re.compile(r"gpt-jax serve: a step compiled (\d+) and loaded (\d+) programs on first use "
                  r"\(\d+\.\d s; every running request waited\)")


def test_the_line_counts_what_the_step_compiled_and_loaded_and_is_silent_otherwise(capsys):
    say_first_use(Programs(compiled=3, loaded=1), Programs(compiled=5, loaded=4), 10.24)
    assert LINE.search(capsys.readouterr().out).groups() == ("2", "3")
    say_first_use(Programs(compiled=3, loaded=1), Programs(compiled=3, loaded=1), 0.01)
    assert capsys.readouterr().out == ""


def printed(proc, until: str | None = None, quiet_s: float = 1.0, timeout: float = 120) -> str:
    """What `proc` wrote to stdout: up to `until`, or until it is quiet for `quiet_s`."""
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline and (until is None or until.encode() not in out):
        if not select.select([proc.stdout], [], [], quiet_s)[0]:
            if until is None:
                break
            continue
        chunk = os.read(proc.stdout.fileno(), 1 << 16)
        if not chunk:
            break
        out += chunk
    return out.decode()


def test_serve_says_when_a_request_waits_for_a_program_and_not_when_none_compiles(
        tmp_path, config, params):
    """`gpt-jax serve --no-warmup`: the first request's steps compile (or load) their
    programs and say so; the same request again runs them and says nothing."""
    run_dir = save_run(tmp_path / "run", config, params)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt_jax.cli", "serve", "--run-dir", str(run_dir), "--port",
         str(port), "--max-slots", "1", "--no-warmup"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    body = {"model": "run", "prompt": "ABC", "max_tokens": 4, "temperature": 0}
    try:
        assert " ready on " in printed(proc, until=" ready on ")
        said = []
        for _ in range(2):  # each line is printed before the step's tokens go out
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                               timeout=120)
            assert reply.status_code == 200, reply.text
            said.append(printed(proc))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    counts = [tuple(map(int, m.groups())) for m in LINE.finditer(said[0])]
    assert counts and sum(map(sum, counts)) > 0, said[0]  # compiled, or loaded from a cache
    assert not LINE.search(said[1]), said[1]
