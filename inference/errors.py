"""The one error a bad request raises, at every front (the library, the command line, the
server), so that each can name the field its own way without reading the message back."""

from __future__ import annotations

from collections.abc import Mapping


class _Names(dict):
    """Field names for `str.format_map`: a name not given is itself."""

    def __missing__(self, key):
        return key


class RequestError(ValueError):
    """A request's bad value, found before any work starts.

    Attributes:
      field: the engine's name of the field (`SamplingParams` field, "prompt").
      value: the value given.
      allowed: what the field allows, in words; other fields appear as `{name}`.
      code: an OpenAI-style error code ("invalid_value", "invalid_type",
        "context_length_exceeded").
      problem: the sentence before "; allowed:", with the field as `{field}` and the value
        as `{value!r}` (default: "{field}={value!r} is out of range").

    `str(error)` names the field `owner.field` (`SamplingParams.top_p=2.0 is out of range;
    allowed: [0, 1]`); `message` names it and the fields it mentions as a front does.
    """

    def __init__(self, field: str, value, allowed: str, *, code: str = "invalid_value",
                 problem: str = "{field}={value!r} is out of range",
                 owner: str = "SamplingParams"):
        self.field, self.value, self.allowed, self.code = field, value, allowed, code
        self.problem = problem
        super().__init__(self.message(f"{owner}.{field}" if owner else field))

    def message(self, name: str, names: Mapping[str, str] = {}) -> str:
        """The message with this field called `name` and every other field it mentions
        called as `names` maps it (engine name -> the front's; a name not in it is kept)."""
        words = _Names(names, field=name, value=self.value)
        return f"{self.problem.format_map(words)}; allowed: {self.allowed.format_map(words)}"
