import numpy as np
import pytest

from training import data

HEADER = """The Project Gutenberg EBook of Hamlet, by William Shakespeare

This eBook is for the use of anyone anywhere at no cost.

*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***

"""
LICENCE = """

*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***

***** This file should be named 1524.txt *****
Updated editions will replace the previous one.
"""
PLAY = "HAMLET\n\nACT I. Scene I.\n\nBER. Who's there?\nFRAN. Nay, answer me.\n"


def test_strip_gutenberg_keeps_only_the_work():
    text = (HEADER + PLAY + LICENCE).replace("\n", "\r\n")
    assert data.strip_gutenberg(text) == PLAY


def test_strip_gutenberg_old_style_end_line_and_plain_text():
    old_style = "*** START OF THE PROJECT GUTENBERG EBOOK X ***\n" + PLAY + \
        "\nEnd of the Project Gutenberg EBook of Hamlet\nlicence text\n"
    assert data.strip_gutenberg(old_style) == PLAY
    assert data.strip_gutenberg(PLAY) == PLAY  # nothing to strip: unchanged


def test_builtin_corpus_is_the_plays_of_shakespeare_0_6():
    plays = data.shakespeare_plays()
    assert len(plays) == 42
    assert all(name.endswith("_gut.txt") for name in plays)
    assert "hamlet_gut.txt" in plays and "DENMARK" in plays["hamlet_gut.txt"]
    for name, text in plays.items():
        assert "Gutenberg" not in text and "GUTENBERG" not in text, name
        assert "\nby William Shakespeare\n" in text[:200], name  # starts with the title
    corpus = data.shakespeare_text()
    assert corpus.startswith(next(iter(plays.values()))[:100])
    assert len(corpus) > 4_000_000


def test_non_utf8_file_names_the_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("To be or not to be\ncaf".encode() + b"\xe9 au lait")
    with pytest.raises(ValueError, match=rf"{path} is not UTF-8: byte 0xe9 at offset 22"):
        data.load_text(path)


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ValueError, match=rf"{path} is empty: a corpus needs text"):
        data.load_text(path)


def test_split_is_the_tail():
    tokens = np.arange(100)
    train, val = data.split(tokens, 0.1)
    assert train.tolist() == list(range(90)) and val.tolist() == list(range(90, 100))


def test_get_batch_is_a_pure_function_of_seed_and_step():
    tokens = np.arange(1000, dtype=np.int32)
    x, y = data.get_batch(tokens, 4, 16, seed=3, step=7)
    assert x.shape == y.shape == (4, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(y, x + 1)  # targets are the inputs shifted by one
    again = data.get_batch(tokens, 4, 16, seed=3, step=7)
    np.testing.assert_array_equal(x, again[0])
    other = data.get_batch(tokens, 4, 16, seed=3, step=8)
    assert not np.array_equal(x, other[0])


def test_get_batch_refuses_data_shorter_than_a_block():
    with pytest.raises(ValueError, match="corpus split has 16 tokens, fewer than one block "
                                         r"of 16 \+ 1"):
        data.get_batch(np.arange(16), 2, 16, 0, 0)


def test_a_directory_or_missing_file_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=rf"{tmp_path} cannot be read as a text file: Is a dir"):
        data.load_text(tmp_path)
    with pytest.raises(ValueError, match="cannot be read as a text file: No such file"):
        data.load_text(tmp_path / "missing.txt")
