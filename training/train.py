"""Train a GPT on a text corpus, with checkpoints, resume, evaluation and plots.

Usage:
  python -m training.train                               # shakespeare-char on the plays
  python -m training.train --text my.txt --run-dir runs/mine --max-steps 2000
  python -m training.train --run-dir runs/x              # resumes runs/x if it has checkpoints

Every TrainConfig field is a flag (`--batch-size 64`). A run resumes from the latest
checkpoint in its run directory; the batch for step s depends only on (seed, s), so a
resumed run sees exactly the data an uninterrupted run would have seen.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from gpt_jax import checkpoint
from gpt_jax.config import GPTConfig
from gpt_jax.model import forward
from gpt_jax.params import init_params, param_count
from gpt_jax.tokenizer import CharTokenizer
from training import data


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: str = "shakespeare-char"  # GPTConfig preset; vocab_size comes from the tokenizer
    text: str | None = None  # UTF-8 corpus file; None = the built-in Shakespeare plays
    run_dir: str = "runs/shakespeare-char"  # checkpoints, config, tokenizer, metrics, plots
    batch_size: int = 32  # sequences per step
    block_size: int = 0  # tokens per sequence; 0 = the model's max_seq_len
    max_steps: int = 3000  # optimizer steps (the cosine schedule ends here)
    time_budget_s: float = 0.0  # stop (and checkpoint) after this much training; 0 = none
    learning_rate: float = 2e-3  # peak AdamW learning rate
    min_learning_rate: float = 2e-4  # end of the cosine decay
    warmup_steps: int = 100  # linear warmup from 0
    weight_decay: float = 0.1  # decoupled, on matrices only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # global-norm clipping
    eval_interval: int = 250  # steps between val-loss evaluations and checkpoints
    eval_batches: int = 16  # batches per evaluation
    seed: int = 0  # parameter init and data order
    val_fraction: float = 0.1  # tail of the corpus held out
    keep_checkpoints: int = 3  # Orbax keeps this many

    def __post_init__(self):
        for name in ("batch_size", "max_steps", "eval_interval", "eval_batches",
                     "keep_checkpoints"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TrainConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.block_size < 0 or self.warmup_steps < 0 or self.time_budget_s < 0:
            raise ValueError("block_size, warmup_steps and time_budget_s must be >= 0")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"TrainConfig.val_fraction must be in (0, 1), got {self.val_fraction}")


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """AdamW with linear warmup and cosine decay, after global-norm gradient clipping."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.learning_rate, cfg.warmup_steps, max(cfg.max_steps, cfg.warmup_steps + 1),
        cfg.min_learning_rate,
    )
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, cfg.beta1, cfg.beta2, weight_decay=cfg.weight_decay,
                    mask=decay_mask),
    )


def loss_fn(params, config: GPTConfig, x_BT, y_BT):
    """Mean next-token cross-entropy in nats."""
    logits_BTV = forward(params, x_BT, config)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, y_BT).mean()


def make_train_step(config: GPTConfig, optimizer):
    """`train_step(params, opt_state, x, y) -> (params, opt_state, loss)`, jitted, donating
    the old params and optimizer state."""

    def train_step(params, opt_state, x_BT, y_BT):
        loss, grads = jax.value_and_grad(loss_fn)(params, config, x_BT, y_BT)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(train_step, donate_argnums=(0, 1))


def evaluate(params, config, split_tokens, cfg: TrainConfig, block: int) -> float:
    """Mean loss over `eval_batches` fixed batches (the same every evaluation)."""
    eval_loss = jax.jit(loss_fn, static_argnums=1)
    losses = [
        eval_loss(params, config, *data.get_batch(split_tokens, cfg.batch_size, block,
                                                   cfg.seed + 1, i))
        for i in range(cfg.eval_batches)
    ]
    return float(np.mean(jax.device_get(losses)))


def load_corpus(cfg: TrainConfig) -> str:
    return data.load_text(cfg.text) if cfg.text else data.shakespeare_text()


def prepare_run(cfg: TrainConfig):
    """Config, tokenizer and token splits; a resumed run reuses its saved config and
    tokenizer. Raises ValueError for a corpus too short for one block."""
    run_dir = Path(cfg.run_dir)
    text = load_corpus(cfg)
    if (run_dir / "config.json").exists():
        config, tokenizer = checkpoint.load_config(run_dir), checkpoint.load_tokenizer(run_dir)
    else:
        tokenizer = CharTokenizer.from_text(text)
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
    return config, tokenizer, train_tokens, val_tokens, block


def train(cfg: TrainConfig, *, on_eval=None) -> dict[str, Any]:
    """Train (or resume) a run. Returns a summary: steps, losses, tokens/s, seconds.

    `on_eval(step, params)` is called after each evaluation (tests use it to stop a run).
    """
    config, tokenizer, train_tokens, val_tokens, block = prepare_run(cfg)
    run_dir = Path(cfg.run_dir)
    optimizer = make_optimizer(cfg)
    params = init_params(config, jax.random.key(cfg.seed))
    opt_state = optimizer.init(params)
    mngr = checkpoint.manager(run_dir, cfg.keep_checkpoints)
    start = 0
    if (latest := mngr.latest_step()) is not None:
        params, opt_state, meta = checkpoint.restore(mngr, latest, params, opt_state)
        start = int(meta["step"])
        print(f"resuming {run_dir} from step {start}")
    else:
        checkpoint.save_config(run_dir, config)
        checkpoint.save_tokenizer(run_dir, tokenizer)
        checkpoint.write_json_atomic(run_dir / "train_config.json", dataclasses.asdict(cfg))
    print(f"model {cfg.model}: {param_count(params) / 1e6:.2f}M params, vocab "
          f"{config.vocab_size}, block {block}, {len(train_tokens):,} train tokens")

    train_step = make_train_step(config, optimizer)
    tokens_per_step = cfg.batch_size * block
    t0, train_seconds, loss, val_loss = time.perf_counter(), 0.0, math.nan, math.nan
    step = start
    bar = tqdm(range(start, cfg.max_steps), initial=start, total=cfg.max_steps, unit="step")
    for step in bar:
        x, y = data.get_batch(train_tokens, cfg.batch_size, block, cfg.seed, step)
        tick = time.perf_counter()
        params, opt_state, loss_arr = train_step(params, opt_state, x, y)
        loss = float(loss_arr)  # syncs, so the timing below is real
        train_seconds += time.perf_counter() - tick
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step * (step + 1 - start) / train_seconds:,.0f}")
        last = step + 1 == cfg.max_steps
        out_of_time = cfg.time_budget_s and time.perf_counter() - t0 >= cfg.time_budget_s
        if (step + 1) % cfg.eval_interval == 0 or last or out_of_time:
            val_loss = evaluate(params, config, val_tokens, cfg, block)
            record = {"step": step + 1, "train_loss": loss, "val_loss": val_loss,
                      "elapsed_s": time.perf_counter() - t0}
            with open(run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            bar.write(f"step {step + 1}: train {loss:.4f} val {val_loss:.4f}")
            checkpoint.save(mngr, step + 1, params, opt_state, {"step": step + 1})
            if on_eval:
                on_eval(step + 1, params)
        if out_of_time:
            bar.write(f"time budget of {cfg.time_budget_s:.0f}s reached at step {step + 1}")
            break
    bar.close()
    plot_losses(run_dir)
    steps_done = step + 1 - start
    return {
        "steps": step + 1, "train_loss": loss, "val_loss": val_loss,
        "train_seconds": train_seconds,
        "tokens_per_s": tokens_per_step * steps_done / max(train_seconds, 1e-9),
    }


def plot_losses(run_dir: Path) -> Path | None:
    """Write run_dir/loss.png (train and val loss against step) from metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in path.read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in ("train_loss", "val_loss"):
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], marker=".", label=key)
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=Path(run_dir).name)
    ax.legend()
    fig.tight_layout()
    out = Path(run_dir) / "loss.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def parser_for(cls) -> argparse.ArgumentParser:
    """An argparse parser with one `--field-name` flag per dataclass field."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(cls):
        kind = field.type if isinstance(field.type, type) else str
        if field.type in ("int", int):
            kind = int
        elif field.type in ("float", float):
            kind = float
        else:
            kind = str
        parser.add_argument("--" + field.name.replace("_", "-"), dest=field.name, type=kind,
                            default=field.default)
    return parser


def main(argv=None):
    args = parser_for(TrainConfig).parse_args(argv)
    summary = train(TrainConfig(**vars(args)))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
