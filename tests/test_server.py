"""`gpt-jax serve`, tested as clients use it: a real uvicorn on 127.0.0.1 (a free port), the
official `openai` client, raw HTTP for the error bodies and disconnects, a real headless
chromium for the playground page, and the `gpt-jax serve` process itself for SIGTERM.

Every completion is checked against `LLM.generate` for the same request (seeded), so the
server adds nothing and loses nothing on the way."""

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx2 as httpx
import numpy as np
import openai
import pytest

from conftest import free_port, taken_port
from inference import Engine
from inference.server import ServerConfig
from live_server import (KEY, SLOTS, TOKENIZER, client, llm, metric, running,  # noqa: F401
                         save_run, solo, url, wait_ready)


# ---------------------------------------------------------------------- 1. completions

def test_completion_n2_stop_seed_logprobs_equal_llm_generate(client, llm):
    fields = dict(max_new_tokens=40, temperature=0.9, seed=11, n=2, logprobs=3)
    ref = solo(llm, "ABCD", **fields)
    assert all(r.finish_reason == "length" for r in ref)
    stop = ref[1].text[10:13]  # a stop string that the second sample meets
    ref = solo(llm, "ABCD", **fields, stop=[stop])
    assert ref[1].finish_reason == "stop" and len(ref[1].text) == 10
    r = client.completions.create(model="tiny", prompt="ABCD", max_tokens=40, temperature=0.9,
                                  seed=11, n=2, logprobs=3, stop=stop)
    assert [c.index for c in r.choices] == [0, 1]
    for choice, expected in zip(r.choices, ref):
        assert choice.text == expected.text
        assert choice.finish_reason == {"length": "length", "stop": "stop"}[
            expected.finish_reason]
        lp = choice.logprobs
        assert lp.tokens == [TOKENIZER.decode([t]) for t in expected.tokens]
        np.testing.assert_allclose(lp.token_logprobs, expected.logprobs, atol=1e-5)
        assert [len(top) for top in lp.top_logprobs] == [3] * len(expected.tokens)
        assert lp.text_offset == list(range(len(expected.tokens)))
    assert r.usage.prompt_tokens == 4
    assert r.usage.completion_tokens == sum(len(e.tokens) for e in ref)


def test_streamed_chunks_join_to_the_completion(client, llm):
    prompts = ["ABCD", "hello0"]
    refs = [solo(llm, p, max_new_tokens=30, temperature=0.7, seed=5, n=2, logprobs=1)
            for p in prompts]
    stream = client.completions.create(
        model="tiny", prompt=prompts, max_tokens=30, temperature=0.7, seed=5, n=2, logprobs=1,
        stream=True, stream_options={"include_usage": True})
    texts, logprobs, reasons, chunks, usage = {}, {}, {}, 0, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for c in chunk.choices:
            chunks += 1
            assert c.index not in reasons, "a chunk after the choice's finish reason"
            texts[c.index] = texts.get(c.index, "") + c.text
            logprobs.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    expected = [r for ref in refs for r in ref]  # prompt-major, then samples: OpenAI's order
    assert chunks > len(expected), "the text came in one piece: not streamed"
    assert texts == {i: e.text for i, e in enumerate(expected)}
    assert reasons == {i: "length" for i in range(len(expected))}
    for i, e in enumerate(expected):
        np.testing.assert_allclose(logprobs[i], e.logprobs, atol=1e-5)
    assert usage.completion_tokens == 4 * 30 and usage.prompt_tokens == 4 + 6


def test_token_id_prompts_and_models(client, llm, config):
    ref = solo(llm, "ABC", max_new_tokens=12, temperature=0.0)
    r = client.completions.create(model="tiny", prompt=[TOKENIZER.encode("ABC")] * 2,
                                  max_tokens=12, temperature=0)
    assert [c.text for c in r.choices] == [ref[0].text] * 2
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert models[0].model_extra["max_model_len"] == config.max_seq_len


def test_logit_bias_and_min_tokens_reach_the_sampler(client, llm):
    forced = client.completions.create(model="tiny", prompt="AB", max_tokens=6,
                                       logit_bias={str(TOKENIZER.encode("Z")[0]): 100})
    assert forced.choices[0].text == "Z" * 6
    ref = solo(llm, "ABCD", max_new_tokens=30, temperature=0.0)[0].text
    stop = ref[3:5]  # met at token 5, ignored inside min_tokens = 10
    kept = solo(llm, "ABCD", max_new_tokens=30, temperature=0.0, stop=[stop], min_tokens=10)
    r = client.completions.create(model="tiny", prompt="ABCD", max_tokens=30, temperature=0,
                                  stop=stop, extra_body={"min_tokens": 10})
    assert r.choices[0].text == kept[0].text and len(kept[0].text) > 5
    assert r.choices[0].finish_reason == ("stop" if kept[0].finish_reason == "stop" else
                                          "length")


# ---------------------------------------------------------------------- 2. under load

def test_64_concurrent_streams_each_equal_its_solo_result(url, llm):
    rng = np.random.default_rng(0)
    letters = [chr(ord("0") + i) for i in range(64)]
    requests = [("".join(rng.choice(letters, int(rng.integers(1, 40)))),
                 int(rng.integers(1, 60)), int(rng.integers(0, 2**31))) for _ in range(64)]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

    async def one(prompt, max_tokens, seed):
        text, reason = "", None
        stream = await client.completions.create(model="tiny", prompt=prompt,
                                                 max_tokens=max_tokens, temperature=0.8,
                                                 seed=seed, stream=True)
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def all_of_them():
        async with client:
            # a bound against a hang, not a speed test: ~30 s idle, over 120 s at load 8-10
            return await asyncio.wait_for(asyncio.gather(*(one(*r) for r in requests)), 300)

    tick = time.perf_counter()
    results = asyncio.run(all_of_them())
    print("server", time.perf_counter() - tick)
    tick = time.perf_counter()
    for (prompt, max_tokens, seed), (text, reason) in zip(requests, results):
        ref = solo(llm, prompt, max_new_tokens=max_tokens, temperature=0.8, seed=seed)[0]
        assert (text, reason) == (ref.text, "length"), prompt
    print("solo", time.perf_counter() - tick)
    assert metric(url, "gpt_jax:kv_pages_used") == 0
    assert metric(url, "gpt_jax:kv_pages_free") == metric(url, "gpt_jax:kv_pages_total")
    assert metric(url, "gpt_jax:num_requests_running") == 0
    assert metric(url, "gpt_jax:time_to_first_token_seconds_count") >= 64


def test_speculative_requests_served_together_return_the_tokens_of_speculation_off(url):
    """Greedy requests with n-gram speculation (k = 3: one program width) sent at once with
    the same requests without it, some with a stop string or max_tokens landing inside the text:
    each speculative answer (text, finish reason, token count) is the one without, and
    drafts were accepted on the way (`/metrics`)."""
    prompts = ["0123012301230123", "ABCDABCDAB", "hello0hello0hel", "9a8b7c6d"]

    async def one(client, prompt, fields):
        r = await client.completions.create(model="tiny", prompt=prompt, temperature=0,
                                            **fields)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    def send(requests):
        async def all_of_them():
            async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY,
                                          max_retries=0) as client:  # a bound against a hang
                return await asyncio.wait_for(
                    asyncio.gather(*(one(client, *r) for r in requests)), 600)
        return asyncio.run(all_of_them())

    full = send([(p, {"max_tokens": 40}) for p in prompts])
    variants = [(p, {"max_tokens": 40}) for p in prompts]
    variants += [(p, {"max_tokens": 40, "stop": text[6:9]}) for p, (text, _, _) in
                 zip(prompts, full)] + [(p, {"max_tokens": 13}) for p in prompts[:2]]
    accepted = metric(url, "gpt_jax:spec_decode_num_accepted_tokens")
    spec = {"speculative": "ngram", "num_speculative_tokens": 3}
    answers = send([(p, dict(f, extra_body=extra)) for extra in (None, spec)
                    for p, f in variants])
    off, on = answers[:len(variants)], answers[len(variants):]
    assert sum(reason == "stop" for _, reason, _ in off) >= 3  # stops inside the text
    assert on == off
    # drafts were accepted (fewer than verified drafts would allow: the cost-aware switch
    # pauses a row whose expected tokens per verification do not beat its cost on CPU,
    # `inference.spec_cost`)
    assert metric(url, "gpt_jax:spec_decode_num_accepted_tokens") > accepted + 10


# ---------------------------------------------------------------------- 3. errors

def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", 5, "is out of range; allowed: numbers in [0, 2]"),
    ("top_p", -0.1, "is out of range; allowed: numbers in [0, 1]"),
    ("max_tokens", -1, "is out of range; allowed: integers in [1, "),
    ("max_tokens", 0, "is out of range; allowed: integers in [1, "),  # vLLM refuses 0 too
    ("n", 0, "is out of range; allowed: integers in [1, "),
    ("logprobs", 21, "is out of range; allowed: integers in [0, 20]"),
    ("seed", -3, "is out of range; allowed: integers in [0, "),
    ("presence_penalty", 3, "is out of range; allowed: numbers in [-2, 2]"),
    ("stop", [""], "non-empty strings"),
    ("logit_bias", {"3": 101}, "[-100, 100]"),
    ("logit_bias", {"64": 1}, "vocab_size is 64"),
    ("logit_bias", {"x": 1}, "not a token id"),
    ("min_tokens", 20, "max_tokens=16"),
    ("temprature", 0.5, "unknown field"),
    ("top_k", 2**31, "allowed: integers in [-1, 2147483647]"),  # once crashed the engine thread
    ("logit_bias", {"\u00b2": 1}, "not a token id"),  # '²'.isdigit() but not int('²')
    ("max_tokens", "5", "is not an integer"), ("max_tokens", True, "is not an integer"),
    ("stream", "yes", "valid boolean"),
    ("prompt", [1.5], "a list of token ids"), ("stop", [None], "a list of them"),
    ("echo", True, "not supported"),
    ("speculative", "draft", "--draft-run-dir DIR"),  # named only Engine(..., draft=...)
])
def test_a_bad_field_is_a_400_naming_it_and_what_is_allowed(url, field, value, allowed):
    r = httpx.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": "tiny", "prompt": "AB", field: value})
    assert r.status_code == 400
    error = error_of(r)
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert allowed in error["message"]
    if field not in ("temprature", "logit_bias", "prompt", "stop", "echo"):
        assert f"{field}=" in error["message"]


@pytest.mark.parametrize("field, sent, said", [
    ("temperature", '"hot"', 'temperature="hot" is not a number; allowed: numbers in [0, 2]'),
    ("temperature", "NaN", "temperature=NaN is not a finite number; allowed: numbers in [0, 2]"),
    ("top_p", "Infinity", "top_p=Infinity is not a finite number; allowed: numbers in [0, 1]"),
    ("min_p", "true", "min_p=true is not a number; allowed: numbers in [0, 1]"),
    ("repetition_penalty", "NaN",
     "repetition_penalty=NaN is not a finite number; allowed: numbers in (0, inf)"),
    ("presence_penalty", "-Infinity",
     "presence_penalty=-Infinity is not a finite number; allowed: numbers in [-2, 2]"),
    ("frequency_penalty", '"0.5"',
     'frequency_penalty="0.5" is not a number; allowed: numbers in [-2, 2]'),
    # a new user's trial: these said pydantic's "Input should be greater than or equal to 0"
    ("temperature", "-1", "temperature=-1 is out of range; allowed: numbers in [0, 2]"),
    ("top_p", "1.5", "top_p=1.5 is out of range; allowed: numbers in [0, 1]"),
    ("n", "0", "n=0 is out of range; allowed: integers in [1, 2147483647]"),
    ("n", '"two"', 'n="two" is not an integer; allowed: integers in [1, 2147483647]'),
    ("seed", "-1", "seed=-1 is out of range; allowed: integers in [0, 4294967295]"),
    ("logprobs", "21", "logprobs=21 is out of range; allowed: integers in [0, 20]"),
    ("max_tokens", "-1", "max_tokens=-1 is out of range; allowed: integers in [1, 2147483647]"),
])
def test_a_number_field_s_bad_value_is_a_400_naming_value_and_what_is_allowed(url, field,
                                                                              sent, said):
    """Fault: `"temperature": "hot"` was "invalid: Input should be a valid number" (nothing
    allowed said), and NaN (which Python's json writes) got pydantic's "greater than or
    equal to 0". Sent as raw text: httpx refuses to write NaN."""
    r = httpx.post(f"{url}/v1/completions", content=f'{{"prompt": "AB", "{field}": {sent}}}',
                   headers={"Authorization": f"Bearer {KEY}",
                            "Content-Type": "application/json"})
    assert r.status_code == 400
    error = error_of(r)
    assert (error["param"], error["message"]) == (field, said)
    codes = {"is not a": "invalid_type", "out of range": "invalid_value"}
    assert error["code"] == next((c for k, c in codes.items() if k in said and
                                  "finite" not in said), None)


def test_request_errors_have_openai_shape(url, config):
    auth = {"Authorization": f"Bearer {KEY}"}
    post = lambda body, **kw: httpx.post(f"{url}/v1/completions", json=body,  # noqa: E731
                                         headers=kw.get("headers", auth))
    over = post({"prompt": "A" * 100, "max_tokens": 50})
    assert over.status_code == 400
    assert error_of(over)["code"] == "context_length_exceeded"
    assert error_of(over)["message"] == (  # no context_overflow="crop" hint: the API has none
        "prompt 0: prompt length 100 + max_tokens 50 = 150 exceeds the model's max_seq_len 128; "
        "allowed: a sum of at most 128")
    oov = post({"prompt": [[1, 2, config.vocab_size]]})
    assert over.status_code == 400 and str(config.vocab_size) in error_of(oov)["message"]
    bad_char = post({"prompt": "hello world"})  # ' ' is not in the vocabulary
    assert bad_char.status_code == 400 and error_of(bad_char)["param"] == "prompt"
    assert post({"prompt": []}).status_code == 400
    missing = post({"max_tokens": 3})
    assert missing.status_code == 400 and error_of(missing)["param"] == "prompt"
    bad_json = httpx.post(f"{url}/v1/completions", content=b"{not json", headers=auth)
    assert bad_json.status_code == 400 and "JSON" in error_of(bad_json)["message"]
    not_object = post([1, 2])
    assert not_object.status_code == 400 and "JSON object" in error_of(not_object)["message"]
    empty = post({"prompt": ["AB", ""]})  # no BOS to start it from: test_chat_llama has one
    assert empty.status_code == 400 and error_of(empty)["message"] == (
        "prompt 1 is empty: the text '' encodes to no tokens (this tokenizer adds no BOS); a "
        "prompt needs at least one token")
    assert error_of(post({"prompt": [[1], []]}))["message"] == (
        "prompt 1 is empty; a prompt needs at least one token")
    huge = httpx.post(f"{url}/v1/completions", headers=auth,
                      content=b'{"prompt": "' + b"A" * (9 << 20) + b'"}')
    assert huge.status_code == 413 and error_of(huge)["code"] == "request_too_large"
    model = post({"model": "gpt-4", "prompt": "AB"})
    assert model.status_code == 404 and error_of(model)["code"] == "model_not_found"
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        denied = post({"prompt": "AB"}, headers=headers)
        assert denied.status_code == 401 and error_of(denied)["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    chat = httpx.post(f"{url}/v1/chat/completions", headers=auth,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and error_of(chat)["code"] == "chat_template_missing"
    assert httpx.get(f"{url}/v2/nothing").status_code == 404
    assert error_of(httpx.get(f"{url}/v2/nothing"))["type"] == "not_found"


@pytest.mark.parametrize("request_, param, code, message", [
    (dict(prompt="A" * 100, max_tokens=50), "max_tokens", "context_length_exceeded",
     "prompt 0: prompt length 100 + max_tokens 50 = 150 exceeds the model's max_seq_len 128; "
     "allowed: a sum of at most 128"),
    (dict(prompt=["AB", "A" * 128], max_tokens=1), "prompt", "context_length_exceeded",
     "prompt 1: prompt length 128 leaves no room for a new token in the model's max_seq_len "
     "128; allowed: prompt length + max_tokens 1 at most 128"),
    (dict(prompt="AB", logit_bias={"64": 1}), "logit_bias", "invalid_value",
     "prompt 0: logit_bias id 64 is outside [0, 64) (the model's vocab_size is 64)"),
    (dict(prompt=[[1, 2], [3, 64]]), "prompt", "invalid_value",
     "prompt 1: token id 64 is outside [0, 64) (the model's vocab_size is 64)"),
    (dict(prompt="AB", max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens",
     "invalid_value", "min_tokens=5 is more than max_tokens=4; allowed: 0 <= min_tokens <= "
     "max_tokens"),
], ids=["max_tokens-past-context", "prompt-fills-context", "logit_bias-id", "prompt-token-id",
        "min_tokens"])
def test_the_openai_client_reads_param_and_code_of_a_refused_request(client, request_, param,
                                                                      code, message):
    """The engine's checks (`inference.validation`, `SamplingParams`) reach the client as
    OpenAI errors: the API's field names, the error's code, no "crop" hint (the API has no
    context_overflow), the prompt named by its index."""
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model="tiny", **request_)
    error = raised.value
    assert (error.status_code, error.param, error.code) == (400, param, code)
    assert error.type == "invalid_request_error" and error.body["message"] == message


class GatedEngine(Engine):
    """The real Engine, whose steps wait for permits: the test decides when it runs."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.permits = threading.Semaphore(0)

    def step(self):
        self.permits.acquire()
        return super().step()


def test_503_while_loading_then_429_with_retry_after_when_the_queue_is_full(config, params):
    loaded = threading.Event()
    engines = []

    def load():
        loaded.wait(60)
        engines.append(GatedEngine(params, config, TOKENIZER, max_slots=1))
        return engines[0]

    cfg = ServerConfig("tiny", max_queue=1)
    with running(load, cfg) as base:
        starting = httpx.post(f"{base}/v1/completions", json={"prompt": "AB"})
        assert starting.status_code == 503 and "Retry-After" in starting.headers
        assert error_of(starting)["type"] == "service_unavailable"
        assert httpx.get(f"{base}/health").status_code == 503
        loaded.set()
        wait_ready(base)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        with concurrent_requests(client, 2, max_tokens=4) as results:
            try:
                deadline = time.monotonic() + 30  # both accepted: 1 slot + 1 in the queue
                while metric(base, "gpt_jax:num_completions_in_flight") < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                full = httpx.post(f"{base}/v1/completions", json={"prompt": "AB"})
                assert full.status_code == 429 and full.headers["Retry-After"] == "1"
                assert error_of(full)["code"] == "rate_limit_exceeded"
                with pytest.raises(openai.RateLimitError):
                    client.completions.create(model="tiny", prompt="AB")
            finally:
                engines[0].permits.release(100)
        assert [r.choices[0].finish_reason for r in results] == ["length"] * 2
        assert metric(base, "gpt_jax:num_completions_in_flight") == 0
        assert httpx.post(f"{base}/v1/completions", json={"prompt": "AB"}).status_code == 200


@contextlib.contextmanager
def concurrent_requests(client, count, **fields):
    """`count` completions sent from threads; the list of responses is filled on exit."""
    results = [None] * count

    def send(i):
        results[i] = client.completions.create(model="tiny", prompt="AB", **fields)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    try:
        yield results
    finally:
        for t in threads:
            t.join(timeout=60)


def test_a_client_that_disconnects_has_its_request_aborted_and_pages_freed(config, params):
    engines = []

    def load():
        engines.append(GatedEngine(params, config, TOKENIZER, max_slots=2))
        return engines[0]

    with running(load, ServerConfig("tiny")) as base:
        wait_ready(base)
        gate, port = engines[0].permits, int(base.rsplit(":", 1)[1])
        for streamed in (True, False):
            while gate.acquire(blocking=False):  # no permits left from the last round
                pass
            tokens_before = metric(base, "gpt_jax:generation_tokens_total")
            body = json.dumps({"prompt": "ABC", "max_tokens": 120, "stream": streamed})
            with socket.create_connection(("127.0.0.1", port), timeout=30) as raw:
                raw.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                             f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                             f"\r\n\r\n{body}").encode())
                gate.release(1)  # the prefill: pages taken, the first token out
                deadline = time.monotonic() + 30
                while metric(base, "gpt_jax:generation_tokens_total") == tokens_before:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                if streamed:
                    assert raw.recv(4096).startswith(b"HTTP/1.1 200")
                assert metric(base, "gpt_jax:kv_pages_used") > 0
            # the client has gone: one step (a chunk of 8 tokens) per 0.1 s, until the abort
            # reaches the engine (120 tokens would take 15 steps)
            while metric(base, "gpt_jax:kv_pages_used") > 0:
                assert time.monotonic() < deadline, "the disconnected request kept its pages"
                gate.release(1)
                time.sleep(0.1)
            generated = metric(base, "gpt_jax:generation_tokens_total") - tokens_before
            assert generated < 120, "the request ran to the end after its client had gone"
            assert metric(base, "gpt_jax:num_requests_running") == 0


PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}


@pytest.mark.parametrize("allowed, origin, answered", [
    (("http://page.test", "http://b.test"), "http://page.test", "http://page.test"),
    (("*",), "http://any.test", "*"),
    (("http://page.test",), "http://other.test", None),
    ((), "http://page.test", None),
], ids=["listed", "any", "refused", "same-origin-only"])
def test_a_page_on_an_allowed_origin_may_call_the_server(config, params, allowed, origin,
                                                         answered):
    """Fault (issue 41): a browser page on another origin could not call the server
    (OPTIONS answered 405, no Access-Control-* headers). `--allowed-origins` lists the
    origins whose preflight and requests are answered with them (`*`: any); by default
    none, so only the server's own page (the same origin) calls it."""
    cfg = ServerConfig("tiny", api_key=KEY, allowed_origins=allowed)
    with running(lambda: Engine(params, config, TOKENIZER, max_slots=SLOTS), cfg) as base:
        preflight = httpx.options(f"{base}/v1/completions",
                                  headers={"Origin": origin, **PREFLIGHT})
        wait_ready(base)
        models = httpx.get(f"{base}/v1/models", headers={
            "Origin": origin, "Authorization": f"Bearer {KEY}"})
    assert models.status_code == 200
    assert models.headers.get("access-control-allow-origin") == answered
    assert preflight.headers.get("access-control-allow-origin") == answered
    if answered:
        assert preflight.status_code == 200
        assert "POST" in preflight.headers["access-control-allow-methods"]
        allowed_headers = preflight.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed_headers and "content-type" in allowed_headers
    elif allowed:  # refused: starlette answers 400 without the origin, the browser stops
        assert preflight.status_code == 400
    else:  # no CORS at all
        assert preflight.status_code == 405
        assert not any(h.startswith("access-control-") for h in preflight.headers)


def test_allowed_origins_are_repeatable_or_comma_separated_and_checked():
    from inference.serve import parse_origins

    assert parse_origins(None) == ()
    assert parse_origins(["http://a.test, https://b.test:8443", "*"]) == (
        "http://a.test", "https://b.test:8443", "*")
    for bad in ("a.test", "http://a.test/", "http://a.test/page"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_origins([bad])


# ---------------------------------------------------------------------- 4. the page

def test_the_playground_page_streams_text_in_a_real_browser(url, llm):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=Service(shutil.which("chromedriver") or "chromedriver"))
    try:
        driver.get(url + "/")
        field = lambda name: driver.find_element(By.ID, name)  # noqa: E731
        for name, value in (("api_key", KEY), ("max_tokens", "40"), ("temperature", "0"),
                            ("prompt", "ROMEO0")):
            field(name).clear()
            field(name).send_keys(value)
        field("generate").click()
        WebDriverWait(driver, 60).until(lambda d: field("status").text.startswith("done"))
        expected = solo(llm, "ROMEO0", max_new_tokens=40, temperature=0.0)[0].text
        assert field("output").text == "ROMEO0" + expected
        assert field("status").text == "done (length)"
        assert field("error").text == ""
        # the text arrived in pieces: the SSE stream, not one response
        assert "stream: true" in driver.page_source or "stream:true" in driver.page_source
    finally:
        driver.quit()


def test_the_page_and_server_examples_mark_speakers_as_the_corpus_does():
    """Fault (issue 41, found by a new user): the page's default prompt and the server's
    examples began `ROMEO:`, a mark the model never saw: the corpus marks speakers `Romeo.`
    (training/demo.py's PROMPTS). Each example prompt is one of the demo's."""
    from pathlib import Path

    from inference import server
    from training.demo import PROMPTS

    root = Path(__file__).parent.parent
    page = (root / "inference" / "playground.html").read_text()
    examples = re.findall(r'<textarea id="prompt"[^>]*>([^<]*)</textarea>', page)
    for text in ((root / "README.md").read_text(), server.__doc__):
        examples += [json.loads(f'"{p}"') for groups in
                     re.findall(r'\bprompt="([^"]*)"|"prompt": "([^"]*)"', text)
                     for p in groups if p]
    assert len(examples) >= 4, examples
    assert [e for e in examples if e not in PROMPTS and e + "\n" not in PROMPTS] == []


# ---------------------------------------------------------------------- the process

def test_gpt_jax_serve_finishes_requests_in_flight_on_sigterm(tmp_path, config, params, llm):
    run_dir = save_run(tmp_path / "run", config, params)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt_jax.cli", "serve", "--run-dir", str(run_dir), "--port",
         str(port), "--max-slots", "2", "--no-warmup", "--shutdown-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"})
    base = f"http://127.0.0.1:{port}"
    try:
        # "ready" only once it listens with the model loaded (with --no-warmup it was
        # printed before uvicorn bound the port): no polling
        printed = "".join(iter_until(proc.stdout, " ready on "))
        assert " ready on " in printed, printed
        assert httpx.get(f"{base}/health").status_code == 200
        body = {"model": "run", "prompt": "ABC", "max_tokens": 100, "temperature": 0,
                "stream": True}
        text, events = "", []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            proc.send_signal(signal.SIGTERM)
            events += [line[6:] for line in lines if line.startswith("data: ")]
        assert len(events) > 2, "the stream had ended before SIGTERM: nothing was in flight"
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        text = "".join(c["text"] for c in chunks)
        assert text == solo(llm, "ABC", max_new_tokens=100, temperature=0.0)[0].text
        assert chunks[-1]["finish_reason"] == "length"
        # a clean drain exits 0 (uvicorn re-raised the signal it drained for: 143)
        assert proc.wait(timeout=30) == 0
        said = proc.stdout.read()
        assert "Traceback" not in said
        assert ("gpt-jax serve: SIGTERM: draining (no new connections; the requests in "
                "flight finish, for at most 60 s), then exiting") in said, said
        with pytest.raises(httpx.TransportError):  # no longer admitting
            httpx.get(f"{base}/health")
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_while_the_programs_compile_stops_with_one_line(tmp_path, config, params,
                                                                 sig, status):
    """Fault (a new user's trial): SIGTERM or Ctrl-C while `gpt-jax serve` compiled its
    programs at start-up crashed it (exit 139, or 134 after "terminate called after
    throwing ..." or "FATAL: exception not rethrown"): the interpreter shut down with the
    loading thread inside XLA's compiler. Now one line and the signal's status."""
    run_dir = save_run(tmp_path / "run", config, params)
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt_jax.cli", "serve", "--run-dir", str(run_dir), "--port",
         str(free_port()), "--max-slots", "2"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        printed = "".join(iter_until(proc.stdout, "preparing the engine's programs"))
        assert "preparing" in printed, printed
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == status
        assert "programs compiled" not in proc.stdout.read()  # it was still compiling
        stderr = proc.stderr.read()
        assert stderr.splitlines()[-1] == \
            f"gpt-jax serve: {sig.name} while the model was loading; stopped", stderr
        assert "Traceback" not in stderr and "terminate" not in stderr, stderr
    finally:
        if proc.poll() is None:
            proc.kill()


def iter_until(lines, mark: str):
    """`lines` up to and including the first that contains `mark` (all of them if none)."""
    for line in lines:
        yield line
        if mark in line:
            return


@pytest.mark.parametrize("warmup", [[], ["--no-warmup"]], ids=["warmup", "no-warmup"])
def test_serve_on_a_port_in_use_exits_1_naming_it_before_loading(tmp_path, config, params,
                                                                 warmup):
    """Fault (issue 41, found by a new user): on a port in use, `gpt-jax serve` compiled,
    then aborted (exit 134, "terminate called after throwing ..."); with --no-warmup it
    printed "ready" first. The port is now taken before anything loads."""
    run_dir = save_run(tmp_path / "run", config, params)
    with taken_port() as port:
        done = subprocess.run(
            [sys.executable, "-m", "gpt_jax.cli", "serve", "--run-dir", str(run_dir),
             "--port", str(port), *warmup], capture_output=True, text=True, timeout=300,
            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert (done.returncode, done.stdout) == (1, ""), done
    assert done.stderr == f"gpt-jax serve: port {port} on 127.0.0.1 is in use\n"


@pytest.mark.parametrize("flags, message", [
    (["--port", "99999"], r"--port must be in \[1, 65535\], got 99999$"),
    (["--max-queue", "-1"], r"--max-queue must be >= 0, got -1$"),
    (["--max-prefill-tokens", "0"], r"--max-prefill-tokens must be >= 1, got 0$"),
    (["--kv-cache-bytes", "10"], r"--kv-cache-bytes 10 holds no KV page; one page of \d+ "
                                 r"tokens takes \d+ bytes$"),
    (["--run-dir", "{empty}"], r"config\.json"),
    (["--shutdown-timeout", "-1"], r"--shutdown-timeout must be >= 0 \(seconds\), got -1$"),
    (["--served-model-name", ""], r"--served-model-name '' is empty; allowed: the model id "
                                  r"clients send, or no flag for the directory's name$"),
], ids=["port", "max-queue", "max-prefill-tokens", "kv-cache-bytes", "not-a-run",
        "shutdown-timeout", "served-model-name"])
def test_serve_refuses_bad_flags_and_models_before_it_listens(tmp_path, config, params,
                                                              monkeypatch, flags, message):
    """Fault (found by a new user): --port 99999 listened on 34463 (99999 - 65536) while
    it printed 99999, and a directory that is not a run, or a page pool too small, started
    a server that answered 500 to everything and printed nothing; a later trial: a negative
    --shutdown-timeout and an empty --served-model-name were accepted, and the page pool's
    error named the Python parameter `kv_cache_bytes=`. Each now stops the command, naming
    the flag and value, before uvicorn starts."""
    from inference import serve

    run_dir = save_run(tmp_path / "run", config, params)
    (tmp_path / "empty").mkdir()
    monkeypatch.setattr(serve._Uvicorn, "run",
                        lambda *a, **k: pytest.fail("the server started"))
    argv = ["--run-dir", str(run_dir), "--no-warmup", "--port", str(free_port())]
    argv += [f.format(empty=tmp_path / "empty") for f in flags]
    with pytest.raises(SystemExit, match=r"^gpt-jax serve: .*" + message):
        serve.main(argv)


def test_the_request_model_bounds_each_field_as_sampling_params_does():
    """One range per field, in inference/sampling_params.py (`RANGES`): the server's request model
    takes its bounds from there; it differs only where the API does (temperature at most 2,
    as OpenAI documents; top_k -1 = off and max_tokens at least 1, as vLLM)."""
    from inference.sampling_params import API_MAX_TEMPERATURE, RANGES
    from inference.api import CompletionRequest

    api_names = {"max_tokens": "max_new_tokens"}
    differs = {"temperature": {"le": API_MAX_TEMPERATURE}, "top_k": {"ge": -1},
               "max_tokens": {"ge": 1}}
    checked = set()
    for name, field in CompletionRequest.model_fields.items():
        engine_name = api_names.get(name, name)
        if engine_name not in RANGES:
            continue
        range_ = RANGES[engine_name]
        expected = {"gt" if range_.low_open else "ge": range_.low}
        if range_.high != float("inf"):
            expected["le"] = range_.high
        expected |= differs.get(name, {})
        bounds = {key: getattr(m, key) for m in field.metadata for key in ("ge", "gt", "le")
                  if hasattr(m, key)}
        assert bounds == expected, name
        checked.add(engine_name)
    assert checked == set(RANGES)  # every numeric field the API has
