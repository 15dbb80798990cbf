"""Joining a `jax.distributed` run, the parts training (`training.distributed`) and
multi-host serving (`inference.multihost`) share: the launch flags' checks, a start with
bounded, clear failures (a coordinator that never answers, a port in use), a check that
every process got the same settings, and leaving at once after a failed collective.

`jax.distributed.initialize` does the work (we build no transport of our own): process 0
hosts the coordination service at `--coordinator`, every process connects to it, and from
then on `jax.devices()` lists every process's devices.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import sys
import time

import jax
import numpy as np


class DistributedError(RuntimeError):
    """The processes could not form a run: no coordinator, or the port is taken."""


def check_launch(coordinator: str | None, num_processes: int | None,
                 process_id: int | None, init_timeout_s: int, heartbeat_timeout_s: int) -> None:
    """Raise ValueError, naming the flag, the value and the range, for launch flags out of
    range: --num-processes < 1, --process-id outside [0, N), a --coordinator that is not
    HOST:PORT, timeouts below 1 s."""
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if process_id is not None and not 0 <= process_id < (num_processes or sys.maxsize):
        raise ValueError(f"--process-id must be in [0, {num_processes}) "
                         f"(0 .. --num-processes - 1), got {process_id}")
    if coordinator is not None:
        host, _, port = coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--coordinator must be HOST:PORT with a port in [1, 65535], "
                             f"got {coordinator!r}")
    for name, value in (("init_timeout_s", init_timeout_s),
                        ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


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


def join(coordinator: str | None, num_processes: int | None, process_id: int | None,
         init_timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> None:
    """`jax.distributed.initialize`, with bounded, clear failures; call it before any other
    JAX work. None values: JAX reads them from the launcher's environment.

    Raises:
      DistributedError: the coordinator never answered (processes other than 0), or its
        port could not be opened (process 0).
    """
    tick = time.monotonic()
    if coordinator and process_id:  # not process 0: is anyone listening?
        wait_for_coordinator(coordinator, init_timeout_s)
    elif process_id == 0:
        if coordinator:
            check_port_free(coordinator)
        print(f"process 0 of {num_processes}: coordinator on {coordinator}, "
              f"waiting up to {init_timeout_s} s for the others", file=sys.stderr,
              flush=True)
    remaining = max(1, round(init_timeout_s - (time.monotonic() - tick)))
    try:
        jax.distributed.initialize(
            coordinator, num_processes, process_id,
            initialization_timeout=remaining,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            # A clean exit waits here for every process; a lost one would hold it 300 s.
            shutdown_timeout_seconds=heartbeat_timeout_s)
    except jax.errors.JaxRuntimeError as error:  # e.g. "Failed to start RPC server"
        raise DistributedError(f"jax.distributed could not start on {coordinator}: "
                               f"{str(error).splitlines()[0]} (is the port already in "
                               "use?)") from None


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


def exit_now(message: str, code: int = 1) -> None:
    """Print and leave at once. After a failed collective the others may be gone, and JAX's
    clean exit would wait for them (up to the heartbeat timeout, then abort)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)
