"""Compiled structured-output automata kept on disk, so a constraint compiles once per
machine, not once per process: outlines-core's index of `{"type": "json_object"}` over
GPT-2's 50,257 tokens takes tens of seconds, reading the entry a small fraction of one
(benchmarks/README.md, "Structured output").

Where: `$GPT_JAX_CACHE/constraints`, default `$XDG_CACHE_HOME/gpt-jax/constraints`
(`~/.cache/gpt-jax/constraints`), one `.npz` file per entry (`Automaton`'s three arrays,
compressed, no pickles). What names an entry (`entry_key`): a SHA-256 of the regex the
constraint compiles to, the tokenizer's token strings and vocab size (`constraints._Vocab.key`),
the outlines-core version and this file's `FORMAT`; so a changed schema compiler, tokenizer or
layout never reads an old entry.

Writes are atomic (a temporary file in the same directory, then `os.replace`), so a reader
sees a whole entry or none. An entry that does not load or whose arrays are inconsistent (a
truncated file, another program's) is removed with a warning and its constraint compiled
again. A directory that cannot be written costs a warning and the compile, never an error.
At most `MAX_ENTRIES` are kept: a write removes the least recently used (file mtimes; a hit
touches its file).
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np

from inference import compile_cache

ENV = "GPT_JAX_CACHE"  # gpt-jax's cache directory (`inference.compile_cache`, `training.data`)
FORMAT = "1"  # bump when `Automaton`'s arrays change meaning
MAX_ENTRIES = 256  # the test suite's schemas over 50k tokens take 1-18 KB each


def cache_dir() -> Path:
    """`$GPT_JAX_CACHE/constraints`, else `$XDG_CACHE_HOME/gpt-jax/constraints`."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]) / "constraints"
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(home) / "gpt-jax" / "constraints"


def entry_key(regex: str, vocab_key: str) -> str:
    """The hex SHA-256 naming the entry of `regex` compiled over the vocabulary `vocab_key`."""
    parts = (FORMAT, _library_version(), vocab_key, regex)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@functools.cache
def _library_version() -> str:
    from importlib.metadata import version

    return version("outlines_core")


class Arrays(NamedTuple):
    """An entry's arrays, as `inference.constraints.Automaton` holds them."""

    token_class: np.ndarray  # [V] int32
    next_state: np.ndarray  # [S, C] int32, -1 = dead
    accepting: np.ndarray  # [S] bool


def load(key: str, vocab_size: int) -> Arrays | None:
    """The cached arrays of `key` over `vocab_size` tokens, or None when there are none
    (a broken entry is removed with a warning: its caller compiles it again)."""
    path = cache_dir() / f"{key}.npz"
    try:
        with np.load(path, allow_pickle=False) as data:
            table = Arrays(*(data[name] for name in Arrays._fields))
        _check(table, vocab_size)
        os.utime(path)  # recently used: kept longest
        return table
    except OSError:  # none, or a directory this process cannot read: `store` says so
        return None
    except Exception as error:  # noqa: BLE001: any failure to read is a broken entry
        compile_cache.drop_broken(path, "the structured-output cache entry", error,
                                  "the constraint is compiled again", stacklevel=2)
        return None


def _check(table: Arrays, vocab_size: int) -> None:
    """Raises ValueError unless the arrays form an automaton over `vocab_size` tokens."""
    S, C = table.next_state.shape
    if not (table.token_class.shape == (vocab_size,) and table.accepting.shape == (S,)
            and table.token_class.dtype == np.int32 and table.next_state.dtype == np.int32
            and table.accepting.dtype == bool and S > 0 and C > 0
            and 0 <= table.token_class.min() and table.token_class.max() < C
            and -1 <= table.next_state.min() and table.next_state.max() < S):
        raise ValueError(f"arrays of shapes {table.token_class.shape}, {(S, C)}, "
                         f"{table.accepting.shape} are no automaton over {vocab_size} tokens")


def store(key: str, table: Arrays) -> None:
    """Write `table` as the entry `key` atomically, then keep the newest MAX_ENTRIES; a
    failure to write is a warning."""
    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, suffix=".tmp", delete=False) as f:
            np.savez_compressed(f, token_class=table.token_class,
                                next_state=table.next_state, accepting=table.accepting)
        os.replace(f.name, directory / f"{key}.npz")
    except OSError as error:
        warnings.warn(f"gpt-jax: cannot keep a compiled constraint in {directory} "
                      f"({error}); it will be compiled again in the next process",
                      stacklevel=2)
        return
    _prune(directory)


def _prune(directory: Path) -> None:
    """Remove the least recently used entries past MAX_ENTRIES."""
    entries = []
    for path in directory.glob("*.npz"):
        try:
            entries.append((path.stat().st_mtime, path))
        except FileNotFoundError:  # removed by another process meanwhile
            continue
    for _, path in sorted(entries, reverse=True)[MAX_ENTRIES:]:
        path.unlink(missing_ok=True)
