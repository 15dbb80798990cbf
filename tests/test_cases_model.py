"""The model, cache and batching cases of shared/cases/generation.md (G01, G02, G04, G06,
G18, G19): faults other engines shipped, each kept as a test of its whole kind.

All models here use `lively_params` (weights x6), so greedy outputs vary and an engine that
ignores positions or the cache would give different tokens.
"""

import contextlib
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, assert_lively
from gpt_jax import GPTConfig, cache as kv, forward
from gpt_jax.attention import attend
from inference import SamplingParams, compile_counts, decode_step, generate, init_cache, prefill
from inference.generation import validate

PAD = 0


def greedy_steps(params, config, logits_BV, cache, steps):
    """`steps` greedy decode steps from prefill logits. Returns tokens `[B, steps]`, the
    logits after feeding each token `[B, steps, V]`, the position each token was fed at
    (the row's cache length then) `[B, steps]`, and the final cache."""
    tokens, logits, positions = [], [], []
    for _ in range(steps):
        token_B = jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
        positions.append(np.asarray(cache.lengths))
        logits_BV, cache = decode_step(params, config, token_B, cache)
        tokens.append(np.asarray(token_B))
        logits.append(np.asarray(logits_BV))
    return np.stack(tokens, 1), np.stack(logits, 1), np.stack(positions, 1), cache


def solo(params, config, prompt, steps, capacity=32):
    """One prompt alone: its prefill logits `[V]` and greedy tokens."""
    cache = init_cache(config, 1, capacity)
    logits, cache = prefill(params, config, jnp.array([prompt]), jnp.array([len(prompt)]), cache)
    tokens, _, _, _ = greedy_steps(params, config, logits, cache, steps)
    return logits[0], tokens[0].tolist()


def pad_row(prompt, width, side, pad=PAD):
    padding = [pad] * (width - len(prompt))
    return padding + prompt if side == "left" else prompt + padding


# ------------------------------------------------------------------------------- G01


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_g01_positions_follow_each_rows_own_padding(config, params, padding_side):
    a, b = [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8]
    lengths = jnp.array([3, 8])

    def run(pad):
        tokens = jnp.array([pad_row(a, 8, padding_side, pad), b])
        cache = init_cache(config, 2, 32)
        return prefill(params, config, tokens, lengths, cache, padding_side=padding_side)

    logits, cache = run(PAD)
    assert_close(logits, run(63)[0], 0.0, "prefill logits with another pad id")
    tokens, step_logits, positions, _ = greedy_steps(params, config, logits, cache, 10)
    # Row a's token t goes in at position 3 + t, row b's at 8 + t, whatever the padding.
    assert positions[0].tolist() == list(range(3, 13))
    assert positions[1].tolist() == list(range(8, 18))
    for row, prompt in enumerate((a, b)):
        solo_logits, solo_tokens = solo(params, config, prompt, 10)
        assert_lively(solo_tokens, 5)
        assert_close(logits[row], solo_logits, 1e-5, f"row {row} prefill logits vs alone")
        assert tokens[row].tolist() == solo_tokens, f"row {row}: batched != alone"
    # The public decode_step is the decode path generate's loop runs (`steps.run_decode`):
    # its batched, padded run gives the same tokens.
    looped = generate(params, config, [a, b], SamplingParams(temperature=0.0, max_new_tokens=10))
    assert [o.tokens for o in looped] == tokens.tolist()
    # Every decode step equals the full causal forward at that position (one right-padded
    # batch: padding after a sequence cannot change its causal logits).
    seqs = [prompt + tokens[row].tolist() for row, prompt in enumerate((a, b))]
    full = forward(params, jnp.array([pad_row(s, 18, "right") for s in seqs]), config)
    for row, prompt in enumerate((a, b)):
        assert_close(step_logits[row], full[row, len(prompt): len(seqs[row])], 1e-5,
                     f"row {row} decode logits")


# ------------------------------------------------------------------------------- G02


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_g02_decode_never_reads_pad_or_unwritten_cache_slots(config, params, padding_side):
    a, b, c, d, e = 11, 22, 33, 44, 55
    full = forward(params, jnp.array([[a, b, c, d, e]]), config)[0]  # positions 0..4
    rng = np.random.default_rng(0)

    def garbage_at(cache, slots):  # slot s of the row: page s // 4, offset s % 4
        def fill(pool):
            for s in range(8)[slots]:
                shape = pool[s // 4, :, s % 4].shape
                pool = pool.at[s // 4, :, s % 4].set(rng.uniform(-1e3, 1e3, shape))
            return pool
        return cache.replace(k=tuple(map(fill, cache.k)), v=tuple(map(fill, cache.v)))

    def run(before=None, after=None):
        """Prefill [PAD, PAD, a, b, c] (3 real tokens), then decode d and e. `before` and
        `after` fill the given cache slots with +-1e3 before / after the prefill."""
        cache = init_cache(config, 1, 8, page_size=4)
        if before is not None:
            cache = garbage_at(cache, before)
        row = jnp.array([pad_row([a, b, c], 5, padding_side)])
        logits_c, cache = prefill(params, config, row, jnp.array([3]), cache,
                                  padding_side=padding_side)
        assert int(cache.lengths[0]) == 3
        if after is not None:
            cache = garbage_at(cache, after)
        logits_d, cache = decode_step(params, config, jnp.array([d]), cache)
        logits_e, _ = decode_step(params, config, jnp.array([e]), cache)
        return jnp.stack([logits_c[0], logits_d[0], logits_e[0]])

    clean = run()
    assert_close(clean, full[2:5], 1e-5, "cached logits vs no-cache forward of [a, b, c, d, e]")
    # The two pads were written to slots 3 and 4 (after the real tokens), then d and e
    # overwrite them; until then they must never be read.
    assert_close(run(after=slice(3, 5)), clean, 1e-6, "logits with garbage in the pad slots")
    assert_close(run(after=slice(3, 8)), clean, 1e-6, "logits with garbage after the index")
    assert_close(run(before=slice(0, 8)), clean, 1e-6, "logits with garbage in unwritten slots")


# ------------------------------------------------------------------------------- G04


def test_g04_one_token_row_left_padded_to_eight_stays_finite_and_equal(config, params):
    a, b = [9], list(range(20, 28))
    tokens = jnp.array([pad_row(a, 8, "left"), b])
    logits, cache = prefill(params, config, tokens, jnp.array([1, 8]), init_cache(config, 2, 32),
                            padding_side="left")
    assert np.isfinite(np.asarray(logits)).all()
    assert all(np.isfinite(np.asarray(pool)).all() for pool in cache.k + cache.v)
    # Every query row of the padded batch, pad rows included, through every layer.
    assert np.isfinite(np.asarray(forward(params, tokens, config))).all()

    batched, _, _, _ = greedy_steps(params, config, logits, cache, 20)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    through_generate = generate(params, config, [a, b], greedy)
    for row, prompt in enumerate((a, b)):
        _, alone = solo(params, config, prompt, 20)
        assert_lively(alone, 5)
        assert batched[row].tolist() == alone, f"row {row}: batched != alone"
        assert through_generate[row].tokens == alone, f"row {row}: generate != alone"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_g04_attention_row_with_every_key_masked_is_zero_with_finite_gradients(dtype):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(3, 4, 8)), dtype)  # T=3 queries, N=4 heads
    k, v = (jnp.asarray(rng.normal(size=(5, 2, 8)) * 10, dtype) for _ in range(2))  # K=2
    mask = jnp.array([[False] * 5, [True, True, False, False, False], [False] * 5])

    out = attend(q, k, v, mask)
    assert out.dtype == dtype
    assert_close(out[0], np.zeros((4, 8)), 0.0, "fully masked row 0")
    assert_close(out[2], np.zeros((4, 8)), 0.0, "fully masked row 2")
    q1 = np.asarray(q[1], np.float32).reshape(2, 2, 8)  # [K, G, H]
    s = np.einsum("kgh,skh->kgs", q1, np.asarray(k, np.float32)[:2]) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = np.einsum("kgs,skh->kgh", p, np.asarray(v, np.float32)[:2]).reshape(4, 8)
    assert_close(out[1], expected, 1e-5 if dtype == jnp.float32 else 0.2, "row with two keys")

    grads = jax.grad(lambda q, k, v: attend(q, k, v, mask).astype(jnp.float32).sum(),
                     argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g, np.float32)).all()


# ------------------------------------------------------------------------------- G06


@pytest.fixture
def one_layer_cache():
    """One layer, 2 slots of 8 token positions in pages of 3 (3, 3, 2 used): slot 0 owns
    pages 0-2, slot 1 pages 3-5, every position holding its slot index x 10 + position;
    both slots have 0 tokens written."""
    config = GPTConfig(vocab_size=16, max_seq_len=8, n_layers=1, n_heads=1, d_model=4)
    cache = init_cache(config, 2, 8, page_size=3)
    value = (jnp.arange(6)[:, None] // 3 * 10 + jnp.arange(6)[:, None] % 3 * 3
             + jnp.arange(3)[None, :]).astype(jnp.float32)  # page p, offset o
    pool = jnp.broadcast_to(value[:, None, :, None], cache.k[0].shape)
    return cache.replace(k=(pool,), v=(pool,))


def _write(cache, slot, start, size):
    """Write `size` new entries (-5) into `slot` at position `start`."""
    cache = cache.replace(lengths=cache.lengths.at[slot].set(start))
    new = (jnp.full((2, size, 1, 4), -5.0),)
    return kv.write(cache, new, new, jnp.zeros(2, jnp.int32).at[slot].set(size))


@pytest.mark.parametrize("start, size, pages", [(9, 1, 3), (8, 2, 3), (6, 1, 2), (5, 2, 2)])
def test_g06_out_of_range_cache_writes_are_refused(one_layer_cache, start, size, pages):
    """Past the slot's page table, or into a table entry with no page (the slot's third page
    taken away): refused whole, never clamped onto the last page."""
    cache = one_layer_cache
    if pages == 2:
        cache = cache.replace(page_table=cache.page_table.at[1, 2].set(kv.NO_PAGE))
    message = (rf"KV cache write of {size} token\(s\) at position {start} of slot 1 is out of "
               rf"range: the slot has {pages} page\(s\) of 3 = {3 * pages} token slots")
    with pytest.raises(ValueError, match=message):
        _write(cache, 1, start, size)
    out = jax.jit(_write, static_argnums=(1, 3))(cache, 1, start, size)
    assert bool(out.overflow[1]) and not bool(out.overflow[0])
    assert out.lengths.tolist() == [0, start]  # unchanged
    assert_close(out.k[0], cache.k[0], 0.0, "pool after a refused write (last page included)")


def test_g06_cache_writes_that_fit_land_in_the_slots_pages(one_layer_cache):
    """A write across a page edge and into the last position, under jit and without."""
    cache = one_layer_cache
    for write in (_write, jax.jit(_write, static_argnums=(1, 3))):
        out = write(cache, 1, 2, 2)  # positions 2 and 3: page 3 offset 2, page 4 offset 0
        expected = cache.k[0].at[3, :, 2].set(-5.0).at[4, :, 0].set(-5.0)
        assert_close(out.k[0], expected, 0.0, "pool after writing positions 2-3 of slot 1")
        assert out.lengths.tolist() == [0, 4] and not bool(out.overflow.any())
        out = write(cache, 0, 8, 1)  # the last position of slot 0's pages
        assert_close(out.k[0], cache.k[0].at[2, :, 2].set(-5.0), 0.0, "the last position")


def test_g06_model_writes_past_the_cache_end_are_flagged_not_clamped(config, params):
    cache = init_cache(config, 1, 8, page_size=4)
    _, cache = prefill(params, config, jnp.array([[1, 2, 3, 4, 5, 6]]), jnp.array([6]), cache)
    # A 3-token chunk at index 6 of 8 slots would be shifted to start at 5 if clamped.
    _, after = prefill(params, config, jnp.array([[7, 8, 9]]), jnp.array([3]), cache)
    assert bool(after.overflow[0]) and int(after.lengths[0]) == 6
    assert_close(after.k, cache.k, 0.0, "keys after a refused prefill chunk")  # all layers
    assert_close(after.v, cache.v, 0.0, "values after a refused prefill chunk")
    for token in (7, 8):  # fills slots 6 and 7; the next write is past the end
        _, cache = decode_step(params, config, jnp.array([token]), cache)
    assert not bool(cache.overflow[0]) and int(cache.lengths[0]) == 8
    _, after = decode_step(params, config, jnp.array([9]), cache)
    assert bool(after.overflow[0]) and int(after.lengths[0]) == 8
    assert_close(after.k, cache.k, 0.0, "keys after a refused decode write (slot 7 included)")


def test_g06_generate_checks_every_rows_length_before_compiling(config, params):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=28)
    fits, too_long = [1] * 100, [1] * 101  # + 28 against max_seq_len 128
    validate(config, [fits], greedy)  # exactly at the limit is allowed
    before = compile_counts()
    with pytest.raises(ValueError, match=r"prompt 1: prompt length 101 \+ max_new_tokens 28 = "
                                         r"129 exceeds the model's max_seq_len 128"):
        generate(params, config, [fits, too_long], greedy)
    assert compile_counts() == before


# ------------------------------------------------------------------------------- G18


@contextlib.contextmanager
def backend_compiles():
    """Counts every XLA compilation in the block by function name (jax.monitoring)."""
    counts = Counter()

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            counts[kwargs.get("fun_name", "?")] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_g18_sampling_changes_within_a_bucket_never_recompile(config, params):
    def request(length, temperature, top_p, top_k, seed, max_new_tokens=20):
        sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            max_new_tokens=max_new_tokens)
        return generate(params, config, [list(range(1, length + 1))], sp)[0]

    request(3, 0.7, 0.8, 0, 0)  # warm-up: prompts of 1..16 tokens, 17..32 new tokens
    before = compile_counts()
    calls = [(3, 0.7, 0.8, 0, 1), (5, 0.9, 0.95, 5, 2), (7, 1.0, 0.8, 20, 3),
             (11, 0.7, 0.95, 0, 4, 17), (3, 0.9, 0.8, 3, 5), (5, 1.0, 0.95, 0, 6, 32),
             (7, 0.7, 0.8, 1, 7), (11, 0.9, 0.95, 40, 8), (3, 0.0, 1.0, 0, 9), (11, 1.0, 0.8, 0, 10, 25)]
    with backend_compiles() as counts:
        outputs = [request(*call) for call in calls]
    assert dict(counts) == {}, f"recompiled: {dict(counts)}"
    assert compile_counts() == before
    assert len({tuple(o.tokens) for o in outputs}) >= 8  # the settings really differed

    # A prompt in a new length bucket (17..32) compiles exactly one program: prefill and the
    # whole decode loop together (the tokens loop is a lax.scan, not a Python loop); the
    # only other compile allowed is JAX's host-to-device copy of the new prompt shape.
    with backend_compiles() as counts:
        request(20, 0.8, 0.9, 0, 11)
    assert counts["jit(generation)"] == 1, dict(counts)
    assert set(counts) <= {"jit(generation)", "jit(stage)"}, dict(counts)
    after = compile_counts()
    assert after["generate"] == before["generate"] + 1
    assert after["decode_step"] == before["decode_step"] and after["prefill"] == before["prefill"]
    with backend_compiles() as counts:  # another length and token count in the same buckets
        request(29, 0.8, 0.9, 0, 12, max_new_tokens=31)
    assert dict(counts) == {}, f"recompiled: {dict(counts)}"


# ------------------------------------------------------------------------------- G19


def test_g19_empty_prompt_raises_before_compiling_unless_bos_is_given(config, params):
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    before = compile_counts()
    with pytest.raises(ValueError, match=r"prompt 0 is empty; a prompt needs at least one token "
                                         r"\(pass bos_token_id to inference.generate"):
        generate(params, config, [[]], greedy)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        generate(params, config, [[], [1, 2, 3]], greedy)
    assert compile_counts() == before

    # With a BOS id, the empty prompt is the prompt [BOS]; the other row is unaffected.
    bos = 50
    empty, other = generate(params, config, [[], [1, 2, 3]], greedy, bos_token_id=bos)
    (from_bos,) = generate(params, config, [[bos]], greedy)
    (alone,) = generate(params, config, [[1, 2, 3]], greedy)
    assert_lively(alone.tokens, 5)
    assert empty.tokens == from_bos.tokens and other.tokens == alone.tokens
    assert all(0 <= t < config.vocab_size for t in empty.tokens + other.tokens)


def test_g19_empty_prompt_with_no_new_tokens_returns_nothing_and_compiles_nothing(config, params):
    none = SamplingParams(max_new_tokens=0, seed=3)
    with backend_compiles() as counts:
        out = generate(params, config, [[]], none)
        both = generate(params, config, [[], [1, 2]], none)
    assert dict(counts) == {}
    assert [(c.tokens, c.finish_reason) for c in out + both] == [([], "length")] * 3


def test_g19_zero_length_row_in_prefill_stays_finite_and_apart(config, params):
    tokens = jnp.array([[PAD, PAD, PAD], [1, 2, 3]])
    logits, cache = prefill(params, config, tokens, jnp.array([0, 3]), init_cache(config, 2, 8))
    assert np.isfinite(np.asarray(logits)).all()
    assert all(np.isfinite(np.asarray(pool)).all() for pool in cache.k + cache.v)
    assert cache.lengths.tolist() == [0, 3]
    alone, _ = prefill(params, config, tokens[1:], jnp.array([3]), init_cache(config, 1, 8))
    assert_close(logits[1], alone[0], 1e-5, "the non-empty row's logits")
