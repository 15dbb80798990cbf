"""`SamplingParams`, how one request samples, and the allowed range of each of its fields
(`RANGES`, defined once: `SamplingParams` checks them and the server's request model takes its
bounds from them). Plain Python, no JAX: the sampling math on arrays is `inference.sampling`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import sys

from inference.errors import RequestError

MAX_LOGPROBS = 20  # most alternatives `logprobs` may ask for
INT32_MAX = 2**31 - 1  # integer fields become int32 arrays
CONTEXT_OVERFLOW = ("error", "crop")  # SamplingParams.context_overflow values (None: default)
SPECULATIVE = ("ngram", "draft")  # SamplingParams.speculative values (None: off)
MAX_SPECULATIVE_TOKENS = 8  # most drafted tokens per verification
# longest n-gram prompt lookup matches: a character-level model's text repeats 3 or 4
# characters everywhere, where 8 can still locate a copied passage (prompt_lookup_max, 3 by
# default, up to this)
MAX_NGRAM = 8


@dataclasses.dataclass(frozen=True)
class Range:
    """A numeric field's allowed values, `low` to `high` (`low_open`: above `low`), and how
    an error states them."""

    low: float
    high: float
    allowed: str
    integer: bool = False
    low_open: bool = False

    def __contains__(self, value) -> bool:
        return (value > self.low if self.low_open else value >= self.low) and value <= self.high


# Every numeric field's range, defined once: SamplingParams checks them (in this order), and
# the server's request model takes its bounds from them (`inference.api`).
RANGES = {
    "temperature": Range(0.0, math.inf, "[0, inf)"),
    "top_k": Range(0, INT32_MAX, f"[0, {INT32_MAX}] (0 = off)", integer=True),
    "top_p": Range(0.0, 1.0, "[0, 1]"),
    "min_p": Range(0.0, 1.0, "[0, 1]"),
    "repetition_penalty": Range(0.0, math.inf, "(0, inf)", low_open=True),
    "presence_penalty": Range(-2.0, 2.0, "[-2, 2]"),
    "frequency_penalty": Range(-2.0, 2.0, "[-2, 2]"),
    "seed": Range(0, 2**32 - 1, "None or [0, 2**32 - 1]", integer=True),
    "max_new_tokens": Range(0, INT32_MAX, f"[0, {INT32_MAX}]", integer=True),
    "logprobs": Range(0, MAX_LOGPROBS, f"None or [0, {MAX_LOGPROBS}]", integer=True),
    "n": Range(1, INT32_MAX, f"[1, {INT32_MAX}]", integer=True),
    "min_tokens": Range(0, INT32_MAX, f"[0, {INT32_MAX}]", integer=True),
    "num_speculative_tokens": Range(1, MAX_SPECULATIVE_TOKENS,
                                    f"[1, {MAX_SPECULATIVE_TOKENS}]", integer=True),
    "prompt_lookup_min": Range(1, MAX_NGRAM, f"[1, {MAX_NGRAM}]", integer=True),
    "prompt_lookup_max": Range(1, MAX_NGRAM, f"[1, {MAX_NGRAM}]", integer=True),
}
BIAS = Range(-100.0, 100.0, "[-100, 100]")  # a logit_bias value
TOKEN_ID = Range(0, math.inf, "token ids >= 0", integer=True)  # stop ids, biased ids
# OpenAI's API documents temperature in [0, 2], and the server keeps to it; the engine
# samples at any temperature in RANGES.
API_MAX_TEMPERATURE = 2.0


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated on construction.

    Raises:
      RequestError (a ValueError): a field is out of range, NaN, not a number or not an
        integer; the message names the field, the value and its range (`RANGES`).
      TypeError: an unknown field (the dataclass constructor rejects it).
    """

    temperature: float = 1.0  # 0 = greedy; otherwise logits are divided by it
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # keep the smallest set whose probability reaches top_p; 1 = off
    min_p: float = 0.0  # keep tokens with prob >= min_p * max prob; 0 = off
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in prompt or output
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    # None: a fresh random seed, reported back in the Completion. The noise of a row comes
    # from (seed, a hash of the prompt's tokens, sample index, step): the same seed with the
    # same prompt repeats exactly, alone or in any batch; with different prompts it draws
    # independent noise (`prompt_hash`, `row_keys`).
    seed: int | None = None
    max_new_tokens: int = 16  # most tokens to generate
    stop_token_ids: tuple[int, ...] = ()  # EOS ids: generation ends after emitting one
    stop: tuple[str, ...] = ()  # stop strings: output is cut before the first one found
    logprobs: int | None = None  # None = off; n >= 0 = sampled token's logprob + top n
    n: int = 1  # independent samples of this prompt, sharing one prefill
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # token id sequences; output cut before one
    # vLLM's min_tokens: no stop (EOS id, token stop sequence, stop string) until this many
    # tokens have been generated. An EOS id cannot be sampled while fewer have been (its
    # logit is -inf, `stopping.ban_early_eos`); a stop sequence or string counts only if the
    # token that completes it comes after the first min_tokens (a match may start inside
    # them). At most max_new_tokens, which still ends the row.
    min_tokens: int = 0
    # OpenAI's logit_bias: token id -> bias in [-100, 100], added to the raw logits before
    # penalties, temperature and filters (not to the reported logprobs, which stay the
    # model's). Given as a dict or (id, bias) pairs; kept as pairs sorted by id (hashable).
    # Ids past the vocabulary are refused by `inference.validation.check_request`, which
    # knows it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # What a request that outgrows the model's context (max_seq_len) does: "error" refuses
    # a prompt + max_new_tokens past it (`inference.validation.check_request`); "crop" (nanoGPT's
    # sample: `idx_cond = idx[:, -block_size:]`) predicts each token from exactly the last
    # max_seq_len tokens of prompt and output, and crops a longer prompt to its last
    # max_seq_len tokens (the penalties and the prompt hash then see only those). None: the
    # front's default, "error" for `generate`, `Engine` and the server (nothing outgrows the
    # context silently), "crop" for `LLM` and `gpt-jax generate`.
    context_overflow: str | None = None
    # Speculative decoding (`inference.speculative`): None (off) or "ngram", prompt lookup:
    # draft up to `num_speculative_tokens` tokens by matching the row's last n tokens
    # (n from prompt_lookup_max down to prompt_lookup_min) earlier in its prompt and output,
    # and verify them in one forward. The output's distribution (greedy: its tokens) is
    # that of decoding without it. "draft": the drafts come from a draft model given to
    # `generate`, `Engine` or `LLM` (`inference.draft`).
    speculative: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # Structured output, at most one of the four (`inference.constraints`, which needs the
    # tokenizer): the whole output is JSON valid under `json_schema` (a dict or its JSON text,
    # kept as JSON text with sorted keys: hashable), matches `regex` (Rust regex syntax), is
    # one of the strings of `choice`, or is a JSON object (`json_object`). The row ends ("stop")
    # once its output is complete and nothing may follow; its EOS ids only where it is complete.
    json_schema: str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False

    def __post_init__(self):
        set_ = object.__setattr__
        set_(self, "stop_token_ids", _as_tuple("stop_token_ids", self.stop_token_ids))
        set_(self, "stop", (self.stop,) if isinstance(self.stop, str) else
             _as_tuple("stop", self.stop))
        set_(self, "stop_sequences", tuple(
            _as_tuple("stop_sequences", q) for q in _as_tuple("stop_sequences", self.stop_sequences)
        ))
        for name in RANGES:
            if getattr(self, name) is not None or name not in ("seed", "logprobs"):
                _check(name, getattr(self, name))
        for token_id in self.stop_token_ids:
            _check("stop_token_ids", token_id, TOKEN_ID)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise RequestError("stop", s, "non-empty strings")
        for sequence in self.stop_sequences:
            if not sequence:
                raise RequestError("stop_sequences", sequence,
                                   "non-empty sequences of token ids >= 0")
            for token_id in sequence:
                _check("stop_sequences", token_id, TOKEN_ID)
        if self.min_tokens > self.max_new_tokens:
            raise RequestError("min_tokens", self.min_tokens, "0 <= {min_tokens} <= "
                               "{max_new_tokens}", problem="{field}={value!r} is more than "
                               f"{{max_new_tokens}}={self.max_new_tokens}")
        set_(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.context_overflow not in CONTEXT_OVERFLOW + (None,):
            raise RequestError("context_overflow", self.context_overflow,
                               f"None, {', '.join(map(repr, CONTEXT_OVERFLOW))}")
        if self.speculative not in SPECULATIVE + (None,):
            raise RequestError("speculative", self.speculative,
                               f"None, {', '.join(map(repr, SPECULATIVE))}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise RequestError("prompt_lookup_min", self.prompt_lookup_min,
                               "1 <= {prompt_lookup_min} <= {prompt_lookup_max}",
                               problem="{field}={value!r} is more than "
                               f"{{prompt_lookup_max}}={self.prompt_lookup_max}")
        _check_constraint(self)
        if self.speculative is not None and self.constrained:  # after _check_constraint
            raise RequestError("speculative", self.speculative,
                               "None with json_schema, regex, choice or json_object",
                               problem="{field}={value!r} does not run with structured output "
                               "yet: drafts are not checked against the constraint")

    def overflow(self, default: str) -> str:
        """`context_overflow`, or `default` when it is None."""
        return default if self.context_overflow is None else self.context_overflow

    @property
    def constrained(self) -> bool:
        """Whether one of the structured-output fields is set."""
        return self.json_object or any(
            getattr(self, f) is not None for f in ("json_schema", "regex", "choice"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_constraint(sp: SamplingParams) -> None:
    """Normalize the structured-output fields in place (a schema dict to sorted JSON text, a
    choice list to a tuple) and refuse wrong types, empty values and more than one."""
    set_ = object.__setattr__
    if isinstance(sp.json_schema, dict):
        set_(sp, "json_schema", json.dumps(sp.json_schema, sort_keys=True))
    elif sp.json_schema is not None:
        if not isinstance(sp.json_schema, str):
            raise RequestError("json_schema", sp.json_schema, "a dict (or its JSON text)",
                               code="invalid_type", problem="{field}={value!r:.60} is not a dict")
        try:
            schema = json.loads(sp.json_schema)
        except ValueError:
            raise RequestError("json_schema", sp.json_schema, "a dict (or its JSON text)",
                               problem="{field}={value!r:.60} is not JSON") from None
        if not isinstance(schema, dict):
            raise RequestError("json_schema", sp.json_schema, "a dict (or its JSON text)",
                               problem="{field}={value!r:.60} is not a JSON object")
        set_(sp, "json_schema", json.dumps(schema, sort_keys=True))
    if sp.regex is not None and (not isinstance(sp.regex, str) or not sp.regex):
        raise RequestError("regex", sp.regex, "a non-empty str")
    if sp.choice is not None:
        set_(sp, "choice", _as_tuple("choice", sp.choice))
        if not sp.choice or not all(isinstance(c, str) and c for c in sp.choice):
            raise RequestError("choice", sp.choice, "a non-empty list of non-empty strings")
    if not isinstance(sp.json_object, bool):
        raise RequestError("json_object", sp.json_object, "True or False", code="invalid_type")
    given = [f for f in ("json_schema", "regex", "choice") if getattr(sp, f) is not None]
    given += ["json_object"] * sp.json_object
    if len(given) > 1:
        raise RequestError(given[1], getattr(sp, given[1]),  # {name}: each front's name
                           f"at most one constraint (got {{{given[0]}}} too)",
                           problem="{field} is given with another constraint")


def _as_tuple(name, value) -> tuple:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise RequestError(name, value, "a list", code="invalid_type")
    return tuple(value)


def _bias_pairs(value) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (id, bias) pairs sorted by id, from a dict or pairs; each id an int >= 0
    given once, each bias a real in [-100, 100]."""
    pairs = value.items() if isinstance(value, dict) else _as_tuple("logit_bias", value)
    out = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise RequestError("logit_bias", pair, "a dict or pairs {{token id >= 0: bias}}",
                               code="invalid_type",
                               problem="{field} entry {value!r} is not a (token id, bias) pair")
        token_id, bias = pair
        _check("logit_bias", token_id, TOKEN_ID)
        _check("logit_bias", bias, BIAS, f"{{field}}[{token_id}]={{value!r}}")
        if int(token_id) in out:
            raise RequestError("logit_bias", token_id, "each id once",
                               problem="{field} gives token id {value!r} twice")
        out[int(token_id)] = float(bias)
    return tuple(sorted(out.items()))


def _check(name, value, range_=None, subject="{field}={value!r}"):
    """Raise RequestError unless `value` is in `range_` (default `RANGES[name]`): an integer
    for an integer range, else a finite real. The message names the value as `subject`
    says and what is wrong with it: not an integer, not a number (a string, a bool: code
    "invalid_type", as OpenAI's API refuses `"temperature": "hot"`), NaN, or out of range
    (inf included: a float range's bounds are finite or open)."""
    range_ = range_ or RANGES[name]
    if range_.integer and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
        raise RequestError(name, value, f"integers {range_.allowed}", code="invalid_type",
                           problem=subject + " is not an integer")
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise RequestError(name, value, f"numbers in {range_.allowed}", code="invalid_type",
                           problem=subject + " is not a number")
    if value != value:  # NaN, the one value unequal to itself
        raise RequestError(name, value, range_.allowed, problem=subject + " is NaN (not a "
                           "number)")
    # a float field's value must be a finite float: not inf, nor an int past float's range
    # (no math.isfinite, which raises OverflowError for such an int)
    if not (range_.integer or abs(value) <= sys.float_info.max) or value not in range_:
        raise RequestError(name, value, range_.allowed, problem=subject + " is out of range")
