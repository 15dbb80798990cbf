"""Character-level tokenizer, saved as JSON beside a checkpoint."""

from __future__ import annotations

import json
import os
from pathlib import Path


class CharTokenizer:
    """Maps each distinct character of a corpus to an id, in sorted character order.

    Raises:
      ValueError: (encode) a character is not in the vocabulary, naming it and its offset.
    """

    kind = "char"

    def __init__(self, chars: list[str]):
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise ValueError("CharTokenizer needs distinct single characters")
        self.chars = list(chars)
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        if not text:
            raise ValueError("cannot build a character vocabulary from empty text")
        return cls(sorted(set(text)))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._ids[c] for c in text]
        except KeyError:
            offset = next(i for i, c in enumerate(text) if c not in self._ids)
            raise ValueError(
                f"character {text[offset]!r} at offset {offset} is not in the tokenizer's "
                f"vocabulary of {self.vocab_size} characters: {''.join(self.chars)!r}"
            ) from None

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps({"kind": self.kind, "chars": self.chars}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharTokenizer:
        data = json.loads(Path(path).read_text())
        if data.get("kind") != cls.kind:
            raise ValueError(f"{path} holds a {data.get('kind')!r} tokenizer, not 'char'")
        return cls(data["chars"])
