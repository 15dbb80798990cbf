"""Train a GPT on a text corpus, with checkpoints, resume, evaluation and plots.

Usage:
  python -m training.train                               # shakespeare-char on the plays
  python -m training.train --preset nanogpt-cpu --text tinyshakespeare.txt --run-dir runs/nano
  python -m training.train --text my.txt --run-dir runs/mine --max-steps 2000 --tokenizer bpe
  python -m training.train --run-dir runs/x              # resumes runs/x if it has checkpoints
  python -m training.train --cpu-devices 4 --devices 4 --shard-params true
  python -m training.train --coordinator HOST0:5000 --num-processes 2 --process-id 0   # on
  python -m training.train --coordinator HOST0:5000 --num-processes 2 --process-id 1   # each

`--preset` picks a TrainConfig preset; every TrainConfig field is also a flag
(`--batch-size 64`) overriding it, and the resolved config is saved as train_config.json. On
CPU the host is split into one XLA device per core (`--cpu-devices`) and the batch is
data-parallel over them. A run resumes from its latest good checkpoint; the batch for step s
depends only on (seed, s), so a resumed run sees exactly the data an uninterrupted run would
have seen. Several processes (hosts) train one model through `jax.distributed`
(`training/distributed.py`; training/README.md shows SLURM and ssh launches).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import inspect
import json
import math
import os
import re
import sys
import time
import types
import typing
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from gpt_jax import checkpoint
from gpt_jax.config import GPTConfig
from gpt_jax.model import forward, unstack_layers
from gpt_jax.params import init_params, param_count
from gpt_jax.tokenizer import BPETokenizer, CharTokenizer
from training import data, distributed, report, sharding


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters. Presets: `TRAIN_PRESETS`; `TrainConfig.preset(name, **kw)`.

    Raises:
      ValueError: a value is out of range (naming the field, value and range).
    """

    model: str = "shakespeare-char"  # GPTConfig preset; vocab_size comes from the tokenizer
    text: str | None = None  # UTF-8 corpus file; None = the built-in Shakespeare plays
    run_dir: str = "runs/shakespeare-char"  # checkpoints, config, tokenizer, metrics, plots
    tokenizer: str = "char"  # "char" or "bpe" (byte-level BPE trained on the corpus)
    bpe_vocab_size: int = 512  # BPE vocabulary size (256 bytes + merges)
    batch_size: int = 12  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step (gradients averaged)
    block_size: int = 0  # tokens per sequence; 0 = the model's max_seq_len
    max_steps: int = 4000  # optimizer steps (the cosine schedule ends here)
    time_budget_s: float = 0.0  # stop (and checkpoint) after this much wall time; 0 = none
    learning_rate: float = 2e-3  # peak AdamW learning rate
    min_learning_rate: float = 2e-4  # end of the cosine decay
    warmup_steps: int = 100  # linear warmup from 0
    weight_decay: float = 0.1  # decoupled, on weight matrices and embeddings only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # global-norm clipping; 0 = off
    compute_dtype: str = "float32"  # "bfloat16": bf16 matmuls, float32 master weights
    eval_interval: int = 500  # steps between val-loss evaluations and checkpoints
    eval_batches: int = 16  # batches per evaluation
    sample_tokens: int = 100  # tokens sampled and printed at each evaluation; 0 = none
    seed: int = 0  # parameter init and data order
    val_fraction: float = 0.1  # tail of the corpus held out
    keep_checkpoints: int = 3  # the last k are kept (and the best by val loss)
    devices: int = 0  # data-parallel devices on the mesh; 0 = all
    cpu_devices: int = 0  # CPU backend: XLA devices the host is split into by the command
    # line, before JAX starts (one program per core; see training/sharding.py); 0 = one per
    # core, as many as divide batch_size
    shard_params: bool = False  # split params and optimizer state over the mesh too
    peak_flops: float = 0.0  # device peak FLOP/s for the MFU estimate; 0 = measure a matmul

    def __post_init__(self):
        positive = ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_batches",
                    "keep_checkpoints", "learning_rate")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("block_size", "warmup_steps", "time_budget_s", "min_learning_rate",
                     "weight_decay", "grad_clip", "sample_tokens", "devices", "cpu_devices",
                     "peak_flops"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("val_fraction", "beta1", "beta2"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be in (0, 1), got {getattr(self, name)}")
        choices = {"tokenizer": ("char", "bpe"), "compute_dtype": ("float32", "bfloat16")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"TrainConfig.{name} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")

    @property
    def tokens_per_step(self) -> int:
        """Only meaningful once block_size is resolved (see `prepare_run`)."""
        return self.grad_accum * self.batch_size * self.block_size

    @classmethod
    def preset(cls, name: str, **overrides) -> TrainConfig:
        """A named configuration with field overrides.

        Raises:
          ValueError: unknown preset or field (naming it and listing the allowed ones).
        """
        if name not in TRAIN_PRESETS:
            raise ValueError(f"unknown TrainConfig preset {name!r}; choose one of "
                             f"{sorted(TRAIN_PRESETS)}")
        fields = [f.name for f in dataclasses.fields(cls)]
        if unknown := sorted(set(overrides) - set(fields)):
            raise ValueError(f"unknown TrainConfig field(s) {unknown}; fields are {fields}")
        return dataclasses.replace(TRAIN_PRESETS[name], **overrides)


TRAIN_PRESETS: dict[str, TrainConfig] = {
    # `make demo`: the built-in plays, nanoGPT's CPU recipe (12 x 64 tokens per step) at twice its
    # learning rate; 4000 steps take ~325 s of the 450 s budget on 2 idle cores (2 devices).
    # `cli demo` trains TrainConfig() itself, so this preset is the class defaults.
    "shakespeare-char": TrainConfig(),
    # nanoGPT's config/train_shakespeare_char.py with its README's CPU overrides
    # (--device=cpu --compile=False --eval_iters=20 --block_size=64 --batch_size=12
    # --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0),
    # except the learning rate: twice nanoGPT's 1e-3 (and min 1e-4), as in the demo preset.
    # At 2000 steps on tinyshakespeare it ends at val 1.81-1.82 nats/char where nanoGPT's own
    # rate ends at 1.89-1.90 (training/README.md); pass --learning-rate 1e-3
    # --min-learning-rate 1e-4 for nanoGPT's exact recipe.
    "nanogpt-cpu": TrainConfig(
        model="nanogpt-cpu", run_dir="runs/nanogpt-cpu", batch_size=12, block_size=64,
        max_steps=2000, learning_rate=2e-3, min_learning_rate=2e-4, warmup_steps=100,
        weight_decay=0.1, beta1=0.9, beta2=0.99, grad_clip=1.0, eval_interval=250,
        eval_batches=20, sample_tokens=0,
    ),
    # Tests: seconds, not minutes.
    "tiny": TrainConfig(
        model="tiny", run_dir="runs/tiny", batch_size=8, block_size=32, max_steps=300,
        learning_rate=1e-2, min_learning_rate=1e-3, warmup_steps=10, eval_interval=100,
        eval_batches=4, sample_tokens=0,
    ),
}


@dataclasses.dataclass(frozen=True)
class Batches:
    """Everything a run draws batches from, resolved once."""

    train: np.ndarray  # int32 [n_train] token ids
    val: np.ndarray  # int32 [n_val] token ids
    block: int  # tokens per sequence
    val_chars_per_token: float  # characters per token in the val split, to report nats/char


def split_host(cfg: TrainConfig, processes: int = 1) -> None:
    """Split the host CPU into XLA devices for data parallelism (`sharding.split_host_cpu`):
    `cfg.cpu_devices` of them, or for 0 the largest count that is at most the core count
    and, times `processes` (each splitting its host alike), divides `batch_size`, unless
    XLA_FLAGS already sets --xla_force_host_platform_device_count (then that count stands).
    The command line calls this before JAX's first operation.

    Raises:
      RuntimeError: JAX has already run an operation (from `jax.config`).
    """
    n = cfg.cpu_devices
    if not n:
        if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
            return
        n = max((d for d in range(1, min(sharding.host_cores(), cfg.batch_size) + 1)
                 if cfg.batch_size % (d * processes) == 0), default=1)
    sharding.split_host_cpu(n)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW (Loshchilov & Hutter 2019) with nanoGPT's schedule: linear warmup
    `learning_rate * (step + 1) / (warmup_steps + 1)`, so the first step already moves the
    weights, then cosine decay to `min_learning_rate` at `max_steps`; after global-norm
    clipping.
    Weight decay applies to the weight matrices and embeddings (names starting with "w"),
    not to biases or LayerNorm parameters, whatever their stacked rank."""
    schedule = optax.warmup_cosine_decay_schedule(
        cfg.learning_rate / (cfg.warmup_steps + 1), cfg.learning_rate, cfg.warmup_steps, max(cfg.max_steps, cfg.warmup_steps + 1),
        cfg.min_learning_rate,
    )

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: str(path[-1].key).startswith("w"), params)

    adamw = optax.adamw(schedule, cfg.beta1, cfg.beta2, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip \
        else adamw


def loss_fn(params, config: GPTConfig, x_BT, y_BT, compute_dtype=jnp.float32):
    """Mean next-token cross-entropy in nats per token. With a bfloat16 `compute_dtype` the
    float32 master params are cast for the forward pass (their gradients come back float32);
    logits, LayerNorm and softmax stay float32 inside the model.

    The layers run unrolled (`unstack_layers`): the train step measured ~14% faster than with
    the `lax.scan` over stacked layers (nanogpt-cpu shape, 10 paired rounds on 2 cores), for
    a few seconds more compilation. Gradients flow back to the stacked params.
    """
    params = unstack_layers(jax.tree.map(lambda p: p.astype(compute_dtype), params))
    logits_BTV = forward(params, x_BT, config)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, y_BT).mean()


def make_train_step(config: GPTConfig, optimizer, compute_dtype=jnp.float32,
                    shardings=None):
    """`train_step(params, opt_state, x_ABT, y_ABT) -> (params, opt_state, loss)`, jitted,
    donating the old params and optimizer state.

    x_ABT, y_ABT hold A micro-batches; their gradients are averaged (a `lax.scan`, so memory
    stays one micro-batch) before one optimizer update. `shardings` = (params, opt_state)
    shardings pins the outputs to the inputs' layout on a mesh.
    """
    grad_fn = jax.value_and_grad(loss_fn)

    def train_step(params, opt_state, x_ABT, y_ABT):
        def micro(acc, xy):
            loss, grads = grad_fn(params, config, *xy, compute_dtype)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        total, _ = jax.lax.scan(micro, zero, (x_ABT, y_ABT))
        loss, grads = jax.tree.map(lambda t: t / x_ABT.shape[0], total)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    out_shardings = None if shardings is None else (*shardings, None)
    return jax.jit(train_step, donate_argnums=(0, 1), out_shardings=out_shardings)


def step_batch(cfg: TrainConfig, batches: Batches, step: int):
    """The global batch of optimizer step `step`: `(x, y)` int32 `[A, B, T]`, a pure
    function of (seed, step)."""
    x, y = data.get_batch(batches.train, cfg.grad_accum * cfg.batch_size, batches.block,
                          cfg.seed, step)
    shape = (cfg.grad_accum, cfg.batch_size, batches.block)
    return x.reshape(shape), y.reshape(shape)


_eval_loss = jax.jit(loss_fn, static_argnums=(1, 4))  # one cache for every run in a process


def evaluate(params, config, cfg: TrainConfig, batches: Batches, mesh) -> dict[str, float]:
    """Val loss over `eval_batches` fixed batches (the same every evaluation), in nats per
    token and per character (per-token loss x tokens / characters of the val split)."""
    dtype = jnp.dtype(cfg.compute_dtype)
    losses = []
    for i in range(cfg.eval_batches):
        x, y = data.get_batch(batches.val, cfg.batch_size, batches.block, cfg.seed + 1, i)
        losses.append(_eval_loss(params, config, sharding.put_batch(x, mesh),
                                sharding.put_batch(y, mesh), dtype))
    per_token = float(np.mean(jax.device_get(losses)))
    return {"val_loss": per_token, "val_loss_per_char": per_token / batches.val_chars_per_token}


def load_corpus(cfg: TrainConfig) -> str:
    return data.load_text(cfg.text) if cfg.text else data.shakespeare_text()


def make_tokenizer(cfg: TrainConfig, text: str):
    if cfg.tokenizer == "bpe":
        return BPETokenizer.from_text(text, cfg.bpe_vocab_size)
    return CharTokenizer.from_text(text)


def prepare_run(cfg: TrainConfig):
    """`(config, tokenizer, Batches)`; a resumed run reuses its saved config and tokenizer.

    Raises:
      ValueError: the corpus is empty or too short for one block in either split, the
        block is longer than the model's max_seq_len, or the run directory holds another
        model than `cfg.model`.
    """
    run_dir = Path(cfg.run_dir)
    text = load_corpus(cfg)
    if not text:
        raise ValueError("the corpus is empty: a corpus needs text")
    if (run_dir / "config.json").exists():
        saved = run_dir / "train_config.json"
        model = json.loads(saved.read_text()).get("model") if saved.exists() else None
        if model is not None and model != cfg.model:
            raise ValueError(f"{run_dir} holds a {model!r} model; it cannot resume as "
                             f"model {cfg.model!r} (start a new --run-dir for that)")
        config, tokenizer = checkpoint.load_config(run_dir), checkpoint.load_tokenizer(run_dir)
    else:
        tokenizer = make_tokenizer(cfg, text)
        config = GPTConfig.preset(cfg.model, vocab_size=tokenizer.vocab_size)
    block = cfg.block_size or config.max_seq_len
    if block > config.max_seq_len:
        raise ValueError(f"block_size {block} exceeds the model's max_seq_len {config.max_seq_len}")
    tokens = np.asarray(tokenizer.encode(text), np.int32)
    train_tokens, val_tokens = data.split(tokens, cfg.val_fraction)
    for name, part in (("train", train_tokens), ("val", val_tokens)):
        if len(part) <= block:
            raise ValueError(
                f"the {name} split has {len(part)} tokens, fewer than one block of {block} + 1; "
                f"the corpus ({len(tokens)} tokens) is too short"
            )
    chars_per_token = len(tokenizer.decode(val_tokens)) / len(val_tokens)
    return config, tokenizer, Batches(train_tokens, val_tokens, block, chars_per_token)


def init_state(cfg: TrainConfig, config: GPTConfig, optimizer, mesh):
    """Fresh params and optimizer state, placed on the mesh, and their shardings.

    With several processes the params are drawn by process 0 and sent to the others, and
    each process supplies only its own devices' shards (`sharding.put_host`); the optimizer
    state is made on the mesh by one jitted program. Avoided: `device_put` of host copies
    checks leaf by leaf that every process holds the same copy (a cross-process gather per
    array, 4-8 s of start-up for the tiny model), and drawing them everywhere compiles the
    init on every process but 0 (on CPU JAX's persistent cache serves process 0 alone).
    """
    params = distributed.on_process_0(lambda: init_params(config, jax.random.key(cfg.seed)))
    param_shardings = sharding.tree_shardings(params, mesh, cfg.shard_params)
    params = jax.tree.map(sharding.put_host, params, param_shardings)
    opt_shardings = sharding.tree_shardings(jax.eval_shape(optimizer.init, params), mesh,
                                            cfg.shard_params)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    return params, opt_state, (param_shardings, opt_shardings)


def start_or_resume(cfg, config, tokenizer, params, opt_state, mngr):
    """Restore the latest good checkpoint (every process: each restores its own shards),
    or write the run's config files (process 0 alone). Returns
    `(params, opt_state, step, elapsed_s)`."""
    run_dir, primary = Path(cfg.run_dir), distributed.is_primary()
    if mngr.all_steps():
        params, opt_state, meta = checkpoint.restore(mngr, None, params, opt_state)
        step, elapsed = int(meta["step"]), float(meta.get("elapsed_s", 0.0))
        if primary:
            report.truncate_metrics(run_dir, step)  # drop evaluations logged after it
            print(f"resuming {run_dir} from step {step}")
    else:
        if primary:
            checkpoint.save_config(run_dir, config)
            checkpoint.save_tokenizer(run_dir, tokenizer)
        step, elapsed = 0, 0.0
    if primary:  # rewritten on resume too: what a later `--run-dir DIR` alone resumes with
        checkpoint.write_json_atomic(run_dir / "train_config.json", dataclasses.asdict(cfg))
    return params, opt_state, step, elapsed


def check_same_corpus(batches: Batches, config: GPTConfig) -> None:
    """Every process tokenized the same corpus the same way (a collective, so also the
    barrier before process 0 writes into the run directory that the others just read)."""
    if jax.process_count() == 1:
        return
    sha = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()  # noqa: E731
    distributed.check_same("corpus and tokenizer", {
        "train_tokens_sha256": sha(batches.train), "val_tokens_sha256": sha(batches.val),
        "vocab_size": config.vocab_size})


def train(cfg: TrainConfig, *, on_eval=None) -> dict[str, Any]:
    """Train (or resume) a run. Returns a summary: steps, losses, tokens/s, seconds.

    `on_eval(step, params)` is called after each evaluation; the next step donates those
    params' buffers, so copy them (`jax.device_get`) to keep them.
    """
    mesh = sharding.make_mesh(cfg.devices)
    if cfg.batch_size % mesh.devices.size:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the "
                         f"{mesh.devices.size} devices of the mesh (set --devices, or "
                         "--cpu-devices on CPU)")
    config, tokenizer, batches = prepare_run(cfg)
    check_same_corpus(batches, config)
    cfg = dataclasses.replace(cfg, block_size=batches.block)
    optimizer = make_optimizer(cfg)
    params, opt_state, shardings = init_state(cfg, config, optimizer, mesh)
    mngr = checkpoint.manager(cfg.run_dir, cfg.keep_checkpoints)
    params, opt_state, start, elapsed0 = start_or_resume(cfg, config, tokenizer, params,
                                                         opt_state, mngr)
    flops_per_token = report.flops_per_token(config, params, batches.block)
    peak = cfg.peak_flops or report.measure_peak_flops(mesh)
    if distributed.is_primary():
        print(f"model {cfg.model}: {param_count(params) / 1e6:.2f}M params, vocab "
              f"{config.vocab_size}, block {batches.block}, {len(batches.train):,} train "
              f"tokens, {mesh.devices.size} device(s) in {jax.process_count()} process(es), "
              f"peak {peak / 1e9:.0f} GFLOP/s")
    train_step = make_train_step(config, optimizer, jnp.dtype(cfg.compute_dtype), shardings)
    loop = Loop(cfg, config, tokenizer, batches, mesh, mngr, flops_per_token, peak, elapsed0)
    params, opt_state = loop.run(train_step, params, opt_state, start, on_eval)
    if distributed.is_primary():
        report.plot_losses(cfg.run_dir)
    return loop.summary()


class Loop:
    """The training loop's bookkeeping: timing, progress bar, evaluation, checkpoints. In a
    multi-process run every process runs it; process 0 alone prints and logs."""

    def __init__(self, cfg, config, tokenizer, batches, mesh, mngr, flops_per_token, peak,
                 elapsed0):
        self.cfg, self.config, self.tokenizer, self.batches = cfg, config, tokenizer, batches
        self.mesh, self.mngr, self.flops_per_token, self.peak = mesh, mngr, flops_per_token, peak
        self.elapsed0, self.train_seconds, self.steps_run = elapsed0, 0.0, 0
        self.step, self.loss, self.losses, self.evals = 0, math.nan, [], {}
        self.saved_step, self.primary = None, distributed.is_primary()

    def run(self, train_step, params, opt_state, start, on_eval):
        """Raises RunAborted (with where to resume) when a step fails in a multi-process
        run: that is how another process stopping shows on this one."""
        cfg, t0 = self.cfg, time.perf_counter()
        self.step = self.saved_step = start
        bar = tqdm(range(start, cfg.max_steps), initial=start, total=cfg.max_steps,
                   unit="step", file=sys.stdout, mininterval=1.0, disable=not self.primary)
        for step in bar:
            try:
                params, opt_state, stop = self.one_step(train_step, params, opt_state, step,
                                                        start, t0, bar, on_eval)
            except Exception as error:
                if jax.process_count() == 1:
                    raise
                raise distributed.RunAborted(
                    f"process {jax.process_index()} of {jax.process_count()} stopped at step "
                    f"{step + 1}: {str(error).splitlines()[0][:300]}. In a multi-process run "
                    "this is how another process stopping shows. Start every process again "
                    "with the same command: the run resumes from the last complete "
                    f"checkpoint in {self.mngr.directory} (this process saved up to step "
                    f"{self.saved_step})") from error
            if stop:
                break
        bar.close()
        return params, opt_state

    def one_step(self, train_step, params, opt_state, step, start, t0, bar, on_eval):
        """Step `step`, then evaluate and checkpoint when it is time. Returns
        `(params, opt_state, stop)`; `stop` when the time budget is spent."""
        cfg = self.cfg
        x, y = step_batch(cfg, self.batches, step)
        tick = time.perf_counter()
        params, opt_state, loss = train_step(params, opt_state,
                                             sharding.put_batch(x, self.mesh, 1),
                                             sharding.put_batch(y, self.mesh, 1))
        self.loss = float(loss)  # syncs, so the timing below is real
        if step > start:  # the first step of a process compiles: not throughput
            self.train_seconds += time.perf_counter() - tick
            self.steps_run += 1
        self.step = step + 1
        self.losses.append(self.loss)
        bar.set_postfix_str(self.postfix(), refresh=False)
        elapsed = time.perf_counter() - t0
        out_of_time = bool(cfg.time_budget_s) and elapsed >= cfg.time_budget_s
        if cfg.time_budget_s and jax.process_count() > 1:  # clocks differ: process 0 decides
            from jax.experimental import multihost_utils

            out_of_time = bool(multihost_utils.broadcast_one_to_all(np.bool_(out_of_time)))
        if self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps or out_of_time:
            self.checkpoint(params, opt_state, self.elapsed0 + elapsed, bar)
            if on_eval:
                on_eval(self.step, params)
        if out_of_time:
            self.say(bar, f"time budget of {cfg.time_budget_s:.0f}s reached at step {self.step}")
        return params, opt_state, out_of_time

    def say(self, bar, text: str) -> None:
        if self.primary:  # tqdm.write prints even for a disabled bar
            bar.write(text)

    def tokens_per_s(self) -> float:
        """Training throughput, the compiling first step left out."""
        return self.cfg.tokens_per_step * self.steps_run / max(self.train_seconds, 1e-9)

    def postfix(self) -> str:
        tok_s = self.tokens_per_s()
        mfu = tok_s * self.flops_per_token / self.peak
        return f"loss={self.loss:.3f}, tok/s={tok_s:,.0f}, MFU={100 * mfu:.1f}%"

    def checkpoint(self, params, opt_state, elapsed, bar):
        """Evaluate, log a metrics line, print a sample, save a checkpoint (every process
        takes part in the evaluation and the save; process 0 logs and samples)."""
        self.evals = evaluate(params, self.config, self.cfg, self.batches, self.mesh)
        record = {"step": self.step, "train_loss": float(np.mean(self.losses)),
                  **self.evals, "elapsed_s": elapsed, "tokens_per_s": self.tokens_per_s(),
                  "train_losses": self.losses}  # every step's loss since the last line
        self.losses = []
        if self.primary:  # one writer when several processes train together
            report.append_metrics(self.cfg.run_dir, record)
        self.say(bar, f"step {self.step}: train {record['train_loss']:.4f} val "
                      f"{self.evals['val_loss']:.4f} nats/token "
                      f"({self.evals['val_loss_per_char']:.4f}/char), {elapsed:.0f}s")
        if self.cfg.sample_tokens:
            local = distributed.local_copy(params)  # joined by all when params span processes
            if self.primary:  # on process 0's own device: no other process takes part
                bar.write(report.sample(local, self.config, self.tokenizer,
                                        self.batches.val[:1], self.cfg.sample_tokens, self.step))
        checkpoint.save(self.mngr, self.step, params, opt_state,
                        {"step": self.step, "elapsed_s": elapsed}, self.evals["val_loss"])
        self.saved_step = self.step

    def summary(self) -> dict[str, Any]:
        return {"steps": self.step, "train_loss": self.loss, **self.evals,
                "train_seconds": self.train_seconds, "tokens_per_s": self.tokens_per_s()}


def _flag_type(annotation):
    """argparse `type=` for a dataclass field annotation (a string under
    `from __future__ import annotations`)."""
    hint = eval(annotation, {"types": types, "typing": typing}) \
        if isinstance(annotation, str) else annotation
    options = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = options[0]
    if kind is bool:
        def parse_bool(value: str) -> bool:
            if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
            return value.lower() in ("1", "true", "yes")
        return parse_bool
    return kind


def _field_comments(cls) -> dict[str, str]:
    """Each dataclass field's trailing `# comment` in the class source, with the comment-only
    lines that continue it: the fields' documentation, reused as flag help."""
    try:
        source = inspect.getsource(cls)
    except OSError:  # installed without sources: flags without help
        return {}
    comments, name = {}, None
    for line in source.splitlines():
        field = re.match(r"\s+(\w+): [^#]*#\s*(.*)$", line)
        more = re.match(r"\s+#\s*(.*)$", line)
        if field:
            name, comments[field.group(1)] = field.group(1), field.group(2)
        elif more and name:
            comments[name] += " " + more.group(1)
        else:
            name = None
    return comments


def parser_for(cls, defaults: bool = True) -> argparse.ArgumentParser:
    """An argparse parser with one `--field-name` flag per dataclass field, its help the
    field's comment and class default (the shakespeare-char preset). With `defaults=False`
    every flag defaults to None, so only the flags given are overrides."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    comments = _field_comments(cls)
    for field in dataclasses.fields(cls):
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name,
                            type=_flag_type(field.type),
                            default=field.default if defaults else None,
                            help=f"{comments.get(field.name, '')} (shakespeare-char: "
                                 f"{field.default!r})".strip().replace("%", "%%"))
    return parser


def parse_args(argv=None) -> tuple[TrainConfig, distributed.DistributedConfig]:
    """The TrainConfig of the flags given, over `--preset NAME`; without `--preset`, over
    the run directory's saved `train_config.json` when it has one (so `--run-dir DIR` alone
    resumes that run as it was started, and `--max-steps N` extends it), else over the
    shakespeare-char preset. And how this process joins a multi-process run."""
    parser = parser_for(TrainConfig, defaults=False)
    parser.add_argument("--preset", default=None,
                        help=f"one of {sorted(TRAIN_PRESETS)}; default: the run directory's "
                             "saved train_config.json, else shakespeare-char")
    distributed.add_flags(parser)
    args = vars(parser.parse_args(argv))
    dist = distributed.from_args(args)
    name = args.pop("preset")
    overrides = {k: v for k, v in args.items() if v is not None}
    saved = Path(overrides.get("run_dir", TrainConfig().run_dir)) / "train_config.json"
    if name is None and saved.exists():
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        base = {k: v for k, v in json.loads(saved.read_text()).items() if k in fields}
        return dataclasses.replace(TrainConfig(**base), **overrides), dist
    return TrainConfig.preset(name or "shakespeare-char", **overrides), dist


def config_from_args(argv=None) -> TrainConfig:
    """The TrainConfig of `parse_args`."""
    return parse_args(argv)[0]


def main(argv=None):
    """Parse, join the other processes (if any) before any JAX work, check they all run the
    same flags, train; process 0 prints the summary."""
    try:
        cfg, dist = parse_args(argv)
        processes = distributed.expected_processes(dist)
        if cfg.batch_size % processes:  # known before starting: no process waits for this
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the "
                             f"{processes} processes (each feeds batch_size / processes rows)")
        split_host(cfg, processes)
        distributed.start(dist)
        distributed.check_same("flags", dataclasses.asdict(cfg))
        summary = train(cfg)
    except distributed.RunAborted as error:  # the others may be gone: leave without them
        distributed.exit_now(f"train: {error}")
    except (ValueError, FileNotFoundError, distributed.DistributedError) as error:
        raise SystemExit(f"train: {error}") from None  # bad input: a one-line error
    if distributed.is_primary():
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
