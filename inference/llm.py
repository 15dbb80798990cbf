"""The text-level front: load a trained run, generate or stream text from text prompts.

    llm = LLM.from_checkpoint("runs/shakespeare-char")
    outputs = llm.generate(["Romeo.\n"], SamplingParams(temperature=0.8, max_new_tokens=200))
    print(outputs[0].text)
    for delta in llm.stream(["Romeo.\n"], SamplingParams(max_new_tokens=200)):
        print(delta.text, end="", flush=True)

Both run the same host loop over compiled chunks of decode steps (`engine.start_program`,
`engine.chunk_program`), so streamed deltas join to exactly the generated text. Between
chunks each running row is decoded and searched for its stop strings; a row that contains
one is cut before it (finish reason "stop") and marked finished, so it generates nothing
more. A delta only carries text that is final: a byte-level tokenizer's incomplete UTF-8
character (decoded as U+FFFD) is held back until its last byte arrives, and a tail that
could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import jax
import jax.numpy as jnp

from gpt_jax import checkpoint
from gpt_jax.model import decode_layout
from gpt_jax.params import check_params
from inference import engine, stopping
from inference.sampling import SamplingParams

INCOMPLETE = "\ufffd"  # what a byte-level decoder shows for a character missing bytes


@dataclasses.dataclass
class TextCompletion:
    text: str  # generated text, cut before a stop string, without an ending EOS token's text
    tokens: list[int]  # generated ids, through the EOS or the token that completed a stop string
    finish_reason: str  # "eos", "stop" or "length"
    seed: int  # pass it back in SamplingParams to repeat the sample
    logprobs: list[float] | None = None  # per token of `tokens`, when asked
    top_logprobs: list[dict[int, float]] | None = None  # the `logprobs` most likely per step


@dataclasses.dataclass(frozen=True)
class Delta:
    """New text of one completion, as streamed."""

    index: int  # which completion: prompts in order, the n samples of each consecutively
    text: str  # text since this completion's previous delta (may be empty on the last one)
    completion: TextCompletion | None = None  # set on the completion's last delta


@dataclasses.dataclass
class _RowText:
    """Host-side progress of one decode row."""

    stops: tuple[str, ...]
    shown: int = 0  # characters already streamed
    finished: bool = False


def _text_of(tokenizer, tokens: list[int], final: bool) -> str:
    """Decoded text; while the row runs, without a trailing incomplete character."""
    text = tokenizer.decode(tokens)
    return text if final else text.rstrip(INCOMPLETE)


def _stop_cut(tokenizer, tokens: list[int], text: str, stops) -> tuple[str, list[int]] | None:
    """If `text` contains a stop string: the text before it and the tokens through the one
    that completed it (the first prefix whose text reaches the stop string's end)."""
    hit = stopping.find_stop(text, stops)
    if hit is None:
        return None
    start, end = hit
    k = next((k for k in range(1, len(tokens) + 1)
              if len(_text_of(tokenizer, tokens[:k], final=False)) >= end), len(tokens))
    return text[:start], tokens[:k]


DTYPES = ("float32", "bfloat16")


class LLM:
    """A model, its config and tokenizer, generating text.

    `dtype="bfloat16"` (or `jnp.bfloat16`) stores the weights and the KV cache in bfloat16
    (half the bytes a memory-bound decode step reads); LayerNorm, softmax, attention
    accumulators and logits stay float32 inside the model. Raises ValueError for any other
    dtype than `DTYPES`, or for params whose shapes do not match `config`
    (`gpt_jax.params.check_params`).
    `params` are kept in the decode layout (`gpt_jax.model.decode_layout`), made once here.
    """

    def __init__(self, params, config, tokenizer, dtype="float32"):
        try:
            name = jnp.dtype(dtype).name  # "bfloat16" and jnp.bfloat16 alike
        except TypeError:
            name = dtype
        if name not in DTYPES:
            raise ValueError(f"LLM dtype must be one of {DTYPES}, got {dtype!r}")
        self.cache_dtype = jnp.dtype(name)
        check_params(params, config)
        # The decode layout once, here: inside each compiled call it would copy every weight.
        self.params = jax.jit(decode_layout)(
            jax.tree.map(lambda a: a.astype(self.cache_dtype), params))
        self.config, self.tokenizer = config, tokenizer

    @classmethod
    def from_checkpoint(cls, run_dir, step: int | None = None, dtype="float32") -> LLM:
        """Load the latest (or given) checkpoint of a training run directory."""
        config, params, tokenizer = checkpoint.load_params(run_dir, step)
        return cls(params, config, tokenizer, dtype)

    def _encode(self, prompts) -> list[list[int]]:
        """Token ids of each text prompt. Raises TypeError for a bare string (which would
        otherwise be taken as one prompt per character) or a non-string prompt."""
        if isinstance(prompts, (str, bytes)):
            raise TypeError(f"prompts must be a list of strings, got a bare string {prompts!r:.40}"
                            "; wrap it in a list")
        bad = [p for p in prompts if not isinstance(p, str)]
        if bad:
            raise TypeError(f"prompts must be strings, got {type(bad[0]).__name__}")
        return [self.tokenizer.encode(p) for p in prompts]

    def generate(self, prompts: list[str], sampling=None, *, max_batch_size: int = 32,
                 progress: bool = True) -> list[TextCompletion]:
        """Generate for each text prompt: one TextCompletion per prompt and sample, in order.

        Any number of prompts: they are grouped by token length into batches of at most
        `max_batch_size` prompts (similar lengths pad little and reuse compiled programs),
        run batch by batch behind a tqdm progress bar, and returned in input order.

        Args:
          sampling: one SamplingParams for all prompts or one per prompt.
          max_batch_size: most prompts per batch, >= 1.
          progress: show the progress bar (stderr).
        Raises:
          ValueError: `max_batch_size` < 1, a prompt character outside the tokenizer's
            vocabulary, or any invalid request (see `inference.engine.validate`), before
            anything runs.
        """
        from tqdm import tqdm

        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, got {max_batch_size!r}")
        token_prompts = self._encode(prompts)
        _, per_prompt = engine.validate(self.config, token_prompts, sampling)
        results: list[list[TextCompletion]] = [[] for _ in prompts]
        groups = engine.length_groups([len(t) for t in token_prompts], max_batch_size)
        for group in tqdm(groups, disable=not progress, unit="batch", desc="generate"):
            group_sampling = [per_prompt[i] for i in group]
            deltas = self.stream([prompts[i] for i in group], group_sampling)
            done = {d.index: d.completion for d in deltas if d.completion}
            first = 0  # a prompt's n samples are consecutive completions
            for i, sp in zip(group, group_sampling):
                results[i] = [done[first + k] for k in range(sp.n)]
                first += sp.n
        return [c for per in results for c in per]

    def stream(self, prompts: list[str], sampling=None) -> Iterator[Delta]:
        """Yield text deltas per completion as compiled chunks of decode steps finish; the
        last delta of each completion carries its TextCompletion. Joined, a completion's
        deltas equal its `generate` text. Raises as `generate`, before the first delta."""
        token_prompts = self._encode(prompts)
        token_prompts, per_prompt = engine.validate(self.config, token_prompts, sampling)
        if not token_prompts:  # nothing to generate (as `generate([])` returns [])
            return
        batch = engine.pack(self.config, token_prompts, per_prompt)
        static = dict(capacity=batch.capacity, model_fns=engine.cached_model,
                      cache_dtype=self.cache_dtype)
        state = engine.start_program(
            self.params, self.config, jnp.asarray(batch.tokens_PT), jnp.asarray(batch.lengths_P),
            jnp.asarray(batch.source_B), batch.stops, n_steps=batch.n_steps, n_top=batch.n_top,
            **static,
        )
        rows = [_RowText(sp.stop) for sp in batch.requests]
        while True:
            host = engine.fetch(state)
            deltas = [self._advance(batch, b, row, host) for b, row in enumerate(rows)
                      if not row.finished]
            yield from (d for d in deltas if d.text or d.completion)
            stopped = [d.index for d in deltas
                       if d.completion and d.completion.finish_reason == "stop"
                       and not host.done[d.index]]
            if stopped:
                state = engine.mark_stopped(state, stopped)
            if all(row.finished for row in rows):
                return
            state = engine.chunk_program(self.params, self.config, state, batch.rows, batch.stops,
                                         pad_id=0, **static)

    def _advance(self, batch: engine.Batch, b: int, row: _RowText, host) -> Delta:
        """Row b's new text after a chunk, and its TextCompletion if it has now finished."""
        n, finish = int(host.num_tokens[b]), int(host.finish[b])
        tokens = host.tokens[b, :n].tolist()
        text_tokens = tokens[:-1] if finish == stopping.EOS else tokens
        done = bool(host.done[b])
        text = _text_of(self.tokenizer, text_tokens, final=done)
        cut = _stop_cut(self.tokenizer, text_tokens, text, row.stops) if row.stops else None
        if cut is None and not done:  # still running: show what can no longer change
            visible = text[: len(text) - stopping.held_back(text, row.stops)]
            delta, row.shown = visible[row.shown:], len(visible)
            return Delta(b, delta)
        if cut is None:
            reason = stopping.FINISH_REASONS[finish]
        else:
            text, kept = cut
            reason, n = "stop", len(kept)
        c = engine.unpack_row(batch, b, host, n, reason)
        row.finished = True
        return Delta(b, text[row.shown:], TextCompletion(text, c.tokens, reason, c.seed,
                                                         c.logprobs, c.top_logprobs))
