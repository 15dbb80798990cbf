"""What one speculative round costs in decode steps on CPU, and what a row expects it to
yield: the two sides of the cost-aware off-switch of `inference.speculative.adapt`.

A verification feeds T = width + 1 positions of every row through the model in one forward
(`inference.verify`); a decode step feeds one. On a GPU the two cost about the same; on
CPU they do not: XLA:CPU emits a decode step's matrix-vector products inline, while T > 1
makes them matrix products run by XNNPACK on XLA's thread pool, so for a model whose
weights stay in cache a verification costs several steps, and for one whose weights are
read from memory it approaches one (benchmarks/README.md, "Speculative decoding").

`verify_cost` interpolates the ratio verification / decode step measured at batch 1 by
`gpt-jax bench verify_cost` (`CALIBRATION`) at the model's float32 weight bytes
(piecewise linear in their logarithm between the calibrated models, held outside them) and
linearly in T between the measured widths (1 at T = 1, extended past the widest with the
last slope). A draft model's round adds its own steps (`round_cost`): their time relative
to the target's step comes from the decode step's time by weight bytes measured side by
side by `gpt-jax bench step_cost` (`STEP_CALIBRATION`). A row drafts only while its expected
tokens per round (`expected_tokens`) beat that cost. The cost sets how often a row drafts,
never the distribution of what it emits: greedy tokens are those of decoding without
speculation whatever it is.

Both tables are measurements of one machine and one build (a kernel for the products of
few rows changes them): re-measure with the commands in their comments and paste the
printed values.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from gpt_jax.config import GPTConfig

# (float32 weight bytes, {T: verification / decode step at batch 1}) per calibrated model,
# smallest first (benchmarks/README.md, "Speculative decoding"):
# - the trained shakespeare-char-llama (0.80M parameters; with the few-rows kernel, mean of
#   two side-by-side runs; "Third pass");
# - shakespeare-char-10m (10.6M, random weights: the shape is what costs), `gpt-jax bench
#   verify_cost --preset shakespeare-char-10m --batch 1 --positions 2 5 9 --length 128
#   --no-xla --name verify_cost-10m` (XNNPACK's products: its weights are over the few-rows
#   kernel's 512 KB), mean of two runs (T = 9: one) ("Fifth pass");
# - the GPT-2 shape (124M, random; the few-rows kernel is not used there), `--preset gpt2
#   --batch 1 --positions 2 5 --length 128 --steps 8 --no-xla` ("Third pass").
CALIBRATION = ((3.2e6, {2: 1.9, 5: 2.9}), (4.25e7, {2: 1.59, 5: 2.23, 9: 2.76}),
               (4.98e8, {2: 1.33, 5: 1.89}))

# (float32 weight bytes, ms per decode step at batch 1), smallest first, measured side by
# side in one process (only the ratios are used): `gpt-jax bench step_cost --repeats 11`
# (presets shakespeare-char-draft, shakespeare-char-llama, shakespeare-char-10m, gpt2;
# "Fifth pass")
STEP_CALIBRATION = ((4.01e5, 0.0628), (3.21e6, 0.317), (4.26e7, 2.83), (4.94e8, 47.0))


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


def _by_size(points, nbytes: float) -> float:
    """The value at `nbytes` of `points` ((weight bytes, value), smallest first): piecewise
    linear in log(bytes), the end values outside them."""
    at = math.log(nbytes)
    logs = [math.log(b) for b, _ in points]
    if at <= logs[0]:
        return points[0][1]
    for (l0, (_, v0)), (l1, (_, v1)) in zip(zip(logs, points), zip(logs[1:], points[1:])):
        if at <= l1:
            return v0 + (v1 - v0) * (at - l0) / (l1 - l0)
    return points[-1][1]


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
    return _by_size([(b, _ratio_at(table, width + 1)) for b, table in CALIBRATION],
                    weight_bytes(config))


def step_ratio(draft_config: GPTConfig, config: GPTConfig) -> float:
    """The draft model's decode step time over the target's at batch 1, by
    `STEP_CALIBRATION` (its log ms interpolated at each model's weight bytes)."""
    log_ms = [(b, math.log(ms)) for b, ms in STEP_CALIBRATION]
    return math.exp(_by_size(log_ms, weight_bytes(draft_config))
                    - _by_size(log_ms, weight_bytes(config)))


def round_cost(config: GPTConfig, width: int, draft_config: GPTConfig | None = None) -> float:
    """What a speculative round of `width` drafts costs, in units of the step the row runs
    while it does not draft. With n-gram drafts (`draft_config` None) that is a decode step
    and the round is one verification (`verify_cost`). With a draft model, a row that does
    not draft still feeds its token to the draft (`inference.draft`), so its step costs
    1 + r, r = `step_ratio`, and a round costs the verification plus max(width, 1) draft
    steps: (verify_cost + max(width, 1) r) / (1 + r), 1 at width 0. Raises ValueError for a
    negative width."""
    cost = verify_cost(config, width)
    if draft_config is None:
        return cost
    r = step_ratio(draft_config, config)
    return (cost + max(width, 1) * r) / (1 + r)


def row_costs(config: GPTConfig, ks, draft_config: GPTConfig | None = None,
              drafted=None) -> np.ndarray:
    """`round_cost` of each row's own k (0: not speculative, cost 1), with the draft model
    `draft_config` where `drafted` (bools, one per row; None: no row), float32
    (`inference.speculative.SpecArrays.cost`). A row's own k, not the batch's width: when
    it drafts must not depend on its neighbours, or a seeded sampled request would not
    reproduce in another batch."""
    drafted = [False] * len(ks) if drafted is None else drafted
    return np.array([round_cost(config, int(k), draft_config if d else None)
                     for k, d in zip(ks, drafted)], np.float32)


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
