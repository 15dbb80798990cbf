"""The one error a bad request raises, at every front (the library, the command line, the
server), so that each can name the field its own way without reading the message back."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

PYTHON_SETTING = '{field}="{value}"'  # how the library spells a hint's setting


class _Names(dict):
    """Field names for `str.format_map`: a name not given is itself."""

    def __missing__(self, key):
        return key


@dataclasses.dataclass(frozen=True)
class Hint:
    """Another setting under which the request would be accepted: `field` set to `value`,
    which would `effect` (e.g. context_overflow "crop", "to predict each token from the last
    max_seq_len")."""

    field: str
    value: str
    effect: str


class RequestError(ValueError):
    """A request's bad value, found before any work starts.

    Attributes:
      field: the engine's name of the field (`SamplingParams` field, "prompt",
        "request_id").
      value: the value given (for a prompt too long, its length).
      allowed: what the field allows, in words; other fields appear as `{name}`.
      code: an OpenAI-style error code ("invalid_value", "invalid_type",
        "context_length_exceeded").
      problem: the sentence before "; allowed:", with the field as `{field}`, the value as
        `{value!r}` and the request as `{request}` (default: "{field}={value!r} is out of
        range").
      request: which request, when one of several: a prompt's index in a batch (int,
        `{request}` is "prompt 0") or an engine request id (str, "request 'a'"); None.
      hint: a `Hint`, or None; a front says it in its own spelling, or not at all.
      lead: the words between the problem and `allowed` ("; allowed: ").

    `str(error)` names the field `owner.field` (`SamplingParams.top_p=2.0 is out of range;
    allowed: [0, 1]`); `message` names it and the fields it mentions as a front does.
    """

    def __init__(self, field: str, value, allowed: str, *, code: str = "invalid_value",
                 problem: str = "{field}={value!r} is out of range",
                 owner: str = "SamplingParams", request: int | str | None = None,
                 hint: Hint | None = None, lead: str = "; allowed: "):
        self.field, self.value, self.allowed, self.code = field, value, allowed, code
        self.problem, self.request, self.hint, self.lead = problem, request, hint, lead
        super().__init__(self.message(f"{owner}.{field}" if owner else field))

    def message(self, name: str, names: Mapping[str, str] = {}, *,
                setting: str | None = PYTHON_SETTING) -> str:
        """The message with this field called `name` and every other field it mentions
        called as `names` maps it (engine name -> the front's; a name not in it is kept).
        `setting` spells the hint's setting from its `{field}` and `{value}` (None: the hint
        is left out)."""
        request = (f"request {self.request!r}" if isinstance(self.request, str)
                   else f"prompt {self.request}")
        words = _Names(names, field=name, value=self.value, request=request)
        text = f"{self.problem.format_map(words)}{self.lead}{self.allowed.format_map(words)}"
        if self.hint is None or setting is None:
            return text
        spelled = setting.format(field=self.hint.field, value=self.hint.value)
        return f"{text} (or {spelled} {self.hint.effect})"
