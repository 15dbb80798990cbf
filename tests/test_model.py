import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax import GPTConfig, forward, init_params
from gpt_jax.attention import attend
from gpt_jax.layers import OutputMajor, layer_norm
from gpt_jax.params import decode_layout
from inference import decode_step, init_cache, prefill


def test_forward_shapes_and_dtype(config, params):
    logits = forward(params, jnp.zeros((3, 5), jnp.int32), config)
    assert logits.shape == (3, 5, config.vocab_size) and logits.dtype == jnp.float32


def test_causality_later_token_leaves_earlier_logits_unchanged(config, params):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 12)), jnp.int32)
    changed = tokens.at[:, 7].set((tokens[:, 7] + 1) % config.vocab_size)
    a, b = forward(params, tokens, config), forward(params, changed, config)
    assert_close(a[:, :7], b[:, :7], 0.0, "logits before the change")
    assert np.abs(np.asarray(a[:, 7:] - b[:, 7:])).max() > 1e-3  # later logits do change


def test_prefill_then_decode_equals_forward(config, params):
    seq = np.random.default_rng(1).integers(0, config.vocab_size, 24).astype(np.int32)
    full = forward(params, jnp.asarray(seq)[None], config)[0]  # [T, V]
    n = 9
    cache = init_cache(config, 1, 32)
    logits, cache = prefill(params, config, jnp.asarray(seq[None, :n]), jnp.array([n]), cache)
    assert_close(logits[0], full[n - 1], 1e-5, "prefill logits")
    for t in range(n, len(seq)):
        logits, cache = decode_step(params, config, jnp.asarray(seq[t: t + 1]), cache)
        assert_close(logits[0], full[t], 1e-5, f"decode logits at {t}")
    assert int(cache.lengths[0]) == len(seq) and not bool(cache.overflow[0])


@pytest.mark.parametrize("prompt", [4, OutputMajor.MANY_ROWS])  # w^T x, and x w^T (prefill)
def test_decode_layout_gives_the_same_logits(config, params, prompt):
    """The inference programs run the weights output-major and unstacked (`decode_layout`);
    prefill and decode with them equal the stacked, input-major params (the scan path), with
    few prompt rows and with `OutputMajor.MANY_ROWS` (computed in the other orientation)."""
    laid_out = jax.jit(decode_layout)(params)
    assert decode_layout(laid_out) is laid_out  # already laid out: unchanged, no copy
    rng = np.random.default_rng(prompt)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (2, prompt)), jnp.int32)
    lengths = jnp.array([prompt, prompt // 2])
    results = []
    for p in (params, laid_out):
        l1, cache = prefill(p, config, tokens, lengths, init_cache(config, 2, prompt + 4))
        l2, _ = decode_step(p, config, jnp.array([9, 10]), cache)
        results.append((l1, l2))
    (a1, a2), (b1, b2) = results
    assert_close(b1, a1, 1e-5, "prefill logits, decode layout")
    assert_close(b2, a2, 1e-5, "decode logits, decode layout")


def test_jitted_steps_equal_unjitted(config, params):
    """Compiled and eager runs of the same code agree (XLA's fusions change nothing that
    matters). It compares the code with itself, so it proves nothing about the math; the
    tests against `forward`, a naive recomputation and Hugging Face's GPT-2 do that."""
    tokens = jnp.asarray([[3, 4, 5, 6], [7, 8, 0, 0]], jnp.int32)
    lengths = jnp.array([4, 2])

    def run():
        cache = init_cache(config, 2, 16)
        l1, cache = prefill(params, config, tokens, lengths, cache)
        l2, cache = decode_step(params, config, jnp.array([9, 10]), cache)
        return l1, l2, forward(params, tokens, config)

    jitted = run()
    with jax.disable_jit():
        eager = run()
    for a, b in zip(jitted, eager):
        assert_close(a, b, 1e-5, "jit vs no-jit logits")


def test_layer_norm_uses_its_epsilon_and_a_constant_row_gives_the_bias():
    """Without eps, [0, 2e-3] would normalize to +-1; with eps 1e-5 the variance 1e-6 is
    swamped: (x - mean) / sqrt(1e-6 + 1e-5) = +-1e-3 / 3.317e-3 = +-0.3015."""
    p = {"scale": jnp.ones(2), "bias": jnp.array([0.25, -0.5])}
    out = layer_norm(p, jnp.array([[0.0, 2e-3]]), 1e-5)
    assert_close(out, [[-0.3015 + 0.25, 0.3015 - 0.5]], 1e-4, "layer_norm")
    constant = layer_norm(p, jnp.full((1, 2), 7.0), 1e-5)
    assert_close(constant, [[0.25, -0.5]], 1e-6, "constant row")


def test_fully_masked_attention_row_is_zero_not_nan():
    q = jnp.ones((2, 2, 4))
    k = v = jnp.full((3, 2, 4), 5.0)
    mask = jnp.array([[False, False, False], [True, False, False]])
    out = attend(q, k, v, mask)
    assert np.isfinite(np.asarray(out)).all()
    assert_close(out[0], np.zeros((2, 4)), 0.0, "fully masked row")
    assert_close(out[1], v[0], 1e-6, "row attending to one key")


def test_grouped_query_attention_runs_and_is_causal():
    config = GPTConfig(vocab_size=32, max_seq_len=16, n_layers=2, n_heads=4, n_kv_heads=2, d_model=32)
    params = init_params(config, jax.random.key(0))
    assert params["blocks"]["attn"]["w_k"].shape == (2, 32, 2, 8)
    tokens = jnp.arange(8)[None] % 32
    full = forward(params, tokens, config)[0]
    cache = init_cache(config, 1, 16)
    logits, cache = prefill(params, config, tokens[:, :5], jnp.array([5]), cache)
    assert_close(logits[0], full[4], 1e-5, "GQA prefill logits")
    logits, _ = decode_step(params, config, tokens[:, 5], cache)
    assert_close(logits[0], full[5], 1e-5, "GQA decode logits")
