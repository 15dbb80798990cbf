"""Several processes training one model, through JAX's own distributed runtime.

`jax.distributed.initialize` does the work (we build no transport of our own): process 0
hosts the coordination service at `--coordinator`, every process connects to it, and from
then on `jax.devices()` lists every process's devices, so `sharding.make_mesh` spans them
all and the jitted train step runs as one program over all of them (the cross-process
collectives are NCCL on GPU, the interconnect on TPU, gloo over TCP on CPU). This module is
the part JAX leaves to the program:

- when to start it: `--coordinator/--num-processes/--process-id`, or with none of them
  when a launcher started several tasks (SLURM `srun`, Open MPI `mpirun`: JAX reads the
  rest from their environment), or always with `--distributed on` (Cloud TPU pods,
  Kubernetes); before any other JAX work;
- bounded, clear failures: a coordinator that never answers, processes started with
  different flags or corpora, a process lost in the middle of a run;
- process-local copies of arrays that span processes (checkpoint digests, samples).

Usage (two processes on this machine; on a cluster, process 0's host and a free port):
  python -m training.train --preset tiny --coordinator 127.0.0.1:5000 --num-processes 2 --process-id 0 &
  python -m training.train --preset tiny --coordinator 127.0.0.1:5000 --num-processes 2 --process-id 1
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import socket
import sys
import time
import typing
from typing import Annotated, Literal

import jax
import numpy as np
import tyro

Mode = Literal["auto", "on", "off"]
MODES = typing.get_args(Mode)


class DistributedError(RuntimeError):
    """The processes could not form a run: no coordinator, or the port is taken."""


class RunAborted(RuntimeError):
    """A multi-process run failed after it started (another process stopping shows here
    as a failed collective); the message says where to resume."""


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process run (see training/README.md). Not part of
    TrainConfig: it differs between the processes of one run, and a run may resume on
    another process count.

    Raises:
      ValueError: a value out of range (naming the flag, the value and the range).
    """

    # auto: start jax.distributed when --coordinator, --num-processes or --process-id is
    # given, or SLURM (srun) or Open MPI (mpirun) started several tasks; on: always (JAX
    # reads the rest from the environment: Cloud TPU, Kubernetes); off: never
    mode: Annotated[Mode, tyro.conf.arg(name="distributed")] = "auto"
    # process 0's address and a free port, where the others connect; the same on every process
    coordinator: Annotated[str | None, tyro.conf.arg(metavar="HOST:PORT")] = None
    # processes in the run; the same on every process
    num_processes: Annotated[int | None, tyro.conf.arg(metavar="N")] = None
    # this process, 0 .. N-1 (process 0 hosts the coordinator)
    process_id: Annotated[int | None, tyro.conf.arg(metavar="I")] = None
    # wait at most S seconds for every process to join (JAX's default)
    init_timeout_s: Annotated[int, tyro.conf.arg(metavar="S")] = 300
    # a process silent for S seconds is declared dead and the run stops (JAX's default)
    heartbeat_timeout_s: Annotated[int, tyro.conf.arg(metavar="S")] = 100

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--distributed must be one of {MODES}, got {self.mode!r}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not (
                0 <= self.process_id < (self.num_processes or sys.maxsize)):
            raise ValueError(f"--process-id must be in [0, {self.num_processes}) "
                             f"(0 .. --num-processes - 1), got {self.process_id}")
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--coordinator must be HOST:PORT with a port in [1, 65535], "
                                 f"got {self.coordinator!r}")
        for name in ("init_timeout_s", "heartbeat_timeout_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        if self.mode == "off" and self.flags_given:
            raise ValueError("--distributed off contradicts --coordinator/--num-processes/"
                             "--process-id")

    @property
    def flags_given(self) -> bool:
        return any(v is not None for v in (self.coordinator, self.num_processes,
                                           self.process_id))


def launcher_processes() -> int | None:
    """Tasks a launcher started, from the environment JAX's own detection reads: SLURM
    (inside `srun`) or Open MPI (`mpirun`); None when neither launched this process."""
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
             "SLURM_LOCALID")
    if all(name in os.environ for name in slurm):
        return int(os.environ["SLURM_NTASKS"])
    if "OMPI_MCA_orte_hnp_uri" in os.environ and "OMPI_COMM_WORLD_SIZE" in os.environ:
        return int(os.environ["OMPI_COMM_WORLD_SIZE"])
    return None


def should_start(dist: DistributedConfig) -> bool:
    if dist.mode != "auto":
        return dist.mode == "on"
    return dist.flags_given or (launcher_processes() or 1) > 1 \
        or "JAX_COORDINATOR_ADDRESS" in os.environ


def expected_processes(dist: DistributedConfig) -> int:
    """The process count as known before starting (flags, else the launcher), else 1."""
    if not should_start(dist):
        return 1
    return dist.num_processes or launcher_processes() or 1


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Block until something accepts TCP connections at `address`, at most `timeout_s`.

    A process other than 0 calls this before `jax.distributed.initialize`, whose own wait
    ends the process (a C++ abort, no Python exception) when the coordinator never answers.

    Raises:
      DistributedError: nothing answered in time (naming the address and the wait).
    """
    host, _, port = address.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"no coordinator answered at {address} within {timeout_s:.0f} s "
                    f"({error.strerror or error}): start process 0 with the same "
                    "--coordinator, check that this host can reach it, or raise "
                    "--init-timeout-s") from None
            time.sleep(0.2)


def check_port_free(address: str) -> None:
    """Process 0: can the coordinator listen where JAX will bind it
    (JAX_COORDINATOR_BIND_ADDRESS, else every interface on the --coordinator port)? JAX
    0.10 sometimes segfaults on a port in use instead of raising.

    Raises:
      DistributedError: the port is taken (naming it).
    """
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "[::]:" + address.rpartition(":")[2])
    host, _, port = bind.rpartition(":")
    host = host.strip("[]")
    if host in ("", "::"):  # every interface: IPv6's wildcard, or IPv4's on a host without
        candidates = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    else:
        candidates = [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]
    for family, name in candidates:
        try:
            with socket.socket(family) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
                s.bind((name, int(port)))
            return
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise DistributedError(f"the coordinator cannot listen on {bind}: the port "
                                       "is in use on this host; pick a free port for "
                                       "--coordinator on every process") from None
    # Could not try (no such address family, say): JAX reports what it finds.


def start(dist: DistributedConfig) -> None:
    """`jax.distributed.initialize` when `dist` says so; call it before any other JAX work.

    Raises:
      DistributedError: the coordinator never answered (processes other than 0), or its
        port could not be opened (process 0).
    """
    if not should_start(dist):
        return
    tick = time.monotonic()
    if dist.coordinator and dist.process_id:  # not process 0: is anyone listening?
        wait_for_coordinator(dist.coordinator, dist.init_timeout_s)
    elif dist.process_id == 0:
        if dist.coordinator:
            check_port_free(dist.coordinator)
        print(f"process 0 of {dist.num_processes}: coordinator on {dist.coordinator}, "
              f"waiting up to {dist.init_timeout_s} s for the others", file=sys.stderr,
              flush=True)
    remaining = max(1, round(dist.init_timeout_s - (time.monotonic() - tick)))
    try:
        jax.distributed.initialize(
            dist.coordinator, dist.num_processes, dist.process_id,
            initialization_timeout=remaining,
            heartbeat_timeout_seconds=dist.heartbeat_timeout_s,
            # A clean exit waits here for every process; a lost one would hold it 300 s.
            shutdown_timeout_seconds=dist.heartbeat_timeout_s)
    except jax.errors.JaxRuntimeError as error:  # e.g. "Failed to start RPC server"
        raise DistributedError(f"jax.distributed could not start on {dist.coordinator}: "
                               f"{str(error).splitlines()[0]} (is the port already in "
                               "use?)") from None


def is_primary() -> bool:
    """Process 0: the one that prints, logs metrics and plots."""
    return jax.process_index() == 0


def check_same(what: str, fields: dict) -> None:
    """Check every process holds the same `fields` (JSON-able). A collective: every process
    calls it at the same point; free in a one-process run.

    Raises:
      ValueError: some process differs from process 0 (naming the process, the fields and
        both values); raised on every process alike, so they all stop.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    text = json.dumps(fields, sort_keys=True)
    digest = np.frombuffer(hashlib.sha256(text.encode()).digest(), np.uint8)
    digests = np.asarray(multihost_utils.process_allgather(digest))  # [processes, 32]
    if (digests == digests[0]).all():
        return
    # Someone differs: every process sees that, so all gather the texts to name the fields.
    raw = np.frombuffer(text.encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int32(len(raw))))
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(raw)] = raw
    texts = np.asarray(multihost_utils.process_allgather(padded))
    views = [json.loads(t[:n].tobytes()) for t, n in zip(texts, lengths)]
    lines = []
    for pid, view in enumerate(views[1:], start=1):
        diff = [f"{k}={view.get(k)!r} (process 0: {views[0].get(k)!r})"
                for k in sorted(set(view) | set(views[0])) if view.get(k) != views[0].get(k)]
        if diff:
            lines.append(f"process {pid} has " + ", ".join(diff))
    raise ValueError(f"the {len(views)} processes disagree on the {what}: "
                     + "; ".join(lines) + ". Start every process with the same flags and "
                     "files; only --process-id differs")


def on_process_0(make):
    """`make()` (a pytree of arrays), computed by process 0 alone and sent to every process
    (as host arrays); the others only trace it for the shapes, so they skip computing, and
    compiling, it. A collective with several processes; just `make()` with one."""
    if jax.process_count() == 1:
        return make()
    from jax.experimental import multihost_utils

    mine = make() if is_primary() else jax.tree.map(
        lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(make))
    return multihost_utils.broadcast_one_to_all(mine)


def local_copy(tree):
    """The pytree with every array whole on this process (a replicated array's local copy;
    an array split over several processes gathered, a collective every process must join)."""
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return x
        if x.is_fully_replicated:
            return x.addressable_data(0)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)


def exit_now(message: str, code: int = 1) -> None:
    """Print and leave at once. After a failed collective the others may be gone, and JAX's
    clean exit would wait for them (up to the heartbeat timeout, then abort)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
