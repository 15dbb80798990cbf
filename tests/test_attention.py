"""Live-length (blockwise, online-softmax) attention equals full attention, and never reads
cache blocks past the live length: over one cache buffer (prefill, `attend_cached`) and over
a paged cache (the decode loop, `attend_paged`)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax import GPTConfig, forward, init_cache, init_params, model
from gpt_jax import cache as kv
from gpt_jax.cache import CACHE_BATCH_AXES
from gpt_jax.model import attend, attend_cached, attend_paged

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


def head_major(cache_LSKH):
    """The cache row as the model stores it, `[L, K, S, H]`."""
    return np.ascontiguousarray(cache_LSKH.transpose(0, 2, 1, 3))


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
            got = run(q, k_new, v_new, head_major(k_cache), head_major(v_cache), 1, length,
                      jnp.int32(bound))
            assert_close(got, expected, 2e-5, f"attention at length {length}, bound {bound}")


def test_blocks_past_the_bound_are_never_read(block4):
    """NaN in every cache block at or past the bound's block: a full read would turn the
    output NaN (0 * NaN in the value sum), a live-length read stays equal to the reference."""
    length, T = 6, 1
    q, k_new, v_new, k_cache, v_cache = _case(2, T, length)
    expected = _full_attention(q, k_new, v_new, k_cache, v_cache, 0, length)
    k_cache[:, 8:], v_cache[:, 8:] = np.nan, np.nan  # blocks 2.. of 4 slots
    got = jax.jit(attend_cached)(q, k_new, v_new, head_major(k_cache), head_major(v_cache), 0,
                                 length, jnp.int32(length))
    assert_close(got, expected, 2e-5, "attention with NaN past the live blocks")


def _pages(cache_LSKH, layer):
    """Layer `layer` of a cache row as pages of 4 slots: S = 21 gives 5 of 4 and one of 1."""
    return kv.split_pages(jnp.asarray(head_major(cache_LSKH)[layer]), 4)


@pytest.mark.parametrize("K", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_paged_decode_attention_equals_full_attention(decode_attention, K):
    """One new token at lengths on, before and after page edges, up to the last slot: the
    output equals full attention, and the pages hold the new key and value at `length`."""
    run = jax.jit(lambda *args: attend_paged(*args))  # traced here, length and bound too
    for length in (0, 1, 3, 4, 5, 19, 20):
        q, k_new, v_new, k_cache, v_cache = _case(K, 1, length)
        expected = _full_attention(q, k_new, v_new, k_cache, v_cache, 1, length)
        k_cache[1, length], v_cache[1, length] = k_new[0], v_new[0]
        for bound in (length, min(length + 6, S - 1)):  # own length, or a longer row's
            got, (k_pages, v_pages, ok) = run(q, k_new, v_new, _pages(k_cache, 1),
                                              _pages(v_cache, 1), length, jnp.int32(bound))
            assert bool(ok)
            assert_close(got, expected, 2e-5, f"paged attention at length {length}, bound {bound}")
            for pages, cache in ((k_pages, k_cache), (v_pages, v_cache)):
                assert_close(jnp.concatenate(pages, axis=1), head_major(cache)[1], 0.0,
                             f"pages after writing slot {length}")


def test_pages_past_the_bound_are_never_read(decode_attention):
    """NaN in every page past the bound's page (pages of 4: slots 8.. for bound 6)."""
    length = 6
    q, k_new, v_new, k_cache, v_cache = _case(2, 1, length)
    expected = _full_attention(q, k_new, v_new, k_cache, v_cache, 0, length)
    k_cache[:, 8:], v_cache[:, 8:] = np.nan, np.nan
    got, _ = jax.jit(lambda *args: attend_paged(*args))(
        q, k_new, v_new, _pages(k_cache, 0), _pages(v_cache, 0), length, jnp.int32(length))
    assert_close(got, expected, 2e-5, "paged attention with NaN past the live pages")


def test_long_prefill_is_blockwise_and_equals_full_attention(monkeypatch):
    """A 40-token prefill in blocks of 8 keys equals one full [T, S] softmax."""
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 8)
    T, K = 40, 2
    rng = np.random.default_rng(3)
    q = rng.normal(size=(T, N, H)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(T, K, H)).astype(np.float32) for _ in range(2))
    empty = np.zeros((1, K, T, H), np.float32)
    got = jax.jit(attend_cached, static_argnums=(6, 7))(q, k_new, v_new, empty, empty, 0, 0, 0)
    mask = np.tril(np.ones((T, T), bool))
    assert_close(got, attend(q, k_new, v_new, jnp.asarray(mask)), 2e-5, "blockwise prefill")


def test_forward_gradients_equal_blockwise_path_gradients(monkeypatch):
    """Training differentiates `forward` (plain masked attention); the cached path runs the same
    math in several key blocks with an online softmax. Their gradients agree, so either could
    train the model."""
    monkeypatch.setattr(model, "ATTENTION_BLOCK", 4)
    config = GPTConfig(vocab_size=16, max_seq_len=16, n_layers=2, n_heads=4, n_kv_heads=2,
                       d_model=16)
    params = init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (1, 10)), jnp.int32)

    def loss_forward(p):
        return (forward(p, tokens, config) ** 2).mean()

    def loss_blockwise(p):
        run_row = functools.partial(model.transformer, config=config, bound=0)
        x_BTD, _ = jax.vmap(run_row, in_axes=(None, 0, CACHE_BATCH_AXES))(
            p, tokens, init_cache(config, 1, 16))
        return (model.lm_head(p, x_BTD, config) ** 2).mean()

    got = jax.jit(jax.grad(loss_forward))(params)
    want = jax.jit(jax.grad(loss_blockwise))(params)
    for path, g in jax.tree_util.tree_leaves_with_path(got):
        w = dict(jax.tree_util.tree_leaves_with_path(want))[path]
        assert_close(g, w, 1e-6 + 1e-4 * float(np.abs(w).max()), jax.tree_util.keystr(path))
    assert np.abs(np.asarray(got["blocks"]["attn"]["w_k"])).max() > 0


def test_linear_gradient_equals_autodiff():
    """`linear` chooses its backward matmul layouts by hand; the values are autodiff's."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(3, 5, 7)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(7, 4)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(4,)), jnp.float32)
    probe = jnp.asarray(rng.normal(size=(3, 5, 4)), jnp.float32)

    def loss(f):
        return lambda x, w, b: (jnp.tanh(f(x, w, b)) * probe).sum()

    got = jax.grad(loss(model.linear), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(lambda x, w, b: x @ w + b[None, None]), argnums=(0, 1, 2))(x, w, b)
    for name, g, e in zip("xwb", got, want):
        assert_close(g, e, 1e-5, f"d loss / d {name}")
