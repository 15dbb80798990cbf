"""The text-level front: load a trained run, generate text from text prompts.

    llm = LLM.from_checkpoint("runs/shakespeare-char")
    outputs = llm.generate(["Romeo.\n"], SamplingParams(temperature=0.8, max_new_tokens=200))
    print(outputs[0].text)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from gpt_jax import checkpoint
from inference import stopping
from inference.engine import Completion, generate
from inference.sampling import SamplingParams


@dataclasses.dataclass
class TextCompletion:
    text: str  # generated text, cut before a stop string
    tokens: list[int]  # generated token ids (those of `text`, plus an EOS that ended it)
    finish_reason: str  # "eos", "stop" or "length"
    seed: int


class LLM:
    """A model, its config and tokenizer, generating text."""

    def __init__(self, params, config, tokenizer, cache_dtype=jnp.float32):
        self.params, self.config, self.tokenizer = params, config, tokenizer
        self.cache_dtype = cache_dtype

    @classmethod
    def from_checkpoint(cls, run_dir, step: int | None = None) -> LLM:
        """Load the latest (or given) checkpoint of a training run directory."""
        config, params, tokenizer = checkpoint.load_params(run_dir, step)
        return cls(params, config, tokenizer)

    def generate(self, prompts: list[str], sampling=None) -> list[TextCompletion]:
        """Generate for each text prompt. Stop strings are searched in the generated text
        and the output is cut before the first one.

        Raises:
          ValueError: a prompt character outside the tokenizer's vocabulary, or any invalid
            request (see `inference.engine.validate`).
        """
        sampling = sampling or SamplingParams()
        per_prompt = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        token_prompts = [self.tokenizer.encode(p) for p in prompts]
        no_strings = [dataclasses.replace(s, stop=()) for s in per_prompt]
        completions = generate(self.params, self.config, token_prompts, no_strings,
                               cache_dtype=self.cache_dtype)
        stops = [s.stop for s in per_prompt for _ in range(s.n)]
        return [self._finish(c, stop) for c, stop in zip(completions, stops)]

    def _finish(self, c: Completion, stops: tuple[str, ...]) -> TextCompletion:
        text = self.tokenizer.decode(c.tokens)
        cut = stopping.find_stop(text, stops)
        if cut is None:
            return TextCompletion(text, c.tokens, c.finish_reason, c.seed)
        kept = len(self.tokenizer.encode(text[:cut]))  # char-level: one token per character
        return TextCompletion(text[:cut], c.tokens[:kept], "stop", c.seed)
