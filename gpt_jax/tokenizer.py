"""Tokenizers saved as JSON beside a checkpoint: character-level and byte-level BPE."""

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`'s characters (a character vocabulary adds no special tokens,
        so `add_special_tokens` changes nothing; it is there for BPETokenizer's callers)."""
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


class BPETokenizer:
    """Byte-level BPE (GPT-2 style, Sennrich et al. 2016; Radford et al. 2019) trained on a
    corpus with the Hugging Face `tokenizers` library, saved in its own `tokenizer.json`
    format. Any Unicode text round-trips exactly (the 256 byte symbols are always in the
    vocabulary), including text the tokenizer never saw.

    Special tokens (a chat template's `<|im_start|>`, `<|im_end|>`, ...) are `tokenizers`'
    added tokens: `encode` maps each occurrence in the text to its one id (never split into
    bytes), and `decode` leaves them out, as a Hugging Face tokenizer does.
    """

    kind = "bpe"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer with byte-level pre/post steps

    @classmethod
    def from_text(cls, text: str, vocab_size: int = 512,
                  special_tokens: tuple[str, ...] = ()) -> BPETokenizer:
        """Train on `text`, with `special_tokens` (ids 0, 1, ... in order). Raises
        ValueError for empty text or vocab_size < 257 (the 256 bytes plus at least one
        merge) or > 2**20."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        if not text:
            raise ValueError("cannot train a BPE tokenizer on empty text")
        if not 257 <= vocab_size <= 2**20:
            raise ValueError(f"BPE vocab_size must be in [257, {2**20}], got {vocab_size}")
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False, special_tokens=list(special_tokens),
        )
        tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
        return cls(tok)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text`, with the tokenizer's post-processor tokens (a Llama
        tokenizer.json's BOS) unless `add_special_tokens` is False: text that already holds
        them, such as a rendered chat template that starts with `bos_token`, is encoded
        without (transformers' `apply_chat_template` does the same)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, path: str | os.PathLike) -> None:
        self.tokenizer.save(str(path))

    @classmethod
    def load(cls, path: str | os.PathLike) -> BPETokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))


def load_tokenizer_file(path: str | os.PathLike) -> CharTokenizer | BPETokenizer:
    """Load a tokenizer saved by either class: ours carry `"kind": "char"`, a BPE file is
    the `tokenizers` JSON format (with a `"model"` entry).

    Raises:
      ValueError: the file is neither, naming it.
    """
    data = json.loads(Path(path).read_text())
    if data.get("kind") == CharTokenizer.kind:
        return CharTokenizer.load(path)
    if data.get("model", {}).get("type") == "BPE":
        return BPETokenizer.load(path)
    raise ValueError(f"{path} is neither a char tokenizer nor a tokenizers BPE file")
