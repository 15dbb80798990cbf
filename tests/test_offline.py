"""Offline generation of many prompts through the engine with few slots: returned in input
order, each result equal to the prompt run alone."""

import pytest

from gpt_jax import CharTokenizer
from inference import SamplingParams
from inference.llm import LLM


def test_many_prompts_come_back_in_input_order(config, params):
    tokenizer = CharTokenizer([chr(ord("0") + i) for i in range(config.vocab_size)])
    llm = LLM(params, config, tokenizer)
    prompts = ["0123456789", "a", "BCD", "0000000000000000000000", "ij", "KLMNOPQ"]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
    grouped = llm.generate(prompts, sampling, max_batch_size=2, progress=False)
    assert [len(g.tokens) for g in grouped] == [12] * len(prompts)
    alone = [llm.generate([p], sampling, progress=False)[0].text for p in prompts]
    assert len(set(alone)) >= 4 and len(set("".join(alone))) >= 8, alone  # can tell apart
    assert [g.text for g in grouped] == alone


def test_bad_max_batch_size_raises_before_work(config, params):
    llm = LLM(params, config, CharTokenizer(["a", "b"]))
    with pytest.raises(ValueError, match=r"max_batch_size must be an int >= 1, got 0"):
        llm.generate(["ab"], max_batch_size=0)
