"""The cost model of a speculative round (`inference.spec_cost`): the calibration tables read
by weight bytes, a draft model's steps counted in a draft row's cost, and that cost reaching
the rows of `generate` and the Engine (it decides when a row stops drafting)."""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import numpy as np
import pytest

from gpt_jax import GPTConfig, init_params
from inference import SamplingParams, generation, spec_cost
from inference.draft import check_draft
from inference.spec_engine import SpecSlots
from inference.speculative import SpecArrays

SMALL, TEN_M, GPT2 = (GPTConfig.preset(n) for n in ("shakespeare-char-llama",
                                                     "shakespeare-char-10m", "gpt2"))
DRAFT = GPTConfig.preset("shakespeare-char-llama-256")


def test_tables_are_read_piecewise_in_log_bytes_and_held_outside():
    points = ((1e6, 1.0), (1e8, 3.0), (1e10, 4.0))
    assert spec_cost._by_size(points, 1e7) == pytest.approx(2.0)
    assert spec_cost._by_size(points, 1e9) == pytest.approx(3.5)
    assert spec_cost._by_size(points, 1e3) == 1.0 and spec_cost._by_size(points, 1e12) == 4.0
    for table in (spec_cost.CALIBRATION, spec_cost.STEP_CALIBRATION):
        sizes = [b for b, _ in table]
        assert sizes == sorted(sizes)


def test_verify_cost_falls_with_size_toward_one():
    """A verification costs fewer decode steps the more the step reads its weights from
    memory: the 10M model between the demo model and GPT-2, each above 1."""
    costs = [spec_cost.verify_cost(c, 4) for c in (SMALL, TEN_M, GPT2)]
    assert costs[0] > costs[1] > costs[2] > 1.0
    assert spec_cost.verify_cost(TEN_M, 0) == 1.0
    assert spec_cost.verify_cost(TEN_M, 1) < spec_cost.verify_cost(TEN_M, 4)


def test_a_draft_rounds_cost_counts_its_steps():
    """With a draft model a round costs the verification plus max(k, 1) draft steps, in
    steps of the row not drafting (one target step and one draft step): (V + k r) / (1 + r);
    its own copy as the draft (r = 1) costs (V + k) / 2; no drafts cost 1."""
    r = spec_cost.step_ratio(DRAFT, TEN_M)
    assert 0 < r < 1 and spec_cost.step_ratio(TEN_M, TEN_M) == pytest.approx(1.0)
    assert spec_cost.step_ratio(TEN_M, DRAFT) == pytest.approx(1 / r)
    verify = spec_cost.verify_cost(TEN_M, 4)
    assert spec_cost.round_cost(TEN_M, 4) == verify
    assert spec_cost.round_cost(TEN_M, 4, DRAFT) == pytest.approx((verify + 4 * r) / (1 + r))
    assert spec_cost.round_cost(TEN_M, 4, TEN_M) == pytest.approx((verify + 4) / 2)
    assert spec_cost.round_cost(TEN_M, 0, DRAFT) == pytest.approx(1.0)
    assert spec_cost.round_cost(TEN_M, 4, TEN_M) > spec_cost.round_cost(TEN_M, 4, DRAFT)
    with pytest.raises(ValueError, match="width"):
        spec_cost.round_cost(TEN_M, -1, DRAFT)


def _rows():
    return [SamplingParams(speculative="draft", num_speculative_tokens=4),
            SamplingParams(speculative="ngram", num_speculative_tokens=4), SamplingParams()]


def test_rows_of_generate_and_the_engine_get_the_draft_rounds_cost():
    """Fault: a draft row's cost was its verification's alone (its k draft steps free), so a
    row kept drafting where the draft's steps ate the gain."""
    config = GPTConfig.preset("tiny-llama")
    draft = GPTConfig.preset("tiny")
    want = [spec_cost.round_cost(config, 4, draft), spec_cost.verify_cost(config, 4), 1.0]
    assert want[0] != want[1]
    np.testing.assert_allclose(SpecArrays.from_params(_rows(), config, draft).cost, want,
                               rtol=1e-6)
    batch = generation.pack(config, [[1, 2, 3]] * 3, _rows(), draft_config=draft)
    np.testing.assert_allclose(batch.spec.cost[:3], want, rtol=1e-6)
    active = [types.SimpleNamespace(sampling=sp, prompt=[1, 2, 3], slot=slot)
              for slot, sp in enumerate(_rows())]
    np.testing.assert_allclose(SpecSlots.arrays(active, 4, config, draft).cost, want + [1.0],
                               rtol=1e-6)


def test_the_benchmark_pair_a_memory_bound_target_and_a_draft_an_eighth_its_size():
    """shakespeare-char-10m's float32 weights exceed a 32 MB L3 cache (its decode step reads
    them from memory); shakespeare-char-llama-256 drafts for it at under 1/8 of its
    parameters, with its context (vocabulary 65: the tokenizer of tinyshakespeare)."""
    target, draft = (dataclasses.replace(c, vocab_size=65) for c in (TEN_M, DRAFT))
    counts = [sum(math.prod(x.shape) for x in jax.tree.leaves(jax.eval_shape(
        lambda key, c=c: init_params(c, key), jax.random.key(0)))) for c in (target, draft)]
    assert 4 * counts[0] > 32 * 2**20 and counts[0] >= 8 * counts[1]
    check_draft(target, draft)
