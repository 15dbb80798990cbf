"""The ragged forward (`gpt_jax.ragged`): a decode token of one row and a prompt chunk of
another, flattened into one batch of query tokens, give the logits and cache entries of
running them separately (the decode step, the chunked prefill), on both attention paths."""

import jax
import jax.numpy as jnp
import numpy as np

from conftest import assert_close
from gpt_jax import cache as kv
from gpt_jax.model import lm_head
from gpt_jax.ragged import ragged_transformer
from inference.steps import run_prefill


def test_a_decode_row_and_a_prefill_chunk_in_one_step_equal_running_them_apart(
        config, params, decode_attention):
    rng = np.random.default_rng(0)
    p0, p1 = (rng.integers(0, config.vocab_size, n).tolist() for n in (11, 30))
    cache = kv.init_cache(config, 2, 48, page_size=8)
    prefill = jax.jit(run_prefill, static_argnums=1)
    # row 0 holds its 11-token prompt; row 1 the first 13 tokens of its 30
    first = jnp.array([p0 + [0] * 2, p1[:13]], jnp.int32)
    _, cache = prefill(params, config, first, jnp.array([11, 13]), cache)
    token = 7  # row 0's next token, fed at position 11

    # apart: the decode step of row 0 (T = 1), then the second chunk of row 1
    logits0, apart = prefill(params, config, jnp.array([[token]]), jnp.array([1]), cache,
                             jnp.array([0]))
    logits1, apart = prefill(params, config, jnp.array([p1[13:]]), jnp.array([17]), apart,
                             jnp.array([1]))

    # together: one flattened batch: two single tokens (row 0's decode token, padding), then
    # row 1's chunk in two blocks of 16 (its last 15 places padding)
    tokens = np.zeros(34, np.int32)
    rows, positions = np.full(34, 2), np.zeros(34, np.int32)
    tokens[0], rows[0], positions[0] = token, 0, 11
    tokens[2:19] = p1[13:]
    rows[2:], positions[2:] = 1, np.arange(13, 45)
    valid = (rows < 2) & (np.arange(34) < 19)
    table = jnp.take(cache.page_table, jnp.asarray(rows), axis=0, mode="fill",
                     fill_value=kv.NO_PAGE)
    run = jax.jit(ragged_transformer, static_argnums=(6, 7))
    x_ND, together = run(params, jnp.asarray(tokens), jnp.asarray(positions), table,
                         jnp.asarray(valid), cache, config, 2)
    logits = lm_head(params, x_ND[jnp.array([0, 18])], config)
    assert_close(logits[0], logits0[0], 1e-5, "decode row's logits")
    assert_close(logits[1], logits1[0], 1e-5, "prefill chunk's logits")
    for a, b in zip(together.k + together.v, apart.k + apart.v):  # float rounding of layer 1
        assert_close(a, b, 5e-5, "stored keys and values")
    assert not np.allclose(logits[0], logits[1])  # two rows, two predictions
