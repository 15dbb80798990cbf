"""The bfloat16 inference mode (weights and KV cache in bfloat16) against float32: close
logits through prefill and cached decode, mostly equal greedy tokens, and a clear error for a
dtype it does not offer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, lively_params
from gpt_jax import GPTConfig, forward, init_cache
from inference.generation import generate
from inference.steps import decode_step, prefill
from inference.llm import LLM
from inference.sampling_params import SamplingParams

CONFIG = GPTConfig(vocab_size=64, max_seq_len=64, n_layers=2, n_heads=4, n_kv_heads=2,
                   d_model=64)


class Chars:
    def encode(self, text):
        return [ord(c) - ord("a") for c in text]

    def decode(self, ids):
        return "".join(chr(ord("a") + int(i)) for i in ids)


def _prefill_then_decode(params, dtype, tokens):
    cache = init_cache(CONFIG, 1, 32, jnp.dtype(dtype))
    t = jnp.asarray([tokens], jnp.int32)
    logits, cache = prefill(params, CONFIG, t, jnp.asarray([len(tokens)], jnp.int32), cache)
    steps = [logits]
    for token in (3, 17, 42):
        logits, cache = decode_step(params, CONFIG, jnp.asarray([token], jnp.int32), cache)
        steps.append(logits)
    return np.stack([np.asarray(s) for s in steps]), cache


def test_bfloat16_logits_close_to_float32():
    params = lively_params(CONFIG, scale=2.0)
    llm = LLM(params, CONFIG, Chars(), dtype="bfloat16")
    assert {a.dtype for a in jax.tree.leaves(llm.params)} == {jnp.dtype(jnp.bfloat16)}
    tokens = [5, 9, 1, 30, 22, 7, 7, 60]
    want, _ = _prefill_then_decode(params, "float32", tokens)
    got, cache = _prefill_then_decode(llm.params, "bfloat16", tokens)
    assert cache.k[0].dtype == jnp.bfloat16 and got.dtype == np.float32
    # bfloat16 keeps 8 significant bits (relative step 2^-8 = 0.4%); through two layers the
    # logits move by a few percent of their spread, never more.
    assert_close(got, want, 0.05 * float(np.abs(want).max()), "bfloat16 vs float32 logits")


def test_bfloat16_greedy_tokens_mostly_equal_float32():
    params = lively_params(CONFIG, scale=2.0)
    prompts = [[1, 2, 3], [40, 41, 42, 43, 44, 45], [7]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    want = generate(params, CONFIG, prompts, greedy)
    got = LLM(params, CONFIG, Chars(), dtype="bfloat16").generate(
        [Chars().decode(p) for p in prompts], greedy, progress=False)
    # Rounding can flip a near-tie, after which a sequence goes its own way: the runs must
    # agree up to their first difference, and there float32 must be nearly tied between the
    # two tokens (within the logit error bound of the test above).
    agreed = 0
    for prompt, w, g in zip(prompts, want, got):
        i = next((i for i, (a, b) in enumerate(zip(w.tokens, g.tokens)) if a != b), None)
        if i is None:
            assert w.tokens == g.tokens
            agreed += 1
            continue
        logits = np.asarray(forward(params, jnp.asarray([prompt + w.tokens[:i]]), CONFIG))[0, -1]
        gap = logits[w.tokens[i]] - logits[g.tokens[i]]
        assert 0 <= gap <= 0.05 * np.abs(logits).max(), (prompt, i, gap)
    assert agreed >= 2, f"only {agreed} of 3 greedy runs equal"


def test_unknown_dtype_is_refused_and_a_dtype_object_is_taken_as_its_name():
    with pytest.raises(ValueError, match="LLM dtype must be one of .*'float16'"):
        LLM(lively_params(CONFIG), CONFIG, Chars(), dtype="float16")
    with pytest.raises(ValueError, match="LLM dtype must be one of .*'int8'"):
        LLM(lively_params(CONFIG), CONFIG, Chars(), dtype="int8")
    llm = LLM(lively_params(CONFIG), CONFIG, Chars(), dtype=jnp.bfloat16)
    assert llm.cache_dtype == jnp.bfloat16 and llm.params["wte"].dtype == jnp.bfloat16
