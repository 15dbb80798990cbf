"""Live-length (blockwise, online-softmax) attention equals full attention, and never reads
cache blocks past the live length."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax import GPTConfig, forward, init_params, model
from gpt_jax.model import attend, attend_cached

L, S, N, H = 2, 21, 4, 8  # S is not a multiple of the block: the last block is shifted back


def _case(K, T, length, seed=0):
    """Random q, new k/v, and a cache row whose slots past `length` hold large garbage."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(T, N, H)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(T, K, H)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.normal(size=(L, S, K, H)).astype(np.float32) for _ in range(2))
    for c in (k_cache, v_cache):
        c[:, length:] = rng.uniform(-1e3, 1e3, size=c[:, length:].shape)
    return q, k_new, v_new, k_cache, v_cache


def _full_attention(q, k_new, v_new, k_cache, v_cache, layer, length):
    """The reference: write the new keys into the cache, attend over all S slots, causal."""
    T = q.shape[0]
    k = k_cache[layer].copy()
    v = v_cache[layer].copy()
    k[length: length + T], v[length: length + T] = k_new, v_new
    mask = np.arange(S)[None, :] <= (length + np.arange(T))[:, None]
    return attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))


@pytest.fixture
def block4(monkeypatch):
    """Blocks of 4 slots, so these small shapes span several blocks."""
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 4)


@pytest.mark.parametrize("K", [4, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("T,lengths", [(1, (0, 1, 3, 4, 5, 20)), (6, (0, 7, 15))])
def test_live_length_attention_equals_full_attention(block4, K, T, lengths):
    run = jax.jit(attend_cached)  # length and bound traced: one compile per shape
    for length in lengths:
        q, k_new, v_new, k_cache, v_cache = _case(K, T, length)
        expected = _full_attention(q, k_new, v_new, k_cache, v_cache, 1, length)
        # bound: this row's length, or a longer row's (the batch maximum), or the capacity
        for bound in (length, min(length + 6, S), S):
            got = run(q, k_new, v_new, k_cache, v_cache, 1, length, jnp.int32(bound))
            assert_close(got, expected, 2e-5, f"attention at length {length}, bound {bound}")


def test_blocks_past_the_bound_are_never_read(block4):
    """NaN in every cache block at or past the bound's block: a full read would turn the
    output NaN (0 * NaN in the value sum), a live-length read stays equal to the reference."""
    length, T = 6, 1
    q, k_new, v_new, k_cache, v_cache = _case(2, T, length)
    expected = _full_attention(q, k_new, v_new, k_cache, v_cache, 0, length)
    k_cache[:, 8:], v_cache[:, 8:] = np.nan, np.nan  # blocks 2.. of 4 slots
    got = jax.jit(attend_cached)(q, k_new, v_new, k_cache, v_cache, 0, length, jnp.int32(length))
    assert_close(got, expected, 2e-5, "attention with NaN past the live blocks")


def test_long_prefill_is_blockwise_and_equals_full_attention(monkeypatch):
    """A 40-token prefill in blocks of 8 keys equals one full [T, S] softmax."""
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 8)
    T, K = 40, 2
    rng = np.random.default_rng(3)
    q = rng.normal(size=(T, N, H)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(T, K, H)).astype(np.float32) for _ in range(2))
    empty = np.zeros((1, T, K, H), np.float32)
    got = jax.jit(attend_cached, static_argnums=(6, 7))(q, k_new, v_new, empty, empty, 0, 0, 0)
    mask = np.tril(np.ones((T, T), bool))
    assert_close(got, attend(q, k_new, v_new, jnp.asarray(mask)), 2e-5, "blockwise prefill")


def test_forward_gradient_flows_through_blockwise_attention(monkeypatch):
    """Training differentiates `forward`, whose attention runs in several key blocks."""
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 4)
    config = GPTConfig(vocab_size=16, max_seq_len=16, n_layers=1, n_heads=2, d_model=16)
    params = init_params(config, jax.random.key(0))
    tokens = jnp.arange(10)[None] % 16

    def loss(p):
        return forward(p, tokens, config)[0, -1].sum()

    grads = jax.jit(jax.grad(loss))(params)
    w_k = np.asarray(grads["blocks"]["attn"]["w_k"])
    assert np.isfinite(w_k).all() and np.abs(w_k).max() > 0
