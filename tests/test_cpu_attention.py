"""The CPU decode-attention kernel (gpt_jax/cpu_attention.cc): a vmapped batch of rows with
their own lengths equals full attention row by row, it never reads a slot past a row's
length, and a kernel that cannot be built leaves the XLA path running, with a warning."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax import cpu_attention
from gpt_jax import cache as kv

N, S, PAGE = 4, 21, 4  # pages of 4 slots: five of 4 and one of 1


def _rows(K, lengths, dtype, H=8, seed=0):
    """Queries `[B, K, G, H]` and a batch-major cache `[B, K, S, H]` per k and v; slots past
    each row's length hold NaN, which any read of them would carry into the output."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    q = rng.normal(size=(B, K, N // K, H)).astype(np.float32)
    k, v = (np.array(jnp.asarray(rng.normal(size=(B, K, S, H)), dtype).astype(jnp.float32))
            for _ in range(2))
    for b, length in enumerate(lengths):
        k[b, :, length:], v[b, :, length:] = np.nan, np.nan
    return q, k, v


def _reference(q_KGH, k_KSH, v_KSH, length):
    """Full attention of one row over its first `length` slots, in float64 numpy (zeros for
    none): softmax(q k^T / sqrt(H)) v."""
    H = q_KGH.shape[-1]
    if length == 0:
        return np.zeros(q_KGH.shape)
    scores_KGS = np.einsum("kgh,ksh->kgs", q_KGH, k_KSH[:, :length], dtype=np.float64)
    probs_KGS = np.exp(scores_KGS / np.sqrt(H) - (scores_KGS / np.sqrt(H)).max(-1, keepdims=True))
    probs_KGS /= probs_KGS.sum(-1, keepdims=True)
    return np.einsum("kgs,ksh->kgh", probs_KGS, v_KSH[:, :length])


@pytest.mark.parametrize("H", [8, 32, 64, 128])  # any head dim; those compiled for registers
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("K", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_kernel_batch_equals_full_attention_row_by_row(K, dtype, H):
    assert cpu_attention.available(), "the CPU attention kernel did not build"
    lengths = [0, 1, 3, 4, 5, 20, 21, 22]  # none, page edges, the last slot, past it (all)
    q, k, v = _rows(K, lengths, dtype, H)
    pages = [kv.split_pages(jnp.asarray(x, dtype), PAGE, axis=2) for x in (k, v)]
    run = jax.jit(jax.vmap(cpu_attention.paged_decode_attention))
    got = run(jnp.asarray(q), *pages, jnp.asarray(lengths, jnp.int32))
    assert got.dtype == jnp.float32 and got.shape == q.shape
    for b, length in enumerate(lengths):
        expected = _reference(q[b], k[b], v[b], min(length, S))
        assert_close(got[b], expected, 2e-6, f"row {b} (length {length}, {K} kv heads, H {H})")


def test_kernel_runs_one_row_without_vmap():
    assert cpu_attention.available()
    q, k, v = _rows(2, [13], jnp.float32, 64)
    pages = [kv.split_pages(jnp.asarray(x[0]), PAGE, axis=1) for x in (k, v)]
    got = jax.jit(cpu_attention.paged_decode_attention)(jnp.asarray(q[0]), *pages, 13)
    assert_close(got, _reference(q[0], k[0], v[0], 13), 2e-6, "one row")


def test_a_kernel_that_does_not_compile_warns_and_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.warns(RuntimeWarning, match="did not compile .*`false -O3 .* exited with 1"):
        assert cpu_attention.available.__wrapped__() is False  # uncached: build again
    assert list((tmp_path / "gpt-jax").iterdir()) == []  # no library, whole or partial
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="CPU attention kernel unavailable"):
        assert cpu_attention.available.__wrapped__() is False


def test_the_kernel_can_be_switched_off(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("GPT_JAX_CPU_KERNEL", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu_attention.available.__wrapped__() is False
    assert not (tmp_path / "gpt-jax").exists()  # nothing built
