import random

import pytest

from gpt_jax import checkpoint
from gpt_jax.tokenizer import BPETokenizer, CharTokenizer, load_tokenizer_file

CORPUS = ("To be, or not to be, that is the question:\n"
          "Whether 'tis nobler in the mind to suffer\n"
          "The slings and arrows of outrageous fortune,\n") * 40


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.from_text(CORPUS, vocab_size=300)


def random_unicode(rng: random.Random, n: int) -> str:
    """Code points from every plane (surrogates excluded: they are not valid text)."""
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(n))


def test_char_round_trip_and_unknown_character():
    tok = CharTokenizer.from_text(CORPUS)
    assert tok.decode(tok.encode("To be")) == "To be"
    with pytest.raises(ValueError, match=r"character 'Z' at offset 3 is not in"):
        tok.encode("to Z")


def test_bpe_round_trips_text_outside_the_corpus(bpe):
    rng = random.Random(0)
    samples = [
        "", " ", "\n\n\t  ", "To be, or not to be", "naïve café — “quotes” ½ ∑ ∞",
        "日本語のテキスト 你好 안녕하세요", "emoji 🎉👩‍👩‍👧 flags 🇫🇷", "\x00\x01\x7f\u200b\ufeff",
        "مرحبا بالعالم", "e\u0301 combining", "   leading and trailing spaces   ",
    ] + [random_unicode(rng, rng.randint(1, 60)) for _ in range(200)]
    for text in samples:
        ids = bpe.encode(text)
        assert all(0 <= i < bpe.vocab_size for i in ids)
        assert bpe.decode(ids) == text, repr(text)


def test_bpe_vocab_size_is_configurable_and_merges_compress(bpe):
    assert bpe.vocab_size == 300
    big = BPETokenizer.from_text(CORPUS, vocab_size=400)
    assert big.vocab_size > 300
    line = "The slings and arrows of outrageous fortune,"
    assert len(big.encode(line)) <= len(bpe.encode(line)) < len(line.encode())


def test_bpe_saved_in_run_dir_and_loaded_for_generate(bpe, tmp_path):
    checkpoint.save_tokenizer(tmp_path, bpe)
    loaded = checkpoint.load_tokenizer(tmp_path)
    assert isinstance(loaded, BPETokenizer)
    text = "Whether 'tis nobler ✓"
    assert loaded.encode(text) == bpe.encode(text)
    assert loaded.decode(bpe.encode(text)) == text


def test_char_tokenizer_file_loads_by_kind(tmp_path):
    tok = CharTokenizer.from_text("abc")
    tok.save(tmp_path / "t.json")
    assert load_tokenizer_file(tmp_path / "t.json").chars == ["a", "b", "c"]
    (tmp_path / "x.json").write_text('{"kind": "wordpiece"}')
    with pytest.raises(ValueError, match="neither a char tokenizer nor a tokenizers BPE"):
        load_tokenizer_file(tmp_path / "x.json")


@pytest.mark.parametrize("vocab_size", [256, 0, 2**20 + 1])
def test_bpe_rejects_bad_vocab_size(vocab_size):
    with pytest.raises(ValueError, match=rf"BPE vocab_size must be in \[257, 1048576\], got "
                                         rf"{vocab_size}"):
        BPETokenizer.from_text(CORPUS, vocab_size)


def test_bpe_rejects_empty_text():
    with pytest.raises(ValueError, match="cannot train a BPE tokenizer on empty text"):
        BPETokenizer.from_text("", 300)
