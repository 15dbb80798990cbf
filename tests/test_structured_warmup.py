"""`Engine.warmup(constraints=...)` compiles the constrained variants of the engine's prefill
and decode programs (the smallest table size and each given constraint's), so structured
requests afterwards compile nothing; without `constraints` it compiles none of them."""

import json

import pytest

from gpt_jax.tokenizer import CharTokenizer
from inference import Engine, SamplingParams
from inference.engine import compile_counts

CHARS = sorted('{}[]":, 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRST')  # 64
# wider than the smallest table bucket (64 states, 32 classes): a program of its own
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "s": {"type": "string", "maxLength": 40}},
          "required": ["n", "s"]}


def engine(config, params):
    # one prefill shape (a 16-token chunk, one row) and one decode size: cheap warmups
    return Engine(params, config, tokenizer=CharTokenizer(CHARS), max_slots=1,
                  max_prefill_tokens=16, prefill_chunk_tokens=16)


def run(engine, requests):
    for i, (prompt, sp) in enumerate(requests):
        engine.add_request(str(i), prompt, sp)
    outs = {}
    while engine.has_unfinished_requests():
        outs |= {o.request_id: o for o in engine.step() if o.finished}
    return [outs[str(i)] for i in range(len(requests))]


def test_warmup_compiles_the_constrained_programs(config, params):
    assert config.vocab_size == len(CHARS)  # every token decodes
    plain, warm = engine(config, params), engine(config, params)
    n_plain = plain.warmup()
    n_warm = warm.warmup(constraints=[SamplingParams(json_schema=SCHEMA)])
    assert n_plain > 0 and n_warm == 2 * n_plain  # two table sizes, each plain's programs
    before = compile_counts()
    choice = SamplingParams(choice=["yes", "no"], seed=1, max_new_tokens=8)
    schema = SamplingParams(json_schema=SCHEMA, seed=2, max_new_tokens=80)
    free = SamplingParams(seed=3, max_new_tokens=5)
    outs = run(warm, [("ab", choice)]) + run(warm, [("a{", schema), ("b", free)])
    assert compile_counts() == before
    assert outs[0].text in ("yes", "no")
    assert set(json.loads(outs[1].text)) == {"n", "s"}
    with pytest.raises(ValueError, match="json_schema cannot be compiled: .type. must be"):
        engine(config, params).warmup(constraints=[SamplingParams(json_schema={"type": 7})])
    with pytest.raises(ValueError, match="SamplingParams with a constraint, got"):
        engine(config, params).warmup(constraints=[SamplingParams(seed=1)])
