"""The CPU few-rows float32 matmul kernel (`gpt_jax.kernels.few_rows_matmul`) computes XLA's
product to float rounding, alone and under vmap, and a speculative verification uses it
only where its rows are few (batch times positions up to MAX_ROWS)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_jax import init_cache, layers
from gpt_jax.kernels import few_rows_matmul as few_rows_kernel
from gpt_jax.params import decode_layout
from inference.verify import run_verify
from tests.conftest import assert_close


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
