"""`training/step.py`: the loss, the train step (several steps in one call, gradient
accumulation, bfloat16 compute), the optimizer and the evaluation."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from conftest import assert_close
from gpt_jax import forward
from gpt_jax.config import GPTConfig
from gpt_jax.params import init_params
from training import data, sharding
from training.config import TrainConfig
from training.run_dir import prepare_run
from training.step import TrainState, evaluate, loss_fn, make_optimizer, make_train_steps


def _one_step(cfg, config, x, y, optimizer, compute_dtype=jnp.float32):
    """`(params, loss)` after one train step (a call of one) from the seed-0 init."""
    params = init_params(config, jax.random.key(0))
    steps = make_train_steps(config, optimizer, compute_dtype)
    state, losses = steps(TrainState(params, optimizer.init(params)), x[None], y[None],
                          np.int32(1))
    return state.params, losses[0]

def test_loss_is_next_token_cross_entropy_at_every_position():
    """Fault: targets shifted by one more position (logits[:, :-1] against y[:, 1:]) still
    learns, so only the exact value catches it. The train step reports the same loss."""
    config = GPTConfig.preset("tiny")
    params = init_params(config, jax.random.key(0))
    x = np.random.default_rng(0).integers(0, config.vocab_size, (2, 8)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    expected = optax.softmax_cross_entropy_with_integer_labels(forward(params, x, config), y)
    loss = loss_fn(params, config, x, y)
    assert_close(loss, expected.mean(), 1e-5, "loss")
    y_first_changed = y.copy()
    y_first_changed[:, 0] = (y[:, 0] + 1) % config.vocab_size
    assert abs(float(loss_fn(params, config, x, y_first_changed)) - float(loss)) > 1e-4
    _, step_loss = _one_step(TrainConfig.preset("tiny"), config, x[None], y[None],
                                optax.sgd(0.0))
    assert_close(step_loss, expected.mean(), 1e-5, "train step loss")

def test_steps_in_one_call_equal_the_same_steps_one_call_each():
    """`make_train_steps` (the loop's, `steps_per_call` steps in one program) runs the first
    n of K batches: the same losses and params as n calls of one step each (to float32
    rounding: XLA fuses the loop's body its own way), a 0 loss and nothing else from the
    batches past n (here garbage: out-of-range token ids)."""
    cfg = TrainConfig.preset("tiny")
    config = GPTConfig.preset("tiny")
    optimizer = make_optimizer(cfg)
    x = np.random.default_rng(0).integers(0, config.vocab_size, (4, 1, 2, 16)).astype(np.int32)
    y = np.roll(x, -1, axis=3)
    x[3], y[3] = -7, config.vocab_size + 5

    def fresh():
        params = init_params(config, jax.random.key(0))
        return TrainState(params, optimizer.init(params))

    train_steps = make_train_steps(config, optimizer)
    state, losses = fresh(), []
    for k in range(3):
        state, loss = train_steps(state, x[k:k + 1], y[k:k + 1], np.int32(1))
        losses.append(float(loss[0]))
    called, call_losses = train_steps(fresh(), x, y, np.int32(3))
    assert_close(call_losses[:3], np.array(losses), 1e-6, "losses")
    assert float(call_losses[3]) == 0.0
    for a, b in zip(jax.tree.leaves(called), jax.tree.leaves(state)):
        assert_close(a, b, 1e-5, "params and optimizer state after 3 steps")

def test_gradient_accumulation_equals_one_big_batch():
    config = GPTConfig.preset("tiny")
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (8, 16)).astype(np.int32)
    y = np.roll(x, -1, axis=1)
    sgd = optax.sgd(0.5)  # updates are the gradients themselves, so they are compared
    cfg = TrainConfig.preset("tiny")
    big, loss_big = _one_step(cfg, config, x[None], y[None], sgd)
    acc, loss_acc = _one_step(cfg, config, x.reshape(4, 2, 16), y.reshape(4, 2, 16), sgd)
    assert_close(loss_acc, loss_big, 1e-6, "loss")
    for a, b in zip(jax.tree.leaves(acc), jax.tree.leaves(big)):
        assert_close(a, b, 1e-6, "params")

def test_bfloat16_compute_keeps_float32_master_weights():
    config = GPTConfig.preset("tiny")
    x = np.random.default_rng(1).integers(0, config.vocab_size, (1, 4, 16)).astype(np.int32)
    cfg = TrainConfig.preset("tiny")
    optimizer = make_optimizer(cfg)
    p32, loss32 = _one_step(cfg, config, x, x, optimizer)
    p16, loss16 = _one_step(cfg, config, x, x, optimizer, jnp.bfloat16)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(p16))
    assert abs(float(loss16) - float(loss32)) < 0.05
    assert float(loss16) != float(loss32)  # it did compute in bfloat16

def test_the_first_optimizer_step_moves_the_weights():
    """Fault: warmup from exactly 0 made step 0 a no-op (a step-1 checkpoint equal to the
    initial weights). nanoGPT's warmup starts at lr / (warmup + 1)."""
    config = GPTConfig.preset("tiny")
    cfg = TrainConfig.preset("tiny", warmup_steps=10, grad_clip=0.0)
    x = np.random.default_rng(0).integers(0, config.vocab_size, (1, 2, 16)).astype(np.int32)
    moved, _ = _one_step(cfg, config, x, np.roll(x, -1, axis=2), make_optimizer(cfg))
    initial = init_params(config, jax.random.key(0))
    # Adam's first update is lr * sign(gradient) (weight decay adds under 1%): lr / 11
    step = jnp.abs(moved["wte"] - initial["wte"]).max()
    assert_close(step, cfg.learning_rate / 11, 0.02 * cfg.learning_rate / 11, "first step")

def test_weight_decay_spares_biases_and_layernorm():
    config = GPTConfig.preset("tiny")
    params = init_params(config, jax.random.key(0))
    cfg = TrainConfig.preset("tiny", warmup_steps=0, grad_clip=0.0)
    optimizer = make_optimizer(cfg)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
    flat = jax.tree_util.tree_flatten_with_path(updates)[0]
    for path, update in flat:
        name = path[-1].key
        assert bool(jnp.any(update != 0)) == name.startswith("w"), name

def test_val_loss_per_char_uses_the_bpe_token_length(corpus, tmp_path):
    cfg = TrainConfig.preset("tiny", text=str(corpus), tokenizer="bpe", bpe_vocab_size=300,
                               run_dir=str(tmp_path / "bpe"))
    config, tokenizer, batches = prepare_run(cfg)
    assert config.vocab_size == tokenizer.vocab_size == 300
    ratio = len(tokenizer.decode(batches.val)) / len(batches.val)
    assert ratio > 1.5  # words merge into multi-character tokens
    params = init_params(config, jax.random.key(0))
    mesh = sharding.make_mesh(1)
    evals = evaluate(params, config, dataclasses.replace(cfg, block_size=32), batches, mesh)
    assert math.isclose(evals["val_loss_per_char"], evals["val_loss"] / ratio, rel_tol=1e-9)


def test_the_val_loss_is_the_mean_loss_over_the_val_batches():
    """Planted fault that survived (issue 41): evaluation drawing its batches from the train
    split passed every val-loss test (it beats the unigram entropy and goes down on the train
    split too). With splits that differ (train all one token, val random), the reported val
    loss is the mean loss over the val split's `eval_batches` fixed batches."""
    config = GPTConfig.preset("tiny")
    cfg = TrainConfig.preset("tiny", batch_size=2, block_size=8, eval_batches=3)
    rng = np.random.default_rng(0)
    batches = data.Batches(train=np.full(500, 5, np.int32),
                           val=rng.integers(0, config.vocab_size, 300).astype(np.int32),
                           block=8, val_chars_per_token=1.0)
    params = init_params(config, jax.random.key(0))
    evals = evaluate(params, config, cfg, batches, sharding.make_mesh(1))
    expected = np.mean([loss_fn(params, config, *data.get_batch(batches.val, 2, 8,
                                                                 cfg.seed + 1, i))
                        for i in range(3)])
    assert_close(evals["val_loss"], expected, 1e-5, "val loss")
