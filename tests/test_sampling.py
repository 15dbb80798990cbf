"""Sampler: cases G08, G09, G10, G12, G13, G20 of shared/cases/generation.md, every option
applied, per-row parameters without recompiling, and exact distributions (chi-square)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conftest import assert_close, assert_lively, lively_params
from gpt_jax import forward
from inference import decode, engine, generate, generation, steps
from inference.sampling import (
    SamplingArrays, SamplingParams, apply_penalties, apply_temperature, filter_logits,
    greedy_tokens, min_p_keep, prompt_hash, prompt_hashes, sample, top_p_keep,
)

DTYPES = [jnp.float32, jnp.bfloat16]


def test_greedy_tokens_is_argmax_first_index_ties_and_minus_inf_included():
    """The two-reduction greedy pick equals jnp.argmax: the first index among ties, -inf
    entries (banned tokens) and a row of only -inf (index 0, as argmax)."""
    rng = np.random.default_rng(0)
    logits = rng.integers(-3, 4, size=(64, 50)).astype(np.float32)  # many ties
    logits[rng.random(logits.shape) < 0.3] = -np.inf
    logits[5] = -np.inf
    logits[6] = rng.standard_normal(50)
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_tokens)(logits)),
                                  np.argmax(logits, axis=-1))


def arrays(*params, seeds=None):
    """SamplingArrays of these rows, for the vocabulary size `draws` passes."""
    seeds = seeds or [7] * len(params)
    return functools.partial(SamplingArrays.from_params, list(params), seeds,
                             [0] * len(params), [0] * len(params))


def draws(logits_BV, rows, seen_BV=None, counts_BV=None, *, n_draws=1, pad_id=0):
    """int32 `[n_draws, B]`: sample() at steps 0..n_draws-1 (a fresh key per step)."""
    return _draws(logits_BV, rows(vocab_size=logits_BV.shape[-1]), seen_BV, counts_BV,
                  n_draws=n_draws, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=("n_draws", "pad_id"))
def _draws(logits_BV, rows, seen_BV=None, counts_BV=None, *, n_draws=1, pad_id=0):
    B, V = logits_BV.shape
    seen_BV = jnp.zeros((B, V), bool) if seen_BV is None else seen_BV
    counts_BV = jnp.zeros((B, V), jnp.int32) if counts_BV is None else counts_BV
    return jax.vmap(lambda i: sample(logits_BV, rows, seen_BV, counts_BV, i, pad_id))(
        jnp.arange(n_draws))


def kept(logits, top_k=0, top_p=1.0, min_p=0.0):
    """The set of token ids filter_logits keeps for a one-row logits list."""
    out = filter_logits(jnp.asarray([logits], jnp.float32), jnp.array([top_k]),
                        jnp.array([top_p], jnp.float32), jnp.array([min_p], jnp.float32))
    return set(np.flatnonzero(np.isfinite(np.asarray(out[0]))).tolist())


# ----------------------------------------------------------------------------------- G08


@pytest.mark.parametrize("top_p, expected", [
    (0.75, [1, 1, 0, 0]), (0.6, [1, 1, 0, 0]), (0.5, [1, 0, 0, 0]), (0.51, [1, 1, 0, 0]),
    (1.0, [1, 1, 1, 1]),
])
def test_g08_top_p_on_dyadic_probabilities(top_p, expected):
    probs = jnp.array([[0.5, 0.25, 0.125, 0.125]], jnp.float32)
    assert top_p_keep(probs, jnp.array([top_p], jnp.float32))[0].tolist() == [bool(e) for e in expected]


@pytest.mark.parametrize("dtype", DTYPES)
def test_g08_top_p_cutoff_on_unsorted_logits_two_rows(dtype):
    probs = np.array([0.125, 0.5, 0.125, 0.25])  # most likely 1, then 3, then 0 and 2 (tie)
    logits = jnp.asarray(np.log(np.stack([probs, probs])), dtype)
    # the mass of the top two is 0.75 in float32; in bfloat16, that of the rounded logits
    rounded = np.asarray(logits[0].astype(jnp.float32), np.float64)
    mass = (np.exp(rounded) / np.exp(rounded).sum())[[1, 3]].sum()
    assert abs(mass - 0.75) < (1e-6 if dtype == jnp.float32 else 1e-2)
    top_p = jnp.array([mass - 1e-4, mass + 1e-4], jnp.float32)
    out = filter_logits(logits.astype(jnp.float32), jnp.array([0, 0]), top_p, jnp.zeros(2))
    assert np.isfinite(np.asarray(out[0])).tolist() == [False, True, False, True]
    assert np.isfinite(np.asarray(out[1])).tolist() == [True, True, False, True]  # tie: lower id

    rows = arrays(*[SamplingParams(top_p=float(p)) for p in top_p])
    got = np.asarray(draws(logits, rows, n_draws=20_000))
    assert set(got[:, 0].tolist()) == {1, 3}
    assert set(got[:, 1].tolist()) == {0, 1, 3}


# ----------------------------------------------------------------------------------- G09


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_p", [0.0, 1e-8])
def test_g09_top_p_zero_keeps_the_argmax(dtype, top_p):
    logits = jnp.asarray([[0.1, 1.0, -0.5, 2.5, 2.0, 0.0]], dtype)
    got = draws(logits, arrays(SamplingParams(top_p=top_p)), n_draws=1000)
    assert (np.asarray(got) == 3).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_g09_one_hot_row_with_every_filter_on(dtype):
    logits = jnp.full((1, 16), -jnp.inf, dtype).at[0, 7].set(0.0)
    sp = SamplingParams(top_p=0.9, top_k=5, temperature=0.7, min_p=0.1)
    assert (np.asarray(draws(logits, arrays(sp), n_draws=1000)) == 7).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_g09_dead_rows_return_pad_and_do_not_touch_other_rows(dtype):
    live = np.random.default_rng(0).normal(size=16)
    logits = jnp.asarray(np.stack([np.full(16, -np.inf), live, np.full(16, np.nan)]), dtype)
    sp = SamplingParams(top_p=0.9, top_k=5, temperature=0.7, min_p=0.1, seed=3)
    got = np.asarray(draws(logits, arrays(sp, sp, sp), n_draws=1000, pad_id=5))
    solo = np.asarray(draws(logits[1:2], arrays(sp), n_draws=1000, pad_id=5))
    assert (got[:, 0] == 5).all() and (got[:, 2] == 5).all()
    assert (got[:, 1] == solo[:, 0]).all() and len(set(solo[:, 0].tolist())) > 1


# ----------------------------------------------------------------------------------- G10


@pytest.mark.parametrize("top_k", [0, 65, 1000])
def test_g10_top_k_off_values_filter_nothing(top_k):
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(1, 65)), jnp.float32)
    out = filter_logits(logits, jnp.array([top_k]), jnp.ones(1), jnp.zeros(1))
    assert_close(out, logits, 0.0, "filtered logits")


@pytest.mark.parametrize("dtype", DTYPES)
def test_g10_top_k_one_is_greedy_and_top_k_zero_samples_widely(dtype):
    logits = jnp.asarray(np.random.default_rng(2).normal(scale=0.3, size=(3, 65)), dtype)
    greedy = np.asarray(jnp.argmax(logits.astype(jnp.float32), -1))
    got = np.asarray(draws(logits, arrays(*[SamplingParams(top_k=1)] * 3), n_draws=1000))
    assert (got == greedy[None]).all()
    wide = np.asarray(draws(logits[:1], arrays(SamplingParams(top_k=0)), n_draws=20_000))
    assert len(set(wide[:, 0].tolist())) >= 10


def test_g10_per_row_top_k_in_one_batch_equals_solo():
    logits = jnp.asarray(np.random.default_rng(3).normal(size=(3, 65)), jnp.float32)
    params = [SamplingParams(top_k=k, seed=s) for k, s in ((0, 1), (5, 2), (1000, 3))]
    batched = np.asarray(draws(logits, arrays(*params, seeds=[1, 2, 3]), n_draws=1000))
    for b, sp in enumerate(params):
        solo = np.asarray(draws(logits[b:b + 1], arrays(sp, seeds=[sp.seed]), n_draws=1000))
        assert (batched[:, b] == solo[:, 0]).all()
    top5 = set(np.argsort(-np.asarray(logits[1]))[:5].tolist())
    assert set(batched[:, 1].tolist()) == top5


def test_g10_negative_top_k_is_rejected_before_tracing():
    with pytest.raises(ValueError, match=r"SamplingParams.top_k=-1 is out of range; allowed: \[0, 2147483647\]"):
        SamplingParams(top_k=-1)


# ----------------------------------------------------------------------------------- G12

G12_LOGITS = [3.0, 2.9, 11.0, -2.4]


@pytest.mark.parametrize("dtype", DTYPES)
def test_g12_temperature_zero_is_argmax_without_division(dtype):
    logits = jnp.asarray([G12_LOGITS], dtype)
    assert (np.asarray(draws(logits, arrays(SamplingParams(temperature=0.0)), n_draws=1000)) == 2).all()
    # the greedy row's logits are only shifted by their maximum: the division is by exactly 1
    shifted = apply_temperature(logits.astype(jnp.float32), jnp.zeros(1))
    as_f32 = np.asarray(logits.astype(jnp.float32))
    assert_close(shifted, as_f32 - as_f32.max(), 0.0, "greedy-row logits")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1e-5, 1e-8, 1e-12])
def test_g12_tiny_temperatures_stay_finite(dtype, temperature):
    logits = jnp.asarray([G12_LOGITS], dtype)
    probs = jax.nn.softmax(apply_temperature(logits.astype(jnp.float32), jnp.array([temperature])))
    assert np.isfinite(np.asarray(probs)).all()
    got = draws(logits, arrays(SamplingParams(temperature=temperature)), n_draws=1000)
    assert (np.asarray(got) == 2).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_g12_mixed_temperatures_in_one_compiled_step(dtype):
    logits = jnp.asarray([G12_LOGITS] * 3, dtype)
    run = lambda temps: draws(logits, arrays(*[SamplingParams(temperature=t) for t in temps]),  # noqa: E731
                              n_draws=1000)
    run([0.5, 0.5, 0.5])
    before = _draws._cache_size()
    got = np.asarray(run([0.0, 1e-6, 1.0]))
    assert _draws._cache_size() == before  # new values, no new program
    assert (got[:, :2] == 2).all()
    hot = np.asarray(run([0.0, 1e-6, 8.0]))[:, 2]
    assert len(set(hot.tolist())) > 1


# ----------------------------------------------------------------------------------- G13

G13_LOGITS = jnp.array([[2.0, -2.0, 0.5, -1.0]])


def penalize(seen, counts, repetition=1.0, presence=0.0, frequency=0.0):
    return apply_penalties(G13_LOGITS, jnp.array([seen]), jnp.array([counts], jnp.int32),
                           jnp.array([repetition]), jnp.array([presence]), jnp.array([frequency]))


def test_g13_repetition_penalty_lowers_positive_and_negative_logits():
    out = penalize([True, True, False, False], [0, 0, 0, 0], repetition=2.0)
    assert_close(out, [[1.0, -4.0, 0.5, -1.0]], 0.0, "penalized logits")
    before, after = jax.nn.softmax(G13_LOGITS)[0], jax.nn.softmax(out)[0]
    assert after[0] < before[0] and after[1] < before[1]
    assert_close(penalize([True, True, False, False], [0, 0, 0, 0], repetition=1.0), G13_LOGITS,
                 0.0, "logits under penalty 1")


def test_g13_repetition_once_frequency_per_occurrence():
    out = penalize([False] * 4, [3, 0, 0, 0], repetition=2.0, frequency=0.25, presence=0.5)
    assert_close(out, [[2.0 / 2 - 0.5 - 3 * 0.25, -2.0, 0.5, -1.0]], 1e-6, "penalized logits")


def test_presence_and_frequency_count_the_output_only_repetition_the_prompt_too():
    """Fault: presence penalty applied to prompt tokens. Token 0 seen in the prompt only,
    nothing generated yet: presence and frequency leave the logits alone (OpenAI's penalties
    count generated tokens), repetition penalizes it (Keskar et al. / HF count the prompt)."""
    prompt_only = ([True, False, False, False], [0, 0, 0, 0])
    assert_close(penalize(*prompt_only, presence=0.5), G13_LOGITS, 0.0, "presence, prompt only")
    assert_close(penalize(*prompt_only, frequency=0.5), G13_LOGITS, 0.0, "frequency, prompt only")
    assert_close(penalize(*prompt_only, repetition=2.0), [[1.0, -2.0, 0.5, -1.0]], 0.0,
                 "repetition, prompt only")
    output_only = ([False] * 4, [0, 2, 0, 0])  # and each counts the output
    assert_close(penalize(*output_only, presence=0.5), [[2.0, -2.5, 0.5, -1.0]], 0.0, "presence")
    assert_close(penalize(*output_only, frequency=0.5), [[2.0, -3.0, 0.5, -1.0]], 0.0, "frequency")
    assert_close(penalize(*output_only, repetition=2.0), [[2.0, -4.0, 0.5, -1.0]], 0.0,
                 "repetition")


# ----------------------------------------------------------------------------------- G20


def test_g20_min_p_threshold_relative_to_the_top_token():
    probs = jnp.array([[0.5, 0.3, 0.09, 0.06, 0.05]], jnp.float32)
    assert min_p_keep(probs, jnp.array([0.2]))[0].tolist() == [True, True, False, False, False]
    assert min_p_keep(probs, jnp.array([0.0]))[0].all()
    assert kept(np.log([0.09, 0.5, 0.05, 0.3, 0.06]), min_p=0.2) == {1, 3}
    # relative to the largest (0.4), not to the sum (1): a threshold of 0.2, not 0.5
    assert min_p_keep(jnp.array([[0.4, 0.3, 0.2, 0.1]]), jnp.array([0.5]))[0].tolist() == \
        [True, True, True, False]
    assert kept(np.log([0.525, 0.475, 1e-9, 1e-9]), min_p=0.5) == {0, 1}


def test_filters_never_empty_a_row():
    """The most likely token survives every filter at its most severe setting, so a
    too-strict filter cannot leave a row with nothing to draw from."""
    logits = [0.3, 2.0, 1.9, -1.0]
    for options in (dict(min_p=1.0), dict(top_p=0.0), dict(top_k=1),
                    dict(top_k=1, top_p=0.0, min_p=1.0)):
        assert kept(logits, **options) == {1}, options


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("option, on, seen, counts, changed", [
    # logits [2.0, 1.9, -30, -30]: every option below must move the draws off {0, 1} or off 0
    ("temperature", dict(temperature=0.0), None, None, "only_0"),
    ("top_k", dict(top_k=1), None, None, "only_0"),
    ("top_p", dict(top_p=0.5), None, None, "only_0"),
    ("min_p", dict(min_p=0.95), None, None, "only_0"),
    ("repetition_penalty", dict(temperature=0.0, repetition_penalty=2.0), [1, 0, 0, 0], None, "only_1"),
    ("presence_penalty", dict(temperature=0.0, presence_penalty=0.5), None, [1, 0, 0, 0], "only_1"),
    ("frequency_penalty", dict(temperature=0.0, frequency_penalty=0.2), None, [1, 0, 0, 0], "only_1"),
    ("seed", dict(seed=8), None, None, "different"),
    ("logit_bias", dict(logit_bias={0: -100}), None, None, "only_1"),
])
def test_g20_every_option_changes_the_draws(dtype, option, on, seen, counts, changed):
    logits = jnp.asarray([[2.0, 1.9, -30.0, -30.0]], dtype)
    seen = None if seen is None else jnp.array([seen], bool)
    counts = None if counts is None else jnp.array([counts], jnp.int32)
    base = dict(temperature=1.0, seed=7) if "penalty" not in option else dict(temperature=0.0)
    off = np.asarray(draws(logits, arrays(SamplingParams(**base), seeds=[7]), seen, counts,
                           n_draws=1000))[:, 0]
    sp = SamplingParams(**{**base, **on})
    got = np.asarray(draws(logits, arrays(sp, seeds=[sp.seed or 7]), seen, counts,
                           n_draws=1000))[:, 0]
    expected_off = {0} if "penalty" in option else {0, 1}
    assert set(off.tolist()) == expected_off
    if changed == "only_0":
        assert set(got.tolist()) == {0}
    elif changed == "only_1":
        assert set(got.tolist()) == {1}
    else:
        assert (got != off).any() and set(got.tolist()) == {0, 1}


@pytest.mark.parametrize("field, value, allowed", [
    ("temperature", -0.1, r"\[0, inf\)"), ("temperature", float("inf"), r"\[0, inf\)"),
    ("top_p", 1.01, r"\[0, 1\]"), ("min_p", -0.1, r"\[0, 1\]"),
    ("repetition_penalty", 0.0, r"\(0, inf\)"), ("presence_penalty", 2.5, r"\[-2, 2\]"),
    ("frequency_penalty", -3.0, r"\[-2, 2\]"), ("seed", -1, r"None or \[0, 2\*\*32 - 1\]"),
    ("seed", 2**32, r"None or \[0, 2\*\*32 - 1\]"),
    ("max_new_tokens", -1, r"\[0, 2147483647\]"), ("max_new_tokens", 2**31, r"\[0, 2147483647\]"),
    ("top_k", 2**31, r"\[0, 2147483647\] \(0 = off\)"), ("n", 2**40, r"\[1, 2147483647\]"),
    ("stop_token_ids", [-3], "token ids >= 0"), ("stop", [""], "non-empty strings"),
    ("logprobs", 21, r"None or \[0, 20\]"), ("n", 0, r"\[1, 2147483647\]"),
    ("stop_sequences", [[1, -2]], "token ids >= 0"), ("stop_sequences", [[]], "non-empty"),
    ("stop_token_ids", 5, "a list"), ("min_tokens", -1, r"\[0, 2147483647\]"),
    ("logit_bias", {-1: 1.0}, "token ids >= 0"), ("logit_bias", 5, "a list"),
    ("context_overflow", "wrap", "None, 'error', 'crop'"),
])
def test_out_of_range_values_are_rejected_naming_field_value_and_range(field, value, allowed):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}=.* is out of range; allowed: {allowed}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty",
                                   "presence_penalty", "frequency_penalty"])
def test_a_float_field_says_what_is_wrong_with_a_value_that_is_no_finite_number(field):
    """Fault: `temperature="hot"` was "out of range" (it is no number at all), NaN was "out
    of range" too, and an int past float's range raised OverflowError from math.isfinite.
    Now: not a number (code invalid_type, as OpenAI's API answers a string), NaN, or out of
    range; each naming the field, the value and what is allowed."""
    import re

    from inference.errors import RequestError
    from inference.sampling_params import RANGES

    allowed = re.escape(RANGES[field].allowed)
    for value, problem, code in [
            ("hot", "is not a number; allowed: numbers in ", "invalid_type"),
            ("0.5", "is not a number; allowed: numbers in ", "invalid_type"),
            (True, "is not a number; allowed: numbers in ", "invalid_type"),
            (None, "is not a number; allowed: numbers in ", "invalid_type"),
            (float("nan"), r"is NaN \(not a number\); allowed: ", "invalid_value"),
            (float("inf"), "is out of range; allowed: ", "invalid_value"),
            (-float("inf"), "is out of range; allowed: ", "invalid_value"),
            (10**400, "is out of range; allowed: ", "invalid_value")]:
        with pytest.raises(RequestError) as caught:
            SamplingParams(**{field: value})
        assert re.fullmatch(rf"SamplingParams\.{field}={re.escape(repr(value))} {problem}"
                            rf"{allowed}", str(caught.value)), str(caught.value)
        assert caught.value.code == code
    for bias, problem in [("x", "is not a number"), (float("nan"), r"is NaN \(not a number\)")]:
        with pytest.raises(RequestError, match=rf"^SamplingParams\.logit_bias\[3\]="
                                               rf"{re.escape(repr(bias))} {problem}; allowed: "):
            SamplingParams(logit_bias={3: bias})


@pytest.mark.parametrize("field, value", [("top_k", 1.5), ("max_new_tokens", 3.5), ("n", True),
                                          ("min_tokens", 2.0)])
def test_non_integer_values_are_rejected_as_such(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}={value!r} is not an integer"):
        SamplingParams(**{field: value})


def test_unknown_option_raises():
    with pytest.raises(TypeError, match="unexpected keyword argument 'top_q'"):
        SamplingParams(top_q=0.9)


def test_logit_bias_is_stored_as_sorted_pairs_and_checked_per_entry():
    a = SamplingParams(logit_bias={9: -1, 3: 2.5})
    b = SamplingParams(logit_bias=[(3, 2.5), (9, -1.0)])
    assert a.logit_bias == ((3, 2.5), (9, -1.0)) and a == b and hash(a) == hash(b)
    for value, message in [
        ({5: 100.5}, r"SamplingParams\.logit_bias\[5\]=100.5 is out of range; allowed: "
                     r"\[-100, 100\]"),
        ({5: float("inf")}, r"SamplingParams\.logit_bias\[5\]=inf is out of range"),
        ({5: True}, r"SamplingParams\.logit_bias\[5\]=True is not a number; allowed: "
                    r"numbers in \[-100, 100\]"),
        ({"5": 1.0}, r"SamplingParams\.logit_bias='5' is not an integer"),
        ([(5, 1.0), (5, -2.0)], r"SamplingParams\.logit_bias gives token id 5 twice"),
        ([(5,)], r"SamplingParams\.logit_bias entry \(5,\) is not a \(token id, bias\) pair"),
    ]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(logit_bias=value)


def test_min_tokens_above_max_new_tokens_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"^SamplingParams\.min_tokens=9 is more than "
                                         r"max_new_tokens=8; allowed: 0 <= min_tokens <= "
                                         r"max_new_tokens$"):
        SamplingParams(min_tokens=9, max_new_tokens=8)
    assert SamplingParams(min_tokens=8, max_new_tokens=8).min_tokens == 8


def test_logit_bias_is_added_before_the_penalties():
    """Token 0 (logit 4, in the prompt) biased by -2 under repetition penalty 2: biased first,
    (4 - 2) / 2 = 1 beats token 1's 0.5; penalized first it would be 4 / 2 - 2 = 0 < 0.5."""
    logits = jnp.array([[4.0, 0.5]])
    sp = SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: -2})
    got = draws(logits, arrays(sp), jnp.array([[True, False]]), n_draws=1)
    assert np.asarray(got).tolist() == [[0]]


# ---------------------------------------------------------------------- exact distributions

STAT_LOGITS = np.array([1.2, -0.3, 0.4, 2.0, -1.5, 0.9, 0.0, -0.8])


def expected_distribution(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """float64, from the definitions: softmax(logits / T), then top-k, top-p, min-p."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    p = np.exp(z[order] - z[order].max())
    p[(top_k or len(z)):] = 0
    p /= p.sum()
    before = np.concatenate([[0.0], np.cumsum(p)[:-1]])
    keep = (before < top_p) & (p >= min_p * p[0])
    keep[0] = True
    out = np.zeros(len(z))
    out[order] = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_empirical_frequencies_match_the_exact_distribution(dtype):
    options = [dict(temperature=0.7), dict(top_k=3), dict(top_p=0.8), dict(min_p=0.2),
               dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.1)]
    logits = jnp.asarray(np.stack([STAT_LOGITS] * len(options)), dtype)
    rows = arrays(*[SamplingParams(**o) for o in options], seeds=list(range(11, 16)))
    got = np.asarray(draws(logits, rows, n_draws=20_000))
    exact_logits = np.asarray(logits[0].astype(jnp.float32), np.float64)  # as rounded to dtype
    for b, option in enumerate(options):
        expected = expected_distribution(exact_logits, **option)
        counts = np.bincount(got[:, b], minlength=len(STAT_LOGITS))
        excluded = expected == 0
        assert excluded.any() == ("temperature" not in option or len(option) > 1)
        assert counts[excluded].sum() == 0, (option, counts)
        p_value = stats.chisquare(counts[~excluded], 20_000 * expected[~excluded]).pvalue
        assert p_value > 1e-3, (option, counts, expected, p_value)


# ------------------------------------------------------------- requests through the engine

PREFILL_ROWS = []  # prefill batch sizes traced by counting_model


def counting_model(params, config, capacity, cache_dtype):
    """The cached model, recording how many rows each compiled prefill runs."""
    prefill_fn, step_fn = steps.cached_model(params, config, capacity, cache_dtype)

    def counted(prompt_tokens, prompt_lengths, source_B, forked):
        PREFILL_ROWS.append(prompt_tokens.shape[0])
        return prefill_fn(prompt_tokens, prompt_lengths, source_B, forked)

    return counted, step_fn


def test_n_samples_share_one_prefill_and_differ(config, params):
    PREFILL_ROWS.clear()
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, n=4, seed=9)
    outs = generation.run(params, config, [[4, 5, 6, 7]], sampling, model_fns=counting_model)
    assert PREFILL_ROWS == [1]  # one compiled prefill, of one row, for four decode rows
    assert len(outs) == 4 and len({tuple(o.tokens) for o in outs}) == 4
    assert all(o.seed == 9 and len(o.tokens) == 12 for o in outs)
    # sample k of n is the same whatever else runs beside it
    again = generation.generate(params, config, [[1, 2], [4, 5, 6, 7]],
                            [SamplingParams(temperature=0.5, max_new_tokens=12), sampling])
    assert [o.tokens for o in again[1:]] == [o.tokens for o in outs]


def test_one_seed_on_different_prompts_draws_independent_noise(config, params):
    """Fault: one seed for several prompts gave them the same noise, so at a high temperature
    their samples agreed on almost every token. The prompt's hash is in each row's key: the
    same prompt with the same seed still repeats exactly."""
    prompts = [[1, 2, 3], [1, 2, 4], [7, 7, 7], [30, 31, 32], [1, 2, 3]]
    hot = SamplingParams(temperature=5.0, max_new_tokens=24, seed=42)
    outs = [o.tokens for o in generate(params, config, prompts, hot)]
    assert outs[4] == outs[0]  # same seed, same prompt
    for i in range(4):
        for j in range(i):
            same = sum(a == b for a, b in zip(outs[i], outs[j]))
            assert same <= 6, f"prompts {i} and {j} share {same} of 24 tokens"
    engine_run = engine.Engine(params, config, max_slots=2)
    engine_run.add_request("r", prompts[1], hot)
    tokens = []
    while engine_run.has_unfinished_requests():
        tokens += [t for o in engine_run.step() for t in o.new_token_ids]
    assert tokens == outs[1]


def test_prompt_hash_is_the_same_on_the_host_and_in_a_program():
    """An exported program hashes its padded prompts in-graph; `generate` hashes each prompt
    on the host: bit for bit the same value, whatever the padding holds."""
    rng = np.random.default_rng(0)
    tokens_BT = rng.integers(0, 50257, (64, 40)).astype(np.int32)
    lengths_B = rng.integers(1, 41, 64).astype(np.int32)
    host = np.array([prompt_hash(t[:n].tolist()) for t, n in zip(tokens_BT, lengths_B)],
                    np.uint32)
    assert np.array_equal(prompt_hashes(tokens_BT, lengths_B), host)
    padded_BT = np.where(np.arange(40)[None, :] < lengths_B[:, None], tokens_BT, -7)
    in_graph = jax.jit(lambda t, n: prompt_hashes(t, n, jnp))(padded_BT, lengths_B)
    assert in_graph.dtype == jnp.uint32 and np.array_equal(np.asarray(in_graph), host)
    # order, position, value and length all count
    variants = [[1, 2, 3], [3, 2, 1], [1, 2, 4], [1, 2, 3, 0], [0, 1, 2, 3], [1, 2], [2, 1]]
    assert len({prompt_hash(v) for v in variants}) == len(variants)


def test_seeded_request_is_the_same_alone_first_last_and_beside_unseeded(config, params):
    seeded = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.02,
                            repetition_penalty=1.2, frequency_penalty=0.3, max_new_tokens=24,
                            seed=123)
    others = [SamplingParams(temperature=0.8, max_new_tokens=20),
              SamplingParams(temperature=0.0, presence_penalty=0.5, max_new_tokens=24)]
    prompt, p1, p2 = [1, 2, 3], [9] * 11, [30, 31]
    (alone,) = generate(params, config, [prompt], seeded)
    assert_lively(alone.tokens)
    first = generate(params, config, [prompt, p1, p2], [seeded] + others)
    last = generate(params, config, [p2, p1, prompt], others[::-1] + [seeded])
    assert first[0].tokens == alone.tokens == last[2].tokens
    # an unseeded request reports the seed it drew, and that seed repeats it
    replay = dataclasses.replace(others[0], seed=first[1].seed)
    assert generate(params, config, [p1], replay)[0].tokens == first[1].tokens


def test_penalties_ignore_padding_and_match_solo_runs(config, params):
    seen = decode.prompt_seen(jnp.array([[0, 1, 3, 3]]), jnp.array([2]), 4)  # 3 is padding
    out = apply_penalties(G13_LOGITS, seen, jnp.zeros((1, 4), jnp.int32), jnp.array([2.0]),
                          jnp.zeros(1), jnp.zeros(1))
    assert_close(out, [[1.0, -4.0, 0.5, -1.0]], 0.0, "penalized logits")
    sampling = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4,
                              max_new_tokens=24)
    prompts = [[3, 4], [5, 6, 7, 8, 9, 10, 11]]
    batched = generate(params, config, prompts, sampling, pad_id=3)
    for prompt, row in zip(prompts, batched):
        assert row.tokens == generate(params, config, [prompt], sampling, pad_id=3)[0].tokens
    plain = generate(params, config, prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=24))
    assert plain[0].tokens != batched[0].tokens  # the penalties did act


def test_logprobs_are_the_models_raw_log_probabilities(config, params):
    prompt = [7, 8, 9]
    (out,) = generate(params, config, [prompt], SamplingParams(
        temperature=1.0, top_k=5, max_new_tokens=24, seed=1, logprobs=3))
    logits = forward(params, jnp.asarray([prompt + out.tokens]), config)[0, len(prompt) - 1:-1]
    expected = np.asarray(jax.nn.log_softmax(logits, -1))
    assert_close(out.logprobs, expected[np.arange(24), out.tokens], 1e-5, "token logprobs")
    for step, top in enumerate(out.top_logprobs):
        best = np.argsort(-expected[step])[:3]
        assert list(top) == best.tolist()
        assert_close(list(top.values()), expected[step, best], 1e-5, "top logprobs")
    (plain,) = generate(params, config, [prompt], SamplingParams(max_new_tokens=24, seed=1))
    assert plain.logprobs is None and plain.top_logprobs is None


def test_logprobs_on_a_vocabulary_smaller_than_twenty():
    """Fault: the 20 recorded alternatives were a top_k over a smaller axis (a crash inside
    tracing). Now at most the vocabulary, and more than it is refused before compiling."""
    from gpt_jax import GPTConfig
    from gpt_jax.tokenizer import CharTokenizer
    from inference import Engine, LLM

    config = GPTConfig(vocab_size=5, max_seq_len=16, n_layers=1, n_heads=1, d_model=8)
    params = lively_params(config)
    sp = SamplingParams(temperature=0.0, max_new_tokens=4, logprobs=2)
    (out,) = generate(params, config, [[1, 2]], sp)
    assert len(out.top_logprobs) == 4 and all(len(t) == 2 for t in out.top_logprobs)
    assert all(max(t.values()) == pytest.approx(lp, abs=1e-5)  # greedy: the top one
               for t, lp in zip(out.top_logprobs, out.logprobs))
    engine = Engine(params, config, max_slots=2)
    engine.add_request("r", [1, 2], sp)
    while engine.has_unfinished_requests():
        final = engine.step()[-1]
    assert [list(t) for t in final.top_logprobs] == [list(t) for t in out.top_logprobs]
    assert_close([list(t.values()) for t in final.top_logprobs],
                 [list(t.values()) for t in out.top_logprobs], 1e-5, "engine top logprobs")
    llm = LLM(params, config, CharTokenizer(list("ACGT\n")))
    (text,) = llm.generate(["ACG"], SamplingParams(max_new_tokens=3, logprobs=1, seed=1),
                           progress=False)
    assert [len(t) for t in text.top_logprobs] == [1, 1, 1]
    with pytest.raises(ValueError, match=r"logprobs=6 asks for more alternatives than the "
                                         r"vocabulary has; allowed: \[0, 5\]"):
        generate(params, config, [[1, 2]], SamplingParams(logprobs=6, max_new_tokens=2))


# ------------------------------------------------- logit_bias and min_tokens, end to end


def engine_outputs(params, config, prompts, sampling, max_slots=2):
    """`(tokens, finish_reason)` of each request run through the serving Engine (with fewer
    slots than requests, some join while others decode)."""
    eng = engine.Engine(params, config, max_slots=max_slots)
    for i, (prompt, sp) in enumerate(zip(prompts, sampling)):
        eng.add_request(str(i), prompt, sp)
    final = {}
    while eng.has_unfinished_requests():
        final |= {o.request_id: o for o in eng.step() if o.finished}
    return [(final[str(i)].token_ids, final[str(i)].finish_reason) for i in range(len(prompts))]


def test_logit_bias_of_100_forces_a_token_and_of_minus_100_bans_one(config, params):
    prompt = [3, 4, 5]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
    ref, plain = (o.tokens for o in generate(params, config, [prompt] * 2, [greedy, sampled]))
    assert_lively(ref) and assert_lively(plain)
    top, top_sampled = (max(set(t), key=t.count) for t in (ref, plain))  # the most frequent
    forced = next(t for t in range(config.vocab_size) if t not in ref + plain)
    requests = [dataclasses.replace(greedy, logit_bias={top: -100}),
                dataclasses.replace(greedy, logit_bias={forced: 100}),
                dataclasses.replace(sampled, logit_bias={top_sampled: -100}),
                dataclasses.replace(sampled, logit_bias={forced: 100, top_sampled: -100})]
    outs = generate(params, config, [prompt] * 4, requests)
    tokens = [o.tokens for o in outs]
    assert tokens[0] != ref and top not in tokens[0]
    assert tokens[2] != plain and top_sampled not in tokens[2]
    assert tokens[1] == tokens[3] == [forced] * 24
    assert engine_outputs(params, config, [prompt] * 4, requests) == \
        [(o.tokens, o.finish_reason) for o in outs]


def test_out_of_vocabulary_logit_bias_id_is_refused_before_compiling(config, params):
    sp = SamplingParams(max_new_tokens=4, logit_bias={3: 1.0, 64: -5.0})
    message = r"logit_bias id 64 is outside \[0, 64\) \(the model's vocab_size is 64\)$"
    before = engine.compile_counts()
    with pytest.raises(ValueError, match=r"^prompt 1: " + message):
        generate(params, config, [[1], [2]], [SamplingParams(max_new_tokens=4), sp])
    eng = engine.Engine(params, config, max_slots=2)
    with pytest.raises(ValueError, match=r"^request 'r': " + message):
        eng.add_request("r", [1, 2], sp)
    assert not eng.has_unfinished_requests()
    assert engine.compile_counts() == before


def mixed_requests(config):
    """Requests with logit_bias and min_tokens set (an EOS id the greedy row would emit at
    once), greedy and sampled, beside plain ones."""
    return [
        SamplingParams(temperature=0.0, max_new_tokens=20, logit_bias={7: 3.0, 12: -2.5}),
        SamplingParams(temperature=0.0, max_new_tokens=20, min_tokens=9, stop_token_ids=[1, 2]),
        SamplingParams(temperature=0.9, max_new_tokens=20, seed=5, min_tokens=6,
                       stop_token_ids=list(range(0, config.vocab_size, 3)),
                       logit_bias={i: 4.0 for i in range(0, config.vocab_size, 3)}),
        SamplingParams(temperature=0.7, top_k=20, max_new_tokens=12, seed=8),
    ]


def test_rows_with_logit_bias_and_min_tokens_are_batch_invariant(config, params):
    prompts = [[3, 4, 5], [9], [20, 21, 22, 23, 24, 25, 26], [40, 41]]
    sampling = mixed_requests(config)
    batched = [(o.tokens, o.finish_reason) for o in generate(params, config, prompts, sampling)]
    for prompt, sp, row in zip(prompts, sampling, batched):
        (solo,) = generate(params, config, [prompt], sp)
        assert (solo.tokens, solo.finish_reason) == row
    assert engine_outputs(params, config, prompts, sampling) == batched
    assert batched[2][1] == "eos" and len(batched[2][0]) > 6  # min_tokens held the EOS off


def test_changing_logit_bias_and_min_tokens_values_compiles_nothing(config, params):
    """One Engine slot: its programs' shapes (one decode row) do not depend on when requests
    finish, so only the values change between runs."""
    prompts = [[3, 4, 5], [9], [20, 21, 22, 23, 24, 25, 26], [40, 41]]
    sampling = mixed_requests(config)
    generate(params, config, prompts, sampling)  # warm-up: these shapes are compiled
    engine_outputs(params, config, prompts, sampling, max_slots=1)
    before = engine.compile_counts()
    outputs = []
    for bias, min_tokens in [({}, 0), ({43: -100.0}, 3), ({i: 8.0 for i in range(40)}, 19)]:
        changed = [dataclasses.replace(sp, logit_bias=bias, min_tokens=min(min_tokens,
                                                                          sp.max_new_tokens))
                   for sp in sampling]
        outs = generate(params, config, prompts, changed)
        assert engine_outputs(params, config, prompts, changed, max_slots=1) == \
            [(o.tokens, o.finish_reason) for o in outs]
        outputs.append(tuple(tuple(o.tokens) for o in outs))
    assert engine.compile_counts() == before
    assert len(set(outputs)) == 3  # the values really differed
