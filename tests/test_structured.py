"""Structured output (`SamplingParams.json_schema`, `regex`, `choice`, `json_object`): every
output of a constrained request parses and fits, for a trained character model (here) and a
random GPT-2-shaped model with a 50,257-token byte-level BPE (test_structured_bpe.py, apart:
under `make test` it runs on another worker); rows keep their solo outputs in mixed batches
and through the server; bad constraints are refused by name before any work.

Every schema here describes a finite language (bounded strings, integers and arrays, one
optional space), so each row ends on its own ("stop") within `longest_output` tokens."""

import json
import re

import jsonschema
import numpy as np
import pytest

from gpt_jax import checkpoint
from inference import LLM, Engine, SamplingParams
from inference.constraints import automaton
from inference.errors import RequestError
from inference.generation import generate
from inference.server import ServerConfig
from live_server import KEY, running, wait_ready
from training.data import shakespeare_text

JSON_CHARS = '{}[]"0123456789_@#'  # what JSON needs beyond Shakespeare's characters

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
     "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
     "required": ["color"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "none": {"type": "null"}},
     "required": ["ok", "none"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
     "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 50},
                                         "tag": {"type": "string", "maxLength": 3}},
        "required": ["id", "tag"]}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                      "b": {"type": "boolean"}}, "required": ["a"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["x", "yy"]}},
                                "required": ["k"]}, "minItems": 1, "maxItems": 2},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"enum": [1, "two", None, True]},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3},
               {"type": "string", "maxLength": 2}]},
    {"const": "fixed"},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
     "maxItems": 2},
    {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 100, "maximum": 999},
        "kind": {"enum": ["a", "b"]}, "note": {"type": "string", "maxLength": 4}},
     "required": ["id", "kind"]},
    {"type": "string", "pattern": "^[a-z]{1,3}@[a-z]{1,3}$"},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": -3,
                                            "exclusiveMaximum": 3}}, "required": ["n"]},
    {"$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}},
     "type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2},
    {"type": "array", "items": {"enum": ["up", "down"]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {
        "type": "object", "properties": {"c": {"type": "boolean"}}, "required": ["c"]}},
        "required": ["b"]}}, "required": ["a"]},
]
SEEDS = range(8)


def longest_output(table) -> int:
    """Most tokens any path of the automaton takes to a state with no live token (it must
    be acyclic: every schema here describes a finite language)."""
    live = table.next_state >= 0
    depth = np.zeros(len(table.accepting), np.int64)
    for _ in range(len(depth)):  # Bellman-Ford on the DAG: at most S rounds
        reach = np.where(live, depth[np.maximum(table.next_state, 0)] + 1, 0).max(axis=1)
        if (reach == depth).all():
            return int(depth[0])
        depth = reach
    raise AssertionError("the automaton has a cycle: the schema is not finite")


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    """A tiny character model trained (100 steps) on Shakespeare whose vocabulary also holds
    JSON's characters (one line of them in the corpus)."""
    from training import train as T
    from training.config import TrainConfig

    corpus = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    corpus.write_text(shakespeare_text()[:200_000] + "\n" + JSON_CHARS + "\n")
    run_dir = tmp_path_factory.mktemp("run") / "char"
    T.train(TrainConfig.preset("tiny", text=str(corpus), run_dir=str(run_dir), max_steps=100,
                               eval_interval=100))
    config, params, tokenizer = checkpoint.load_params(run_dir)
    return params, config, tokenizer


def run_schemas(model, prompt: str, per_call: int = len(SCHEMAS)):
    """Every schema x seed, in generate calls of `per_call` schemas (one compiled program
    each), the schemas ordered by `longest_output`. A call's batch is padded to a power of
    two rows and its loop runs until its longest row ends: with a 50,257-token vocabulary
    each row's step is most of the time, and calls of 4 schemas (32 rows) step about 3/8 of
    the rows x steps of one call of 160 rows (padded to 256) that runs as long as the
    longest. Returns `(schema, text, finish_reason)` per schema x seed, in SCHEMAS x SEEDS
    order."""
    params, config, tokenizer = model
    longest = [longest_output(automaton(SamplingParams(json_schema=s), tokenizer,
                                        config.vocab_size)) for s in SCHEMAS]
    order = sorted(range(len(SCHEMAS)), key=longest.__getitem__)
    results = {}
    for first in range(0, len(order), per_call):
        rows = [(i, seed) for i in order[first:first + per_call] for seed in SEEDS]
        sampling = [SamplingParams(json_schema=SCHEMAS[i], seed=seed, temperature=1.0,
                                   max_new_tokens=longest[i]) for i, seed in rows]
        outs = generate(params, config, [tokenizer.encode(prompt)] * len(rows), sampling,
                        tokenizer=tokenizer)
        results |= {(i, seed): (SCHEMAS[i], tokenizer.decode(o.tokens), o.finish_reason)
                    for (i, seed), o in zip(rows, outs)}
    return [results[(i, seed)] for i in range(len(SCHEMAS)) for seed in SEEDS]


def assert_every_output_validates(results):
    for schema, text, reason in results:
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
    assert len({text for _, text, _ in results}) > len(SCHEMAS) * 4  # seeds do differ


def test_every_output_validates_against_its_schema(char_model):
    assert_every_output_validates(run_schemas(char_model, "ROMEO:\n"))


def test_a_mixed_batch_gives_each_row_its_solo_output(char_model):
    """4 schemas, a regex and 3 free rows in one batch: each row as alone; the free rows as
    in a batch without any constraint (which compiles none of the masking)."""
    params, config, tokenizer = char_model
    constrained = [dict(json_schema=SCHEMAS[i]) for i in (0, 2, 7, 17)]
    constrained.append(dict(regex=r"[a-z]{3}-[0-9]{2}"))
    rows = [SamplingParams(**c, seed=k, max_new_tokens=48) for k, c in enumerate(constrained)]
    free = [SamplingParams(seed=10 + k, max_new_tokens=48, temperature=0.8) for k in range(3)]
    prompts = [tokenizer.encode(p) for p in ("ROMEO:\n", "JULIET:\nO", "First Citizen:\n",
                                             "KING", "A", "B", "To be", "HAMLET:\n")]
    mixed = generate(params, config, prompts, rows[:3] + free[:1] + rows[3:] + free[1:],
                     tokenizer=tokenizer)
    order = [0, 1, 2, 4, 5, 3, 6, 7]  # where rows + free sit in the mixed batch
    alone = [generate(params, config, [prompts[b]], [sp], tokenizer=tokenizer)[0]
             for b, sp in zip(order, rows + free)]
    for b, solo in zip(order, alone):
        assert (mixed[b].tokens, mixed[b].finish_reason) == (solo.tokens, solo.finish_reason)
    unconstrained = generate(params, config, [prompts[b] for b in (3, 6, 7)], free)
    assert [mixed[b].tokens for b in (3, 6, 7)] == [o.tokens for o in unconstrained]
    for b, c in zip((0, 1, 2, 4), constrained):
        jsonschema.validate(json.loads(tokenizer.decode(mixed[b].tokens)), c["json_schema"])
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", tokenizer.decode(mixed[5].tokens))


def test_bad_constraints_are_refused_by_name_before_any_work(char_model):
    params, config, tokenizer = char_model
    prompt = [tokenizer.encode("A")]

    def refused(**fields) -> RequestError:
        with pytest.raises(RequestError) as e:
            generate(params, config, prompt, SamplingParams(**fields), tokenizer=tokenizer)
        return e.value

    assert "Unsupported type: color" in str(refused(json_schema={"type": "color"}))
    e = refused(json_schema={"properties": {"x": {"type": "integer", "minimum": 0}}})
    assert e.field == "json_schema" and "#/properties/x: minimum" in str(e)
    e = refused(regex="\u03a9+")  # no token writes it: it matches nothing here
    assert e.field == "regex" and "'\u03a9+'" in str(e) and "prompt 0" in str(e)
    assert "tokenizer=" in str(pytest.raises(RequestError, generate, params, config, prompt,
                                             SamplingParams(choice=["a"])).value)
    with pytest.raises(RequestError, match="at most one constraint"):
        SamplingParams(regex="a", choice=["a"])
    with pytest.raises(RequestError, match="choice"):
        SamplingParams(choice=[""])


def test_a_schema_that_is_no_object_and_a_library_refusal_are_one_line():
    """Faults: `--json-schema '[1]'` passed SamplingParams (JSON, but not the dict its
    message allows) and reached outlines-core, whose refusal printed three lines."""
    from inference.constraints import constraint_regex

    for text in ("[1]", "5", '"a"'):
        with pytest.raises(RequestError, match=f"json_schema='{re.escape(text)}' is not a "
                                               r"JSON object; allowed: a dict \(or its"):
            SamplingParams(json_schema=text)
    with pytest.raises(RequestError) as caught:
        constraint_regex(SamplingParams(json_schema={"properties": {"a": [1]}}), request=0)
    message = str(caught.value)
    assert "Unsupported JSON Schema structure [1]" in message and "\n" not in message, message


# ---------------------------------------------------------------------- the server

SERVER_SLOTS = 8  # the server's engine and the solo reference's: the same programs


@pytest.fixture(scope="module")
def char_url(char_model):
    params, config, tokenizer = char_model
    cfg = ServerConfig("char", api_key=KEY, max_queue=64)
    with running(lambda: Engine(params, config, tokenizer, max_slots=SERVER_SLOTS), cfg) as url:
        wait_ready(url)
        yield url


def test_64_concurrent_requests_with_8_schemas_each_valid_and_equal_to_solo(char_model,
                                                                           char_url):
    import asyncio

    import openai

    params, config, tokenizer = char_model
    schemas = [SCHEMAS[i] for i in (0, 1, 2, 3, 6, 7, 10, 16)]
    longest = {i: longest_output(automaton(SamplingParams(json_schema=s), tokenizer,
                                           config.vocab_size)) for i, s in enumerate(schemas)}
    requests = [(k % 8, f"{'ABCDEFGH'[k % 8]}{k}:\n", 1000 + k) for k in range(64)]
    client = openai.AsyncOpenAI(base_url=f"{char_url}/v1", api_key=KEY, max_retries=0)

    async def one(i, prompt, seed):
        # half as OpenAI's response_format, half as vLLM's guided_json
        extra = ({"response_format": {"type": "json_schema", "json_schema": {
            "name": f"s{i}", "schema": schemas[i], "strict": True}}} if seed % 2 else
            {"guided_json": schemas[i]})
        r = await client.completions.create(model="char", prompt=prompt, seed=seed,
                                            max_tokens=longest[i], extra_body=extra)
        return r.choices[0].text, r.choices[0].finish_reason

    async def all_of_them():
        async with client:  # a bound against a hang, not a speed test
            return await asyncio.wait_for(asyncio.gather(*(one(*r) for r in requests)), 300)

    results = asyncio.run(all_of_them())
    llm = LLM(params, config, tokenizer)
    for (i, prompt, seed), (text, reason) in zip(requests, results):
        jsonschema.validate(json.loads(text), schemas[i])
        ref = llm.generate([prompt], SamplingParams(json_schema=schemas[i], seed=seed,
                                                    max_new_tokens=longest[i]),
                           max_batch_size=SERVER_SLOTS, progress=False)[0]
        assert (text, reason) == (ref.text, "stop"), prompt


@pytest.mark.parametrize("field, value, param, named", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"x": {"type": "colour"}}}}}, "response_format",
     "Unsupported type: colour"),
    ("guided_json", {"properties": {"n": {"type": "integer", "maximum": 5}}}, "guided_json",
     "#/properties/n: maximum"),
    ("guided_regex", "\u03a9{2}", "guided_regex", "'\u03a9{2}'"),  # no token writes it
    ("guided_regex", "a(", "guided_regex", "'a(' cannot be compiled"),
    ("guided_choice", [], "guided_choice", "non-empty list"),
    ("response_format", {"type": "xml"}, "response_format", "'xml'"),
])
def test_a_bad_constraint_is_a_400_naming_it(char_url, field, value, param, named):
    import httpx2 as httpx

    r = httpx.post(f"{char_url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "char", "prompt": "A", field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and named in error["message"], error


def test_json_object_a_vocabulary_cannot_write_is_named_as_the_api_names_it(monkeypatch):
    """Fault: over a char vocabulary without '{', the server's 400 said
    `response_format=True cannot be compiled` (the engine's json_object=True, renamed).
    outlines-core's refusal is stood in for (its DFA of json_object takes seconds)."""
    from types import SimpleNamespace

    from gpt_jax.tokenizer import CharTokenizer
    from inference import constraints
    from inference.api import request_error

    def refuse(regex, vocab):
        raise ValueError("The vocabulary provided is incompatible with the regex")

    monkeypatch.setattr(constraints, "_compile", refuse)
    tokenizer = CharTokenizer.from_text("ab ")
    with pytest.raises(RequestError) as caught:
        automaton(SamplingParams(json_object=True), tokenizer, 3, request=0)
    assert str(caught.value).startswith("prompt 0: json_object cannot be compiled: ")
    body = SimpleNamespace(response_format={"type": "json_object"})
    message = request_error(caught.value, body).message
    assert message.startswith("prompt 0: response_format cannot be compiled: ") and \
        "True" not in message, message
