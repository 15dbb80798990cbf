"""Several processes training one model through `jax.distributed`, on 127.0.0.1.

Every training process is a subprocess (`python -m training.train`, JAX_PLATFORMS=cpu), the
two-process runs with one CPU device each, their collectives over gloo on loopback (the
coordinator also binds to 127.0.0.1 only, through JAX_COORDINATOR_BIND_ADDRESS). The
reference is one process with two host devices, the same mesh size, so the same global batch
is split the same way and the results must agree to rounding.

The runs share the machine's cores, so the `runs` fixture starts them together and the
tests then check what they left behind. The subprocesses use this session's persistent
compilation cache (see conftest.py); on CPU only process 0 of a multi-process run hits it
(JAX writes entries from process 0 only, and the other processes' cache keys differ), so
process 1 compiles every time.
"""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from conftest import TEST_XLA_FLAGS, assert_close, free_port, synthetic_corpus, taken_port
from gpt_jax import checkpoint
from training import distributed, report
from training import train as T

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 20, 5
HEARTBEAT_S = 10  # a silent process is declared dead after this (JAX's default is 100)
SURVIVOR_EXIT_S = HEARTBEAT_S + 20  # the bound on the survivor's exit after a SIGKILL


@dataclasses.dataclass
class Proc:
    """One training subprocess, its output in files (glog output can fill a pipe)."""

    popen: subprocess.Popen
    out: Path
    err: Path
    exit_s: float | None = None  # seconds from a reference moment to its exit

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()


# Every run compiles with the suite's XLA flags (conftest.TEST_XLA_FLAGS: LLVM at optimization
# level 0, the elemental fusion emitters): the tests compare what the runs compute, not how
# fast, and level 0 alone halved a run's compile time (16 -> 10 s of CPU each).
XLA_FLAGS = TEST_XLA_FLAGS


class Launcher:
    """Starts `python -m training.train` subprocesses for the tiny preset."""

    def __init__(self, corpus: Path, cache_dir: Path, logs: Path):
        self.corpus, self.logs = corpus, logs
        self.env = dict(os.environ, XLA_FLAGS=XLA_FLAGS)
        self.env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
                        JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

    def command(self, run_dir: Path, *flags) -> list[str]:
        return [sys.executable, "-m", "training.train", "--preset", "tiny",
                "--text", str(self.corpus), "--run-dir", str(run_dir),
                "--max-steps", str(STEPS), "--eval-interval", str(EVERY),
                "--peak-flops", "1e12", *flags]  # a given peak: no matmul to measure

    def start(self, name: str, cmd: list[str], **env) -> Proc:
        out, err = self.logs / f"{name}.out", self.logs / f"{name}.err"
        with out.open("w") as stdout, err.open("w") as stderr:  # the child keeps its copies
            popen = subprocess.Popen(cmd, cwd=REPO, env={**self.env, **env}, stdout=stdout,
                                     stderr=stderr)
        return Proc(popen, out, err)

    def one_process(self, name: str, run_dir: Path) -> Proc:
        """One process, two host devices (XLA's flag; the command line keeps its count)."""
        return self.start(name, self.command(run_dir),
                          XLA_FLAGS=f"{XLA_FLAGS} --xla_force_host_platform_device_count=2")

    def two_processes(self, name: str, run_dir: Path, flags=((), ())) -> list[Proc]:
        """Processes 0 and 1 of one run, one CPU device each; `flags[i]` go to process i."""
        port = free_port()
        join = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                "--cpu-devices", "1", "--init-timeout-s", "60",
                "--heartbeat-timeout-s", str(HEARTBEAT_S)]
        return [self.start(f"{name}.p{i}", self.command(run_dir, *join, "--process-id", str(i),
                                                        *flags[i]),
                           JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}")
                for i in range(2)]


def wait_all(procs: list[Proc], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(max(1.0, deadline - time.monotonic()))


def assert_ok(proc: Proc) -> None:
    assert proc.popen.returncode == 0, proc.stderr()[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """Started together: the one-process two-device reference, an uninterrupted two-process
    run, and a two-process run whose process 1 is SIGKILLed once the step-5 checkpoint is
    complete. That run is then resumed by both processes, and a copy of it by one process
    with two devices (another process count)."""
    root = tmp_path_factory.mktemp("distributed")
    corpus = root / "words.txt"
    corpus.write_text(synthetic_corpus())
    logs = root / "logs"
    logs.mkdir()
    launch = Launcher(corpus, request.config.cache.mkdir("jax-compilation-cache"), logs)
    dirs = {name: root / name for name in ("reference", "two", "killed", "killed_one")}
    started = time.monotonic()
    reference = launch.one_process("reference", dirs["reference"])
    two = launch.two_processes("two", dirs["two"])
    killed = launch.two_processes("killed", dirs["killed"])
    procs = [reference, *two, *killed]
    try:
        first = dirs["killed"] / "checkpoints" / str(EVERY)
        while not first.is_dir():  # Orbax renames a checkpoint into place once complete
            assert all(p.popen.poll() is None for p in killed), killed[0].stderr()[-3000:]
            assert time.monotonic() - started < 240, "no checkpoint appeared"
            time.sleep(0.02)
        killed[1].popen.send_signal(signal.SIGKILL)
        kill_time = time.monotonic()
        killed[0].wait(SURVIVOR_EXIT_S + 30)  # measured below; this only ends a hang
        killed[0].exit_s = time.monotonic() - kill_time
        killed[1].wait(10)
        print(f"\nruns fixture: killed at {kill_time - started:.1f} s, survivor out after "
              f"{killed[0].exit_s:.2f} s")
        shutil.copytree(dirs["killed"], dirs["killed_one"])
        killed_at = max(checkpoint.manager(dirs["killed"]).all_steps())
        resumed = launch.two_processes("resumed", dirs["killed"])
        resumed_one = launch.one_process("resumed_one", dirs["killed_one"])
        procs += [*resumed, resumed_one]
        wait_all(procs)
    finally:
        for p in procs:  # only ours, by handle, and only if a failure left them running
            if p.popen.poll() is None:
                p.popen.kill()
    print(f"\nruns fixture: {time.monotonic() - started:.1f} s")
    return dict(dirs=dirs, reference=reference, two=two, killed=killed, resumed=resumed,
                resumed_one=resumed_one, killed_at=killed_at)


def metrics(run_dir: Path) -> list[dict]:
    return report.read_metrics(run_dir)


def assert_same_training(run_dir: Path, reference_dir: Path, atol=1e-5) -> None:
    """Every step's loss, every evaluation and the final params agree to `atol`."""
    rows, expected = metrics(run_dir), metrics(reference_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in expected] == \
        list(range(EVERY, STEPS + 1, EVERY))
    losses = [x for r in rows for x in r["train_losses"]]
    assert len(losses) == STEPS
    assert_close(losses, [x for r in expected for x in r["train_losses"]], atol, "losses")
    assert_close([r["val_loss"] for r in rows], [r["val_loss"] for r in expected], atol,
                 "val losses")
    _, params, _ = checkpoint.load_params(run_dir)
    _, reference, _ = checkpoint.load_params(reference_dir)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        assert_close(a, b, atol, "final params")


def test_two_processes_train_as_one_process_with_two_devices(runs):
    for p in (runs["reference"], *runs["two"]):
        assert_ok(p)
    assert_same_training(runs["dirs"]["two"], runs["dirs"]["reference"])
    first, second = runs["two"]
    summary = json.loads(first.stdout()[first.stdout().index("{"):])
    assert summary["steps"] == STEPS
    assert "2 devices in 2 processes" in first.stdout()
    for printed in ("model tiny", "step 5:", "steps", "it/s", "step/s"):  # process 0 alone
        assert printed not in second.stdout(), second.stdout()
    # The run directory was written once: one metrics line per evaluation, the files
    # beside the checkpoints, nothing left half-written.
    run_dir = runs["dirs"]["two"]
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints", "config.json", "loss.png", "metrics.jsonl", "tokenizer.json",
        "train_config.json"]
    assert sorted(checkpoint.manager(run_dir).all_steps()) == [10, 15, 20]  # keep 3


def test_sigkill_of_one_process_stops_the_other_and_both_resume_equal(runs):
    survivor, _ = runs["killed"]
    assert survivor.popen.returncode != 0
    assert survivor.exit_s < SURVIVOR_EXIT_S, f"the survivor took {survivor.exit_s:.1f} s"
    err = survivor.stderr()
    # Where it was decides how it learns. In a step (a gloo collective) the connection
    # drops at once: our message, within a second. Inside Orbax's save barrier it waits
    # until JAX's coordination service declares process 1 dead (the heartbeat timeout):
    # then the barrier raises (our message again), unless JAX's own error poller ends the
    # process first with its message; both were seen.
    ours = "gpt-jax train: process 0 of 2 stopped at step" in err and "Start every process again " \
        "with the same command: the run resumes from the last complete checkpoint in" in err
    jax_own = "Terminating process because the JAX distributed service detected fatal " \
        "errors. This most likely indicates that another task died" in err
    assert ours or jax_own, err[-3000:]
    print(f"survivor exited {survivor.exit_s:.2f} s after the SIGKILL "
          f"({'our message' if ours else 'JAX heartbeat'})")
    assert EVERY <= runs["killed_at"] < STEPS
    for p in (*runs["resumed"], runs["resumed_one"]):
        assert_ok(p)
    assert f"from step {runs['killed_at']}" in runs["resumed"][0].stdout()
    assert_same_training(runs["dirs"]["killed"], runs["dirs"]["reference"])
    # the same checkpoint resumed by one process with two devices: another process count
    assert f"from step {runs['killed_at']}" in runs["resumed_one"].stdout()
    assert_same_training(runs["dirs"]["killed_one"], runs["dirs"]["reference"])


def test_two_process_checkpoint_generates_in_one_process(runs, capsys):
    from inference import SamplingParams, generate

    # Sampled, not greedy: 20 steps in, greedy repeats one token, so equal greedy output
    # would show little; a sample follows the whole distribution.
    sampling = SamplingParams(temperature=1.0, seed=3, max_new_tokens=16)
    out = {}
    for name in ("two", "reference"):  # loaded as `gpt-jax generate` loads a run
        config, params, tokenizer = checkpoint.load_params(runs["dirs"][name])
        out[name] = generate(params, config, [tokenizer.encode("The king")], sampling)[0]
    assert "trying the previous checkpoint" not in capsys.readouterr().out  # digests held
    assert len(set(out["two"].tokens)) >= 5, out["two"].tokens
    assert out["two"].tokens == out["reference"].tokens


def test_generation_refuses_to_load_in_a_multi_process_run(runs, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with pytest.raises(RuntimeError, match=r"this is process 1 of 2 \(jax.distributed is "
                                           r"initialized\). Generation is single-process: "
                                           r"`gpt-jax generate`, `gpt-jax serve`, "
                                           r"`LLM.from_checkpoint` and `Engine`"):
        checkpoint.load_params(runs["dirs"]["two"])


def test_processes_with_different_flags_stop_with_the_difference(tmp_path, request):
    corpus = tmp_path / "words.txt"
    corpus.write_text(synthetic_corpus())
    launch = Launcher(corpus, request.config.cache.mkdir("jax-compilation-cache"), tmp_path)
    procs = launch.two_processes("mismatch", tmp_path / "run",
                                 flags=((), ("--learning-rate", "0.02")))
    wait_all(procs, timeout=120)
    for i, p in enumerate(procs):
        assert p.popen.returncode == 1, p.stderr()[-3000:]
        assert "gpt-jax train: the 2 processes disagree on the flags: process 1 has " \
               "learning_rate=0.02 (process 0: 0.01). Start every process with the same " \
               "flags and files; only --process-id differs" in p.stderr(), p.stderr()[-3000:]
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.fixture
def no_joining(monkeypatch):
    """Bad launches must be refused before `jax.distributed.initialize` (which would tie
    this test process to a coordinator). JAX has started in this process, so the host
    split (which must come first) is skipped."""
    def refuse(*args, **kwargs):
        raise AssertionError("jax.distributed.initialize was called")
    monkeypatch.setattr(jax.distributed, "initialize", refuse)
    monkeypatch.setattr(T, "split_host", lambda cfg, processes: None)


@pytest.mark.parametrize("flags, message", [
    (["--num-processes", "3", "--process-id", "0", "--coordinator", "127.0.0.1:9"],
     r"^gpt-jax train: batch_size 8 must be divisible by the 3 processes \(each feeds "
     r"batch_size / processes rows\)$"),
    (["--num-processes", "2", "--process-id", "2", "--coordinator", "127.0.0.1:9"],
     r"^gpt-jax train: --process-id must be in \[0, 2\) \(0 .. --num-processes - 1\), got 2$"),
    (["--num-processes", "0"], r"^gpt-jax train: --num-processes must be >= 1, got 0$"),
    (["--coordinator", "127.0.0.1"],
     r"^gpt-jax train: --coordinator must be HOST:PORT with a port in \[1, 65535\], got '127.0.0.1'$"),
    (["--distributed", "off", "--num-processes", "2"],
     r"^gpt-jax train: --distributed off contradicts --coordinator/--num-processes/--process-id$"),
])
def test_bad_launch_flags_are_refused_before_joining(no_joining, flags, message):
    with pytest.raises(SystemExit, match=message):
        T.main(["--preset", "tiny", *flags])


def test_a_coordinator_that_never_answers_is_a_bounded_clear_error(no_joining):
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    tick = time.monotonic()
    with pytest.raises(SystemExit, match=rf"^gpt-jax train: no coordinator answered at {address} "
                                         r"within 1 s \(Connection refused\): start process 0 "
                                         r"with the same --coordinator"):
        T.main(["--preset", "tiny", "--coordinator", address, "--num-processes", "2",
                "--process-id", "1", "--init-timeout-s", "1"])
    assert time.monotonic() - tick < 5


def test_a_coordinator_port_in_use_is_refused_before_joining(no_joining, monkeypatch):
    """JAX 0.10 sometimes segfaults on a taken port instead of raising."""
    with taken_port() as port:
        address = f"127.0.0.1:{port}"
        monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", address)
        with pytest.raises(SystemExit, match=rf"^gpt-jax train: the coordinator cannot listen on "
                                             rf"{address}: the port is in use on this host"):
            T.main(["--preset", "tiny", "--coordinator", address, "--num-processes", "2",
                    "--process-id", "0"])


@pytest.mark.parametrize("env, flags, starts, processes", [
    ({}, {}, False, 1),  # a plain run: one process, as before
    ({}, {"num_processes": 2, "process_id": 0, "coordinator": "h:1"}, True, 2),
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-4]", "SLURM_NTASKS": "4",
      "SLURM_PROCID": "2", "SLURM_LOCALID": "0"}, {}, True, 4),  # inside srun
    ({"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n1", "SLURM_NTASKS": "1",
      "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, {}, False, 1),  # one task
    ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}, {}, True, 2),  # mpirun
    ({"OMPI_MCA_orte_hnp_uri": "x", "OMPI_COMM_WORLD_SIZE": "2"}, {"mode": "off"}, False, 1),
    ({}, {"mode": "on"}, True, 1),  # e.g. a Cloud TPU pod: JAX finds the rest
])
def test_when_jax_distributed_starts(monkeypatch, env, flags, starts, processes):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    dist = distributed.DistributedConfig(**flags)
    assert distributed.should_start(dist) == starts
    assert distributed.expected_processes(dist) == processes
