"""Structured output, compiled on the host: a request's constraint (`SamplingParams.json_schema`,
`regex`, `choice` or `json_object`) becomes a regular expression, outlines-core turns that into
a deterministic automaton over the model's token ids (`outlines_core.Index`; the method of
Willard & Louf 2023, "Efficient Guided Generation for Large Language Models"), and this module
lays the automaton out as arrays that the compiled loop indexes (`inference.constraint_mask`).

Why outlines-core: of the three maintained libraries (outlines-core, llguidance, xgrammar) it
is the one that hands over the whole token-level automaton (`Index.get_transitions()`: state
-> {token id: next state}), which is what a device-side table needs. llguidance and xgrammar
run a grammar parser (Earley, pushdown automaton) and compute each step's token mask on the
host from the text so far: the per-token host round trip this design exists to avoid. A JSON
schema is compiled to a regex first (outlines-core's `build_regex_from_schema`), so it must
describe a regular language; the schema's integer bounds, which that compiler ignores, are
rewritten here as an `enum` of the allowed integers (`_bounded_integers`), or refused.

Layout (`Automaton`): states are renumbered with the initial one 0. Tokens whose columns of
the transition table are identical in every state share a class (`token_class`, `[V]`), so
the table is `next_state [S, C]` over C classes (dead = -1) plus `accepting [S]`; class 0 holds
every token no state takes (special tokens, ids past the tokenizer's vocabulary). A nested
schema over GPT-2's 50,257 tokens has a few hundred states and about a hundred classes
(benchmarks/README.md, "Structured output").

Compiled automata are cached by (regex, tokenizer) in a bounded LRU (`CACHE_SIZE`), so a
server compiles each schema once, and on disk (`inference.constraint_cache`), so the next
process loads it. EOS ids are not part of the automaton: the decode loop
allows a row's EOS ids exactly in accepting states.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import json
import re
import threading
import weakref

import numpy as np

from inference import constraint_cache
from inference.errors import RequestError

CACHE_SIZE = 64  # compiled automata kept (each a few hundred KB over a 50k vocabulary)
WHITESPACE = r"[ ]?"  # JSON's optional whitespace: at most one space, so outputs stay short
MAX_ENUM = 1024  # an integer range of at most this many values becomes an enum
MAX_SIZE = 2**15 - 1  # most states and token classes: the device tables are int16
FIELDS = ("json_schema", "regex", "choice", "json_object")  # SamplingParams' constraint fields
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")  # what Rust's regex_syntax::escape escapes


@dataclasses.dataclass(frozen=True, eq=False)
class Automaton:
    """One constraint's token-level DFA as arrays (hashed by identity: the cache hands out
    one object per constraint). State 0 is the initial state."""

    token_class: np.ndarray  # [V] int32, each token's class (0: no state takes it)
    next_state: np.ndarray  # [S, C] int32, next state per (state, class); -1 = dead
    accepting: np.ndarray  # [S] bool, the text so far matches

    @property
    def ends(self) -> np.ndarray:
        """bool `[S]`: accepting with no live token, so a row there has finished."""
        return self.accepting & ~(self.next_state >= 0).any(axis=1)

    def walk(self, tokens) -> int:
        """The state after `tokens` from the initial state (a resumed row's state); EOS ids
        and tokens past the end leave it where it is."""
        state = 0
        for token in tokens:
            after = int(self.next_state[state, self.token_class[token]])
            state = after if after >= 0 else state
        return state


def constraint_regex(sampling, request=None) -> tuple[str, str] | None:
    """`(field, regex)` of a request's constraint (`FIELDS`), or None when it has none.
    Raises RequestError naming the part of a JSON schema that cannot be compiled (and the
    request, `RequestError.request`)."""
    from outlines_core.json_schema import build_regex_from_schema

    if sampling.regex is not None:
        return "regex", sampling.regex
    if sampling.choice is not None:
        return "choice", "|".join(_escape(c) for c in sampling.choice)
    if sampling.json_schema is None and not sampling.json_object:
        return None
    field = "json_schema" if sampling.json_schema is not None else "json_object"
    schema = json.loads(sampling.json_schema) if field == "json_schema" else {"type": "object"}
    try:
        bounded = _bounded_integers(schema, "#", request)
        return field, build_regex_from_schema(json.dumps(bounded), WHITESPACE)
    except ValueError as e:  # outlines-core says which keyword or reference it rejects
        if isinstance(e, RequestError):
            raise
        raise _error(field, _short(sampling.json_schema), "a JSON schema outlines-core "
                     "compiles", "{field} cannot be compiled: " + _braces(e), request) from None


def _error(field, value, allowed, problem, request) -> RequestError:
    """A RequestError naming the request when there is one (`RequestError.request`)."""
    if request is None:
        return RequestError(field, value, allowed, problem=problem)
    return RequestError(field, value, allowed, problem="{request}: " + problem, owner="",
                        request=request)


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _braces(error: Exception) -> str:
    """The library's message on one line (outlines-core's may take three), its braces
    escaped for `RequestError`'s format strings."""
    return " ".join(str(error).split()).replace("{", "{{").replace("}", "}}")


def _short(value) -> str:
    return value if value is None or len(value) <= 80 else value[:77] + "..."


def _bounded_integers(node, path: str, request=None):
    """`node` with each integer schema's bounds as an enum of its values (outlines-core
    ignores minimum and maximum). Raises RequestError for bounds it cannot keep: a range
    of more than MAX_ENUM integers, a one-sided bound, or a bounded number."""
    if isinstance(node, list):
        return [_bounded_integers(x, f"{path}/{i}", request) for i, x in enumerate(node)]
    if not isinstance(node, dict):
        return node
    node = {k: _bounded_integers(v, f"{path}/{k}", request) for k, v in node.items()}
    bounds = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & node.keys()
    if not bounds:
        return node
    low = node.get("minimum", node.get("exclusiveMinimum", -np.inf) + 1)
    high = node.get("maximum", node.get("exclusiveMaximum", np.inf) - 1)
    if node.get("type") != "integer" or not high - low < MAX_ENUM:
        raise _error("json_schema", f"{path}: {', '.join(sorted(bounds))}",
                     f"bounds on integers only, both given, at most {MAX_ENUM} values",
                     "{field} at {value} cannot be enforced", request)
    rest = {k: v for k, v in node.items() if k not in bounds | {"type"}}
    return {**rest, "enum": list(range(int(np.ceil(low)), int(np.floor(high)) + 1))}


class _Vocab:
    """A tokenizer's token strings as an outlines-core `Vocabulary`, hashed by their
    content (the compile cache's key), with the model's vocab size."""

    def __init__(self, pieces: list[bytes | None], vocab_size: int):
        self.pieces, self.vocab_size = pieces[:vocab_size], vocab_size
        digest = hashlib.sha256(str(vocab_size).encode())
        for piece in self.pieces:  # tagged and length-prefixed: no two lists hash alike
            digest.update(b"\0" if piece is None else
                          b"\1" + len(piece).to_bytes(4, "little") + piece)
        self.key = digest.hexdigest()

    @functools.cached_property
    def vocabulary(self):
        """The outlines-core `Vocabulary`, built on the first compile (a process whose
        constraints all come from the disk cache never needs it)."""
        from outlines_core import Vocabulary

        by_text = collections.defaultdict(list)
        for token, piece in enumerate(self.pieces):
            if piece:  # special tokens and empty pieces are never live
                by_text[piece].append(token)
        # outlines-core wants an EOS id outside the map; EOS is ours to handle (vocab_size)
        return Vocabulary(self.vocab_size, dict(by_text))

    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Vocab) and other.key == self.key


_VOCABS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _vocab(tokenizer, vocab_size: int) -> _Vocab:
    """The tokenizer's `_Vocab` (made once per tokenizer object and vocab size)."""
    per_size = _VOCABS.setdefault(tokenizer, {})
    if vocab_size not in per_size:
        per_size[vocab_size] = _Vocab(token_bytes(tokenizer), vocab_size)
    return per_size[vocab_size]


def token_bytes(tokenizer) -> list[bytes | None]:
    """Each token id's bytes (None for special tokens): `gpt_jax.tokenizer.CharTokenizer`'s
    characters, or a `BPETokenizer`'s pieces, byte-level (GPT-2's byte-to-unicode alphabet)
    or SentencePiece-style (`▁` for a space, `<0xNN>` byte fallback)."""
    if hasattr(tokenizer, "chars"):
        return [c.encode() for c in tokenizer.chars]
    tok = tokenizer.tokenizer
    special = {a.content for a in tok.get_added_tokens_decoder().values()}
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    to_latin1 = {ord(c): b for b, c in _gpt2_byte_alphabet().items()}  # str.translate's map
    out = []
    for piece in map(tok.id_to_token, range(tok.get_vocab_size())):
        if piece is None or piece in special:
            out.append(None)
        elif byte_level:  # each character stands for one byte
            out.append(piece.translate(to_latin1).encode("latin-1"))
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out


@functools.cache
def _gpt2_byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (Radford et al. 2019, `bytes_to_unicode`)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def automaton(sampling, tokenizer, vocab_size: int, request=None) -> Automaton | None:
    """The request's compiled automaton over `vocab_size` token ids, or None when it has no
    constraint. Cached by (constraint, tokenizer): the last CACHE_SIZE are kept. Raises
    RequestError naming the field (and `request`): a schema or regex the library rejects,
    one that no text of this vocabulary can match, or no tokenizer."""
    key = tuple(getattr(sampling, f) for f in FIELDS)
    if key == (None, None, None, False):
        return None
    if tokenizer is None:
        field = FIELDS[[v not in (None, False) for v in key].index(True)]
        raise _error(field, _value(sampling, field), "a tokenizer", "{field} needs the token "
                     "strings: pass tokenizer= (generate, Engine) or use LLM", request)
    with _LOCK:  # the server checks requests in worker threads, the engine in its own
        vocab = _vocab(tokenizer, vocab_size)
        if (key, vocab) in _CACHE:
            _CACHE.move_to_end((key, vocab))
            return _CACHE[key, vocab]
    field, regex = constraint_regex(sampling, request)
    disk_key = constraint_cache.entry_key(regex, vocab.key)
    arrays = constraint_cache.load(disk_key, vocab_size)
    table = None if arrays is None else Automaton(*arrays)
    if table is None:
        try:
            table = _compile(regex, vocab)
        except ValueError as e:
            json_object = field == "json_object"  # its value, True, says nothing (and the
            raise _error(  # API names the field response_format)
                field, _value(sampling, field),
                "a tokenizer whose tokens can write a JSON object" if json_object else
                "a pattern that some text of the tokenizer's tokens matches",
                ("{field}" if json_object else "{field}={value!r}") + " cannot be compiled: "
                + _braces(e) + _where(regex), request) from None
        constraint_cache.store(disk_key, constraint_cache.Arrays(
            table.token_class, table.next_state, table.accepting))
    with _LOCK:
        _CACHE[key, vocab] = table
        if len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    return table


_CACHE: collections.OrderedDict = collections.OrderedDict()  # (constraint, _Vocab) -> Automaton
_LOCK = threading.Lock()


def _where(regex: str) -> str:
    """Python's word on a syntax error (its position), which outlines-core's lacks; the
    Rust syntax differs only in corners."""
    try:
        re.compile(regex)
    except re.error as e:
        return _braces(f" ({e})")
    return ""


def _value(sampling, field: str):
    value = getattr(sampling, field)
    return _short(value) if isinstance(value, str) else value


def _compile(regex: str, vocab: _Vocab) -> Automaton:
    from outlines_core import Index

    index = Index(regex, vocab.vocabulary)
    table = _layout(index, vocab.vocab_size)
    if not (table.next_state[0] >= 0).any():
        raise ValueError("it matches no non-empty text")
    if max(table.next_state.shape) > MAX_SIZE:
        raise ValueError(f"its automaton has {table.next_state.shape} states and token "
                         f"classes, more than {MAX_SIZE}")
    return table


def _layout(index, vocab_size: int) -> Automaton:
    """The `Automaton` arrays of an outlines-core Index: states renumbered (initial 0),
    tokens grouped into classes by their transition columns. Vectorized: a nested schema
    over 50k tokens has ~10^6 transitions. Columns are grouped by a 64-bit hash of their
    (state, next state) pairs, then checked exactly (`_check_classes`)."""
    transitions = index.get_transitions()
    initial, finals = index.get_initial_state(), list(index.get_final_states())
    sizes = [len(row) for row in transitions.values()]
    src = np.repeat(np.fromiter(transitions.keys(), np.int64, len(sizes)), sizes)
    token = np.concatenate([np.fromiter(r.keys(), np.int64, len(r)) for r in transitions.values()]
                           + [np.zeros(0, np.int64)])
    dst = np.concatenate([np.fromiter(r.values(), np.int64, len(r)) for r in transitions.values()]
                         + [np.zeros(0, np.int64)])
    keep = token < vocab_size  # vocab_size itself is the library's EOS
    src, token, dst = src[keep], token[keep], dst[keep]
    raw = np.unique(np.concatenate([[initial], finals, src, dst]).astype(np.int64))
    renumber = np.arange(len(raw))
    at = int(np.searchsorted(raw, initial))
    renumber[[0, at]] = renumber[[at, 0]]  # the initial state is 0
    src, dst = renumber[np.searchsorted(raw, src)], renumber[np.searchsorted(raw, dst)]
    column_hash = np.zeros(vocab_size, np.uint64)
    np.add.at(column_hash, token, _mix64((src * len(raw) + dst).astype(np.uint64)))
    live = np.bincount(token, minlength=vocab_size) > 0
    token_class = np.zeros(vocab_size, np.int32)
    _, inverse = np.unique(column_hash[live], return_inverse=True)
    token_class[live] = inverse.reshape(-1) + 1
    next_state = np.full((len(raw), int(token_class.max()) + 1), -1, np.int32)
    next_state[src, token_class[token]] = dst
    _check_classes(next_state, token_class, src, token, dst, live)
    accepting = np.zeros(len(raw), bool)
    accepting[renumber[np.searchsorted(raw, np.array(finals, np.int64))]] = True
    return Automaton(token_class, next_state, accepting)


def _mix64(x):
    """splitmix64's finalizer on uint64 (wrapping): spreads each pair over 64 bits."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _check_classes(next_state, token_class, src, token, dst, live) -> None:
    """Every token's transitions are exactly its class's (a hash collision would merge two
    columns: then some transition disagrees, or a class has more than its tokens)."""
    per_token = np.bincount(token, minlength=len(token_class))
    per_class = (next_state >= 0).sum(axis=0)
    if not ((next_state[src, token_class[token]] == dst).all()
            and (per_token[live] == per_class[token_class[live]]).all()):
        raise AssertionError("token classes collided: report this schema")
