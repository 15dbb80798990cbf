"""Paged attention (blockwise online softmax over a row's pages, found through its page
table in a shared pool) equals full attention, and never reads pages past the live length;
prefill attention is blockwise too; the blockwise path differentiates like `forward`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax import GPTConfig, attention, forward, init_cache, init_params, layers, model
from gpt_jax.cache import CACHE_ROW_AXES, NO_PAGE
from gpt_jax.attention import attend, attend_paged

S, N, H, P = 21, 4, 8, 4  # S is not a multiple of the page: the last page is partly used
NUM_PAGES = 16


def _case(K, T, length, seed=0):
    """Random q, new k/v, and a row's cache slots `[S, K, H]` whose slots past `length` hold
    large garbage."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(T, N, H)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(T, K, H)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.normal(size=(S, K, H)).astype(np.float32) for _ in range(2))
    for c in (k_cache, v_cache):
        c[length:] = rng.uniform(-1e3, 1e3, size=c[length:].shape)
    return q, k_new, v_new, k_cache, v_cache


def _full_attention(q, k_new, v_new, k_cache, v_cache, length):
    """The reference: the new keys after the cached slots, attend over all, causal."""
    T = q.shape[0]
    k, v = k_cache.copy(), v_cache.copy()
    k[length: length + T], v[length: length + T] = k_new, v_new
    mask = np.arange(S)[None, :] <= (length + np.arange(T))[:, None]
    return attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(mask))


def _pool(cache_SKH, seed=1):
    """The row's slots as pages of P in a pool of NUM_PAGES, at shuffled page ids (the rest of
    the pool holds garbage), and its page table `[8]` (NO_PAGE after its 6 pages)."""
    rng = np.random.default_rng(seed)
    n = -(-S // P)
    ids = rng.permutation(NUM_PAGES)[:n]
    pool = rng.uniform(-1e3, 1e3, size=(NUM_PAGES, cache_SKH.shape[1], P, H)).astype(np.float32)
    padded = np.concatenate([cache_SKH, np.zeros((n * P - S,) + cache_SKH.shape[1:], np.float32)])
    pool[ids] = padded.reshape(n, P, -1, H).transpose(0, 2, 1, 3)
    table = np.full(8, NO_PAGE, np.int32)
    table[:n] = ids
    return pool, table


@pytest.mark.parametrize("K", [4, 2, 1])  # multi-head, grouped-query, multi-query
@pytest.mark.parametrize("T,lengths", [(1, (0, 1, 3, 4, 5, 19, 20)), (6, (0, 7, 15))])
def test_paged_attention_equals_full_attention(decode_attention, K, T, lengths):
    """New tokens at lengths on, before and after page edges, up to the last slot; decode
    (T = 1) through both paths (the CPU kernel and XLA's), prefill chunks (T = 6)."""
    run = jax.jit(lambda *args: attend_paged(*args))  # traced here, length and bound too
    for length in lengths:
        q, k_new, v_new, k_cache, v_cache = _case(K, T, length)
        expected = _full_attention(q, k_new, v_new, k_cache, v_cache, length)
        (k_pool, table), (v_pool, _) = _pool(k_cache), _pool(v_cache)
        # bound: this row's length, or a longer row's (the batch maximum), or the capacity
        for bound in (length, min(length + 6, S), 8 * P):
            got = run(q, k_new, v_new, k_pool, v_pool, table, length, jnp.int32(bound))
            assert_close(got, expected, 2e-5, f"attention at length {length}, bound {bound}")


def test_pages_past_the_bound_are_never_read(decode_attention):
    """NaN in every page past the bound's page (pages of 4: slots 8.. for length 6): a full
    read would turn the output NaN (0 * NaN in the value sum), a live read does not."""
    length = 6
    q, k_new, v_new, k_cache, v_cache = _case(2, 1, length)
    expected = _full_attention(q, k_new, v_new, k_cache, v_cache, length)
    k_cache[8:], v_cache[8:] = np.nan, np.nan
    (k_pool, table), (v_pool, _) = _pool(k_cache), _pool(v_cache)
    got = jax.jit(lambda *args: attend_paged(*args))(
        q, k_new, v_new, k_pool, v_pool, table, length, jnp.int32(length))
    assert_close(got, expected, 2e-5, "paged attention with NaN past the live pages")


def test_long_prefill_is_blockwise_and_equals_full_attention(monkeypatch):
    """A 40-token prefill in blocks of 8 keys equals one full [T, S] softmax."""
    monkeypatch.setattr(attention, "ATTENTION_BLOCK", 8)
    T, K = 40, 2
    rng = np.random.default_rng(3)
    q = rng.normal(size=(T, N, H)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(T, K, H)).astype(np.float32) for _ in range(2))
    pool, table = np.zeros((2, K, P, H), np.float32), np.full(4, NO_PAGE, np.int32)
    got = jax.jit(attend_paged, static_argnums=(6, 7))(q, k_new, v_new, pool, pool, table, 0, 0)
    mask = np.tril(np.ones((T, T), bool))
    assert_close(got, attend(q, k_new, v_new, jnp.asarray(mask)), 2e-5, "blockwise prefill")


def test_forward_gradients_equal_blockwise_path_gradients(monkeypatch):
    """Training differentiates `forward` (plain masked attention); the cached path runs the same
    math in several key blocks with an online softmax. Their gradients agree, so either could
    train the model."""
    monkeypatch.setattr(attention, "ATTENTION_BLOCK", 4)
    config = GPTConfig(vocab_size=16, max_seq_len=16, n_layers=2, n_heads=4, n_kv_heads=2,
                       d_model=16)
    params = init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (1, 10)), jnp.int32)

    def loss_forward(p):
        return (forward(p, tokens, config) ** 2).mean()

    def loss_blockwise(p):
        run_row = functools.partial(model.transformer, config=config, bound=0)
        x_BTD, _ = jax.vmap(run_row, in_axes=(None, 0, CACHE_ROW_AXES))(
            p, tokens, init_cache(config, 1, 16, page_size=4))
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

    got = jax.grad(loss(layers.linear), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(lambda x, w, b: x @ w + b[None, None]), argnums=(0, 1, 2))(x, w, b)
    for name, g, e in zip("xwb", got, want):
        assert_close(g, e, 1e-5, f"d loss / d {name}")
