"""The layers of the model, as pure functions: linear maps, LayerNorm and RMSNorm, the MLP
(GELU or gated SiLU), rotary position embeddings, embedding lookups, and the weight layouts
they run on.

A weight matrix comes in one of four layouts, and each knows its own products (and the
embedding tables' layouts their row lookup), so no caller branches on the type:
  `InputMajor`   `[I, O]`, the training layout (a plain parameter array, seen as a matrix);
  `OutputMajor`  `[O, I]`, the decode layout (`gpt_jax.params.decode_layout`);
  `PanelMajor`   `[O, I]` in panels of 16 output channels, float32: the decode layout of the
                 large block matrices on CPU (`gpt_jax.params.inference_params`);
  `Int8Weight`   `[O, I]` as int8 with a scale per output channel (`gpt_jax.params.quantize`).
Parameters hold plain arrays (training, checkpoints), `OutputMajor`, `PanelMajor` or
`Int8Weight`;
`as_weight` is the one place a plain array is given its layout. The embedding tables `[V, D]`
are output-major as plain arrays too: the tied output projection multiplies by their
transpose. Shape letters as in `gpt_jax.model`; `M` rows, `I` inputs and `O` outputs of a
matrix product, `F` the MLP's hidden width. A bias may be None (the Llama family has none):
no bias is added.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gpt_jax import kernels
from gpt_jax.config import GPTConfig
from gpt_jax.kernels import few_rows_matmul as few_rows_kernel
from gpt_jax.kernels import panel_matmul as panel_kernel


def _lead(bias: jax.Array, x: jax.Array) -> jax.Array:
    """`bias` with leading unit axes added, to broadcast against `x` explicitly."""
    return bias.reshape((1,) * (x.ndim - bias.ndim) + bias.shape)


def layer_norm(p: dict, x_TD: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (Ba et al. 2016), computed in float32."""
    x32 = x_TD.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * _lead(p["scale"], y) + _lead(p["bias"], y)).astype(x_TD.dtype)


def rms_norm(p: dict, x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis (Zhang & Sennrich 2019): normalized in float32, cast back to
    x's dtype, then scaled, as transformers' `LlamaRMSNorm` orders it. No bias."""
    x32 = x.astype(jnp.float32)
    y = (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)
    return _lead(p["scale"], y) * y


def norm(p: dict, x: jax.Array, config: GPTConfig) -> jax.Array:
    """The config's norm (`config.norm`) over the last axis of `x`."""
    fn = rms_norm if config.norm == "rmsnorm" else layer_norm
    return fn(p, x, config.layer_norm_eps)


def rope_frequencies(config: GPTConfig) -> np.ndarray:
    """The H/2 rotary inverse frequencies `theta^(-2i/H)` (float32, a constant of the
    program), with Llama 3's scaling (`config.rope_scaling`) as transformers'
    `_compute_llama3_parameters` applies it."""
    H = config.head_dim
    inv_freq = (1.0 / (config.rope_theta ** (np.arange(0, H, 2) / H))).astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv_freq
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > s.original_max_seq_len / s.low_freq_factor,
                      inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_seq_len / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ((wavelen >= s.original_max_seq_len / s.high_freq_factor)
              & (wavelen <= s.original_max_seq_len / s.low_freq_factor))
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(x: jax.Array, positions_T: jax.Array, config: GPTConfig) -> jax.Array:
    """Rotary position embeddings (Su et al. 2021) of heads `x` `[..., T, heads, H]` at
    absolute `positions_T` `[..., T]`, in transformers' convention (`rotate_half`: the two
    halves of a head, not interleaved pairs, are the rotated coordinates). The angles are
    float32; the result has x's dtype."""
    frequencies = rope_frequencies(config)
    positions = positions_T[..., None].astype(jnp.float32)
    angles_TF = positions * _lead(frequencies, positions)
    angles_TH = _lead(jnp.concatenate([angles_TF, angles_TF], axis=-1)[..., None, :], x)
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * jnp.cos(angles_TH) + rotated * jnp.sin(angles_TH)).astype(x.dtype)


@jax.custom_vjp
def _matmul(x_MI: jax.Array, w_IO: jax.Array) -> jax.Array:
    return x_MI @ w_IO


def _matmul_fwd(x_MI, w_IO):
    # Keep the input transposed for the weight gradient, so that product reads both operands
    # in the layout the CPU matmul kernels take. Left to autodiff, XLA:CPU transposes the
    # incoming gradient instead, and fuses the whole residual-stream gradient chain (every
    # later layer's LayerNorm backward) into each such transpose (training/README.md, "Where
    # the training step goes").
    return x_MI @ w_IO, (x_MI.T, w_IO)


def _matmul_bwd(residuals, g_MO):
    xt_IM, w_IO = residuals
    return g_MO @ w_IO.T, xt_IM @ g_MO


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


class Weight:
    """A weight matrix in some layout: `matmul(x_MI) -> [M, O]`, and `linears` for several
    products of one input (a layer's q, k and v projections)."""

    @classmethod
    def linears(cls, x_MI: jax.Array, ws: list, bs_O: list[jax.Array],
                concatenate: bool) -> list[jax.Array]:
        """`[x @ w + b for w, b in zip(ws, bs_O)]`, each `[M, O_k]`, for weights of this type.
        With `concatenate`, as ONE product over the weights side by side (on CPU one wider
        product beats three narrow ones, forward and backward; training/README.md). That
        copies the weights per call: the training path's choice, where the rows dwarf them;
        a decode step does not."""
        if not concatenate:
            return [add_bias(w.matmul(x_MI), b_O) for w, b_O in zip(ws, bs_O)]
        out_MO = cls.concatenate(ws).matmul(x_MI)
        if any(b_O is not None for b_O in bs_O):
            out_MO = out_MO + jnp.concatenate(
                [jnp.zeros(w.out_size, out_MO.dtype) if b_O is None else b_O
                 for w, b_O in zip(ws, bs_O)])[None]
        return jnp.split(out_MO, np.cumsum([w.out_size for w in ws[:-1]]), axis=-1)


@struct.dataclass
class InputMajor(Weight):
    """A weight matrix `[I, O]` as training keeps it. Its product's gradient is exactly
    autodiff's (dx = g w^T, dw = x^T g); only the layout of the backward matmuls is chosen
    by hand (see `_matmul_fwd`)."""

    w_IO: jax.Array

    def matmul(self, x_MI: jax.Array) -> jax.Array:
        """`x @ w`, `[M, O]`."""
        return _matmul(x_MI, self.w_IO)

    @property
    def out_size(self) -> int:
        """O, the width of a product."""
        return self.w_IO.shape[1]

    @classmethod
    def concatenate(cls, ws: list[InputMajor]) -> InputMajor:
        """The weights side by side: their outputs in order."""
        return cls(jnp.concatenate([w.w_IO for w in ws], axis=1))


@struct.dataclass
class OutputMajor(Weight):
    """A weight matrix stored transposed, `[O, I]`, for the few-row matmuls of decoding.

    The CPU matmul kernels (YNNPACK and Eigen alike) are tiled along the output rows, so
    `x @ w` with few rows runs far slower than `w_OI @ x^T`, the same product with O as the
    row axis (benchmarks/README.md, "Output-major weights"). `decode_layout` stores
    the block matrices this way once per compiled program; `matmul` computes `(w_OI @ x^T)^T`,
    the barrier keeping XLA from folding the transposes back into `x @ w_OI^T`.

    With many rows (a prefill of `MANY_ROWS` tokens or more per sequence) `matmul` computes
    `x @ w_OI^T` instead: there that orientation is as fast or faster, and its output needs
    no transpose. With few rows in all (a decode step, `inference.steps.run_decode`, or a
    verification of a few positions, `inference.verify`: up to 8 rows per call) a CPU kernel
    computes it on every core (`gpt_jax.kernels.few_rows_matmul`, which says where and
    why), several weights of one input in one call (`linears`). A plain embedding table
    `[V, D]` is one too (`as_weight` with `in_axes=-1`): `rows` is the lookup, `matmul` the
    tied output projection (through the kernel too in a decode step).
    """

    w_OI: jax.Array
    MANY_ROWS = 64  # a class constant, not a field

    def matmul(self, x_MI: jax.Array, preferred_element_type=None) -> jax.Array:
        """`x @ w^T`, `[M, O]`, in the inputs' dtype or `preferred_element_type`."""
        if preferred_element_type in (None, jnp.float32) and few_rows_kernel.use_kernel(
                x_MI, [self.w_OI]):
            return self.linears(x_MI, [self], [None], concatenate=False)[0]
        return self.matmul_xla(x_MI, preferred_element_type)

    @classmethod
    def linears(cls, x_MI, ws, bs_O, concatenate):
        """`Weight.linears`; where the few-rows kernel takes the products
        (`few_rows_kernel.use_kernel`: a decode step's or a verification's few rows), one
        kernel call for all the weights, whose threads share their channels (no copy of the
        weights); otherwise as `Weight.linears` runs them."""
        ws_OI = [w.w_OI for w in ws]
        if concatenate or not few_rows_kernel.use_kernel(x_MI, ws_OI):
            return super().linears(x_MI, ws, bs_O, concatenate)

        def kernel(x_MI, *ws_OI):
            return few_rows_kernel.few_rows_matmuls(x_MI, list(ws_OI))

        def xla(x_MI, *ws_OI):
            return [OutputMajor(w_OI).matmul_xla(x_MI) for w_OI in ws_OI]

        outs = kernels.dispatch(True, kernel, xla, x_MI, *ws_OI)
        return [add_bias(out_MO, b_O) for out_MO, b_O in zip(outs, bs_O)]

    def matmul_xla(self, x_MI: jax.Array, preferred_element_type=None) -> jax.Array:
        """`matmul` as XLA computes it."""
        if x_MI.shape[0] >= self.MANY_ROWS:
            return jnp.matmul(x_MI, self.w_OI.T, preferred_element_type=preferred_element_type)
        out_OM = jnp.matmul(self.w_OI, x_MI.T, preferred_element_type=preferred_element_type)
        return jax.lax.optimization_barrier(out_OM).T

    @property
    def out_size(self) -> int:
        """O, the width of a product."""
        return self.w_OI.shape[0]

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows `w[ids]`, `[*ids.shape, I]` (an embedding lookup)."""
        return self.w_OI[ids]

    @classmethod
    def concatenate(cls, ws: list[OutputMajor]) -> OutputMajor:
        """The weights stacked: their outputs in order."""
        return cls(jnp.concatenate([w.w_OI for w in ws], axis=0))


PANEL = 16  # output channels per panel (`to_panels`)


def to_panels(w_OI: jax.Array) -> jax.Array:
    """`w` `[O, I]` as panels of 16 output channels, `[ceil(O / 16), I, 16]`: channel o at
    `[o // 16, :, o % 16]`, channels past O zero (how `PanelMajor` and `Int8Weight` keep
    their values)."""
    O, I = w_OI.shape
    n_panels = -(-O // PANEL)
    w_OI = jnp.pad(w_OI, ((0, n_panels * PANEL - O), (0, 0)))
    return jnp.swapaxes(w_OI.reshape(n_panels, PANEL, I), 1, 2)


def from_panels(panels: jax.Array, O: int) -> jax.Array:
    """The matrix `[O, I]` of panels `[ceil(O / 16), I, 16]` (`to_panels` undone)."""
    return jnp.swapaxes(panels, 1, 2).reshape(-1, panels.shape[1])[:O]


@struct.dataclass
class PanelMajor(Weight):
    """A float32 weight matrix `w[O, I]` in panels of sixteen output channels,
    `[O / 16, I, 16]` (`to_panels`; O a multiple of 16): the weights of one input for a
    panel's channels are consecutive, so a product reads memory strictly in order, one
    panel at a time. On CPU the panel kernel (`gpt_jax.kernels.panel_matmul`) computes
    `x @ w^T` in the outer-product form (each input of a row broadcast and multiplied into
    a panel's 16 channels), which outruns XLA's products of `OutputMajor` weights at 4 to
    32 rows (the decode steps of a few sequences) and at a prefill's rows, and matches the
    few-rows kernel at one row (figures in benchmarks/README.md, "Float32 panels").
    Elsewhere (GPU, TPU, a `gpt_jax.kernels.portable()` program) XLA contracts the panels
    directly; `gpt_jax.params.inference_params` makes them only where the kernel runs.
    """

    values: jax.Array  # float32 [O / 16, I, 16], channel o at [o // 16, :, o % 16]

    @staticmethod
    def fits(ws_OI: list[jax.Array]) -> bool:
        """Whether the weights `[O_k, I]` of one input (a layer's q, k and v: one `linears`
        call, so one layout) are laid out in panels (`gpt_jax.params.panel_layout`): each
        float32 with O a multiple of 16, and more than `few_rows_kernel.MAX_CACHED_FLOATS`
        weights in all (read from memory, where a product's form matters; smaller ones stay
        `OutputMajor`)."""
        return (all(w.dtype == jnp.float32 and w.shape[0] % PANEL == 0 for w in ws_OI)
                and sum(w.size for w in ws_OI) > few_rows_kernel.MAX_CACHED_FLOATS)

    def matmul(self, x_MI: jax.Array, preferred_element_type=None) -> jax.Array:
        """`x @ w^T`: float32 `[M, I]` -> float32 `[M, O]`."""
        return self.linears(x_MI, [self], [None], concatenate=False)[0]

    @classmethod
    def linears(cls, x_MI, ws, bs_O, concatenate):
        """`Weight.linears` as one kernel call on CPU, whose threads share the panels of all
        the weights (no copy, whatever `concatenate`); XLA's contraction elsewhere."""
        def xla(x_MI, *panels):
            return [jnp.einsum("mi,pic->mpc", x_MI, p).reshape(x_MI.shape[0], -1)
                    for p in panels]

        def kernel(x_MI, *panels):
            return panel_kernel.f32_panel_matmuls(x_MI, list(panels))

        x_MI = x_MI.astype(jnp.float32)
        outs = kernels.dispatch(panel_kernel.use_kernel(), kernel, xla, x_MI,
                                *(w.values for w in ws))
        return [add_bias(out_MO, b_O) for out_MO, b_O in zip(outs, bs_O)]

    @property
    def out_size(self) -> int:
        """O, the width of a product."""
        return self.values.shape[0] * PANEL

    def output_major(self) -> OutputMajor:
        """The same matrix as an `OutputMajor` `[O, I]` (a copy)."""
        return OutputMajor(from_panels(self.values, self.out_size))


@struct.dataclass
class Int8Weight(Weight):
    """A weight matrix `w[O, I]` stored as int8 with one float32 scale per output channel:
    weight-only symmetric absmax quantization, per output channel (the weight half of
    LLM.int8()'s vector-wise quantization, Dettmers et al. 2022, without its outlier
    decomposition; per-channel symmetric int8 weights as in Wu et al. 2020, "Integer
    Quantization for Deep Learning Inference"). `w[o, i] ~ values[o // 16, i, o % 16] *
    scale[o]`, with `scale[o] = max_i |w[o, i]| / 127`: each weight is off by at most half a
    step, `|error| <= scale[o] / 2`, and a quarter of the float32 bytes is read per use.

    The values are in panels of sixteen output channels, `[ceil(O / 16), I, 16]` (channels
    past O are zero): the weights of one input for a panel's channels are consecutive, which
    is how the CPU kernel (`gpt_jax.kernels.panel_matmul`) reads memory in order.
    `gpt_jax.params.quantize` makes them.
    """

    values: jax.Array  # int8 [ceil(O / 16), I, 16], channel o at [o // 16, :, o % 16]
    scale_O: jax.Array  # float32 [O], the step of channel o
    PANEL = PANEL  # output channels per panel (a class constant, not a field)

    @classmethod
    def quantize(cls, w_OI: jax.Array) -> Int8Weight:
        """Round `w_OI` `[O, I]` (any float dtype) to the nearest step of its channel's scale.
        An all-zero channel gets scale 0 and zero values."""
        w_OI = w_OI.astype(jnp.float32)
        scale_O = jnp.max(jnp.abs(w_OI), axis=1) / 127.0
        step_O = jnp.where(scale_O > 0, scale_O, 1.0)
        q_OI = jnp.clip(jnp.round(w_OI / step_O[:, None]), -127, 127).astype(jnp.int8)
        return cls(to_panels(q_OI), scale_O)

    @property
    def shape(self) -> tuple[int, int]:
        """`(O, I)`, the shape of the matrix it stands for."""
        return self.scale_O.shape[0], self.values.shape[1]

    def values_OI(self) -> jax.Array:
        """The int8 values as the matrix `[O, I]` (out of their panels)."""
        return from_panels(self.values, self.shape[0])

    def dequantize(self) -> jax.Array:
        """The float32 matrix `[O, I]` it stands for."""
        return self.values_OI().astype(jnp.float32) * self.scale_O[:, None]

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows `w[ids]` in float32, `[*ids.shape, I]` (an embedding lookup)."""
        values = self.values[ids // self.PANEL, :, ids % self.PANEL]
        return values.astype(jnp.float32) * self.scale_O[ids][..., None]

    def matmul(self, x_MI: jax.Array, preferred_element_type=None) -> jax.Array:
        """`int8_matmul(x_MI, self)`: float32 `[M, O]` whatever `preferred_element_type`."""
        return int8_matmul(x_MI, self)

    @classmethod
    def linears(cls, x_MI, ws, bs_O, concatenate):
        """`Weight.linears` as one kernel call (`int8_matmuls`), whose threads share the
        panels of all the weights: concatenated without a copy, whatever `concatenate`."""
        return [add_bias(out_MO, b_O) for out_MO, b_O in zip(int8_matmuls(x_MI, ws), bs_O)]


def int8_matmul(x_MI: jax.Array, w: Int8Weight) -> jax.Array:
    """`x @ w^T` for an `Int8Weight` `w` `[O, I]`: float32 `[M, I]` -> float32 `[M, O]`, each
    output `scale[o] * sum_i x[m, i] values[o, i]` (the scale applied after the sum).

    On CPU the C++ kernel (`gpt_jax.kernels.panel_matmul`; under vmap one call for the whole
    batch's rows) reads the int8 bytes directly: XLA:CPU would first write a float32 copy of
    the whole matrix (a convert fusion feeding its dot), a decode step's whole cost several
    times over; with many rows (a prefill) the kernel also outran XLA's widen-then-dot, and
    its float32 dot, at every row count measured (1 to 2,048 rows; benchmarks/README.md).
    Elsewhere (GPU,
    TPU, where the kernel cannot be built, or in a program traced within
    `gpt_jax.kernels.portable()`) XLA widens the values and runs its dot. The two agree to
    float rounding (tests/test_quantize.py).
    """
    return int8_matmuls(x_MI, [w])[0]


def int8_matmuls(x_MI: jax.Array, ws: list[Int8Weight]) -> list[jax.Array]:
    """`[int8_matmul(x_MI, w) for w in ws]`, on CPU as one kernel call (see `int8_matmul`)."""
    x_MI = x_MI.astype(jnp.float32)

    def xla(x_MI, *weights):  # the scale after the sum, as the kernel applies it
        return [(x_MI @ Int8Weight(values, scale_O).values_OI().astype(jnp.float32).T)
                * scale_O[None] for values, scale_O in zip(weights[::2], weights[1::2])]

    def kernel(x_MI, *weights):
        return panel_kernel.int8_matmuls(x_MI, list(zip(weights[::2], weights[1::2])))

    args = (x_MI, *(a for w in ws for a in (w.values, w.scale_O)))
    return kernels.dispatch(panel_kernel.use_kernel(), kernel, xla, *args)


def as_weight(w, in_axes: int = 1) -> Weight:
    """`w` as a `Weight`: an `OutputMajor` or `Int8Weight` as it is; a plain array as the
    matrix whose input is its first `in_axes` axes (`InputMajor` `[I, O]`: w_q `[D, N, H]`
    with 1, w_o `[N, H, D]` with 2), or with a negative `in_axes` its last `-in_axes` axes
    (`OutputMajor` `[O, I]`: an embedding table `[V, D]` with -1). The one place a plain
    array becomes a weight type."""
    if isinstance(w, Weight):
        return w
    if in_axes > 0:
        return InputMajor(w.reshape(math.prod(w.shape[:in_axes]), -1))
    return OutputMajor(w.reshape(-1, math.prod(w.shape[in_axes:])))


def add_bias(out_MO: jax.Array, b_O: jax.Array | None) -> jax.Array:
    """`out + b` over the rows, or `out` itself for no bias."""
    return out_MO if b_O is None else out_MO + b_O[None]


def linear(x: jax.Array, w, b_O: jax.Array | None) -> jax.Array:
    """`x @ w + b` over the last axis of `x` (`[..., I]` -> `[..., O]`), as one 2-D matmul
    by the weight's layout (`as_weight`: a plain `w` is `[I, O]`; an `Int8Weight` gives
    float32); no bias for `b_O` None."""
    lead, x_MI = x.shape[:-1], x.reshape(-1, x.shape[-1])
    out_MO = add_bias(as_weight(w).matmul(x_MI), b_O)
    return out_MO.reshape(*lead, out_MO.shape[-1])


def embed(table_VD, ids: jax.Array) -> jax.Array:
    """Rows `table[ids]` of an embedding table `[V, D]` (plain or `Int8Weight`):
    `[*ids.shape, D]` (float32 from an `Int8Weight`)."""
    return as_weight(table_VD, in_axes=-1).rows(ids)


def mlp(p: dict, x_TD: jax.Array, config: GPTConfig) -> jax.Array:
    """The config's MLP (`config.mlp`), D -> F -> D. "gelu": GPT-2's, GELU (tanh
    approximation) of `w_in`. "gated_silu": Llama's SwiGLU (Shazeer 2020),
    `silu(x @ w_gate) * (x @ w_in)`, the two products of one input run as the weights'
    layout runs several (`Weight.linears`)."""
    if config.mlp == "gated_silu":
        lead, x_MI = x_TD.shape[:-1], x_TD.reshape(-1, x_TD.shape[-1])
        ws = [as_weight(p["w_gate"]), as_weight(p["w_in"])]
        gate_MF, up_MF = type(ws[0]).linears(x_MI, ws, [p.get("b_gate"), p.get("b_in")],
                                             concatenate=False)
        h_TF = (jax.nn.silu(gate_MF) * up_MF).reshape(*lead, -1)
    else:
        h_TF = jax.nn.gelu(linear(x_TD, p["w_in"], p.get("b_in")), approximate=True)
    return linear(h_TF, p["w_out"], p.get("b_out"))
