"""The CPU causal-attention kernels of the training path (gpt_jax/kernels/causal_attention.cc):
forward equals float64 attention and the backward equals XLA's autodiff of `attend`, for
multi-head, grouped-query and multi-query heads, every compiled head dim and lengths off
the kernels' tiles; the model's training loss and gradients are the same with them as
without; they are in the CPU program and out of portable and bfloat16 ones."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax import attention, init_params, kernels
from gpt_jax.config import GPTConfig
from gpt_jax.kernels import causal_attention
from training.step import loss_fn

N = 4  # query heads


@pytest.fixture(autouse=True)
def _kernels_built():
    assert causal_attention.available(), "the CPU causal attention kernel did not build"


def _inputs(B, T, K, H, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)]
    return [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]


def _reference(q, k, v):
    """Causal attention in float64 numpy: query t of head n sees keys 0..t of kv head
    n // (N // K)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, _, H = q.shape
    group = N // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(H)
    scores = np.where(np.tril(np.ones((T, T), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnts,bsnh->btnh", probs, v)


def _assert_gradients_equal_xla(gradient, q, k, v, what):
    """`gradient(attention)(q, k, v)` -> (dq, dk, dv), jitted, with the kernels and with
    XLA's `attend` (`_attend_causal_xla`), equal to 1e-5."""
    got = jax.jit(gradient(causal_attention.causal_attention))(q, k, v)
    want = jax.jit(gradient(attention._attend_causal_xla))(q, k, v)
    for name, g, w in zip("qkv", got, want):
        assert_close(g, w, 1e-5, f"d{name}, {what}")


def _weighted_sum_gradient(d_out):
    return lambda attention: jax.grad(lambda q, k, v: (attention(q, k, v) * d_out).sum(),
                                      argnums=(0, 1, 2))


@pytest.mark.parametrize("B, T, K, H", [
    (3, 64, 4, 32),   # the nanogpt-cpu layer shape: multi-head
    (2, 67, 2, 64),   # grouped-query; T off the 4-row tiles and 8-key blocks
    (1, 5, 1, 128),   # multi-query, fewer keys than one block
    (2, 1, 4, 32),    # one position
])
def test_kernels_equal_attention_forward_and_backward(B, T, K, H):
    q, k, v, d_out = _inputs(B, T, K, H)
    what = f"B {B}, T {T}, K {K}, H {H}"
    out = jax.jit(causal_attention.causal_attention)(q, k, v)
    assert out.dtype == jnp.float32 and out.shape == q.shape
    assert_close(out, _reference(q, k, v), 2e-6, what)
    _assert_gradients_equal_xla(_weighted_sum_gradient(d_out), q, k, v, what)


def test_vmapped_kernels_equal_each_element_alone():
    q, k, v, d_out = (x.reshape(2, 3, *x.shape[1:]) for x in _inputs(6, 16, 2, 32))
    loss = lambda q, k, v, d: (causal_attention.causal_attention(q, k, v) * d).sum()
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, d_out)
    for i in range(2):
        alone = jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i], d_out[i])
        for name, got, want in zip("qkv", grads, alone):
            assert_close(got[i], want, 1e-6, f"d{name} of element {i}")


def test_training_loss_and_gradients_are_the_same_without_the_kernels(monkeypatch):
    config = GPTConfig(vocab_size=65, max_seq_len=32, n_layers=2, n_heads=4, d_model=128)
    params = init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 33), 0, 65)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def loss_and_grads():
        return jax.jit(jax.value_and_grad(loss_fn), static_argnums=1)(params, config, x, y)

    hlo = jax.jit(jax.grad(loss_fn), static_argnums=1).lower(params, config, x, y).as_text()
    assert causal_attention.FORWARD in hlo and causal_attention.BACKWARD in hlo
    loss, grads = loss_and_grads()
    monkeypatch.setattr(causal_attention, "use_kernel", lambda *qkv: False)
    xla_loss, xla_grads = loss_and_grads()
    assert_close(loss, xla_loss, 1e-6, "loss")
    jax.tree_util.tree_map_with_path(
        lambda path, got, want: assert_close(got, want, 1e-5, jax.tree_util.keystr(path)),
        grads, xla_grads)


def test_second_order_gradients_equal_xla_attention():
    q, k, v, d_out = _inputs(2, 9, 2, 32)

    def hessian_vector(attention):  # d/d(q, k, v) of <grad_q loss, q>, through both kernels
        grad_q = lambda q, k, v: _weighted_sum_gradient(d_out)(attention)(q, k, v)[0]  # noqa: E731
        return jax.grad(lambda q, k, v: jnp.vdot(grad_q(q, k, v), q), argnums=(0, 1, 2))

    _assert_gradients_equal_xla(hessian_vector, q, k, v, "second order")


def test_huge_scores_stay_finite_and_exact():
    q, k, v, _ = _inputs(2, 13, 2, 32)
    k = k.at[0, 5, 0].set(1e10)  # key 5 of kv head 0 dominates every later query's softmax
    out = jax.jit(causal_attention.causal_attention)(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    assert_close(out, _reference(q, k, v), 2e-6, "scores of 1e10")
    # one-hot rows: dq is exactly 0 there, not rounding x 1e10
    _assert_gradients_equal_xla(_weighted_sum_gradient(jnp.ones_like(q)), q, k, v,
                                "scores of 1e10")


def test_mixed_dtypes_take_xla_and_bad_shapes_are_refused_when_traced():
    q, k, v, _ = _inputs(1, 8, 2, 32)
    k16, v16 = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    assert not causal_attention.use_kernel(q, k16, v16)
    out = jax.jit(attention.attend_causal)(q, k16, v16)
    assert out.dtype == jnp.bfloat16
    assert_close(out.astype(jnp.float32), _reference(q, k16, v16), 3e-2, "bfloat16 k, v")
    with pytest.raises(ValueError, match=r"q \(1, 8, 4, 32\), k \(1, 7, 2, 32\)"):
        jax.jit(causal_attention.causal_attention).lower(q, k[:, :7], v[:, :7])
    with pytest.raises(ValueError, match="K dividing N"):
        jax.jit(causal_attention.causal_attention).lower(q, *_inputs(1, 8, 3, 32)[1:3])


@pytest.mark.parametrize("case", ["portable", "bfloat16"])
def test_portable_and_bfloat16_programs_do_not_call_the_kernels(case):
    q, k, v, _ = _inputs(1, 8, 4, 32)
    if case == "bfloat16":
        q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
        hlo = jax.jit(attention.attend_causal).lower(q, k, v).as_text()
    else:
        with kernels.portable():  # a fresh function: jit caches by function, not context
            hlo = jax.jit(lambda *a: attention.attend_causal(*a)).lower(q, k, v).as_text()
    assert causal_attention.FORWARD not in hlo
    assert causal_attention.FORWARD in jax.jit(attention.attend_causal).lower(
        *(x.astype(jnp.float32) for x in (q, k, v))).as_text()  # the float32 program does
