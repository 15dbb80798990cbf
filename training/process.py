"""This process as a command: restarting it with huge pages, ending it quietly when its
reader closes stdout, and holding Ctrl-C back while a checkpoint is written."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

HUGE_PAGES = "glibc.malloc.hugetlb=1"


def restart_with_huge_pages(module: str, argv: list[str]) -> None:
    """Restart this process as `python -m module *argv` (the same pid and environment) with
    glibc's malloc asking the kernel for transparent huge pages (`GLIBC_TUNABLES` +=
    `glibc.malloc.hugetlb=1`, glibc 2.35 and later), unless the variable already names that
    tunable or this is not Linux. Call it before any work: nothing after it runs twice.
    Other C libraries ignore the variable.

    What for: `training.train` restarts so when its buffers are large (`large_buffers`);
    see there for the measurements.
    """
    if not sys.platform.startswith("linux") or \
            "glibc.malloc.hugetlb" in os.environ.get("GLIBC_TUNABLES", ""):
        return
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], huge_pages_environ())


def huge_pages_environ() -> dict[str, str]:
    """This process's environment with `HUGE_PAGES` added to `GLIBC_TUNABLES` (after any
    tunables already there)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return {**os.environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, HUGE_PAGES]))}


def closed_pipe_is_quiet(main_fn):
    """`main_fn` wrapped so that a reader closing stdout early (`gpt-jax train --help |
    head`) ends the command with status 1 and no traceback: stdout is pointed at /dev/null
    so the interpreter's last flush does not raise again (as Python's signal docs advise)."""
    def run(*args, **kwargs):
        try:
            return main_fn(*args, **kwargs)
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    return run


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (`sigterm_stops`): the run
    stops the same clean way, with the shell's status for SIGTERM (143)."""


def _terminate(signum, frame):
    raise Terminated


@contextlib.contextmanager
def sigterm_stops():
    """While the block runs (in the main thread), SIGTERM raises `Terminated` as Ctrl-C
    raises KeyboardInterrupt, instead of ending the process on the spot with nothing said;
    the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def interrupts_deferred():
    """Hold SIGINT (Ctrl-C) and SIGTERM back while the block runs, then raise what they
    would have raised (KeyboardInterrupt; `Terminated` for SIGTERM under `sigterm_stops`):
    a checkpoint, metrics line or plot being written is finished, never left half-written
    (Orbax's `<step>.orbax-checkpoint-tmp-*` folder). Outside the main thread (where Python
    runs signal handlers) it defers nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    hold = lambda signum, frame: caught.append(signum)  # noqa: E731
    previous = {sig: signal.signal(sig, hold) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGTERM in caught and previous[signal.SIGTERM] is _terminate:
        raise Terminated
    if signal.SIGINT in caught:
        raise KeyboardInterrupt
    if signal.SIGTERM in caught:  # no handler of ours: what SIGTERM does without one
        signal.raise_signal(signal.SIGTERM)
