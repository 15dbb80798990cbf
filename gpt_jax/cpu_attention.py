"""Decode attention over a paged KV cache as a CPU kernel (`cpu_attention.cc`, an XLA FFI
custom call), used by `gpt_jax.model.attend_paged` when the program runs on CPU.

Why: XLA:CPU computes one query's attention over the cache as batched matrix-vector dots
on ONE thread, at about half the memory bandwidth two cores reach, and reads whole pages.
At gpt2 batch 32 that was ~45 ms of a ~170 ms decode step. The kernel spreads the
(row, kv head) pairs over XLA's intra-op thread pool and reads exactly each row's live
slots, page by page through the row's page table. On GPU and TPU the XLA path runs (`jax.lax.platform_dependent`).

The kernel is compiled from source on first use (about 5 s on an idle 2-core machine) with
the C++ compiler (`$CXX`, default `g++`) against the FFI headers jaxlib ships
(`jax.ffi.include_dir()`), and cached under `$XDG_CACHE_HOME/gpt-jax` (default
`~/.cache/gpt-jax`) per source, jaxlib version, compiler (command and `--version`) and CPU.
Builds are serialized by a lock file and bounded in time (`build`).
If it cannot be built, a warning says why and the XLA path runs; `GPT_JAX_CPU_KERNEL=0`
turns it off.
"""

from __future__ import annotations

import ctypes
import functools
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
import jax.numpy as jnp
import jaxlib

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "gpt_jax_paged_decode_attention"
SWITCH = "GPT_JAX_CPU_KERNEL"  # "0": never build or use the kernel
# -march=native: built on the machine that runs it (the CPU is part of the cache key);
# -fopenmp-simd: vectorise the dot-product reductions without -ffast-math.
FLAGS = ("-O3", "-march=native", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC")
BUILD_TIMEOUT_S = 300.0  # most seconds a build (or waiting for another's) may take


def _cpu_id() -> str:
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


def library_path(command: list[str] | None = None) -> Path:
    """Where the built kernel for this source, jaxlib, compiler and CPU lives (it may not
    exist yet). Raises OSError when the compiler is missing."""
    command = compiler() if command is None else command
    key = hashlib.sha256("\0".join([
        SOURCE.read_text(), jaxlib.__version__, " ".join(FLAGS), shlex.join(command),
        _compiler_id(command), platform.machine(), _cpu_id()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt-jax"
    return cache / f"cpu_attention-{key}.so"


def build(timeout: float = BUILD_TIMEOUT_S) -> Path:
    """Compile the kernel unless already built. Returns the shared library's path.

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
    path = library_path(command)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with filelock.FileLock(f"{path}.lock", timeout=timeout):
            if not path.exists():
                partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}"
                                         ".partial")
                try:
                    subprocess.run([*command, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE),
                                    "-o", str(partial)], check=True, capture_output=True,
                                   text=True, timeout=timeout)
                    os.replace(partial, path)
                finally:
                    partial.unlink(missing_ok=True)
    except filelock.Timeout as e:
        raise subprocess.TimeoutExpired(f"lock {e.lock_file}", timeout) from e
    return path


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (built on the first call).
    False, with a warning naming the cause, when it cannot be built; False without one when
    `GPT_JAX_CPU_KERNEL=0`."""
    if os.environ.get(SWITCH, "1") == "0":
        return False
    try:
        library = ctypes.cdll.LoadLibrary(str(build()))
    except subprocess.TimeoutExpired as e:
        warnings.warn(f"gpt-jax CPU attention kernel build timed out (using XLA's attention "
                      f"instead): {e}", RuntimeWarning, stacklevel=2)
        return False
    except subprocess.CalledProcessError as e:
        warnings.warn(f"gpt-jax CPU attention kernel did not compile (using XLA's attention "
                      f"instead): `{shlex.join(e.cmd)}` exited with {e.returncode}: "
                      f"{e.stderr.strip()[-2000:]}", RuntimeWarning, stacklevel=2)
        return False
    except OSError as e:
        warnings.warn(f"gpt-jax CPU attention kernel unavailable (using XLA's attention "
                      f"instead): {e}", RuntimeWarning, stacklevel=2)
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.GptJaxPagedDecodeAttention),
                                platform="cpu")
    return True


def paged_decode_attention(q_KGH: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                           page_table_M: jax.Array, length) -> tuple[jax.Array, jax.Array]:
    """Attention of G queries per kv head over slots [0, length) of one row's pages, on CPU.
    Call only when `available()`.

    Args:
      q_KGH: queries, `[K, G, H]` (any float dtype; computed in float32).
      k_pool, v_pool: `[num_pages, K, P, H]` page pools shared by all rows (`gpt_jax.cache`),
        float32 or bfloat16.
      page_table_M: int32 `[M]`, the row's pages in order (a negative entry ends the row).
      length: int scalar, slots to attend; 0 gives zeros, past the row's pages all of them.
    Returns:
      `(out_KGH, lse_KG)`, float32: softmax(q k^T / sqrt(H)) v with a float32 softmax, and
      the log of its denominator (`gpt_jax.model.MASK_VALUE` for a row with no slot).
    Under `jax.vmap` the row arguments gain the batch axis, the shared pools a leading axis
    of 1 (`vmap_method="expand_dims"`: never copied per row), and the kernel runs the whole
    batch in one call.
    """
    K, G, _ = q_KGH.shape
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct(q_KGH.shape, jnp.float32),
                                     jax.ShapeDtypeStruct((K, G), jnp.float32)),
                            vmap_method="expand_dims")
    return call(q_KGH.astype(jnp.float32), jnp.asarray(length, jnp.int32),
                jnp.asarray(page_table_M, jnp.int32), k_pool, v_pool)
