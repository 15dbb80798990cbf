"""A run directory: what a run is made of (its config, tokenizer and corpus batches) and
where it resumes from.

A new run directory gets the model's config.json, the tokenizer and train_config.json; a
started one is resumed from its latest good checkpoint with the config and tokenizer it
saved, and refused when asked to go on with another model or tokenizer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import jax
import numpy as np

from gpt_jax import checkpoint
from gpt_jax.config import GPTConfig
from gpt_jax.tokenizer import BPETokenizer, CharTokenizer
from training import data, distributed, report
from training.config import TrainConfig
from training.step import TrainState


def load_corpus(cfg: TrainConfig) -> str:
    return data.load_text(cfg.text) if cfg.text else data.shakespeare_text()


def make_tokenizer(cfg: TrainConfig, text: str):
    if cfg.tokenizer == "bpe":
        return BPETokenizer.from_text(text, cfg.bpe_vocab_size)
    return CharTokenizer.from_text(text)


def check_same_run(cfg: TrainConfig) -> None:
    """Raises ValueError when the started run in `cfg.run_dir` (its train_config.json) has
    another model, tokenizer or BPE vocabulary size than `cfg`: what its saved config and
    tokenizer are made of."""
    run_dir = Path(cfg.run_dir)
    saved = run_dir / "train_config.json"
    was = json.loads(saved.read_text()) if saved.exists() else {}
    fixed = ("model", "tokenizer") + (("bpe_vocab_size",) if cfg.tokenizer == "bpe" else ())
    for name in fixed:
        if name in was and was[name] != getattr(cfg, name):
            raise ValueError(f"{run_dir} holds a run with {name} {was[name]!r}; it cannot "
                             f"resume with {name} {getattr(cfg, name)!r} (start a new "
                             "--run-dir for that)")


def check_block_size(cfg: TrainConfig) -> int:
    """The run's tokens per sequence: `cfg.block_size`, or for 0 the model's max_seq_len
    (the run directory's saved config.json, else the `cfg.model` preset's). Reads no
    corpus. Raises ValueError for a block past the max_seq_len."""
    saved = Path(cfg.run_dir) / "config.json"
    max_seq_len = (checkpoint.load_config(cfg.run_dir) if saved.exists()
                   else GPTConfig.preset(cfg.model)).max_seq_len
    block = cfg.block_size or max_seq_len
    if block > max_seq_len:
        raise ValueError(f"--block-size {block} exceeds the model's max_seq_len "
                         f"{max_seq_len}; allowed: 1 to {max_seq_len}, or 0 for "
                         "the max_seq_len")
    return block


def prepare_run(cfg: TrainConfig):
    """`(config, tokenizer, Batches)`; a resumed run reuses its saved config and tokenizer.

    Raises:
      ValueError: the corpus is empty or too short for one block in either split, the
        block is longer than the model's max_seq_len, or the run directory holds a run of
        another model, tokenizer or BPE vocabulary size than `cfg`'s.
    """
    run_dir = Path(cfg.run_dir)
    resumed = (run_dir / "config.json").exists()
    if resumed:
        check_same_run(cfg)
    block = check_block_size(cfg)  # before the corpus is read (and a BPE trained on it)
    text = load_corpus(cfg)
    if not text:
        raise ValueError("the corpus is empty: a corpus needs text")
    if resumed:
        config, tokenizer = checkpoint.load_config(run_dir), checkpoint.load_tokenizer(run_dir)
    else:
        tokenizer = make_tokenizer(cfg, text)
        config = GPTConfig.preset(cfg.model, vocab_size=tokenizer.vocab_size)
    tokens = np.asarray(tokenizer.encode(text), np.int32)
    train_tokens, val_tokens = data.split(tokens, cfg.val_fraction)
    for name, part in (("train", train_tokens), ("val", val_tokens)):
        if len(part) <= block:
            raise ValueError(
                f"the {name} split has {len(part)} tokens, fewer than one block of {block} + 1; "
                f"the corpus ({len(tokens)} tokens) is too short"
            )
    chars_per_token = len(tokenizer.decode(val_tokens)) / len(val_tokens)
    return config, tokenizer, data.Batches(train_tokens, val_tokens, block, chars_per_token)


def start_or_resume(cfg, config, tokenizer, state: TrainState, mngr):
    """Restore the latest good checkpoint into `state`'s structure and shardings (every
    process: each restores its own shards), or write the run's config files (process 0
    alone). Returns `(state, step, elapsed_s)`."""
    run_dir, primary = Path(cfg.run_dir), distributed.is_primary()
    if mngr.all_steps():
        params, opt_state, meta = checkpoint.restore(mngr, None, state.params,
                                                     state.opt_state)
        state = TrainState(params, opt_state)
        step, elapsed = int(meta["step"]), float(meta.get("elapsed_s", 0.0))
        if primary:
            report.truncate_metrics(run_dir, step)  # drop evaluations logged after it
            print(f"resuming {run_dir} from step {step}" if step < cfg.max_steps else
                  f"{run_dir} is at step {step}, max_steps {cfg.max_steps}: nothing to train "
                  "(--max-steps N, above it, trains on)")
    else:
        if primary:
            checkpoint.save_config(run_dir, config)
            checkpoint.save_tokenizer(run_dir, tokenizer)
        step, elapsed = 0, 0.0
    if primary and step < cfg.max_steps:  # rewritten on resume too: what a later
        # `--run-dir DIR` alone resumes with (not by a max_steps that trains nothing)
        checkpoint.write_json_atomic(run_dir / "train_config.json", dataclasses.asdict(cfg))
    return state, step, elapsed


def check_same_corpus(batches: data.Batches, config: GPTConfig) -> None:
    """Every process tokenized the same corpus the same way (a collective, so also the
    barrier before process 0 writes into the run directory that the others just read)."""
    if jax.process_count() == 1:
        return
    sha = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()  # noqa: E731
    distributed.check_same("corpus and tokenizer", {
        "train_tokens_sha256": sha(batches.train), "val_tokens_sha256": sha(batches.val),
        "vocab_size": config.vocab_size})
