"""Structured output for a random GPT-2-shaped model with the GPT-2 tokenizer's size: a
50,257-token byte-level BPE (tiny widths: the vocabulary is what these tests are about).
Every output of a constrained request parses and fits; EOS is live only where a regex or
choice is complete. Apart from test_structured.py (the character model, the server), so
that under `make test` (--dist loadfile) the two run on different workers."""

import re

import jax
import pytest

from gpt_jax import GPTConfig, init_params
from gpt_jax.tokenizer import BPETokenizer
from inference import SamplingParams
from inference.generation import generate
from test_structured import SEEDS, assert_every_output_validates, run_schemas
from training.data import shakespeare_text


@pytest.fixture(scope="module")
def bpe_model():
    """A random GPT-2-shaped model (GPT-2's 50,257-token vocabulary, tiny widths) and a
    byte-level BPE of exactly that size trained on Shakespeare (with its upper-cased copy, so
    there are enough merges)."""
    text = shakespeare_text()
    tokenizer = BPETokenizer.from_text(text + text.upper(), vocab_size=50257,
                                       special_tokens=("<|endoftext|>",))
    config = GPTConfig.preset("tiny", vocab_size=50257)
    return init_params(config, jax.random.key(0)), config, tokenizer


def test_every_output_validates_against_its_schema(bpe_model):
    assert_every_output_validates(run_schemas(bpe_model, "ROMEO:\n", per_call=4))


def test_regex_and_choices_with_shared_prefixes_end_where_they_may(bpe_model):
    """EOS (the BPE's <|endoftext|>) is live only where the output is complete: "cart" may
    end there or go on to "carton"; every output matches, and more than one choice shows."""
    params, config, tokenizer = bpe_model
    eos = tokenizer.tokenizer.token_to_id("<|endoftext|>")
    choices = ("cat", "car", "cart", "carton", "dog")
    pattern = r"[a-c]{1,3}-[0-9]{1,2}(x|yz)?"
    sampling = [SamplingParams(choice=choices, seed=s, max_new_tokens=8, stop_token_ids=[eos])
                for s in SEEDS] + [SamplingParams(regex=pattern, seed=s, max_new_tokens=8,
                                                  stop_token_ids=[eos]) for s in SEEDS]
    outs = generate(params, config, [tokenizer.encode("Say:")] * len(sampling), sampling,
                    tokenizer=tokenizer)
    texts = [tokenizer.decode(o.tokens) for o in outs]
    assert all(o.finish_reason in ("eos", "stop") for o in outs), texts
    assert all(o.tokens[-1] == eos for o in outs if o.finish_reason == "eos")
    assert all(t in choices for t in texts[:8]) and len(set(texts[:8])) > 1, texts
    assert all(re.fullmatch(pattern, t) for t in texts[8:]) and len(set(texts[8:])) > 1, texts
