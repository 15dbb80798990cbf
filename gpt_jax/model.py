"""The GPT-2 model math, as pure functions of `(params, inputs, cache)`.

Architecture (Radford et al. 2019, "Language Models are Unsupervised Multitask Learners";
layout of the released GPT-2 code): learned token and position embeddings, pre-LayerNorm
blocks of causal multi-head self-attention and a GELU (tanh approximation) MLP, a final
LayerNorm, and an output projection tied to the token embedding. Key/value heads may be
fewer than query heads (grouped-query attention, Ainslie et al. 2023).

Shape alphabet, used in einsum strings and variable suffixes everywhere in this project:
  B batch, T query length, S cache/key length, D d_model, N query heads, K kv heads,
  G query heads per kv head (N = K * G), H head dim, F MLP hidden width, V vocab, L layers.

Two paths share every layer function except the attention core. `transformer` runs T new
tokens of ONE sequence against that sequence's pages of the paged KV cache
(`gpt_jax.cache.PagedKVCache`, read only) and returns their keys and values for the caller
to store (`gpt_jax.cache.write`); `inference.engine` vmaps it as prefill (T tokens) and as
the decode step (T = 1) over padded batches. `forward` runs whole sequences with no cache
and a plain masked attention: the training path, and the reference the cached path is
tested against; `forward_last` is `forward` at the last position only (the crop window's
next token). Inference runs the weights in `decode_layout` (layers unstacked, block
matrices `OutputMajor`), or quantized (`gpt_jax.params.quantize`: every weight matrix and
embedding table an `Int8Weight`); every function takes any of these layouts. Definitions go
from leaves to root.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct

from gpt_jax import cache as kv
from gpt_jax import cpu_attention, cpu_causal_attention, cpu_int8
from gpt_jax.config import GPTConfig

# Masked scores get a large finite negative, never -inf: exp() gives 0 and no NaN appears.
MASK_VALUE = -1e30

# Keys per attention block: decode reads ceil(live length / block) blocks of the cache, and
# prefill scores are at most [T, block] per head at a time.
ATTENTION_BLOCK = 128

Params = dict  # nested dict of arrays; layer weights are stacked along a leading L axis


def _lead(bias: jax.Array, x: jax.Array) -> jax.Array:
    """`bias` with leading unit axes added, to broadcast against `x` explicitly."""
    return bias.reshape((1,) * (x.ndim - bias.ndim) + bias.shape)


def layer_norm(p: Params, x_TD: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis (Ba et al. 2016), computed in float32."""
    x32 = x_TD.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * _lead(p["scale"], y) + _lead(p["bias"], y)).astype(x_TD.dtype)


@jax.custom_vjp
def _matmul(x_MI: jax.Array, w_IO: jax.Array) -> jax.Array:
    return x_MI @ w_IO


def _matmul_fwd(x_MI, w_IO):
    # Keep the input transposed for the weight gradient, so that product reads both operands
    # in the layout the CPU matmul kernels take. Left to autodiff, XLA:CPU transposes the
    # incoming gradient instead, and fuses the whole residual-stream gradient chain (every
    # later layer's LayerNorm backward) into each such transpose: measured 122 -> 93 ms per
    # nanogpt-cpu forward+backward on 2 cores.
    return x_MI @ w_IO, (x_MI.T, w_IO)


def _matmul_bwd(residuals, g_MO):
    xt_IM, w_IO = residuals
    return g_MO @ w_IO.T, xt_IM @ g_MO


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@struct.dataclass
class OutputMajor:
    """A weight matrix stored transposed, `[O, I]`, for the few-row matmuls of decoding.

    The CPU matmul kernels (YNNPACK and Eigen alike) are tiled along the output rows: for
    `x @ w` with 8 rows they ran at 17-26 GFLOP/s here, while `w_OI @ x^T`, the same product
    with O as the row axis, ran at 47-52 (a 12-layer gpt2-sized MLP chain: 54 -> 18 ms at 8
    rows, 80 -> 38 ms at 32, 18 -> 12 ms at 1; benchmarks/README.md). `decode_layout` stores
    the block matrices this way once per compiled program; `linear` computes with it.

    With many rows (a prefill of `MANY_ROWS` tokens or more per sequence) `linear` computes
    `x @ w_OI^T` instead: as fast at 64 rows and up to 1.9x faster at 256 (768 x 768: 91 ->
    166 GFLOP/s), and its output needs no transpose (in a batch-32, 64-token prefill those
    transposes took ~0.5 s of ~3.0; after: 2.6-2.9 s).
    """

    w_OI: jax.Array
    MANY_ROWS = 64  # a class constant, not a field


@struct.dataclass
class Int8Weight:
    """A weight matrix `w[O, I]` stored as int8 with one float32 scale per output channel:
    weight-only symmetric absmax quantization, per output channel (the weight half of
    LLM.int8()'s vector-wise quantization, Dettmers et al. 2022, without its outlier
    decomposition; per-channel symmetric int8 weights as in Wu et al. 2020, "Integer
    Quantization for Deep Learning Inference"). `w[o, i] ~ values[o // 16, i, o % 16] *
    scale[o]`, with `scale[o] = max_i |w[o, i]| / 127`: each weight is off by at most half a
    step, `|error| <= scale[o] / 2`, and a quarter of the float32 bytes is read per use.

    The values are in panels of sixteen output channels, `[ceil(O / 16), I, 16]` (channels
    past O are zero): the weights of one input for a panel's channels are consecutive, which
    is how the CPU kernel (`gpt_jax.cpu_int8`) reads memory in order. `linear` and the
    embedding lookups (`embed`) take one; `gpt_jax.params.quantize` makes them.
    """

    values_PIJ: jax.Array  # int8 [ceil(O / 16), I, 16], channel o at [o // 16, :, o % 16]
    scale_O: jax.Array  # float32 [O], the step of channel o
    PANEL = 16  # output channels per panel (a class constant, not a field)

    @classmethod
    def quantize(cls, w_OI: jax.Array) -> Int8Weight:
        """Round `w_OI` `[O, I]` (any float dtype) to the nearest step of its channel's scale.
        An all-zero channel gets scale 0 and zero values."""
        w_OI = w_OI.astype(jnp.float32)
        O, I = w_OI.shape
        scale_O = jnp.max(jnp.abs(w_OI), axis=1) / 127.0
        step_O = jnp.where(scale_O > 0, scale_O, 1.0)
        q_OI = jnp.clip(jnp.round(w_OI / step_O[:, None]), -127, 127).astype(jnp.int8)
        P = -(-O // cls.PANEL)
        q_OI = jnp.pad(q_OI, ((0, P * cls.PANEL - O), (0, 0)))
        return cls(jnp.einsum("PJI->PIJ", q_OI.reshape(P, cls.PANEL, I)), scale_O)

    @property
    def shape(self) -> tuple[int, int]:
        """`(O, I)`, the shape of the matrix it stands for."""
        return self.scale_O.shape[0], self.values_PIJ.shape[1]

    def values_OI(self) -> jax.Array:
        """The int8 values as the matrix `[O, I]` (out of their panels)."""
        O, I = self.shape
        return jnp.einsum("PIJ->PJI", self.values_PIJ).reshape(-1, I)[:O]

    def dequantize(self) -> jax.Array:
        """The float32 matrix `[O, I]` it stands for."""
        return self.values_OI().astype(jnp.float32) * self.scale_O[:, None]

    def rows(self, ids: jax.Array) -> jax.Array:
        """Rows `w[ids]` in float32, `[*ids.shape, I]` (an embedding lookup)."""
        values = self.values_PIJ[ids // self.PANEL, :, ids % self.PANEL]
        return values.astype(jnp.float32) * self.scale_O[ids][..., None]


def int8_matmul(x_MI: jax.Array, w: Int8Weight) -> jax.Array:
    """`x @ w^T` for an `Int8Weight` `w` `[O, I]`: float32 `[M, I]` -> float32 `[M, O]`, each
    output `scale[o] * sum_i x[m, i] values[o, i]` (the scale applied after the sum).

    On CPU the C++ kernel (`gpt_jax.cpu_int8`; under vmap one call for the whole batch's
    rows) reads the int8 bytes directly: XLA:CPU would first write a float32 copy of the
    whole matrix (a convert fusion feeding its dot), a decode step's whole cost several
    times over; with many rows (a prefill) the kernel also outran XLA's widen-then-dot, and
    its float32 dot, at every row count measured (1 to 2,048 rows; benchmarks/README.md).
    Elsewhere (GPU, TPU, where the kernel cannot be built, or in a program traced within
    `gpt_jax.cpu_kernels.portable()`) XLA widens the values and runs its dot. The two agree
    to float rounding (tests/test_quantize.py).
    """
    return int8_matmuls(x_MI, [w])[0]


def int8_matmuls(x_MI: jax.Array, ws: list[Int8Weight]) -> list[jax.Array]:
    """`[int8_matmul(x_MI, w) for w in ws]`, on CPU as one kernel call (see `int8_matmul`)."""
    x_MI = x_MI.astype(jnp.float32)

    def xla(x_MI, *weights):  # the scale after the sum, as the kernel applies it
        return [(x_MI @ Int8Weight(values_PIJ, scale_O).values_OI().astype(jnp.float32).T)
                * scale_O[None] for values_PIJ, scale_O in zip(weights[::2], weights[1::2])]

    def kernel(x_MI, *weights):
        return cpu_int8.int8_matmuls(x_MI, list(zip(weights[::2], weights[1::2])))

    args = (x_MI, *(a for w in ws for a in (w.values_PIJ, w.scale_O)))
    if cpu_int8.use_kernel():
        return jax.lax.platform_dependent(*args, cpu=kernel, default=xla)
    return xla(*args)


def linear(x: jax.Array, w_IO: jax.Array | OutputMajor | Int8Weight,
           b_O: jax.Array) -> jax.Array:
    """`x @ w + b` over the last axis of `x` (`[..., I]` -> `[..., O]`), as one 2-D matmul.

    `w_IO` is `[I, O]`, or an `OutputMajor` `[O, I]` (computed as `(w_OI @ x^T)^T`, the
    barrier keeping XLA from folding the transposes back into `x @ w_OI^T`; with
    `OutputMajor.MANY_ROWS` rows or more, as `x @ w_OI^T`), or an `Int8Weight` `[O, I]`
    (`int8_matmul`; float32 out). Its gradient is exactly autodiff's (dx = g w^T,
    dw = x^T g, db = sum g); only the layout of the backward matmuls is chosen by hand (see
    `_matmul_fwd`).
    """
    lead, x_MI = x.shape[:-1], x.reshape(-1, x.shape[-1])
    if isinstance(w_IO, Int8Weight):
        out_MO = int8_matmul(x_MI, w_IO)
    elif isinstance(w_IO, OutputMajor):
        if x_MI.shape[0] >= OutputMajor.MANY_ROWS:
            out_MO = x_MI @ w_IO.w_OI.T
        else:
            out_MO = jax.lax.optimization_barrier(w_IO.w_OI @ x_MI.T).T
    else:
        out_MO = _matmul(x_MI, w_IO)
    out_MO = out_MO + b_O[None]
    return out_MO.reshape(*lead, out_MO.shape[-1])


def embed(table_VD: jax.Array | Int8Weight, ids: jax.Array) -> jax.Array:
    """Rows `table[ids]` of an embedding table `[V, D]`: `[*ids.shape, D]` (float32 from an
    `Int8Weight`)."""
    return table_VD.rows(ids) if isinstance(table_VD, Int8Weight) else table_VD[ids]


def mlp(p: Params, x_TD: jax.Array) -> jax.Array:
    """GPT-2 MLP: D -> F, GELU (tanh approximation), F -> D."""
    h_TF = jax.nn.gelu(linear(x_TD, p["w_in"], p["b_in"]), approximate=True)
    return linear(h_TF, p["w_out"], p["b_out"])


def attend(q_TNH: jax.Array, k_SKH: jax.Array, v_SKH: jax.Array, mask_TS: jax.Array) -> jax.Array:
    """Scaled dot-product attention (Vaswani et al. 2017) with grouped kv heads.

    Args:
      q_TNH: queries. k_SKH, v_SKH: keys and values (K divides N).
      mask_TS: bool, True where query t may attend to key s.
    Returns:
      [T, N, H] in the dtype of `v_SKH`. Scores and softmax are float32; a query whose keys
      are all masked gets zeros, never NaN.
    """
    T, N, H = q_TNH.shape
    K = k_SKH.shape[1]
    q_TKGH = q_TNH.reshape(T, K, N // K, H)
    scores_KGTS = jnp.einsum(
        "TKGH,SKH->KGTS", q_TKGH, k_SKH, preferred_element_type=jnp.float32
    ) / math.sqrt(H)
    scores_KGTS = jnp.where(mask_TS[None, None], scores_KGTS, MASK_VALUE)
    probs_KGTS = jax.nn.softmax(scores_KGTS, axis=-1)
    probs_KGTS = jnp.where(mask_TS.any(-1)[None, None, :, None], probs_KGTS, 0.0)
    out_TKGH = jnp.einsum("KGTS,SKH->TKGH", probs_KGTS.astype(v_SKH.dtype), v_SKH)
    return out_TKGH.reshape(T, N, H)


def _online_softmax_block(state, q_TKGH, k_KSH, v_KSH, mask_TS):
    """Fold one block of keys into a running softmax (Milakov & Gimelshein 2018, "Online
    normalizer calculation for softmax"; as in FlashAttention, Dao et al. 2022).

    `state` is `(max_KGT, sum_KGT, acc_KGTH)`, float32: the running row maximum of the
    scores, the sum of exp(score - max), and the exp-weighted sum of values. Masked keys add
    exactly zero, so a block with no visible key leaves the state unchanged.
    """
    max_KGT, sum_KGT, acc_KGTH = state
    scores_KGTS = jnp.einsum(
        "TKGH,KSH->KGTS", q_TKGH, k_KSH, preferred_element_type=jnp.float32
    ) / math.sqrt(q_TKGH.shape[-1])
    scores_KGTS = jnp.where(mask_TS[None, None], scores_KGTS, MASK_VALUE)
    new_max_KGT = jnp.maximum(max_KGT, scores_KGTS.max(-1))
    probs_KGTS = jnp.where(mask_TS[None, None], jnp.exp(scores_KGTS - new_max_KGT[..., None]), 0.0)
    rescale_KGT = jnp.exp(max_KGT - new_max_KGT)
    acc_KGTH = acc_KGTH * rescale_KGT[..., None] + jnp.einsum(
        "KGTS,KSH->KGTH", probs_KGTS.astype(v_KSH.dtype), v_KSH,
        preferred_element_type=jnp.float32,
    )
    return new_max_KGT, sum_KGT * rescale_KGT + probs_KGTS.sum(-1), acc_KGTH


def _prefix_state_xla(q_TKGH, k_pool, v_pool, page_table_M, length, bound):
    """The online-softmax state of queries `q_TKGH` over cache slots [0, length) of one
    row's pages, reading the pages below `bound` (>= length) in blocks of ATTENTION_BLOCK
    slots: each block's pages are gathered from the pools by the row's page table.

    `bound` is the trip count's source: a Python int (static loop) or a traced scalar shared
    by a vmapped batch (a `while_loop`: the work follows the live length, not the capacity).
    """
    num_pages, K, P, H = k_pool.shape
    M, T = page_table_M.shape[0], q_TKGH.shape[0]
    per_block = max(1, min(M, ATTENTION_BLOCK // P))
    table = jnp.pad(page_table_M, (0, -M % per_block), constant_values=kv.NO_PAGE)

    def gather(pool, ids):  # [per_block, K, P, H] pages -> [K, per_block * P, H] slots
        pages = pool[jnp.clip(ids, 0, num_pages - 1)]
        return jnp.swapaxes(pages, 0, 1).reshape(K, per_block * P, H)

    def body(i, state):
        ids = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block)
        slot_S = i * per_block * P + jnp.arange(per_block * P)
        live_S = (slot_S < length) & jnp.repeat(ids >= 0, P)
        # Masked slots may hold anything (another request's old entries): zero them, as a
        # NaN there would survive a zero probability.
        v_KSH = jnp.where(live_S[None, :, None], gather(v_pool, ids), 0)
        mask_TS = jnp.broadcast_to(live_S[None], (T, per_block * P))
        return _online_softmax_block(state, q_TKGH, gather(k_pool, ids), v_KSH, mask_TS)

    block_slots = per_block * P
    if isinstance(bound, int):
        n_blocks = -(-min(bound, M * P) // block_slots)
    else:
        n_blocks = -(-jnp.minimum(bound, M * P) // block_slots)
    return jax.lax.fori_loop(0, n_blocks, body, _init_softmax(q_TKGH))


def _prefix_state_kernel(q_TKGH, k_pool, v_pool, page_table_M, length):
    """`_prefix_state_xla`'s state from the CPU kernel (`gpt_jax.cpu_attention`), which
    reads exactly slots [0, length): the normalized output, its log-sum-exp as the running
    maximum and a total of one (zero for an empty prefix)."""
    T, K, G, H = q_TKGH.shape
    q_KQH = jnp.einsum("TKGH->KTGH", q_TKGH).reshape(K, T * G, H)
    out_KQH, lse_KQ = cpu_attention.paged_decode_attention(q_KQH, k_pool, v_pool, page_table_M,
                                                           length)
    lse_KGT = jnp.einsum("KTG->KGT", lse_KQ.reshape(K, T, G))
    acc_KGTH = jnp.einsum("KTGH->KGTH", out_KQH.reshape(K, T, G, H))
    total_KGT = jnp.broadcast_to(jnp.where(length > 0, 1.0, 0.0), lse_KGT.shape)
    return lse_KGT, total_KGT, acc_KGTH


def attend_paged(q_TNH, k_TKH, v_TKH, k_pool, v_pool, page_table_M, length, bound):
    """Causal attention of T new queries at positions length..length+T-1 of one sequence.

    The keys are the row's cached slots [0, length), found through its page table in the
    layer's pools `[num_pages, K, P, H]` (`gpt_jax.cache`), then the T new keys themselves
    (causal among themselves). Blockwise online softmax: no `[T, S]` score matrix is formed.
    A decode step (T = 1) on CPU reads the pages with a kernel on all cores that touches
    exactly the live slots (`gpt_jax.cpu_attention`; XLA:CPU's own dots run on one thread);
    elsewhere, for prefill, where the kernel cannot be built, or inside
    `cpu_attention.portable()`, XLA's blockwise path reads the pages below `bound` (>= length,
    shared by a vmapped batch).
    Equal (to float rounding) to `attend` over the whole sequence with the causal mask.

    Returns:
      `[T, N, H]` in the dtype of `v_TKH`; float32 softmax; a query with no visible key
      gets zeros.
    """
    T, N, H = q_TNH.shape
    K = k_TKH.shape[1]
    q_TKGH = q_TNH.reshape(T, K, N // K, H)
    args = (q_TKGH, k_pool, v_pool, page_table_M, length)
    xla = lambda *args: _prefix_state_xla(*args, bound)  # noqa: E731
    if T == 1 and cpu_attention.use_kernel():
        state = jax.lax.platform_dependent(*args, cpu=_prefix_state_kernel, default=xla)
    else:
        state = xla(*args)
    return _softmax_output(_attend_new(state, q_TKGH, k_TKH, v_TKH)).astype(v_TKH.dtype)


def _attend_new(state, q_TKGH, k_TKH, v_TKH):
    """Fold in the T new keys themselves, causally (key j visible to query t iff j <= t),
    in blocks of ATTENTION_BLOCK keys so no [T, T] score matrix is ever formed."""
    T = q_TKGH.shape[0]
    block = min(ATTENTION_BLOCK, T)
    query_T = jnp.arange(T)
    k_KTH, v_KTH = jnp.swapaxes(k_TKH, 0, 1), jnp.swapaxes(v_TKH, 0, 1)

    def body(j, state):
        lo = j * block
        first = jnp.minimum(lo, T - block)
        k_KSH = jax.lax.dynamic_slice_in_dim(k_KTH, first, block, axis=1)
        v_KSH = jax.lax.dynamic_slice_in_dim(v_KTH, first, block, axis=1)
        key_S = first + jnp.arange(block)
        mask_TS = (key_S[None, :] >= lo) & (key_S[None, :] <= query_T[:, None])
        return _online_softmax_block(state, q_TKGH, k_KSH, v_KSH, mask_TS)

    n_blocks = -(-T // block)
    return body(0, state) if n_blocks == 1 else jax.lax.fori_loop(0, n_blocks, body, state)


def _init_softmax(q_TKGH):
    """The empty online-softmax state for queries `q_TKGH` (see `_online_softmax_block`)."""
    T, K, G, H = q_TKGH.shape
    return (jnp.full((K, G, T), MASK_VALUE, jnp.float32), jnp.zeros((K, G, T), jnp.float32),
            jnp.zeros((K, G, T, H), jnp.float32))


def _softmax_output(state) -> jax.Array:
    """Attention output `[T, N, H]` float32 from a final online-softmax state: the weighted
    sum over the softmax total; zeros for a query that saw no key."""
    _, sum_KGT, acc_KGTH = state
    out_KGTH = jnp.where(sum_KGT[..., None] > 0, acc_KGTH / jnp.maximum(sum_KGT, 1e-30)[..., None], 0.0)
    K, G, T, H = out_KGTH.shape
    return jnp.einsum("KGTH->TKGH", out_KGTH).reshape(T, K * G, H)


def _project_heads(x_TD, w_DNH, b_NH):
    """x @ w + b as one [..., D] @ [D, N*H] matmul, reshaped to heads `[..., N, H]`. `w_DNH`
    may be an `OutputMajor` or `Int8Weight` `[N*H, D]` (see `decode_layout`)."""
    N, H = b_NH.shape
    w = w_DNH if isinstance(w_DNH, (OutputMajor, Int8Weight)) else w_DNH.reshape(-1, N * H)
    out = linear(x_TD, w, b_NH.reshape(N * H))
    return out.reshape(*x_TD.shape[:-1], N, H)


def _merge_heads(p: Params, out_TNH: jax.Array) -> jax.Array:
    """The output projection: `[..., N, H]` -> `[..., D]` as one [N*H, D] matmul (so XLA never
    transposes w_o to match the output). `w_o` may be an `OutputMajor` or `Int8Weight`
    `[D, N*H]`."""
    N, H = out_TNH.shape[-2:]
    w = p["w_o"] if isinstance(p["w_o"], (OutputMajor, Int8Weight)) else \
        p["w_o"].reshape(N * H, -1)
    return linear(out_TNH.reshape(*out_TNH.shape[:-2], N * H), w, p["b_o"])


def _new_qkv(p: Params, x_TD: jax.Array, cache_dtype):
    """Queries `[T, N, H]`, and keys and values `[T, K, H]` in the cache's dtype, of T new
    tokens: three matmuls, with no per-call weight concatenation (see `_project_qkv`); int8
    weights in one kernel call (`int8_matmuls`)."""
    if isinstance(p["w_q"], Int8Weight):
        x_MI = x_TD.reshape(-1, x_TD.shape[-1])
        outs = int8_matmuls(x_MI, [p["w_q"], p["w_k"], p["w_v"]])
        q_TNH, k_TKH, v_TKH = (
            (out_MO + p[b].reshape(-1)[None]).reshape(*x_TD.shape[:-1], *p[b].shape)
            for out_MO, b in zip(outs, ("b_q", "b_k", "b_v")))
        return q_TNH, k_TKH.astype(cache_dtype), v_TKH.astype(cache_dtype)
    q_TNH = _project_heads(x_TD, p["w_q"], p["b_q"])
    k_TKH = _project_heads(x_TD, p["w_k"], p["b_k"]).astype(cache_dtype)
    v_TKH = _project_heads(x_TD, p["w_v"], p["b_v"]).astype(cache_dtype)
    return q_TNH, k_TKH, v_TKH


def attention(p: Params, x_TD: jax.Array, k_pool, v_pool, page_table_M, length, bound):
    """Causal self-attention of T new tokens at positions length..length+T-1 of one sequence,
    against its cached slots in the layer's pools (read only, see `attend_paged`).
    Returns `(out_TD, (k_TKH, v_TKH))`: the new keys and values, for the caller to store."""
    q_TNH, k_TKH, v_TKH = _new_qkv(p, x_TD, k_pool.dtype)
    out_TNH = attend_paged(q_TNH, k_TKH, v_TKH, k_pool, v_pool, page_table_M, length, bound)
    return _merge_heads(p, out_TNH.astype(x_TD.dtype)), (k_TKH, v_TKH)


def block(p: Params, x_TD, attend_fn, config: GPTConfig):
    """One pre-LayerNorm transformer block. `attend_fn(p_attn, h_TD)` is its attention
    against the cache, returning `(out_TD, extra)`. Returns `(x_TD, extra)`."""
    attn_TD, extra = attend_fn(p["attn"], layer_norm(p["ln1"], x_TD, config.layer_norm_eps))
    x_TD = x_TD + attn_TD
    x_TD = x_TD + mlp(p["mlp"], layer_norm(p["ln2"], x_TD, config.layer_norm_eps))
    return x_TD, extra


def transformer(params: Params, tokens_T: jax.Array, cache: kv.PagedKVCache, config: GPTConfig,
                bound: jax.Array | int | None = None):
    """Run T new tokens of ONE sequence through all layers, against that sequence's cache.

    The cache is only read (only its live pages, see `attend_paged`); the new keys and
    values of every layer come back for the caller to store for all rows at once
    (`gpt_jax.cache.write`), since the page pools are shared by the rows of a batch.

    Args:
      tokens_T: int token ids at positions `cache.lengths`..+T-1 (padding after the real
        ones is harmless: nothing reads it, and the caller stores only the real ones).
      cache: ONE row's view of a PagedKVCache: the shared pools (`k`, `v`), its page table
        row `[M]` and scalar `lengths` (see `gpt_jax.cache.CACHE_ROW_AXES`).
      bound: an upper bound on `cache.lengths` shared by every row of a vmapped batch (the
        batch maximum, passed unmapped), so every row reads the same number of pages; a
        Python int makes the loop static. Default: the row's own length.
    Returns:
      `(x_TD, (k_LTKH, v_LTKH))`: final hidden states (before the last LayerNorm), and per
      layer the T new keys and values `[T, K, H]` in the cache's dtype.
    """
    start = cache.lengths
    positions_T = start + jnp.arange(tokens_T.shape[0])
    x_TD = embed(params["wte"], tokens_T) + embed(params["wpe"], positions_T)
    bound = start if bound is None else bound
    blocks = params["blocks"]
    if not isinstance(blocks, tuple):  # stacked on L: one weight slice per layer, unrolled
        blocks = unstack_layers(params)["blocks"]
    new_k, new_v = [], []
    for layer, p in enumerate(blocks):
        attend_fn = lambda p_attn, h_TD, layer=layer: attention(  # noqa: E731
            p_attn, h_TD, cache.k[layer], cache.v[layer], cache.page_table, start, bound)
        x_TD, (k_TKH, v_TKH) = block(p, x_TD, attend_fn, config)
        new_k.append(k_TKH), new_v.append(v_TKH)
    return x_TD, (tuple(new_k), tuple(new_v))


def unstack_layers(params: Params) -> Params:
    """`params` with "blocks" as a tuple of L per-layer dicts instead of arrays stacked on L.

    `transformer` runs the layers as an unrolled Python loop over such params. Inference
    programs do this once
    (inside `decode_layout`), outside their decode loop: slicing a layer out of the stack
    inside the loop (what `lax.scan` over stacked weights does) copies that layer's weights
    on every step, which doubles the memory traffic of a memory-bound decode step.
    """
    blocks = params["blocks"]
    n_layers = jax.tree.leaves(blocks)[0].shape[0]
    layers = tuple(jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(n_layers))
    return {**params, "blocks": layers}


def decode_layout(params: Params) -> Params:
    """`params` as the inference programs run them: layers unstacked (`unstack_layers`) and
    every block matrix `OutputMajor`, `[O, I]` (w_q, w_k, w_v `[N*H, D]`, w_o `[D, N*H]`,
    w_in `[F, D]`, w_out `[D, F]`). Already in this layout, params come back unchanged.
    A copy of every block weight: call it once, outside any decode loop."""
    if isinstance(params["blocks"], tuple) and isinstance(
            params["blocks"][0]["mlp"]["w_in"], (OutputMajor, Int8Weight)):
        return params

    def layer(p):
        attn, mlp = p["attn"], p["mlp"]
        D = attn["w_q"].shape[0]
        heads = {name: OutputMajor(attn[name].reshape(D, -1).T) for name in ("w_q", "w_k", "w_v")}
        return {**p,
                "attn": {**attn, **heads, "w_o": OutputMajor(attn["w_o"].reshape(-1, D).T)},
                "mlp": {**mlp, "w_in": OutputMajor(mlp["w_in"].T),
                        "w_out": OutputMajor(mlp["w_out"].T)}}

    return {**params, "blocks": tuple(layer(p) for p in unstack_layers(params)["blocks"])}


def lm_head(params: Params, x_TD: jax.Array, config: GPTConfig) -> jax.Array:
    """Final LayerNorm and the tied output projection (`wte` `[V, D]`, or its `Int8Weight`).
    Returns float32 logits `[..., V]`."""
    h = layer_norm(params["ln_f"], x_TD, config.layer_norm_eps)
    wte = params["wte"]
    if isinstance(wte, Int8Weight):
        return int8_matmul(h.reshape(-1, h.shape[-1]), wte).reshape(*h.shape[:-1], -1)
    if h.ndim == 1:  # one position (vmapped over rows): `wte` is already [O, I] = [V, D]
        logits_V1 = jnp.matmul(wte, h[:, None], preferred_element_type=jnp.float32)
        return jax.lax.optimization_barrier(logits_V1)[:, 0]
    return jnp.einsum("...D,VD->...V", h, wte, preferred_element_type=jnp.float32)


def _project_qkv(p: Params, x_TD: jax.Array):
    """`(q [..., N, H], k [..., K, H], v [..., K, H])` as ONE `_project_heads` matmul over the
    three weights side by side, `[D, N + 2K, H]` (`OutputMajor` ones stacked by rows): on CPU
    one wider product beats three narrow ones, forward and backward (nanogpt-cpu train step
    ~3% faster). The concatenation copies the three weights per call: the training path's
    choice, where the matmul rows (B * T) dwarf them."""
    names = ("w_q", "w_k", "w_v")
    if isinstance(p["w_q"], Int8Weight):  # three int8 products (panels pad each O to 8)
        return tuple(_project_heads(x_TD, p[n], p["b" + n[1:]]) for n in names)
    if isinstance(p["w_q"], OutputMajor):
        w = OutputMajor(jnp.concatenate([p[n].w_OI for n in names], axis=0))
    else:
        w = jnp.concatenate([p[n] for n in names], axis=1)
    b = jnp.concatenate([p["b_q"], p["b_k"], p["b_v"]])
    N, K = p["b_q"].shape[0], p["b_k"].shape[0]
    return tuple(jnp.split(_project_heads(x_TD, w, b), [N, N + K], axis=-2))


def causal_self_attention(p: Params, x_BTD: jax.Array) -> jax.Array:
    """Causal self-attention over whole sequences, no cache: `[B, T, D]` -> `[B, T, D]`.

    Forms the `[T, T]` scores per head (`attend_causal`), which at training lengths is
    cheaper than the blockwise loop of `attend_paged` and differentiates as one program.
    """
    q_BTNH, k_BTKH, v_BTKH = _project_qkv(p, x_BTD)
    return _merge_heads(p, attend_causal(q_BTNH, k_BTKH, v_BTKH))


def attend_causal(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array) -> jax.Array:
    """`attend` of each query t to keys 0..t of its own row: `[B, T, N, H]`, dtype of v.

    On CPU, float32 with a head dim the kernels are built for, the forward and backward run
    as `gpt_jax.cpu_causal_attention` kernels (the nanogpt-cpu train step ~40 -> ~36 ms);
    elsewhere, or where they cannot be built, or inside `cpu_kernels.portable()`, XLA's
    `attend` runs (`_attend_causal_xla`).
    """
    if cpu_causal_attention.use_kernel(q_BTNH, k_BTKH, v_BTKH):
        return jax.lax.platform_dependent(q_BTNH, k_BTKH, v_BTKH, default=_attend_causal_xla,
                                          cpu=cpu_causal_attention.causal_attention)
    return _attend_causal_xla(q_BTNH, k_BTKH, v_BTKH)


def _attend_causal_xla(q_BTNH, k_BTKH, v_BTKH):
    T = q_BTNH.shape[1]
    causal_TS = jnp.tril(jnp.ones((T, T), bool))
    return jax.vmap(attend, in_axes=(0, 0, 0, None))(q_BTNH, k_BTKH, v_BTKH, causal_TS)


def _blocks_full(params: Params, tokens_BT: jax.Array, config: GPTConfig, n_blocks: int):
    """Embeddings at positions 0..T-1 and the first `n_blocks` blocks over whole sequences
    (`[B, T, D]`). Raises ValueError for T past `config.max_seq_len`."""
    B, T = tokens_BT.shape
    if T > config.max_seq_len:
        raise ValueError(
            f"sequence length {T} exceeds config.max_seq_len={config.max_seq_len}"
        )
    eps = config.layer_norm_eps
    wpe = params["wpe"]
    positions_TD = wpe.rows(jnp.arange(T)) if isinstance(wpe, Int8Weight) else wpe[:T]
    x_BTD = embed(params["wte"], tokens_BT) + positions_TD[None]

    def block_full(x_BTD, p):
        x_BTD = x_BTD + causal_self_attention(p["attn"], layer_norm(p["ln1"], x_BTD, eps))
        return x_BTD + mlp(p["mlp"], layer_norm(p["ln2"], x_BTD, eps)), None

    if isinstance(params["blocks"], tuple):  # unstacked (see unstack_layers): unrolled
        for p in params["blocks"][:n_blocks]:
            x_BTD, _ = block_full(x_BTD, p)
    elif n_blocks:
        first = params["blocks"] if n_blocks == config.n_layers else jax.tree.map(
            lambda w: w[:n_blocks], params["blocks"])
        x_BTD, _ = jax.lax.scan(block_full, x_BTD, first)
    return x_BTD


@functools.partial(jax.jit, static_argnames="config")
def forward(params: Params, tokens_BT: jax.Array, config: GPTConfig) -> jax.Array:
    """Full causal forward pass, no cache kept: the training path and the reference that the
    cached path (`transformer`) is tested against.

    Args:
      tokens_BT: int32 token ids, T <= config.max_seq_len.
    Returns:
      float32 logits `[B, T, V]`; logits[:, t] predict token t + 1.
    Raises:
      ValueError: T exceeds `config.max_seq_len` (positions would run off the table).
    """
    return lm_head(params, _blocks_full(params, tokens_BT, config, config.n_layers), config)


def _last_block(p: Params, x_BTD: jax.Array, eps: float) -> jax.Array:
    """A block whose output is wanted at the last position only: keys and values of every
    position, but the query, attention output and MLP of the last one. Returns `[B, D]`."""
    h_BTD = layer_norm(p["ln1"], x_BTD, eps)
    attn = p["attn"]
    q_B1NH = _project_heads(h_BTD[:, -1:], attn["w_q"], attn["b_q"])
    k_BTKH = _project_heads(h_BTD, attn["w_k"], attn["b_k"])
    v_BTKH = _project_heads(h_BTD, attn["w_v"], attn["b_v"])
    every_1T = jnp.ones((1, x_BTD.shape[1]), bool)  # the last query sees every key
    out_B1NH = jax.vmap(attend, in_axes=(0, 0, 0, None))(q_B1NH, k_BTKH, v_BTKH, every_1T)
    x_BD = x_BTD[:, -1] + _merge_heads(attn, out_B1NH)[:, 0]
    return x_BD + mlp(p["mlp"], layer_norm(p["ln2"], x_BD, eps))


@functools.partial(jax.jit, static_argnames="config")
def forward_last(params: Params, tokens_BT: jax.Array, config: GPTConfig) -> jax.Array:
    """`forward(params, tokens_BT, config)[:, -1]`, the next-token logits of each sequence,
    computing the last block at the last position only (the blocks below at every
    position, for its keys and values). What nanoGPT's `sample` runs on its cropped window
    (`idx[:, -block_size:]`) each step; `inference.engine.window_logits` runs it.

    Args:
      tokens_BT: int32 token ids at positions 0..T-1, T <= config.max_seq_len.
    Returns:
      float32 logits `[B, V]`.
    Raises:
      ValueError: T exceeds `config.max_seq_len`.
    """
    x_BTD = _blocks_full(params, tokens_BT, config, config.n_layers - 1)
    blocks = params["blocks"]
    last = blocks[-1] if isinstance(blocks, tuple) else jax.tree.map(lambda w: w[-1], blocks)
    return lm_head(params, _last_block(last, x_BTD, config.layer_norm_eps), config)
