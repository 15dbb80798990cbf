"""Speculative decoding with a draft model (`inference.draft`): greedy tokens identical to
decoding without it (the target as its own draft: every draft accepted, so stops land inside
accepted runs; a perturbed copy: drafts accepted and refused; k = 1..5, batched with n-gram
and plain rows, and alone), the sampled distribution equal to non-speculative sampling
(chi-square, failing on a planted wrong residual rule and on a planted wrong q), seeded
reproduction, the draft checks, and the Engine's mixed requests with preemption."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from gpt_jax import GPTConfig
from inference import SamplingParams, generate, speculative
from inference import draft as draft_model
from tests.conftest import lively_params
from tests.test_speculative import N_SAMPLES, PROMPT, SMALL, TRANSFORMS, _p_value

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


def test_greedy_with_itself_as_draft_accepts_all_and_stops_inside_runs(greedy_runs):
    off, on, _, _, kinds = greedy_runs
    _same(off, on)
    drafted = [(c, sp.num_speculative_tokens) for c, sp in zip(on, kinds)
               if sp.speculative == "draft"]
    for c, k in drafted:  # every draft accepted; a row that stopped inside a run emitted
        s = c.speculation  # only part of its last step's
        lost = s["drafted"] - s["accepted"]
        assert lost == 0 if c.finish_reason == "length" else lost < k
        assert s["accepted"] > 0 or len(c.tokens) == 1  # (an EOS as the first token)
    # the stopped rows ran fewer forward steps than they emitted tokens: their stops came
    # inside accepted runs
    assert all(c.speculation["steps"] < len(c.tokens) for c, _ in drafted[4:]
               if len(c.tokens) > 2)
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


@pytest.mark.parametrize("plant", ["residual", "q"])
def test_chi_square_catches_a_wrong_rule(samples, monkeypatch, plant):
    """Planted: after a refused draft, draw from p itself instead of max(0, p - q); or
    verify as if the draft were certain (q one-hot at the drawn token, the n-gram rule)."""
    params, draft, off, _ = samples
    if plant == "residual":
        monkeypatch.setattr(speculative, "residual_probs", lambda p_V, q_V: p_V)
    else:
        real = draft_model.draft_distribution

        def one_hot_q(*args):
            token_B, q_BV = real(*args)
            return token_B, jax.nn.one_hot(token_B, q_BV.shape[-1])

        monkeypatch.setattr(draft_model, "draft_distribution", one_hot_q)
    jax.clear_caches()  # the right rule's program is cached
    try:
        planted = _first_tokens(params, draft, seed=12)[0]
    finally:
        jax.clear_caches()
    assert _p_value(off, planted) < 1e-6


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
