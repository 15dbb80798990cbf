"""Speculative decoding with a draft model (`inference.draft`): greedy tokens identical to
decoding without it (the target as its own draft: every draft accepted, so stops land inside
accepted runs; a perturbed copy: drafts accepted and refused; k = 1..5, batched with n-gram
and plain rows, and alone), the sampled distribution equal to non-speculative sampling
(chi-square, failing on a planted wrong residual rule), seeded
reproduction, the draft checks, and the Engine's mixed requests with preemption."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from gpt_jax import GPTConfig
from inference import SamplingParams, generate
from inference import draft as draft_model
from inference.spec_cost import round_cost
from tests.conftest import lively_params
from tests.test_speculative import (N_SAMPLES, PROMPT, SMALL, TRANSFORMS, _mixed_requests,
                                    _p_value, assert_each_alone, planted_residual_p_value,
                                    run_arriving)

GREEDY = dict(temperature=0.0)


def _draft(k, **kw):
    return SamplingParams(speculative="draft", num_speculative_tokens=k, **kw)


def _perturbed(params, scale=0.05, seed=1):
    """`params` with relative noise: a draft that agrees with the target often, not always."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x * (1 + scale * jax.random.normal(k, x.shape, x.dtype))
                                     for x, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def model():
    config = GPTConfig.preset("tiny")
    return lively_params(config, scale=3.0), config


@pytest.fixture(scope="module")
def greedy_runs(model):
    """One batch off and on: rows drafting with k = 1..5, an n-gram row and a plain row, and
    rows whose EOS ids, stop sequences and max_new_tokens are placed in the output of the
    off run. On twice: the target as its own draft, and a perturbed copy."""
    params, config = model
    rng = np.random.default_rng(0)
    base = [list(map(int, rng.integers(0, config.vocab_size, 10))) for _ in range(4)]
    plain = generate(params, config, base, SamplingParams(max_new_tokens=30, **GREEDY))
    out = plain[1].tokens
    extra = ([dict(max_new_tokens=m) for m in (3, 8, 13, 21)]
             + [dict(stop_token_ids=(t,)) for t in out[3:24:5]]
             + [dict(stop_sequences=(tuple(out[i:i + 2]),)) for i in (4, 11, 19)]
             + [dict(logprobs=2)])
    prompts = base + [base[1]] * len(extra)
    settings = [dict(max_new_tokens=30, **s) if "max_new_tokens" not in s else s
                for s in [{}] * len(base) + extra]
    kinds = [_draft(i % 5 + 1, **GREEDY, **s) for i, s in enumerate(settings)]
    kinds[2] = SamplingParams(speculative="ngram", **GREEDY, **settings[2])
    kinds[3] = SamplingParams(**GREEDY, **settings[3])
    off = generate(params, config, prompts, [SamplingParams(**GREEDY, **s) for s in settings])
    on_self = generate(params, config, prompts, kinds, draft=(params, config))
    on_near = generate(params, config, prompts, kinds, draft=(_perturbed(params), config))
    return off, on_self, on_near, prompts, kinds


def _same(off, on):
    for i, (a, b) in enumerate(zip(off, on)):
        assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason), i


def test_greedy_with_itself_as_draft_accepts_all_and_stops_inside_runs(model, greedy_runs):
    config = model[1]
    off, on, _, _, kinds = greedy_runs
    _same(off, on)
    drafted = [(c, sp.num_speculative_tokens) for c, sp in zip(on, kinds)
               if sp.speculative == "draft"]
    for c, k in drafted:  # every draft accepted; a row that stopped inside a run emitted
        s = c.speculation  # only part of its last step's
        lost = s["drafted"] - s["accepted"]
        assert lost == 0 if c.finish_reason == "length" else lost < k
        assert s["accepted"] > 0 or len(c.tokens) == 1  # (an EOS as the first token)
    # the stopped rows that keep drafting (all accepted, k + 1 tokens per round beat the
    # round's cost, its draft steps included; `spec_cost`) ran fewer forward steps than they
    # emitted tokens: their stops came inside accepted runs
    paying = [c for c, k in drafted[4:]
              if k + 1 > round_cost(config, k, config) and len(c.tokens) > 2]
    assert len(paying) >= 4
    assert all(c.speculation["steps"] < len(c.tokens) for c in paying)
    assert {c.finish_reason for c in on[4:]} == {"length", "eos", "stop"}
    np.testing.assert_allclose(on[-1].logprobs, off[-1].logprobs, atol=1e-4)


def test_greedy_with_a_different_draft_identical(greedy_runs):
    off, _, on, _, kinds = greedy_runs
    _same(off, on)
    counts = [c.speculation for c, sp in zip(on, kinds) if sp.speculative == "draft"]
    accepted = sum(c["accepted"] for c in counts)
    assert 10 <= accepted <= sum(c["drafted"] for c in counts) - 10  # accepted and refused


def test_greedy_alone_and_with_an_unrelated_draft(model, greedy_runs):
    """One row alone (its own batch shape), drafting with a random model of other sizes
    that almost never agrees (the adaptive draft length pauses it)."""
    params, config = model
    off, *_, prompts, _ = greedy_runs
    other = GPTConfig(vocab_size=config.vocab_size, max_seq_len=config.max_seq_len,
                      n_layers=1, n_heads=4, d_model=16)
    alone = generate(params, config, [prompts[0]], _draft(4, max_new_tokens=30, **GREEDY),
                     draft=(lively_params(other, seed=9, scale=3.0), other))
    _same(off[:1], alone)
    assert alone[0].speculation["drafted"] > 0


# ------------------------------------------------------------------ sampling distribution

def _first_tokens(params, draft, seed):
    """The first 3 tokens of N_SAMPLES samples of one request (n = N_SAMPLES), drafting
    with `draft` (k = 2; None: off), and the speculative counts summed over them."""
    sp = dict(TRANSFORMS, n=N_SAMPLES, seed=seed)
    if draft is None:
        return np.array([c.tokens for c in generate(params, SMALL, [PROMPT],
                                                    SamplingParams(**sp))]), None
    out = generate(params, SMALL, [PROMPT], _draft(2, **sp), draft=(draft, SMALL))
    counts = {key: sum(c.speculation[key] for c in out) for key in ("drafted", "accepted")}
    return np.array([c.tokens for c in out]), counts


@pytest.fixture(scope="module")
def samples():
    """Non-speculative and draft-speculative samples (different seeds: independent draws);
    the draft is another random model of the same shape."""
    params = lively_params(SMALL, seed=3, scale=2.0)
    draft = lively_params(SMALL, seed=4, scale=2.0)
    return (params, draft, _first_tokens(params, None, seed=11)[0],
            _first_tokens(params, draft, seed=12))


def test_sampled_distribution_equals_non_speculative_and_seed_reproduces(samples):
    params, draft, off, (on, counts) = samples
    assert _p_value(off, on) > 1e-3
    np.testing.assert_array_equal(_first_tokens(params, draft, seed=12)[0], on)
    assert counts["accepted"] > 200 and counts["drafted"] - counts["accepted"] > 200


def test_chi_square_catches_a_wrong_residual_rule(samples, monkeypatch):
    """Planted (`planted_residual_p_value`): the test above must see the difference."""
    params, draft, off, _ = samples
    sample = lambda: _first_tokens(params, draft, seed=12)[0]  # noqa: E731
    assert planted_residual_p_value(monkeypatch, off, sample) < 1e-6


# ------------------------------------------------------------------ checks

def test_draft_checks(model):
    params, config = model
    from gpt_jax.tokenizer import CharTokenizer
    smaller = GPTConfig(vocab_size=32, max_seq_len=config.max_seq_len, n_layers=1, n_heads=2,
                        d_model=16)
    with pytest.raises(ValueError, match="vocab_size 32 differs from the target's 64"):
        generate(params, config, [[1, 2]], _draft(2), draft=(lively_params(smaller), smaller))
    shorter = GPTConfig(vocab_size=64, max_seq_len=32, n_layers=1, n_heads=2, d_model=16)
    with pytest.raises(ValueError, match="max_seq_len 32 is shorter than the target's 128"):
        draft_model.check_draft(config, shorter)
    with pytest.raises(ValueError, match=r"tokenizer \(char, 3 tokens\) differs from the "
                                         r"target's \(char, 3 tokens\)"):
        draft_model.check_draft(config, config, CharTokenizer(list("abc")),
                                CharTokenizer(list("abd")))
    draft_model.check_draft(config, config, CharTokenizer(list("abc")),
                            CharTokenizer(list("abc")))
    with pytest.raises(ValueError, match="speculative='draft' needs a draft model"):
        generate(params, config, [[1, 2]], _draft(2))


# ------------------------------------------------------------------ the Engine

def _draft_or_ngram(i):
    """Draft k = 3 and 4 (one program width) for 3 in 5 greedy requests, n-gram for some."""
    if i % 5 in (0, 1, 2):
        return dict(speculative="draft", num_speculative_tokens=3 + i % 2)
    return dict(speculative="ngram", num_speculative_tokens=3) if i % 10 == 3 else {}


def test_engine_mixed_requests_with_preemption_equal_speculation_off():
    from inference import Engine
    config = GPTConfig.preset("tiny-llama")
    params = lively_params(config, scale=2.0)
    draft = (_perturbed(params, 0.1), config)
    rng = np.random.default_rng(0)
    requests = _mixed_requests(config, rng, 40, sampled_every=5, speculation=_draft_or_ngram)
    engine = Engine(params, config, max_slots=2, num_pages=20, page_size=4, draft=draft)
    finals = run_arriving(engine, requests, rng)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["free_pages"] == stats["total_pages"]
    assert 0.2 < stats["spec_acceptance_rate"] < 1 and stats["spec_tokens_per_verification"] > 1.5
    # rows of one generate call are independent: each is its request alone, here with
    # speculation off (the speculative requests are greedy: the same tokens)
    alone = generate(params, config, [p for _, p, _ in requests],
                     [dataclasses.replace(s, speculative=None) for *_, s in requests])
    assert_each_alone(finals, requests, alone)


def test_engine_sampled_draft_requests_equal_generate_and_reproduce(model):
    """Sampled requests drafting with a draft model, not preempted: the Engine's tokens are
    `generate`'s (draws keyed by seed, prompt, sample and step), twice."""
    from inference import Engine
    params, config = model
    draft = (_perturbed(params), config)
    requests = [(f"s{i}", [3 + i, 7, 11, 5 + i], _draft(3, temperature=0.8, top_p=0.9,
                                                          max_new_tokens=24, seed=i))
                for i in range(3)]
    ref = generate(params, config, [p for _, p, _ in requests], [s for *_, s in requests],
                   draft=draft)
    counts = [c.speculation for c in ref]
    assert 0 < sum(c["accepted"] for c in counts) < sum(c["drafted"] for c in counts)
    for _ in range(2):
        engine = Engine(params, config, max_slots=4, draft=draft)
        for request in requests:
            engine.add_request(*request)
        finals = {}
        while engine.has_unfinished_requests():
            finals |= {o.request_id: o for o in engine.step() if o.finished}
        assert [finals[r].token_ids for r, _, _ in requests] == [c.tokens for c in ref]


def test_engine_refuses_a_draft_request_without_a_draft_model():
    from inference import Engine
    from inference.errors import RequestError
    config = GPTConfig.preset("tiny")
    engine = Engine(lively_params(config), config, max_slots=2)
    with pytest.raises(RequestError, match="speculative='draft' needs a draft model"):
        engine.add_request("a", [1, 2], _draft(2))
    with pytest.raises(ValueError, match="without mesh and mixed_steps"):
        Engine(lively_params(config), config, mixed_steps=True,
               draft=(lively_params(config), config))


# ------------------------------------------------------------------ LLM, the server, flags

def test_server_and_llm_with_a_draft_return_the_tokens_of_speculation_off(model):
    """Greedy requests to a server whose Engine has a draft model, with and without
    speculative="draft" (some with a stop string landing inside the text), and the same
    through `LLM(..., draft=...)`: the same text and finish reason; drafts were accepted."""
    import openai
    from live_server import KEY, TOKENIZER, metric, running, wait_ready

    from inference import LLM, Engine
    from inference.server import ServerConfig
    params, config = model
    draft = (_perturbed(params), config)
    prompts = ["0123012301230123", "ABCDABCDAB", "9a8b7c6d"]
    cfg = ServerConfig("tiny", api_key=KEY, max_queue=64)
    with running(lambda: Engine(params, config, TOKENIZER, max_slots=4, draft=draft),
                 cfg) as url:
        wait_ready(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)

        def answer(prompt, **fields):
            r = client.completions.create(model="tiny", prompt=prompt, temperature=0, **fields)
            return r.choices[0].text, r.choices[0].finish_reason

        spec = dict(extra_body={"speculative": "draft", "num_speculative_tokens": 3})
        for prompt in prompts:
            text, reason = answer(prompt, max_tokens=30)
            assert answer(prompt, max_tokens=30, **spec) == (text, reason)
            stopped = answer(prompt, max_tokens=30, stop=text[9:11])
            assert stopped[1] == "stop" and answer(prompt, max_tokens=30, stop=text[9:11],
                                                   **spec) == stopped
        assert metric(url, "gpt_jax:spec_decode_num_accepted_tokens") > 20
    llm = LLM(params, config, TOKENIZER, draft=(*draft, TOKENIZER), compile_cache=False)
    texts = [[c.text for c in llm.generate(prompts, SamplingParams(
        max_new_tokens=30, **GREEDY, **kw), max_batch_size=4, progress=False)]
        for kw in ({}, dict(speculative="draft", num_speculative_tokens=3))]
    assert texts[0] == texts[1]


def test_serve_draft_flags_load_and_check_the_tokenizer(model, tmp_path):
    from live_server import TOKENIZER, save_run

    from gpt_jax import checkpoint
    from gpt_jax.tokenizer import CharTokenizer
    from inference import serve
    from inference.draft_engine import load_draft
    params, config = model
    target = save_run(tmp_path / "target", config, params)
    args = serve.parse_args(["--run-dir", str(target), "--draft-run-dir", str(target)])
    loaded, draft_config = load_draft(args, config, TOKENIZER)
    assert draft_config == config
    other = tmp_path / "other"
    save_run(other, config, params)
    checkpoint.save_tokenizer(other, CharTokenizer([chr(ord("A") + i) for i in range(64)]))
    args = serve.parse_args(["--run-dir", str(target), "--draft-run-dir", str(other)])
    with pytest.raises(ValueError, match=r"draft model's tokenizer \(char, 64 tokens\) differs"):
        load_draft(args, config, TOKENIZER)
    assert load_draft(serve.parse_args(["--run-dir", str(target)]), config, TOKENIZER) is None
    with pytest.raises(SystemExit):  # one draft source only
        serve.parse_args(["--draft-run-dir", "a", "--draft-hf-checkpoint", "b"])
