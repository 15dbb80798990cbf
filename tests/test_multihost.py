"""`gpt-jax serve` from two processes (`inference.multihost`) on 127.0.0.1, one CPU device
each, `--tensor-parallel 2`: completions equal one process's `LLM.generate` (greedy, and
seeded with n = 2), /metrics reports the two-process mesh, a speculative request is refused,
SIGTERM on process 0 drains a streaming request and both exit 0, and SIGKILL of process 1
ends process 0 within 60 s with an error that says why.

Both pairs are started together (the second only waits to be killed); the coordinator binds
to 127.0.0.1 (JAX_COORDINATOR_BIND_ADDRESS), the collectives are gloo on loopback.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import free_port, start_serve
from test_hf_dirs import NEW_TOKENS, TEXTS, hf_dir  # noqa: F401 (a fixture)

HEARTBEAT_S = 10  # a silent process is declared dead after this
KILL_BOUND_S = 60  # issue 40: process 0 exits within this after process 1 is SIGKILLed


class Pair:
    """Processes 0 and 1 of one two-process server: process 1 (a follower, its output in
    a file) is started first, process 0 is started by `start` (`conftest.start_serve`,
    returns once it is ready)."""

    def __init__(self, path, logs):
        self.port, coordinator = free_port(), free_port()
        self.env = {"JAX_COORDINATOR_BIND_ADDRESS": f"127.0.0.1:{coordinator}"}
        self.args = ["--hf-checkpoint", str(path), "--max-slots", "2", "--no-warmup",
                     "--tensor-parallel", "2", "--coordinator", f"127.0.0.1:{coordinator}",
                     "--num-processes", "2", "--heartbeat-timeout-s", str(HEARTBEAT_S)]
        self.log = logs / f"follower-{self.port}.log"
        with self.log.open("w") as out:
            self.follower = subprocess.Popen(
                [sys.executable, "-m", "gpt_jax.cli", "serve", *self.args, "--process-id",
                 "1", "--port", str(self.port)], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "JAX_PLATFORMS": "cpu", **self.env})
        self.leader = None

    def start(self) -> None:
        self.leader = start_serve([*self.args, "--process-id", "0"], self.port, self.env)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def kill(self) -> None:
        for proc in (self.leader, self.follower):  # only ours, if a failure left them
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.fixture
def pairs(hf_dir, tmp_path):  # noqa: F811 (the fixture)
    path, _ = hf_dir
    started = time.monotonic()
    served, killed = Pair(path, tmp_path), Pair(path, tmp_path)
    other = threading.Thread(target=killed.start)
    other.start()
    try:
        served.start()
        other.join(timeout=600)
        assert killed.leader is not None, "the second pair did not start"
        print(f"\ntwo pairs ready in {time.monotonic() - started:.1f} s")
        yield served, killed
    finally:
        other.join(timeout=600)
        served.kill()
        killed.kill()


def test_two_processes_serve_as_one_drain_on_sigterm_and_stop_when_one_dies(pairs, hf_dir):  # noqa: F811
    import httpx2 as httpx
    from prometheus_client.utils import floatToGoString

    from inference import LLM, SamplingParams

    served, killed = pairs
    path, _ = hf_dir
    llm = LLM.from_pretrained(path)

    def reference(**fields):
        return [r.text for r in llm.generate([TEXTS[0]], SamplingParams(
            max_new_tokens=NEW_TOKENS, **fields), max_batch_size=2, progress=False)]

    # Greedy, and seeded with n = 2: what one process computes.
    for fields, asked in ((dict(temperature=0.0), dict(temperature=0)),
                          (dict(temperature=1.0, seed=7, n=2), dict(temperature=1.0, seed=7,
                                                                    n=2))):
        r = httpx.post(served.url("/v1/completions"), timeout=300, json={
            "model": path.name, "prompt": TEXTS[0], "max_tokens": NEW_TOKENS, **asked})
        assert r.status_code == 200, r.text
        assert [c["text"] for c in r.json()["choices"]] == reference(**fields)
    metrics = httpx.get(served.url("/metrics"), timeout=30).text
    one = llm.engine(2).stats()["mesh"]["kv_cache_bytes_per_device"]
    for line in ('gpt_jax:mesh_axis_size{axis="model"} 2.0', "gpt_jax:mesh_devices 2.0",
                 f"gpt_jax:kv_cache_bytes_per_device {floatToGoString(one // 2)}"):
        assert line in metrics, metrics
    # speculative decoding's draft state lives on process 0 alone: refused, clearly
    r = httpx.post(served.url("/v1/completions"), timeout=60, json={
        "model": path.name, "prompt": TEXTS[0], "max_tokens": 4, "speculative": "ngram"})
    assert r.status_code == 400 and "is not served across processes" in r.text, r.text

    # SIGTERM on process 0 in the middle of a streamed completion: it finishes, both exit 0.
    text = ""
    with httpx.stream("POST", served.url("/v1/completions"), timeout=300, json={
            "model": path.name, "prompt": TEXTS[0], "max_tokens": NEW_TOKENS,
            "temperature": 0, "stream": True}) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if not text:
                served.leader.send_signal(signal.SIGTERM)
            text += json.loads(line[6:])["choices"][0]["text"]
    assert text == reference(temperature=0.0)[0]
    assert served.leader.wait(timeout=60) == 0, served.leader.stdout.read()[-3000:]
    assert served.follower.wait(timeout=60) == 0, served.log.read_text()[-3000:]
    assert "process 1 of 2: process 0 stopped serving; exiting" in served.log.read_text()

    # SIGKILL of process 1 while process 0 waits for requests: JAX's heartbeat ends it.
    killed.follower.send_signal(signal.SIGKILL)
    tick = time.monotonic()
    code = killed.leader.wait(timeout=KILL_BOUND_S + 30)
    took = time.monotonic() - tick
    printed = killed.leader.stdout.read()
    print(f"process 0 exited {took:.1f} s after process 1's SIGKILL (code {code})")
    assert code != 0 and took < KILL_BOUND_S, printed[-3000:]
    assert "Terminating process because the JAX distributed service detected fatal errors" \
        in printed and "stopped sending heartbeats" in printed, printed[-3000:]


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "127.0.0.1:9"], r"--coordinator, --num-processes and --process-id go "
                                       r"together; give all three"),
    (["--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "2"],
     r"--process-id must be in \[0, 2\) \(0 .. --num-processes - 1\), got 2$"),
    (["--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "0",
      "--heartbeat-timeout-s", "0"], r"--heartbeat-timeout-s must be >= 1, got 0$"),
    (["--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1",
      "--tensor-parallel", "3"], r"--tensor-parallel 3 must be a multiple of --num-processes "
                                 r"2: the mesh spans every process's devices"),
])
def test_bad_multi_process_flags_stop_before_anything_starts(tmp_path, flags, message):
    from inference import serve

    with pytest.raises(SystemExit, match=r"^gpt-jax serve: " + message):
        serve.main(["--hf-checkpoint", str(tmp_path), *flags])


def test_a_run_directory_is_refused_across_processes(tmp_path):
    from inference import serve

    with pytest.raises(SystemExit, match=r"^gpt-jax serve: --coordinator serves a "
                                         r"--hf-checkpoint directory; a --run-dir checkpoint "
                                         r"loads in one process only"):
        serve.main(["--run-dir", str(tmp_path), "--coordinator", "127.0.0.1:9",
                    "--num-processes", "2", "--process-id", "0", "--tensor-parallel", "2"])


def test_a_plan_travels_as_bytes_and_builds_nothing_else():
    import pickle
    import zlib

    import jax
    import numpy as np

    from inference import multihost
    from inference.batching import PrefillBatch

    batch = PrefillBatch(*(np.arange(6, dtype=np.int32).reshape(2, 3) + i for i in range(11)))
    plan = multihost.Plan("prefill", 8, (np.zeros((2, 4), bool), batch), {"pad_id": 0})
    back = multihost.decode(multihost.encode(plan))
    assert (back.program, back.recent_width, back.static) == ("prefill", 8, {"pad_id": 0})
    assert isinstance(back.args[1], PrefillBatch)
    for a, b in zip(jax.tree.leaves(plan.args), jax.tree.leaves(back.args), strict=True):
        assert a.dtype == b.dtype and (a == b).all()
    with pytest.raises(pickle.UnpicklingError, match=r"^a plan holds no posix.system$"):
        multihost.decode(zlib.compress(pickle.dumps(os.system)))
