"""The persistent compilation cache of `gpt-jax serve`, `gpt-jax generate` and `LLM`: the
engine's compiled programs kept on disk, so a second start loads them instead of compiling.

It is JAX's persistent compilation cache (`jax_compilation_cache_dir`) in
`$GPT_JAX_CACHE`, default `$XDG_CACHE_HOME/gpt-jax/xla` (`~/.cache/gpt-jax/xla`), on by
default and off with `--no-compile-cache` (`LLM(..., compile_cache=False)`). A process that
already has a cache directory (`JAX_COMPILATION_CACHE_DIR`, or the test suite's) keeps it.

What finds an entry. JAX names each entry by a SHA-256 of the program's StableHLO (so the
model's shapes and dtypes, the engine's slots, pages and chunk sizes, the sampling code),
the jaxlib version, the backend and its version, the XLA flags (`XLA_FLAGS`), the compile
options, the devices and the compression (`jax._src.cache_key.get`). What it lacks, this
module adds as the name of a subdirectory (`key_dir`): the jax version (its lowering), the
source of the native CPU kernels (`gpt_jax.kernels`: an executable calls them by name, so a
changed kernel must not run under an old program) and the CPU's model and feature flags
(XLA:CPU compiles for the host's instructions).

What a broken entry does. JAX reads an entry that does not decompress (truncated: a process
killed while writing it) with a warning and compiles the program, but never replaces it, so
every later start would compile it again. `discard_corrupt` checks each entry written since
the last check once, at `enable`, and removes a broken one with a warning: the program is
compiled and stored anew. Nothing here raises for a bad entry.

`serve` and `LLM` also keep the engine's prefill and decode programs as `jax.export`
artifacts in the key directory's `exported/` (`inference.exported`): a warm start then
deserializes them instead of tracing the engine's Python, which the cache alone still does.

`programs()` counts, for the whole process, the programs XLA compiled and those loaded from
the cache (JAX's monitoring events), for the server's log line and /metrics.

The cache is trusted: whoever can write to it can make this process run code (as JAX warns).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import os
import time
import warnings
from pathlib import Path

import jax
import jaxlib
from jax import monitoring
from jax._src import compilation_cache

from gpt_jax.kernels import builder

ENV = "GPT_JAX_CACHE"  # the cache's base directory
STAMP = ".checked"  # in a key directory: entries older than its mtime have been checked
# JAX's monitoring events: every program XLA was asked for (compiled or loaded), and those
# loaded from the persistent cache.
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
HIT_EVENT = "/jax/compilation_cache/cache_hits"


def base_dir() -> Path:
    """`$GPT_JAX_CACHE`, else `$XDG_CACHE_HOME/gpt-jax/xla` (default `~/.cache/gpt-jax/xla`),
    beside the built CPU kernels (`gpt_jax.kernels.builder`)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpt-jax" / "xla"


def key_dir(base: Path) -> Path:
    """The subdirectory of `base` for what JAX's own cache key leaves out: the jax version,
    the native kernels' source text and the CPU (see the module docstring)."""
    kernels = Path(builder.__file__).parent
    sources = [p.read_text() for p in sorted(kernels.glob("*.cc")) + [builder.HEADER]]
    digest = hashlib.sha256("\0".join([
        jax.__version__, jaxlib.__version__, *sources, builder.cpu_id()]).encode())
    return base / f"jax-{jax.__version__}-{digest.hexdigest()[:16]}"


def enable(base: Path | str | None = None) -> Path | None:
    """Turn the persistent compilation cache on in `key_dir(base)` (default `base_dir()`),
    every program cached however quickly it compiled, after removing broken entries
    (`discard_corrupt`). A process whose JAX already has a cache directory keeps it. Call it
    before the first compile. Returns the key directory (where `inference.exported` keeps
    its artifacts too), or None when the process had a cache directory already or was
    `disable`d."""
    if _enabled.get("off"):
        return None
    current = jax.config.jax_compilation_cache_dir
    if current:
        return Path(current) if current == _enabled.get("dir") else None
    directory = key_dir(Path(base) if base is not None else base_dir())
    directory.mkdir(parents=True, exist_ok=True)
    discard_corrupt(directory)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # the engine's small programs too: a start is then free of compiles, not nearly free
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled["dir"] = str(directory)
    return directory


_enabled: dict[str, str] = {}  # "dir": the directory `enable` turned on; "off": `disable`d


def disable() -> None:
    """Keep this process off the cache: later `enable` calls do nothing
    (`gpt-jax generate --no-compile-cache`; call it before the first)."""
    _enabled["off"] = "yes"


def discard_corrupt(directory: Path) -> list[str]:
    """Remove, with a warning each, the entries of `directory` that do not decompress (JAX
    would warn, compile and keep them: a compile at every start). Only entries written since
    the previous check are read. Returns the names removed."""
    stamp, started = directory / STAMP, time.time()
    since = stamp.stat().st_mtime if stamp.exists() else 0.0
    removed = []
    for entry in directory.glob("*-cache"):
        try:
            if entry.stat().st_mtime < since:
                continue
            data = compilation_cache.decompress_executable(entry.read_bytes())
            if len(data) <= 4:  # 4 bytes of compile time, then the executable
                raise ValueError("no executable in it")
        except FileNotFoundError:  # removed by another process meanwhile
            continue
        except Exception as error:  # noqa: BLE001: any failure to read is a broken entry
            drop_broken(entry, "the compilation cache entry", error,
                        "its program will be compiled again", stacklevel=2)
            entry.with_name(entry.name.removesuffix("-cache") + "-atime").unlink(missing_ok=True)
            removed.append(entry.name)
    stamp.touch()
    os.utime(stamp, (started, started))  # an entry written during the scan is read next time
    return removed


@dataclasses.dataclass(frozen=True)
class Programs:
    """Programs XLA gave this process so far."""

    compiled: int  # compiled now
    loaded: int  # loaded from the persistent cache


_counts: collections.Counter = collections.Counter()


def _count(event: str, *args, **kwargs) -> None:
    if event in (COMPILE_EVENT, HIT_EVENT):
        _counts[event] += 1


monitoring.register_event_listener(_count)
monitoring.register_event_duration_secs_listener(_count)


def programs() -> Programs:
    """The programs compiled and loaded from the cache since this module was imported."""
    return Programs(compiled=_counts[COMPILE_EVENT] - _counts[HIT_EVENT],
                    loaded=_counts[HIT_EVENT])


def add_flag(p: argparse.ArgumentParser) -> None:
    """`--no-compile-cache`, for the commands that run the engine."""
    p.add_argument("--no-compile-cache", action="store_true",
                   help=f"compile every program instead of loading it from the cache "
                        f"(${ENV}, default ~/.cache/gpt-jax/xla)")


def drop_broken(path: Path, what: str, error: Exception, then: str, stacklevel: int) -> None:
    """Remove the unreadable cache file `path` with a warning naming it, the error and
    what happens next (`then`); shared by the caches of compiled programs, exported
    programs (`inference.exported`) and constraints (`inference.constraint_cache`)."""
    warnings.warn(f"gpt-jax: {what} {path} is broken ({type(error).__name__}: {error}); "
                  f"removed, {then}", stacklevel=stacklevel + 1)
    path.unlink(missing_ok=True)
