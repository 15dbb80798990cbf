"""Weight-only int8 (`quantize="int8"`, issue 18): each weight is rounded to within half a
step of its channel's scale; the CPU kernel equals XLA's dequantize-then-matmul, inside jit
and vmap, and the decode program runs it instead of widening the weights to float32; the
logits of a trained character model and a GPT-2-shaped one stay within the error bound
`gpt_jax.params.quantization_error` derives; greedy tokens equal float32's until float32
itself is nearly tied; and the switch is offered by LLM, Engine and the command lines, with a
clear error for anything but int8."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax import GPTConfig, forward, init_cache, init_params, kernels
from gpt_jax.kernels import panel_matmul as panel_kernel
from gpt_jax.layers import Int8Weight, int8_matmul
from gpt_jax.params import QUANTIZE, check_params, quantization_error, quantize
from gpt_jax.tokenizer import CharTokenizer
from inference import cli, steps
from inference.engine import Engine
from inference.generation import generate
from inference.llm import LLM
from inference.sampling_params import SamplingParams

# vocab 61 and d_model 36: neither a multiple of the 8-channel panel nor of the vector width.
SMALL = GPTConfig(vocab_size=61, max_seq_len=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  d_model=36)
TINY = GPTConfig.preset("tiny")


def _random_params(config, std=0.02, seed=0):
    """Random params of `init_params`' shapes from numpy's generator (JAX's op-by-op
    initialisation compiles a program per shape: seconds, for the tests' few models):
    N(0, std) matrices, zero biases, unit LayerNorm scales. std 0.12 (lively: six times
    GPT-2's) keeps a random model's greedy output from repeating one token."""
    rng = np.random.default_rng(seed)

    def leaf(path, shape):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return np.ones(shape.shape, np.float32)
        if len(shape.shape) == 1 or "'b_" in name or "bias" in name:
            return np.zeros(shape.shape, np.float32)
        return std * rng.standard_normal(shape.shape, np.float32)

    shapes = jax.eval_shape(lambda: init_params(config, jax.random.key(0)))
    return jax.tree_util.tree_map_with_path(leaf, shapes)


def _matrix(O, I, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(O, I)).astype(np.float32)
    w[1] = 0.0  # an all-zero channel
    w[2, 3] = 40.0  # an outlier: its channel's step is coarse
    return w


def test_each_weight_is_within_half_a_step_of_its_channel():
    w = _matrix(29, 37)
    q = Int8Weight.quantize(jnp.asarray(w))
    assert q.values.dtype == jnp.int8 and q.values.shape == (2, 37, 16)
    assert q.scale_O.dtype == jnp.float32 and q.shape == (29, 37)
    values = np.asarray(q.values)
    assert np.abs(values).max() == 127 and (values[-1, :, 13:] == 0).all()
    scale = np.asarray(q.scale_O)
    assert scale[1] == 0 and np.allclose(scale, np.abs(w).max(1) / 127)
    error = np.abs(np.asarray(q.dequantize()) - w)
    assert (error <= scale[:, None] / 2 * (1 + 1e-6) + 1e-30).all()
    ids = jnp.asarray([[0, 28, 2], [9, 9, 1]])
    np.testing.assert_array_equal(q.rows(ids), np.asarray(q.dequantize())[np.asarray(ids)])


@functools.cache
def _quantized(O, I):
    w = _matrix(O, I, seed=I)
    return w, jax.jit(Int8Weight.quantize)(w)


@pytest.mark.parametrize("M,I,O", [
    # Tiles (kernels/panel_matmul.cc `panels`): three 16-channel panels by eight rows with AVX-512, one
    # panel by six rows with AVX2; one or two rows panel by panel; rows left over as a
    # smaller tile, panels left over one at a time.
    (1, 37, 29), (2, 37, 29), (3, 37, 29), (8, 37, 29), (13, 37, 29),  # 2 panels: left over
    (15, 37, 29), (17, 37, 29),  # whole tiles of rows and the 7, 1, 3 or 5 left over
    (8, 1100, 40), (60, 1100, 40),  # inputs past L1; 60 rows: blocks of 56 (54) rows
    (11, 64, 96), (10, 64, 200),  # 13 panels: 4 whole tiles and one left over
    (1, 64, 96), (2, 64, 200), (40, 64, 96),
    (1, 96, 50257), (8, 96, 50257),  # GPT-2's vocabulary: 3142 panels, the last one partial
])
def test_kernel_equals_xla_and_both_stay_within_the_rounding_bound(M, I, O, monkeypatch):
    assert panel_kernel.available(), "the CPU int8 kernel did not build"
    x = np.random.default_rng(M).normal(size=(M, I)).astype(np.float32)
    w, q = _quantized(O, I)
    kernel = jax.jit(panel_kernel.int8_matmul)(x, q.values, q.scale_O)
    vmapped = jax.jit(jax.vmap(panel_kernel.int8_matmul, in_axes=(0, None, None)))(
        x[:, None], q.values, q.scale_O)[:, 0]  # one call for the batch of M rows
    monkeypatch.setattr(panel_kernel, "available", lambda: False)
    xla = jax.jit(lambda x, q: int8_matmul(x, q))(x, q)  # a fresh function: traced anew
    # Float rounding: a float32 sum of I products is off by at most ~I ulps of the sum of
    # their magnitudes (~sqrt(I) typically); the paths add in different orders.
    q64 = np.asarray(q.dequantize(), np.float64)
    magnitude = np.abs(x) @ np.abs(q64).T
    for got, what in ((kernel, "kernel"), (vmapped, "vmapped kernel")):
        assert got.shape == (M, O) and got.dtype == jnp.float32
        diff = np.abs(np.asarray(got, np.float64) - np.asarray(xla, np.float64))
        assert (diff <= 1e-6 * math.sqrt(I) * magnitude + 1e-30).all(), f"{what} vs XLA"
    # Against the float32 weights: each weight is within half a step, so an output is
    # within (step / 2) * sum_i |x_i| (plus rounding).
    exact = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x).sum(1)[:, None] * np.asarray(q.scale_O)[None] / 2
    assert (np.abs(np.asarray(kernel) - exact) <= bound * (1 + 1e-4) + 1e-5 * magnitude).all()


def _decode_logits(params, config, tokens, hlo=None):
    """Logits `[len(tokens), V]` of decode steps feeding `tokens` one at a time from an empty
    cache, through one program compiled here (the kernel choice is made at tracing); with a
    list `hlo`, its HLO text is appended."""
    cache = init_cache(config, 1, len(tokens))
    run_step = jax.jit(lambda p, t, c: steps.run_decode(p, config, t, c, jnp.ones(t.shape, bool)))
    step = run_step.lower(params, jnp.asarray(tokens[:1], jnp.int32), cache).compile()
    if hlo is not None:
        hlo.append(step.as_text())
    out = []
    for token in tokens:
        logits, cache = step(params, jnp.asarray([token], jnp.int32), cache)
        out.append(np.asarray(logits[0], np.float64))
    return np.stack(out)


def test_decode_reads_int8_weights_through_the_kernel_and_equals_the_xla_path(monkeypatch):
    """XLA:CPU would widen int8 weights to a float32 copy before its dot (a convert fusion
    feeding the dot): the compiled decode step calls the kernel on the int8 bytes instead,
    for every matmul of every layer and the output projection, and its logits equal the
    full forward pass on XLA's path (what GPUs and TPUs run)."""
    params = quantize(_random_params(SMALL, std=0.12), "int8")
    tokens = [5, 9, 1, 30, 22, 7]
    hlo = []
    decoded = _decode_logits(params, SMALL, tokens, hlo)
    # per layer q, k and v (one call), o, MLP in and out; then the output projection
    assert hlo[0].count('custom_call_target="gpt_jax_int8_matmul"') == 4 * SMALL.n_layers + 1
    panels = set(re.findall(r"s8\[(\d+,\d+,16)\]", hlo[0]))  # the int8 weights [P, I, 16]
    assert len(panels) >= 4 and not [p for p in panels if f"f32[{p}]" in hlo[0]], panels
    monkeypatch.setattr(panel_kernel, "available", lambda: False)
    run_xla = jax.jit(lambda p, t: forward.__wrapped__(p, t, SMALL))  # traced anew: XLA's path
    full = np.asarray(run_xla(params, jnp.asarray([tokens])), np.float64)[0]
    assert "gpt_jax_int8_matmul" not in run_xla.lower(params, jnp.asarray([tokens])).as_text()
    assert_close(decoded, full, 1e-5 * np.abs(full).max(), "kernel decode vs XLA forward")


def test_a_portable_program_calls_no_kernel():
    """Traced within `portable()` (what `inference.export` does), an int8 matmul takes XLA's
    path: a program for another process cannot call the kernel registered in this one."""
    _, q = _quantized(29, 37)
    x = jnp.ones((3, 37), jnp.float32)
    with kernels.portable():
        hlo = jax.jit(lambda x, q: int8_matmul(x, q)).lower(x, q).as_text()
    assert panel_kernel.TARGET not in hlo
    assert panel_kernel.TARGET in jax.jit(lambda x, q: int8_matmul(x, q)).lower(x, q).as_text()


# ------------------------------------------------------------- quality against float32


def _logit_errors(logits, reference):
    """Per position: rms of the float32 logits (mean removed), and the rms and the largest of
    the int8 logits' error (mean removed: a shift of all logits changes no probability)."""
    centered = reference - reference.mean(-1, keepdims=True)
    error = logits - reference
    error = error - error.mean(-1, keepdims=True)
    return np.sqrt(np.square(centered).mean(-1)), np.sqrt(np.square(error).mean(-1)), \
        np.abs(error).max(-1)


def assert_within_bound(logits, reference, eps, what):
    """The bound `quantization_error` derives: over the positions, the rms of the error is
    at most eps times the rms of the float32 logits."""
    scale, rms_error, _ = _logit_errors(logits, reference)
    ratio = np.sqrt(np.square(rms_error).mean() / np.square(scale).mean())
    assert ratio <= eps, f"{what}: rms error {ratio:.4f} of the logits' rms > eps {eps:.4f}"


@pytest.fixture(scope="module")
def char_model():
    """A 2-layer, 64-wide shakespeare-char model, trained for 300 steps on the first 300,000
    characters of the plays: `(config, params, tokenizer, held-out ids)`."""
    from training import data
    from training.config import TrainConfig
    from training.step import TrainState, make_optimizer, make_train_steps

    text = data.shakespeare_text()[:330_000]
    tokenizer = CharTokenizer.from_text(text)
    ids = np.asarray(tokenizer.encode(text), np.int32)
    config = GPTConfig.preset("shakespeare-char", vocab_size=tokenizer.vocab_size, n_layers=2,
                              d_model=64)
    cfg = TrainConfig(max_steps=300, batch_size=16, learning_rate=1e-2, min_learning_rate=1e-3,
                      warmup_steps=20)
    optimizer = make_optimizer(cfg)
    steps = make_train_steps(config, optimizer)
    params = jax.tree.map(jnp.asarray, _random_params(config))
    state = TrainState(params, optimizer.init(params))
    for i in range(cfg.max_steps):
        x, y = data.get_batch(ids[:300_000], cfg.batch_size, config.max_seq_len, 0, i)
        state, _ = steps(state, x[None, None], y[None, None], np.int32(1))
    params = state.params
    return config, params, tokenizer, ids[300_000:]


@pytest.fixture(scope="module")
def char_int8(char_model):
    """The char model quantized, its `quantization_error` eps, and float32 and int8 logits of
    16 held-out windows with their targets."""
    config, params, _, held_out = char_model
    q = quantize(params, "int8")
    starts = np.random.default_rng(0).integers(0, len(held_out) - config.max_seq_len - 1, 16)
    windows = np.stack([held_out[s:s + config.max_seq_len + 1] for s in starts])
    x = jnp.asarray(windows[:, :-1])
    logits = [np.asarray(forward(p, x, config), np.float64) for p in (params, q)]
    return q, quantization_error(params, q), logits, windows[:, 1:]


def test_trained_char_model_logits_and_loss_stay_within_the_bound(char_int8):
    _, eps, (reference, logits), targets = char_int8
    assert 0.01 < eps < 0.1, eps  # per-channel int8 steps: ~1% per matrix
    assert_within_bound(logits, reference, eps, "trained char model")

    def loss(logits_V):
        top = logits_V.max(-1, keepdims=True)
        logp = logits_V - top - np.log(np.exp(logits_V - top).sum(-1, keepdims=True))
        return float(-np.take_along_axis(logp, targets[..., None], -1).mean())

    scale, _, _ = _logit_errors(logits, reference)
    assert loss(reference) < 2.5  # trained: well below the ~3.3 nats of character frequencies
    rms = np.sqrt(np.square(scale).mean())
    assert abs(loss(logits) - loss(reference)) <= math.sqrt(2) * eps * rms


def test_gpt2_shaped_logits_stay_within_the_bound():
    """GPT-2's widths (768, 12 heads, vocab 50257) with one layer and random weights: 16
    positions (16 rows: the kernel's path) at the full-size shapes."""
    config = GPTConfig.preset("gpt2", n_layers=1, max_seq_len=16)
    params = _random_params(config)
    q = quantize(params, "int8")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (1, 16)))
    logits, reference = (np.asarray(forward(p, tokens, config), np.float64) for p in (q, params))
    assert_within_bound(logits, reference, quantization_error(params, q), "gpt2 shape")


def test_greedy_tokens_equal_float32_until_float32_is_nearly_tied(char_model, char_int8):
    """Rounding can flip the argmax only where float32's top two logits are closer than the
    two logits' errors: at most 2 m rms, with m the largest error per rms of the logits at
    one position measured on the 1,024 held-out positions. A near-tie is a gap under
    2 m rms; after a flip the sequences go their own ways. So the int8 tokens (`generate`,
    the cached decode loop on the kernel) must equal float32's up to the first near-tie."""
    config, params, _, held_out = char_model
    q, _, (reference, logits), _ = char_int8
    scale, _, max_error = _logit_errors(logits, reference)
    m = float(np.max(max_error / scale))
    n_prompts, T = reference.shape[:2]  # as many prompts as windows: forward's program is reused
    prompt_len, new = 24, T - 24  # prompt and new tokens fill the context exactly
    starts = np.random.default_rng(1).integers(0, len(held_out) - prompt_len, n_prompts)
    prompts = [held_out[s:s + prompt_len].tolist() for s in starts]
    # float32 greedy: each step's logits from forward over the sequence so far (padded)
    seqs = np.zeros((n_prompts, T), np.int32)
    seqs[:, :prompt_len] = prompts
    steps = []
    for t in range(new):
        at = np.asarray(forward(params, jnp.asarray(seqs), config), np.float64)[
            :, prompt_len - 1 + t]
        steps.append(at)
        if prompt_len + t < T:
            seqs[:, prompt_len + t] = at.argmax(-1)
    steps = np.stack(steps, 1)  # [n_prompts, new, V]
    want = steps.argmax(-1).tolist()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=new)
    got = [o.tokens for o in generate(q, config, prompts, greedy)]
    top2 = np.sort(steps, -1)[..., -2:]
    step_scale, _, _ = _logit_errors(steps, steps)
    near_tie = top2[..., 1] - top2[..., 0] < 2 * m * step_scale
    compared = 0
    for w, g, ties in zip(want, got, near_tie):
        until = int(np.argmax(ties)) if ties.any() else len(w)
        assert g[:until] == w[:until], (w, g, until)
        compared += until
    assert compared >= 200, f"only {compared} tokens before a near-tie: the test says little"


# ------------------------------------------------------------------ the switch and errors


def test_llm_and_engine_hold_int8_weights():
    config, params = TINY, _random_params(TINY)
    llm = LLM(params, config, None, quantize="int8")
    assert isinstance(llm.params["wte"], Int8Weight)
    assert {a.dtype.name for a in jax.tree.leaves(llm.params)} == {"int8", "float32"}
    check_params(llm.params, config)  # the quantized layout passes the shape check
    assert llm.engine(1).params is llm.params  # the LLM's engine runs its int8 weights
    # An Engine quantizes float params itself; quantized ones it runs as they are.
    assert isinstance(Engine(params, config, max_slots=1, quantize="int8").params["wte"],
                      Int8Weight)
    assert Engine(llm.params, config, max_slots=1).params is llm.params


@pytest.mark.parametrize("make", [
    lambda p, c: quantize(p, "int4"),
    lambda p, c: LLM(p, c, None, quantize="fp8"),
    lambda p, c: Engine(p, c, max_slots=1, quantize="INT8"),
])
def test_an_unknown_quantization_is_named_with_the_allowed_ones(make):
    with pytest.raises(ValueError, match=r"quantize must be None or one of 'int8', got '"):
        make(_random_params(TINY), TINY)


def test_quantize_flag_on_the_command_lines(monkeypatch):
    from inference import serve

    assert QUANTIZE == ("int8",)
    assert cli.parse_args(["--quantize", "int8"]).quantize == "int8"
    assert cli.parse_args([]).quantize is None
    assert serve.parse_args(["--quantize", "int8"]).quantize == "int8"
    with pytest.raises(SystemExit):
        cli.parse_args(["--quantize", "int4"])
    loaded = {}
    monkeypatch.setattr(cli.LLM, "from_checkpoint",
                        classmethod(lambda cls, run_dir, **kw: loaded.update(kw)))
    cli.load_llm(cli.parse_args(["--quantize", "int8"]))
    assert loaded == {"dtype": "float32", "quantize": "int8", "draft": None}


def test_int8_weights_with_a_bfloat16_cache():
    """`dtype` is then the KV cache's alone: the weights are int8 from the float32 ones and
    the rest stays float32."""
    config, params = TINY, _random_params(TINY)
    llm = LLM(params, config, None, dtype="bfloat16", quantize="int8")
    assert {a.dtype.name for a in jax.tree.leaves(llm.params)} == {"int8", "float32"}
    assert llm.engine(1).cache_dtype == jnp.bfloat16
    f32 = LLM(params, config, None, quantize="int8")
    assert all(bool((a == b).all()) for a, b in zip(jax.tree.leaves(llm.params),
                                                    jax.tree.leaves(f32.params)))

