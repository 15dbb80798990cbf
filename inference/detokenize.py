"""What a request has produced, as `Engine.step` returns it: `RequestOutput`, built from a
sequence's tokens, and with a tokenizer its text, decoded incrementally: never a partial
UTF-8 character, never a tail that could still grow into a stop string, and cut at a stop
string (which finishes the sample).
"""

from __future__ import annotations

import dataclasses

from inference import stopping
from inference.scheduler import Sequence, Status


@dataclasses.dataclass
class RequestOutput:
    """What one sample of a request has produced so far (returned by `Engine.step`)."""

    request_id: str
    sample_index: int  # 0..n-1 for a request with n samples
    token_ids: list[int]  # every generated token so far
    new_token_ids: list[int]  # those generated since the last output of this sample
    finished: bool
    finish_reason: str | None  # "eos", "stop" or "length"; None while running
    seed: int  # the request's seed (see `Completion.seed`)
    text: str | None = None  # decoded text so far, with a tokenizer (final text when finished)
    new_text: str | None = None  # text since the last output (never a partial character or
    #                              a possible start of a stop string)
    logprobs: list[float] | None = None  # per token of token_ids, when asked
    top_logprobs: list[dict[int, float]] | None = None  # the `logprobs` most likely per step


INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a character missing bytes


def text_of(tokenizer, tokens: list[int], final: bool) -> str:
    """Decoded text; while the row runs, without a trailing incomplete character."""
    text = tokenizer.decode(tokens)
    return text if final else text.rstrip(INCOMPLETE)


def stop_cut(tokenizer, tokens: list[int], text: str, stops,
             min_tokens: int = 0) -> tuple[str, list[int]] | None:
    """If `text` contains a stop string: the text before it and the tokens through the one
    that completed it (the first prefix whose text reaches the stop string's end). Only an
    occurrence completed after the first `min_tokens` tokens counts (it ends past their
    text)."""
    after = len(text_of(tokenizer, tokens[:min_tokens], final=False)) if min_tokens else 0
    hit = stopping.find_stop(text, stops, after)
    if hit is None:
        return None
    start, end = hit
    k = next((k for k in range(1, len(tokens) + 1)
              if len(text_of(tokenizer, tokens[:k], final=False)) >= end), len(tokens))
    return text[:start], tokens[:k]


def sequence_text(tokenizer, seq: Sequence) -> tuple[str, str, bool]:
    """Text so far and the new part of it, and whether a stop string has just finished the
    sample. While the sample runs, the text shown stops before an incomplete UTF-8
    character and before any tail that could still grow into a stop string; a stop string
    found cuts the sample's tokens after the one that completed it and finishes it (reason
    "stop"; a sample that was running must then be freed: `Scheduler.free`)."""
    finished = seq.status == Status.FINISHED
    text_tokens = seq.output[:-1] if seq.finish_reason == "eos" else seq.output
    text = text_of(tokenizer, text_tokens, final=finished)
    stops = seq.sampling.stop
    cut = stop_cut(tokenizer, text_tokens, text, stops,
                   seq.sampling.min_tokens) if stops else None
    stopped = False
    if cut is not None and not (finished and seq.finish_reason == "stop" and seq.text):
        text, kept = cut
        del seq.output[len(kept):], seq.logprobs[len(kept):], seq.top_logprobs[len(kept):]
        stopped = not finished
        seq.status, seq.finish_reason = Status.FINISHED, "stop"
        finished = True
    if not finished:
        text = text[: len(text) - stopping.held_back(text, stops)]
    new_text, seq.shown = text[seq.shown:], len(text)
    if finished:
        seq.text = text
    return text, new_text, stopped


def request_output(seq: Sequence, old: int, text: str | None = None,
                   new_text: str | None = None) -> RequestOutput:
    """The sample's RequestOutput: its tokens from output index `old` on are new."""
    ask = seq.sampling.logprobs is not None
    return RequestOutput(
        seq.request_id, seq.sample_index, list(seq.output), seq.output[old:],
        seq.status == Status.FINISHED, seq.finish_reason, seq.seed, text, new_text,
        list(seq.logprobs) if ask else None, list(seq.top_logprobs) if ask else None)
