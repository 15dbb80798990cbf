"""What one speculative verification costs in decode steps on CPU, and what a row expects
it to yield: the two sides of the cost-aware off-switch of `inference.speculative.adapt`.

A verification feeds T = width + 1 positions of every row through the model in one forward
(`inference.verify`); a decode step feeds one. On a GPU the two cost about the same; on
CPU they do not: XLA:CPU emits a decode step's matrix-vector products inline, while T > 1
makes them matrix products run by XNNPACK on XLA's thread pool, so for a model whose
weights stay in cache a verification costs several steps, and for one whose weights are
read from memory it approaches one (benchmarks/README.md, "Speculative decoding").

`verify_cost` interpolates the ratio verification / decode step measured at batch 1 by
`gpt-jax bench verify_cost` (`CALIBRATION`) at the model's float32 weight bytes
(log-linear between the calibrated models, held outside them) and linearly in T between
the measured widths (1 at T = 1, extended past the widest with the last slope). A row
drafts only while its expected tokens per verification (`expected_tokens`) beat that
ratio. The ratio sets how often a row drafts, never the distribution of what it emits: greedy
tokens are those of decoding without speculation whatever it is.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from gpt_jax.config import GPTConfig

# (float32 weight bytes, {T: verification / decode step at batch 1}) per calibrated model:
# the trained shakespeare-char-llama (0.80M parameters; with the few-rows kernel, mean of two
# side-by-side runs) and the GPT-2 shape (124M, random; the kernel is not used there),
# `gpt-jax bench verify_cost` (benchmarks/README.md, "Third pass: a few-rows kernel and a
# cost-aware off-switch").
CALIBRATION = ((3.2e6, {2: 1.9, 5: 2.9}), (4.98e8, {2: 1.33, 5: 1.89}))


def weight_bytes(config: GPTConfig) -> float:
    """The model's float32 weight bytes, from its shape (the matrices only: embeddings,
    the blocks' projections, an untied output projection)."""
    D, L, V = config.d_model, config.n_layers, config.vocab_size
    H = config.head_dim
    attention = D * H * (2 * config.n_heads + 2 * config.kv_heads)
    F = config.intermediate_size or config.mlp_ratio * D
    mlp = (3 if config.mlp == "gated_silu" else 2) * D * F
    embeddings = V * D * (1 if config.tie_embeddings else 2)
    return 4.0 * (embeddings + L * (attention + mlp))


def _ratio_at(table: dict[int, float], T: int) -> float:
    """Piecewise-linear in T through (1, 1) and the table's points, extended past the
    widest with the last slope."""
    points = sorted({1: 1.0, **table}.items())
    for (t0, c0), (t1, c1) in zip(points, points[1:]):
        if T <= t1:
            return c0 + (c1 - c0) * (T - t0) / (t1 - t0)
    (t0, c0), (t1, c1) = points[-2:]
    return c1 + (c1 - c0) * (T - t1) / (t1 - t0)


def verify_cost(config: GPTConfig, width: int) -> float:
    """Decode steps one verification of `width` drafts (T = width + 1 positions) costs at
    batch 1 on CPU, by `CALIBRATION`. Raises ValueError for a negative width."""
    if width < 0:
        raise ValueError(f"width must be >= 0 drafts, got {width}")
    if width == 0:
        return 1.0
    (small, t_small), (large, t_large) = CALIBRATION
    at = min(max(math.log(weight_bytes(config)), math.log(small)), math.log(large))
    share = (at - math.log(small)) / (math.log(large) - math.log(small))
    T = width + 1
    return (1 - share) * _ratio_at(t_small, T) + share * _ratio_at(t_large, T)


def row_costs(config: GPTConfig, ks) -> np.ndarray:
    """`verify_cost` of each row's own k (0: not speculative, cost 1), float32
    (`inference.speculative.SpecArrays.cost`). A row's own k, not the batch's width: when
    it drafts must not depend on its neighbours, or a seeded sampled request would not
    reproduce in another batch."""
    return np.array([verify_cost(config, int(k)) for k in ks], np.float32)


def expected_tokens(rate, k):
    """Tokens a verification of `k` drafts yields when each draft is accepted with
    probability `rate` given the ones before it: 1 + rate + ... + rate^k (the accepted
    drafts and the one token more; Leviathan et al. 2023, eq. 1). Float32, `rate` in [0, 1]
    and int `k` broadcast."""
    k = jnp.asarray(k, jnp.float32)
    rate = jnp.clip(jnp.asarray(rate, jnp.float32), 0.0, 1.0)
    near_one = rate > 1 - 1e-4
    safe = jnp.where(near_one, 0.5, rate)
    return jnp.where(near_one, k + 1, (1 - safe ** (k + 1)) / (1 - safe))
