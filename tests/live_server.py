"""What the server tests share: a real uvicorn on 127.0.0.1 (a free port) serving the tiny
model with a 64-character tokenizer, the official `openai` client on it, and the reference
each completion is checked against (`LLM.generate` of the request alone).

The fixtures are imported by the test modules that use them (`from live_server import url`)."""

import contextlib
import re
import threading
import time

import httpx2 as httpx
import openai
import pytest
import uvicorn

from conftest import free_port
from gpt_jax import checkpoint
from gpt_jax.tokenizer import CharTokenizer
from inference import LLM, Engine, SamplingParams
from inference.server import ServerConfig, create_app

KEY = "test-key"
SLOTS = 8  # the server's and the reference LLM's: the same shapes, compiled once
TOKENIZER = CharTokenizer([chr(ord("0") + i) for i in range(64)])  # "0".."o": 64 characters


@contextlib.contextmanager
def running(load, cfg: ServerConfig):
    """uvicorn serving create_app(load, cfg) on 127.0.0.1 in a thread; yields the base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(load, cfg), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.05)


def metric(url: str, name: str) -> float:
    """One sample of the server's /metrics, by its full name with labels."""
    text = httpx.get(f"{url}/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert found, f"{name} not in /metrics:\n{text}"
    return float(found.group(1))


def save_run(run_dir, config, params):
    """A run directory `gpt-jax serve --run-dir` loads: config, tokenizer, one checkpoint."""
    checkpoint.save_config(run_dir, config)
    checkpoint.save_tokenizer(run_dir, TOKENIZER)
    checkpoint.save(checkpoint.manager(run_dir), 1, params, params, {"step": 1})
    return run_dir


def solo(llm, prompt: str, **fields):
    """LLM.generate of this request alone."""
    return llm.generate([prompt], SamplingParams(**fields), max_batch_size=SLOTS,
                        progress=False)


@pytest.fixture(scope="module")
def llm(config, params):
    return LLM(params, config, TOKENIZER)


@pytest.fixture(scope="module")
def url(config, params):
    cfg = ServerConfig("tiny", api_key=KEY, max_queue=64)
    with running(lambda: Engine(params, config, TOKENIZER, max_slots=SLOTS), cfg) as base:
        wait_ready(base)
        yield base


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
