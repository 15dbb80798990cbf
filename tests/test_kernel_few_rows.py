"""The CPU few-rows float32 matmul kernel (`gpt_jax.kernels.few_rows_matmul`) computes XLA's
product to float rounding, alone and under vmap, one weight or several per call, on the
calling thread and over the thread pool; a speculative verification and a decode step use
it only where the rows are few (batch times positions up to MAX_ROWS), and greedy decoding
gives the same tokens with it as without."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_jax import GPTConfig, init_cache, layers
from gpt_jax.kernels import few_rows_matmul as few_rows_kernel
from gpt_jax.params import decode_layout
from inference import steps
from inference.verify import run_verify
from tests.conftest import assert_close, assert_lively, lively_params


@pytest.mark.parametrize("M,I,O", [
    (2, 37, 29),  # inputs off the 8-float vectors, an odd channel left over
    (8, 128, 344),  # a whole tile of rows
    (5, 256, 512),  # the largest weight it is used for
])
def test_kernel_equals_xla_alone_and_vmapped(M, I, O):
    assert few_rows_kernel.available(), "the CPU few-rows kernel did not build"
    rng = np.random.default_rng(M)
    x = rng.normal(size=(M, I)).astype(np.float32)
    w = rng.normal(size=(O, I)).astype(np.float32)
    kernel = jax.jit(few_rows_kernel.few_rows_matmul)(x, w)
    vmapped = jax.jit(jax.vmap(few_rows_kernel.few_rows_matmul, in_axes=(0, None)))(
        x.reshape(M, 1, I), w)[:, 0]  # one call for the batch's rows
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    for got, what in ((kernel, "kernel"), (vmapped, "vmapped kernel")):
        assert got.shape == (M, O) and got.dtype == jnp.float32
        diff = np.abs(np.asarray(got, np.float64) - exact)
        assert (diff <= 1e-6 * math.sqrt(I) * magnitude).all(), what


def test_several_weights_in_one_call_equal_xla_for_1_to_8_rows():
    """Three weights of one input in one call, 1.2 MB in all (over the calling-thread
    limit: spread over the thread pool in runs of channels, the last run of each weight
    partial), I off the vectors; and one weight of 1 KB (the calling thread alone)."""
    assert few_rows_kernel.available(), "the CPU few-rows kernel did not build"
    rng = np.random.default_rng(0)
    I = 37
    for Os in ((4103, 3, 4001), (7,)):
        ws = [rng.normal(size=(O, I)).astype(np.float32) for O in Os]
        call = jax.jit(lambda x, *ws: few_rows_kernel.few_rows_matmuls(x, list(ws)))
        for M in range(1, few_rows_kernel.MAX_ROWS + 1):
            x = rng.normal(size=(M, I)).astype(np.float32)
            for got, w in zip(call(x, *ws), ws):
                exact = x.astype(np.float64) @ w.astype(np.float64).T
                magnitude = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
                assert got.shape == (M, w.shape[0]) and got.dtype == jnp.float32
                diff = np.abs(np.asarray(got, np.float64) - exact)
                assert (diff <= 1e-6 * math.sqrt(I) * magnitude).all(), (Os, M)


def test_calls_from_several_threads_at_once_each_get_their_own_products():
    """Back-to-back calls over the pool from three Python threads at once: the pool's helpers
    keep spinning after a call and take the next call's work, whichever thread made it
    (`parallel_for` with spin, common.h), so every product must still be its own call's."""
    import concurrent.futures

    rng = np.random.default_rng(1)
    I = 40
    ws = [rng.normal(size=(O, I)).astype(np.float32) for O in (5003, 2999)]  # 1.3 MB: pooled
    call = jax.jit(lambda x, *ws: few_rows_kernel.few_rows_matmuls(x, list(ws)))
    xs = [rng.normal(size=(1 + k % 3, I)).astype(np.float32) for k in range(3)]
    want = [[x.astype(np.float64) @ w.astype(np.float64).T for w in ws] for x in xs]

    def calls(k):
        for _ in range(40):
            for got, exact in zip(call(xs[k], *ws), want[k]):
                np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-4, atol=1e-4)
        return k

    with concurrent.futures.ThreadPoolExecutor(3) as threads:
        assert sorted(threads.map(calls, range(3))) == [0, 1, 2]


def _greedy_decode(params, config, first_B, n_steps):
    """`n_steps` greedy decode steps from one token per row (an empty cache), through one
    program traced here (the kernel choice is made at tracing): `(tokens [B, n_steps],
    logits [n_steps, B, V], hlo)`."""
    B = first_B.shape[0]
    cache = init_cache(config, B, n_steps + 1)
    step = jax.jit(lambda p, t, c: steps.run_decode(p, config, t, c, jnp.ones(t.shape, bool)))
    step = step.lower(params, first_B, cache).compile()
    tokens, logits = [first_B], []
    for _ in range(n_steps):
        logits_BV, cache = step(params, tokens[-1], cache)
        logits.append(np.asarray(logits_BV))
        tokens.append(jnp.argmax(logits_BV, axis=-1).astype(jnp.int32))
    return np.stack([np.asarray(t) for t in tokens[1:]], 1), np.stack(logits), step.as_text()


def test_greedy_decode_with_the_kernel_equals_xla(monkeypatch):
    """A Llama-style model (q/k/v and gate/up in one call each, untied output): decode at
    batch 2 (two rows per call: the kernel), and at batch 1 with the one-row limit lowered
    (its weights are small: the kernel for every product), give XLA's greedy tokens."""
    config = GPTConfig.preset("tiny-llama")
    params = decode_layout(lively_params(config))
    first_B = jnp.asarray([3, 17], jnp.int32)
    tokens, logits, hlo = _greedy_decode(params, config, first_B, 12)
    # per layer q/k/v (one call), o, gate/up (one call), down; then the output projection
    assert hlo.count(f'custom_call_target="{few_rows_kernel.TARGET}"') == 4 * config.n_layers + 1
    _, _, hlo_solo = _greedy_decode(params, config, first_B[:1], 2)
    assert few_rows_kernel.TARGET not in hlo_solo  # one row, weights in cache: XLA's
    monkeypatch.setattr(few_rows_kernel, "MAX_CACHED_FLOATS", 0)
    solo, solo_logits, hlo_solo = _greedy_decode(params, config, first_B[:1], 12)
    assert few_rows_kernel.TARGET in hlo_solo
    monkeypatch.setattr(few_rows_kernel, "available", lambda: False)
    xla, xla_logits, hlo_xla = _greedy_decode(params, config, first_B, 12)
    assert few_rows_kernel.TARGET not in hlo_xla
    assert_lively(xla[0].tolist(), 4)
    assert (tokens == xla).all() and (solo == xla[:1]).all()
    scale = float(np.abs(xla_logits).max())
    assert_close(logits, xla_logits, 1e-5 * scale, "kernel vs XLA logits")
    assert_close(solo_logits[:, 0], xla_logits[:, 0], 1e-5 * scale, "one-row kernel vs XLA")


def _verify(params, config, batch, T, compile=True):
    """One verification of T positions per row at cache length 5 (zero keys and values
    there), traced here (the kernel choice is made at tracing): `(logits_BTV, hlo)`, or
    only the lowered program's text without `compile`."""
    cache = init_cache(config, batch, 16)
    cache = cache.replace(lengths=jnp.full((batch,), 5, jnp.int32))
    tokens = jnp.asarray(np.arange(batch * T).reshape(batch, T) % config.vocab_size, jnp.int32)
    fn = jax.jit(lambda p, t, c, n: run_verify(p, config, t, c, n)[0])
    lowered = fn.lower(params, tokens, cache, jnp.full((batch,), T, jnp.int32))
    if not compile:
        return None, lowered.as_text()
    compiled = lowered.compile()
    return compiled(params, tokens, cache, jnp.full((batch,), T, jnp.int32)), compiled.as_text()


def test_verification_uses_the_kernel_for_few_rows_only(config, params, monkeypatch):
    params = decode_layout(params)
    logits, hlo = _verify(params, config, 1, 4)
    assert few_rows_kernel.TARGET in hlo
    x, w = jnp.ones((4, 8)), layers.OutputMajor(jnp.ones((16, 8)))
    assert few_rows_kernel.TARGET not in jax.jit(w.matmul).lower(x).as_text()  # not verifying
    _, hlo_wide = _verify(params, config, 4, 4, compile=False)  # 16 rows: XLA's product
    assert few_rows_kernel.TARGET not in hlo_wide
    monkeypatch.setattr(few_rows_kernel, "available", lambda: False)
    xla, hlo_xla = _verify(params, config, 1, 4)
    assert few_rows_kernel.TARGET not in hlo_xla
    assert_close(logits, xla, 1e-5 * float(np.abs(np.asarray(xla)).max()), "kernel vs XLA logits")
