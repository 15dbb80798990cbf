"""Float32 weights in panels (`gpt_jax.layers.PanelMajor`, the CPU panel kernel's float32
target): the kernel computes XLA's product to float rounding at every tile shape, alone,
under vmap and several weights per call; `inference_params` lays out exactly the large
float32 block matrices in panels, only where the kernel runs, and never twice; quantizing
and checking such params works as from the plain decode layout; and decoding gives the
tokens of the `OutputMajor` weights, through `generate` and the `Engine`."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpt_jax import GPTConfig, kernels
from gpt_jax.kernels import panel_matmul as panel_kernel
from gpt_jax.layers import Int8Weight, OutputMajor, PanelMajor, to_panels
from gpt_jax.params import check_params, decode_layout, inference_params, quantize
from inference.engine import Engine
from inference.generation import generate
from inference.sampling_params import SamplingParams
from tests.conftest import assert_close, lively_params

# d_model 320, one kv head of 80: w_q (320 x 320) alone is under the 512 KB of weights that
# stay in cache, w_q, w_k and w_v (one input, one call) are over it, so all three go in
# panels, as the MLP's (1280 x 320); w_o (320 x 320) stays OutputMajor.
WIDE = GPTConfig(vocab_size=97, max_seq_len=64, n_layers=2, n_heads=4, n_kv_heads=1,
                 d_model=320)


def _bound(x, w_OI):
    """Float rounding of a float32 sum of I products in any order: ~I ulps of the sum of
    their magnitudes at worst, ~sqrt(I) typically (the paths add in different orders)."""
    magnitude = np.abs(x).astype(np.float64) @ np.abs(w_OI).astype(np.float64).T
    return 1e-6 * math.sqrt(x.shape[1]) * magnitude


@pytest.mark.parametrize("M,I,O", [
    # Tiles (kernels/panel_matmul.cc `panels`): three panels by eight rows with AVX-512, one
    # panel by six rows with AVX2; one or two rows panel by panel; rows and panels left over.
    (1, 37, 64), (2, 37, 64), (7, 37, 64),
    (9, 64, 80), (16, 128, 48), (17, 96, 112),  # whole tiles and 1, 0 or 1 row(s) left over
    (33, 1100, 32),  # inputs past L1, four tiles of rows and one row left over
])
def test_float32_panel_kernel_equals_the_exact_product_alone_and_vmapped(M, I, O):
    assert panel_kernel.available(), "the CPU panel kernel did not build"
    rng = np.random.default_rng(M)
    x = rng.normal(size=(M, I)).astype(np.float32)
    w = rng.normal(size=(O, I)).astype(np.float32)
    panels = to_panels(jnp.asarray(w))
    assert panels.shape == (O // 16, I, 16)
    kernel = jax.jit(lambda x, p: panel_kernel.f32_panel_matmuls(x, [p])[0])(x, panels)
    vmapped = jax.jit(jax.vmap(lambda x, p: panel_kernel.f32_panel_matmuls(x, [p])[0],
                               in_axes=(0, None)))(x.reshape(M, 1, I), panels)[:, 0]
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    for got, what in ((kernel, "kernel"), (vmapped, "vmapped kernel")):
        assert got.shape == (M, O) and got.dtype == jnp.float32
        assert (np.abs(np.asarray(got, np.float64) - exact) <= _bound(x, w)).all(), what


def test_several_weights_in_one_call_and_xlas_contraction_equal_the_products():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(10, 48)).astype(np.float32)
    ws = [rng.normal(size=(O, 48)).astype(np.float32) for O in (64, 16, 96)]
    weights = [PanelMajor(to_panels(jnp.asarray(w))) for w in ws]
    bias = rng.normal(size=16).astype(np.float32)
    bs = [None, jnp.asarray(bias), None]
    fn = jax.jit(lambda x, weights: PanelMajor.linears(x, weights, bs, concatenate=True))
    hlo = fn.lower(x, weights).as_text()
    assert hlo.count(f"custom_call @{panel_kernel.F32_TARGET}(") == 1  # one call
    with kernels.portable():  # XLA's path, as on a GPU or in an exported program
        portable = jax.jit(lambda x, weights: PanelMajor.linears(x, weights, bs, False))
        assert panel_kernel.F32_TARGET not in portable.lower(x, weights).as_text()
        xla = portable(x, weights)
    for got in (fn(x, weights), xla):
        for out, w, b in zip(got, ws, [0.0, bias, 0.0]):
            exact = x.astype(np.float64) @ w.astype(np.float64).T + b
            assert (np.abs(np.asarray(out, np.float64) - exact) <= _bound(x, w) + 1e-6).all()
    assert weights[0].out_size == 64
    np.testing.assert_array_equal(weights[2].output_major().w_OI, ws[2])


def _block_weights(params):
    return jax.tree.leaves(params["blocks"], is_leaf=lambda w: isinstance(w, OutputMajor)
                           or isinstance(w, PanelMajor))


def test_inference_params_put_the_large_float32_block_matrices_in_panels():
    params = lively_params(WIDE)
    made = inference_params(params, WIDE)
    kinds = {f"{name}": type(made["blocks"][0][part][name]).__name__
             for part, names in (("attn", ("w_q", "w_k", "w_v", "w_o")),
                                 ("mlp", ("w_in", "w_out")))
             for name in names}
    assert kinds == {"w_q": "PanelMajor", "w_k": "PanelMajor", "w_v": "PanelMajor",
                     "w_o": "OutputMajor", "w_in": "PanelMajor", "w_out": "PanelMajor"}
    assert made["blocks"][1]["mlp"]["w_in"].values.shape == (1280 // 16, 320, 16)
    assert made["blocks"][1]["attn"]["w_k"].values.shape == (80 // 16, 320, 16)
    plain = jax.jit(decode_layout)(params)
    np.testing.assert_array_equal(made["blocks"][1]["mlp"]["w_out"].output_major().w_OI,
                                  plain["blocks"][1]["mlp"]["w_out"].w_OI)
    check_params(made, WIDE)  # a layout of its own, checked as the others
    wrong = {**made, "blocks": (made["blocks"][0], {
        **made["blocks"][1], "mlp": {**made["blocks"][1]["mlp"],
                                     "w_in": PanelMajor(made["blocks"][1]["mlp"]["w_in"].values[1:])}})}
    with pytest.raises(ValueError, match=r"\['w_in'\]\.values has shape \(79, 320, 16\), but "
                                         r"the config expects \(80, 320, 16\)"):
        check_params(wrong, WIDE)
    assert inference_params(made, WIDE) is made  # an LLM's params, given to its Engine
    unpaneled = inference_params(made, WIDE, panels=False)  # to be sharded
    assert not any(isinstance(w, PanelMajor) for w in _block_weights(unpaneled))
    np.testing.assert_array_equal(unpaneled["blocks"][1]["mlp"]["w_in"].w_OI,
                                  plain["blocks"][1]["mlp"]["w_in"].w_OI)
    for other in (inference_params(params, WIDE, "bfloat16"),  # the kernel is float32's
                  inference_params(params, WIDE, panels=False)):
        assert not any(isinstance(w, PanelMajor) for w in _block_weights(other))
    int8, want = quantize(made, "int8"), quantize(params, "int8")
    assert isinstance(int8["blocks"][0]["mlp"]["w_in"], Int8Weight)
    for got, expected in zip(jax.tree.leaves(int8), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_panels_where_the_kernel_is_off_are_not_made(monkeypatch):
    monkeypatch.setattr(panel_kernel, "available", lambda: False)
    made = inference_params(lively_params(WIDE), WIDE)
    assert not any(isinstance(w, PanelMajor) for w in _block_weights(made))


def test_decoding_with_panels_gives_the_tokens_of_output_major_weights():
    params = lively_params(WIDE)
    made, plain = inference_params(params, WIDE), jax.jit(decode_layout)(params)
    assert isinstance(made["blocks"][0]["mlp"]["w_in"], PanelMajor)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13], [14, 15], [16] * 6,
               [17, 18, 19], [20, 21], [22, 23, 24, 25, 26]]  # 9 rows: a tile and one more
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12, logprobs=0)
    want = generate(plain, WIDE, prompts, greedy)
    got = generate(made, WIDE, prompts, greedy)
    assert len({t for c in want for t in c.tokens}) >= 10, "reference output too repetitive"
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert_close([c.logprobs for c in got], [c.logprobs for c in want], 1e-4, "logprobs")
    engine = Engine(made, WIDE, max_slots=4)  # 5 requests: one waits for a slot
    assert isinstance(engine.params["blocks"][0]["mlp"]["w_in"], PanelMajor)
    for i, prompt in enumerate(prompts[:5]):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_new_tokens=12))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert [finals[str(i)] for i in range(5)] == [c.tokens for c in want[:5]]
