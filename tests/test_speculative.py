"""Speculative decoding (`inference.speculative`): greedy tokens identical to decoding
without it (random models, k = 1..5 in one batch, stops and max_new_tokens inside accepted
runs), the sampled distribution equal to non-speculative sampling (chi-square over
thousands of samples, failing on a planted wrong residual rule), seeded reproduction, the
n-gram proposal and the adaptive draft length by hand, and the request checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from gpt_jax import GPTConfig
from inference import SamplingParams, generate, spec_cost, speculative
from inference.errors import RequestError
from tests.conftest import lively_params

GREEDY = dict(temperature=0.0)


def _spec(k, **kw):
    return SamplingParams(speculative="ngram", num_speculative_tokens=k, **kw)


@pytest.fixture(scope="module", params=[("tiny", 3.0), ("tiny-llama", 2.0)])
def model(request):
    """Random models scaled so greedy output falls into loops now and then (the drafts are
    accepted often, and refused often)."""
    name, scale = request.param
    config = GPTConfig.preset(name)
    return lively_params(config, scale=scale), config


@pytest.fixture(scope="module")
def greedy_runs(model):
    """Off and on (k = 1..5 over the rows), with rows whose EOS ids, stop sequences and
    max_new_tokens are placed in the output of a first run of the same batch shape (one
    program for both off runs): two compiles per model."""
    params, config = model
    rng = np.random.default_rng(0)
    base = [list(map(int, rng.integers(0, config.vocab_size, 10))) for _ in range(4)]
    base[0] = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]  # a pattern the drafts find at once
    extra = ([dict(max_new_tokens=m) for m in range(2, 31, 4)]
             + [dict(stop_token_ids=(i,)) for i in range(7)]  # placeholders, set below
             + [dict(stop_sequences=((i, i),)) for i in range(5)] + [dict(logprobs=2)])
    prompts = base + [base[1]] * len(extra)
    plain = generate(params, config, prompts, SamplingParams(max_new_tokens=30, **GREEDY))
    out = plain[1].tokens
    extra[8:15] = [dict(stop_token_ids=(t,)) for t in out[2:23:3]]
    extra[15:20] = [dict(stop_sequences=(tuple(out[i:i + 2]),)) for i in range(3, 24, 5)]
    settings = [dict(max_new_tokens=30, **s) if "max_new_tokens" not in s else s
                for s in [{}] * len(base) + extra]
    off = generate(params, config, prompts, [SamplingParams(**GREEDY, **s) for s in settings])
    on = generate(params, config, prompts, [_spec(i % 5 + 1, **GREEDY, **s)
                                            for i, s in enumerate(settings)])
    return off, on, prompts, model


def _top2_gap(params, config, prompt, tokens, at):
    """The target's top-2 logit gap before generated token `at` (full forward)."""
    from gpt_jax.model import forward
    seq = jnp.asarray([prompt + tokens[:at]], jnp.int32)
    top = jnp.sort(forward(params, seq, config)[0, -1])[-2:]
    return float(top[1] - top[0])


def test_greedy_tokens_identical_with_stops_inside_accepted_runs(greedy_runs):
    off, on, prompts, (params, config) = greedy_runs
    for i, (a, b) in enumerate(zip(off, on)):
        assert (a.finish_reason, len(a.tokens)) == (b.finish_reason, len(b.tokens)), i
        if a.tokens != b.tokens:  # only a rounding tie may differ: show the gap is one
            at = next(j for j, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y)
            assert _top2_gap(params, config, prompts[i], a.tokens, at) < 1e-4, (i, at)
    assert sum(a.tokens == b.tokens for a, b in zip(off, on)) >= len(off) - 1
    counts = [c.speculation for c in on]
    assert all(c is not None for c in counts)
    assert sum(c["accepted"] for c in counts) >= 10  # drafts were accepted, not all refused
    # runs of accepted drafts: fewer forward steps than tokens in the stopped rows
    assert sum(len(c.tokens) - c.speculation["steps"] for c in on[4:]) >= 10
    assert {c.finish_reason for c in on[4:]} == {"length", "eos", "stop"}


def test_logprobs_from_the_target(greedy_runs):
    off, on, _, _ = greedy_runs
    np.testing.assert_allclose(on[-1].logprobs, off[-1].logprobs, atol=1e-4)
    assert [sorted(d) for d in on[-1].top_logprobs] == [sorted(d) for d in off[-1].top_logprobs]


# ------------------------------------------------------------------ sampling distribution

SMALL = GPTConfig(vocab_size=8, max_seq_len=32, n_layers=1, n_heads=2, d_model=16)
N_SAMPLES = 2000
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7] * 2  # every token has a 1-gram match: a draft
TRANSFORMS = dict(temperature=0.9, top_k=6, repetition_penalty=1.3, presence_penalty=0.3,
                  logit_bias={3: 1.0}, max_new_tokens=3)


def _first_tokens(params, speculative_on, seed):
    """The first 3 tokens of N_SAMPLES samples (one request, n = N_SAMPLES: every sample
    draws from its own key), and the speculative counts summed over them. The first token
    comes with the prefill; k = 2 drafts decide the next two."""
    sp = dict(TRANSFORMS, n=N_SAMPLES, seed=seed)
    sp = _spec(2, **sp) if speculative_on else SamplingParams(**sp)
    out = generate(params, SMALL, [PROMPT], sp)
    counts = {key: sum(c.speculation[key] for c in out) for key in ("drafted", "accepted")
              } if speculative_on else None
    return np.array([c.tokens for c in out]), counts


def _p_value(a, b, V=SMALL.vocab_size):
    """Chi-square homogeneity p-value of the token triples' distribution in `a` and `b`
    (`[samples, 3]`): the smallest over the second and third tokens' marginals and the
    joints of the first two and of the last two, cells with few counts pooled."""
    p_values = []
    for cells in (lambda x: x[:, 1], lambda x: x[:, 2], lambda x: x[:, 0] * V + x[:, 1],
                  lambda x: x[:, 1] * V + x[:, 2]):
        table = np.stack([np.bincount(cells(a), minlength=V * V),
                          np.bincount(cells(b), minlength=V * V)])
        rare = table.sum(0) < 20
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], 1)
        table = table[:, table.sum(0) > 0]
        p_values.append(scipy_stats.chi2_contingency(table)[1])
    return min(p_values)


@pytest.fixture(scope="module")
def samples():
    """Non-speculative and speculative samples (different seeds: independent draws)."""
    params = lively_params(SMALL, seed=3, scale=2.0)
    return params, _first_tokens(params, False, seed=11)[0], _first_tokens(params, True, 12)


def test_sampled_distribution_equals_non_speculative_and_seed_reproduces(samples):
    params, off, (on, counts) = samples
    assert _p_value(off, on) > 1e-3
    np.testing.assert_array_equal(_first_tokens(params, True, seed=12)[0], on)
    # the drafts were tested: accepted often, and refused often
    assert counts["accepted"] > 100 and counts["drafted"] - counts["accepted"] > 100
    assert counts["drafted"] > N_SAMPLES / 2


def planted_residual_p_value(monkeypatch, off, sample) -> float:
    """`_p_value` of `off` against the tokens `sample()` draws with a planted fault: after a
    refused draft, draw from p itself instead of max(0, p - q) (the draft's own token stays
    possible). The chi-square tests of speculative sampling must see the difference."""
    monkeypatch.setattr(speculative, "residual_probs", lambda p_V, q_V: p_V)
    jax.clear_caches()  # the right rule's program is cached
    try:
        planted = sample()
    finally:
        jax.clear_caches()
    return _p_value(off, planted)


def test_chi_square_catches_a_wrong_residual_rule(samples, monkeypatch):
    """Planted (`planted_residual_p_value`): the test above must see the difference."""
    params, off, _ = samples
    sample = lambda: _first_tokens(params, True, seed=12)[0]  # noqa: E731
    assert planted_residual_p_value(monkeypatch, off, sample) < 1e-6


# ------------------------------------------------------------------ parts by hand

def test_ngram_proposal_longest_latest_match():
    window = jnp.array([[0, 0, 1, 2, 3, 9, 1, 2, 3, 4, 1, 2],   # "1 2" -> latest: 3 4 1 2
                        [0, 0, 0, 0, 0, 0, 0, 0, 5, 6, 7, 8],   # no repeat
                        [4, 7, 4, 7, 5, 5, 5, 5, 5, 1, 4, 7]], jnp.int32)  # n = 2 only
    n_hist = jnp.array([10, 4, 12])
    drafts, available = speculative.ngram_propose(window, n_hist, jnp.array([1, 1, 2]),
                                                  jnp.array([3, 3, 2]), width=3)
    assert available.tolist() == [3, 0, 3]
    assert drafts[0].tolist() == [3, 4, 1] and drafts[2].tolist() == [5, 5, 5]


def test_a_long_ngram_finds_the_copied_passage_a_short_one_misses():
    """Character-level text repeats short n-grams everywhere: the latest "1 2 3" is not the
    copied passage's, the 4-gram "5 1 2 3" is (n up to MAX_NGRAM = 8)."""
    passage = [5, 1, 2, 3, 6, 7, 8]
    window = jnp.array([[0, 4, 4, *passage, 9, 1, 2, 3, 4, 4, 5, 1, 2, 3]], jnp.int32)
    n_hist = jnp.array([window.shape[1]])
    short, _ = speculative.ngram_propose(window, n_hist, jnp.array([1]), jnp.array([3]), 3)
    long, k = speculative.ngram_propose(window, n_hist, jnp.array([1]), jnp.array([8]), 3)
    assert short[0].tolist() == [4, 4, 5] and long[0].tolist() == [6, 7, 8] and int(k[0]) == 3


def test_adaptive_draft_length_pauses_and_recovers():
    arrays = speculative.SpecArrays(k_max=jnp.array([3]), ngram_min=jnp.array([1]),
                                    ngram_max=jnp.array([3]))
    spec = speculative.SpecState.init(arrays)
    one = jnp.array([True])
    for _ in range(3):  # three refused drafts: k 3 -> 0, the row pauses
        spec = speculative.adapt(spec, arrays, spec.k, jnp.array([0]), one)
    assert (int(spec.k[0]), int(spec.pause[0])) == (1, speculative.PAUSE_START)
    spec = speculative.adapt(spec, arrays, jnp.array([0]), jnp.array([0]), one)
    assert int(spec.pause[0]) == speculative.PAUSE_START - 1
    spec = speculative.adapt(spec.replace(pause=jnp.array([0])), arrays, jnp.array([1]),
                             jnp.array([1]), one)  # all accepted: k grows again
    assert (int(spec.k[0]), int(spec.accepted[0]), int(spec.drafted[0])) == (2, 1, 3 + 2 + 1 + 1)


def test_cost_aware_switch_pauses_unprofitable_rows_only():
    """Two rows accepting half their drafts (1.9 expected tokens per verification at k = 3):
    the row whose verification costs 3 decode steps pauses, long enough for a probe to lose
    at most PROBE_LOSS of the wait; the one at cost 1 keeps drafting. The ratio follows the
    calibration (1 at T = 1, dearer for small models than for the GPT-2 shape)."""
    arrays = speculative.SpecArrays(k_max=jnp.array([3, 3]), ngram_min=jnp.array([1, 1]),
                                    ngram_max=jnp.array([3, 3]), cost=jnp.array([3.0, 1.0]))
    spec = speculative.SpecState.init(arrays).replace(rate=jnp.array([0.5, 0.5]))
    spec = speculative.adapt(spec, arrays, jnp.array([2, 2]), jnp.array([1, 1]),
                             jnp.array([True, True]))
    expected = float(spec_cost.expected_tokens(0.5, 3))
    assert spec.pause.tolist() == [int(np.ceil((3.0 - expected) / speculative.PROBE_LOSS)), 0]
    assert spec.k.tolist() == [3, 3] and spec.backoff.tolist() == [
        2 * speculative.PAUSE_START, speculative.PAUSE_START]
    small, gpt2 = GPTConfig.preset("shakespeare-char-llama"), GPTConfig.preset("gpt2")
    assert spec_cost.verify_cost(small, 0) == 1.0
    assert spec_cost.verify_cost(small, 4) > spec_cost.verify_cost(gpt2, 4) > 1.0
    with pytest.raises(ValueError, match="width"):
        spec_cost.verify_cost(small, -1)


@pytest.mark.parametrize("field,value", [("speculative", "medusa"),
                                         ("num_speculative_tokens", 0),
                                         ("num_speculative_tokens", 9),
                                         ("prompt_lookup_max", 9), ("prompt_lookup_min", 0)])
def test_bad_settings_refused(field, value):
    with pytest.raises(RequestError, match=field):
        SamplingParams(**{field: value})
    with pytest.raises(RequestError, match="prompt_lookup_min"):
        SamplingParams(prompt_lookup_min=3, prompt_lookup_max=2)


# ------------------------------------------------------------------ the Engine

def _ngram_every_greedy_but_one_in_four(i):
    return dict(speculative="ngram", num_speculative_tokens=3 + i % 2) if i % 4 else {}


def _mixed_requests(config, rng, count, sampled_every=4,
                    speculation=_ngram_every_greedy_but_one_in_four):
    """Requests of random lengths: every `sampled_every`-th one sampled plain, the others
    greedy (some with EOS ids and stop sequences) with `speculation(i)`'s fields (by
    default n-gram, k = 3 and 4: one program width; or none)."""
    requests = []
    for i in range(count):
        prompt = rng.integers(0, config.vocab_size, int(rng.integers(2, 30))).tolist()
        sp = dict(max_new_tokens=int(rng.integers(1, 40)), seed=i)
        if i % sampled_every == sampled_every - 1:
            sp |= dict(temperature=0.9, top_k=20, frequency_penalty=0.3)
        else:
            sp |= dict(temperature=0.0, stop_token_ids=[int(rng.integers(0, 64))] * (i % 3 == 0),
                       stop_sequences=[[int(t) for t in rng.integers(0, 64, 1)]] * (i % 3 == 1))
            sp |= speculation(i)
        requests.append((f"r{i}", prompt, SamplingParams(**sp)))
    return requests


def test_engine_mixed_requests_with_preemption_equal_each_alone():
    from inference import Engine
    config = GPTConfig.preset("tiny-llama")
    params = lively_params(config, scale=2.0)
    rng = np.random.default_rng(0)
    requests = _mixed_requests(config, rng, 40)
    engine = Engine(params, config, max_slots=2, num_pages=20, page_size=4)
    finals = run_arriving(engine, requests, rng)
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["free_pages"] == stats["total_pages"]
    assert 0.2 < stats["spec_acceptance_rate"] <= 1 and stats["spec_tokens_per_verification"] > 1.5
    # rows of one generate call are independent: each is its request alone
    alone = generate(params, config, [p for _, p, _ in requests], [s for *_, s in requests])
    assert_each_alone(finals, requests, alone)


def run_arriving(engine, requests, rng) -> dict:
    """Run `requests` (`_mixed_requests`) on `engine`, added in order at random steps
    (before each step, the next one with probability 0.4, again while it comes up), until
    all finish. Returns each request's final RequestOutput by request id."""
    pending, finals = list(requests), {}
    while pending or engine.has_unfinished_requests():
        while pending and rng.random() < 0.4:
            engine.add_request(*pending.pop(0))
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    return finals


def assert_each_alone(finals, requests, alone) -> None:
    """Each request's final output (`run_arriving`) has the tokens and finish reason of its
    row of `alone` (one `generate` call's outputs, in the order of `requests`)."""
    for (request_id, _, _), ref in zip(requests, alone):
        assert finals[request_id].token_ids == ref.tokens, request_id
        assert finals[request_id].finish_reason == ref.finish_reason, request_id


def test_server_fields_and_metrics():
    """The request body's fields reach SamplingParams (bad ones are a 400 naming the field),
    and /metrics carries the engine's acceptance counters."""
    import prometheus_client as prom
    from inference import Engine, api
    from inference.metrics import Metrics
    body = api.CompletionRequest(prompt="x", speculative="ngram", num_speculative_tokens=2,
                                 prompt_lookup_max=2)
    sp = api._sampling(body, 8, None, [])
    assert (sp.speculative, sp.num_speculative_tokens, sp.prompt_lookup_max) == ("ngram", 2, 2)
    with pytest.raises(api.APIError, match="speculative"):
        api._sampling(api.CompletionRequest(prompt="x", speculative="medusa"), 8, None, [])
    config = GPTConfig.preset("tiny")
    engine = Engine(lively_params(config), config, max_slots=2)
    stats = engine.stats()
    assert stats["spec_acceptance_rate"] == 0.0 and stats["spec_drafted_tokens"] == 0
    metrics = Metrics()
    metrics.update(stats, engine.page_size, 0.0, 0)
    text = prom.generate_latest(metrics.registry).decode()
    assert "gpt_jax:spec_decode_draft_acceptance_rate 0.0" in text
