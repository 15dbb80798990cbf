"""Build, cache and register the native CPU kernels (XLA FFI custom calls), shared by
`gpt_jax.kernels.paged_attention` (paged decode attention), `gpt_jax.kernels.causal_attention`
(the training path's attention, forward and backward) and `gpt_jax.kernels.panel_matmul`.

Each kernel is one C++ source beside this file, which may include the shared header
`common.h` (the thread-pool loop and vector helpers). It is compiled on first use
(seconds on an idle 2-core machine) with the C++ compiler (`$CXX`, default `g++`) against
the FFI headers jaxlib ships (`jax.ffi.include_dir()`), and cached under `$XDG_CACHE_HOME/
gpt-jax` (default `~/.cache/gpt-jax`) per source and header text, jaxlib version, compiler
(command and `--version`) and CPU. Builds are serialized by a lock file and bounded in time
(`build`). If a kernel cannot be built, a warning says why and the caller's XLA path runs;
`GPT_JAX_CPU_KERNEL=0` turns every kernel off, and programs traced inside
`gpt_jax.kernels.portable()` call none.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import threading
import warnings
from pathlib import Path

import filelock
import jax
import jaxlib

SWITCH = "GPT_JAX_CPU_KERNEL"  # "0": never build or use a kernel
HEADER = Path(__file__).with_name("common.h")  # included by every kernel source
# -march=native: built on the machine that runs it (the CPU is part of the cache key);
# -fopenmp-simd: vectorise the dot-product reductions without -ffast-math.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300.0  # most seconds a build (or waiting for another's) may take


def cpu_id() -> str:
    """The CPU model and feature flags (what -march=native compiles for)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        return "\n".join(sorted({line for line in info.splitlines()
                                 if line.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()


def compiler() -> list[str]:
    """The C++ compiler command: `$CXX` (may carry arguments: "ccache g++"), default g++."""
    return shlex.split(os.environ.get("CXX") or "g++")


def _compiler_id(command: list[str]) -> str:
    """The compiler's own `--version` text (a different compiler or version builds anew).
    Raises OSError when there is no such compiler, subprocess.TimeoutExpired past 60 s."""
    try:
        return subprocess.run([*command, "--version"], capture_output=True, text=True,
                              timeout=60).stdout
    except FileNotFoundError as e:
        raise OSError(f"no C++ compiler {shlex.join(command)!r}: {e}") from e


def library_path(source: Path, command: list[str] | None = None) -> Path:
    """Where the built library of `source` for this header, jaxlib, compiler and CPU lives
    (it may not exist yet). Raises OSError when the compiler is missing."""
    command = compiler() if command is None else command
    key = hashlib.sha256("\0".join([
        source.read_text(), HEADER.read_text(), jaxlib.__version__, " ".join(FLAGS),
        shlex.join(command), _compiler_id(command), platform.machine(),
        cpu_id()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt-jax"
    return cache / f"{source.stem}-{key}.so"


def build(source: Path, timeout: float = BUILD_TIMEOUT_S) -> Path:
    """Compile `source` into a shared library unless already built. Returns its path.

    One build at a time per library, across threads and processes: a lock file beside it
    (`filelock`) is held while checking and compiling, so a second caller waits and then
    finds the library built. The library is written under a name unique to the process and
    thread and renamed into place, so a killed build never leaves a half-written one.

    Raises:
      OSError: no compiler, or the cache directory is not writable.
      subprocess.CalledProcessError: the compiler failed (its output in `.stderr`).
      subprocess.TimeoutExpired: the compiler ran past `timeout` seconds (it is killed), or
        another build held the lock that long.
    """
    command = compiler()
    path = library_path(source, command)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with filelock.FileLock(f"{path}.lock", timeout=timeout):
            if not path.exists():
                partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}"
                                         ".partial")
                try:
                    subprocess.run([*command, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source),
                                    "-o", str(partial)], check=True, capture_output=True,
                                   text=True, timeout=timeout)
                    os.replace(partial, path)
                finally:
                    partial.unlink(missing_ok=True)
    except filelock.Timeout as e:
        raise subprocess.TimeoutExpired(f"lock {e.lock_file}", timeout) from e
    return path


def register(source: Path, targets: dict[str, str], what: str, fallback: str) -> bool:
    """Build `source` (`build`), load it and register each of its handlers with XLA:CPU as
    an FFI target (`targets`: target name -> the library's handler symbol).

    Returns True when registered; False when `GPT_JAX_CPU_KERNEL=0` (silently), or, with a
    RuntimeWarning naming the cause, when the kernel cannot be built or loaded: "gpt-jax
    {what} did not compile (using {fallback} instead): ...".
    """
    if os.environ.get(SWITCH, "1") == "0":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build(source)))
    except subprocess.TimeoutExpired as e:
        warnings.warn(f"gpt-jax {what} build timed out (using {fallback} instead): {e}",
                      RuntimeWarning, stacklevel=3)
        return False
    except subprocess.CalledProcessError as e:
        warnings.warn(f"gpt-jax {what} did not compile (using {fallback} instead): "
                      f"`{shlex.join(e.cmd)}` exited with {e.returncode}: "
                      f"{e.stderr.strip()[-2000:]}", RuntimeWarning, stacklevel=3)
        return False
    except OSError as e:
        warnings.warn(f"gpt-jax {what} unavailable (using {fallback} instead): {e}",
                      RuntimeWarning, stacklevel=3)
        return False
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    return True
