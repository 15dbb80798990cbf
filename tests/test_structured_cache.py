"""The on-disk cache of compiled structured-output automata (`inference.constraint_cache`):
a second process loads what the first compiled (the same arrays, no compile), a broken entry
is recompiled with a warning and rewritten, another tokenizer or constraint never reads it,
an unwritable directory costs a warning only, and the directory keeps at most MAX_ENTRIES."""

import collections

import numpy as np
import pytest

from gpt_jax.tokenizer import CharTokenizer
from inference import SamplingParams, constraint_cache, constraints

TOKENIZER = CharTokenizer(sorted(set('{}[]":, 0123456789abcdefghijklmnopqrstuvwxyz')))
V = TOKENIZER.vocab_size
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 20},
                                           "s": {"type": "string", "maxLength": 3}},
          "required": ["n", "s"]}


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    """An empty cache directory, an empty in-memory cache: every call acts as a new process."""
    monkeypatch.setenv(constraint_cache.ENV, str(tmp_path))
    monkeypatch.setattr(constraints, "_CACHE", collections.OrderedDict())
    return tmp_path / "constraints"


def compile_fresh(sampling, tokenizer=TOKENIZER):
    constraints._CACHE.clear()  # a new process: only the disk cache holds it
    return constraints.automaton(sampling, tokenizer, tokenizer.vocab_size)


def same(a, b):
    return all(np.array_equal(getattr(a, f), getattr(b, f))
               for f in ("token_class", "next_state", "accepting"))


def test_second_process_loads_without_compiling(fresh, monkeypatch):
    sp = SamplingParams(json_schema=SCHEMA)
    first = compile_fresh(sp)
    assert len(list(fresh.glob("*.npz"))) == 1
    monkeypatch.setattr(constraints, "_compile", lambda *a: pytest.fail("compiled again"))
    assert same(compile_fresh(sp), first)


def test_other_tokenizer_or_constraint_compiles_its_own(fresh):
    first = compile_fresh(SamplingParams(regex="[a-c]{2}"))
    other = CharTokenizer(sorted(set("abcxyz")))
    second = compile_fresh(SamplingParams(regex="[a-c]{2}"), other)
    third = compile_fresh(SamplingParams(regex="[a-c]{3}"))
    assert len(list(fresh.glob("*.npz"))) == 3
    assert second.token_class.shape == (other.vocab_size,) != first.token_class.shape
    assert third.next_state.shape[0] == first.next_state.shape[0] + 1


@pytest.mark.parametrize("damage", [b"", b"not a zip", "truncated", "wrong shapes"])
def test_broken_entry_is_recompiled_and_rewritten(fresh, damage):
    sp = SamplingParams(choice=["yes", "no", "maybe"])
    first = compile_fresh(sp)
    (path,) = fresh.glob("*.npz")
    if damage == "truncated":
        damage = path.read_bytes()[:-40]
    elif damage == "wrong shapes":  # a whole file, not this automaton over V tokens
        with open(path, "wb") as f:
            np.savez(f, token_class=np.zeros(3, np.int32), next_state=first.next_state,
                     accepting=first.accepting)
        damage = path.read_bytes()
    path.write_bytes(damage)
    with pytest.warns(UserWarning, match="cache entry .* is broken"):
        again = compile_fresh(sp)
    assert same(again, first)
    assert same(constraint_cache.load(path.stem, V), first)  # rewritten whole


def test_unwritable_directory_warns_and_still_compiles(fresh):
    fresh.parent.mkdir(parents=True, exist_ok=True)
    fresh.write_text("a file where the directory should be")
    with pytest.warns(UserWarning, match="cannot keep a compiled constraint"):
        table = compile_fresh(SamplingParams(regex="a+b"))
    assert table.accepting.any()


def test_keeps_the_most_recently_used(fresh, monkeypatch):
    monkeypatch.setattr(constraint_cache, "MAX_ENTRIES", 2)
    for n in (1, 2, 3):
        compile_fresh(SamplingParams(regex=f"a{{{n}}}"))
    assert len(list(fresh.glob("*.npz"))) == 2
    monkeypatch.setattr(constraints, "_compile", lambda *a: pytest.fail("compiled again"))
    compile_fresh(SamplingParams(regex="a{3}"))  # the newest two survived
    compile_fresh(SamplingParams(regex="a{2}"))
