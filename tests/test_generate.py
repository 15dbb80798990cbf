import dataclasses

import numpy as np
import pytest

from conftest import assert_lively
from gpt_jax import attention
from inference import SamplingParams, compile_counts, generate, naive_generate

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48)


def test_greedy_generate_equals_naive(config, params):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (1, 2, 7, 20)]
    cached = generate(params, config, prompts, GREEDY)
    naive = naive_generate(params, config, prompts, GREEDY)
    for c, n in zip(cached, naive):
        assert_lively(n.tokens)
        assert len(c.tokens) == 48 and c.finish_reason == "length"
        assert c.tokens == n.tokens


def test_paged_decode_loop_equals_naive_across_many_pages(config, params, monkeypatch):
    """Pages of 4 slots: rows of 1 to 11 prompt tokens decode 14 steps over up to 7 pages
    each, every row reading the pages below the longest row's length. A config of its own
    (max_seq_len 96) keeps programs traced with 128-slot pages from being reused here, and
    these from reaching other tests."""
    monkeypatch.setattr(attention, "ATTENTION_BLOCK", 4)
    config = dataclasses.replace(config, max_seq_len=96)
    params = {**params, "wpe": params["wpe"][:96]}
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (1, 5, 11)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=14)
    cached = generate(params, config, prompts, sampling)
    naive = naive_generate(params, config, prompts, sampling)
    for c, n in zip(cached, naive):
        assert_lively(n.tokens)
        assert c.tokens == n.tokens


def test_batch_rows_equal_solo_runs(config, params):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (1, 3, 7, 16)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=30)
    batched = generate(params, config, prompts, sampling)
    for prompt, row in zip(prompts, batched):
        (solo,) = generate(params, config, [prompt], sampling)
        assert_lively(solo.tokens)
        assert row.tokens == solo.tokens


def test_sampled_batch_rows_equal_solo_runs(config, params):
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10, 11]]
    sampling = [SamplingParams(temperature=1.0, top_k=20, max_new_tokens=20, seed=s) for s in (1, 2, 3)]
    batched = generate(params, config, prompts, sampling)
    for prompt, sp, row in zip(prompts, sampling, batched):
        assert row.tokens == generate(params, config, [prompt], sp)[0].tokens


def test_too_long_request_raises_before_compiling(config, params):
    before = compile_counts()
    prompt = [t % 64 for t in range(100)]
    with pytest.raises(ValueError, match=r"prompt length 100 \+ max_new_tokens 30 .* max_seq_len 128"):
        generate(params, config, [[1], prompt], SamplingParams(max_new_tokens=30))
    with pytest.raises(ValueError, match="100"):
        naive_generate(params, config, [prompt], SamplingParams(max_new_tokens=30))
    assert compile_counts() == before


def test_eos_ends_a_row_and_is_kept(config, params):
    (reference,) = generate(params, config, [[5, 6]], GREEDY)
    eos = reference.tokens[4]
    first = reference.tokens.index(eos)
    (out,) = generate(params, config, [[5, 6]], SamplingParams(temperature=0.0, max_new_tokens=48, stop_token_ids=[eos]))
    assert out.tokens == reference.tokens[: first + 1]
    assert out.finish_reason == "eos"


def test_out_of_vocabulary_prompt_token_raises(config, params):
    with pytest.raises(ValueError, match=r"token id 64 is outside \[0, 64\)"):
        generate(params, config, [[1, 64]], GREEDY)
    with pytest.raises(ValueError, match=r"prompt 0: stop_token_ids id 99 is outside \[0, 64\)"):
        generate(params, config, [[1]], SamplingParams(stop_token_ids=[99]))
    with pytest.raises(ValueError, match=r"prompt 0: stop_sequences id 70 is outside \[0, 64\)"):
        generate(params, config, [[1]], SamplingParams(stop_sequences=[[1, 70]]))


def test_non_integer_prompt_token_raises(config, params):
    with pytest.raises(ValueError, match=r"prompt 1: token id 1.7 is not an integer"):
        generate(params, config, [[1], [1.7]], GREEDY)


def test_params_that_do_not_match_the_config_are_refused_before_compiling(config, params):
    from gpt_jax.params import decode_layout
    from gpt_jax.params import check_params
    from inference.llm import LLM

    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
    before = compile_counts()
    with pytest.raises(ValueError, match=r"params\['wte'\] has shape \(64, 32\), but the config "
                                         r"expects \(65, 32\) \(d_model=32, .*vocab_size=65"):
        generate(params, config.replace(vocab_size=65), [[1, 2]], greedy)
    with pytest.raises(ValueError, match=r"params\['blocks'\]\['attn'\]\['b_k'\] has shape "
                                         r"\(2, 2, 16\), but the config expects \(2, 4, 8\)"):
        naive_generate(params, config.replace(n_heads=4), [[1, 2]], greedy)
    laid_out = decode_layout(params)  # the decode layout is checked in its own shapes
    with pytest.raises(ValueError, match=r"params\['blocks'\]\[0\]\['attn'\]\['b_k'\] has "
                                         r"shape \(2, 16\), but the config expects \(1, 16\)"):
        generate(laid_out, config.replace(n_kv_heads=1), [[1, 2]], greedy)
    with pytest.raises(ValueError, match=r"params\['wpe'\] has shape \(128, 32\), but the "
                                         r"config expects \(64, 32\)"):
        LLM(params, config.replace(max_seq_len=64), tokenizer=None)
    assert compile_counts() == before
    check_params(params, config)  # matching params, in either layout, pass
    check_params(laid_out, config)
