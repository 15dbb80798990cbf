"""Train a GPT on a text corpus, with checkpoints, resume, evaluation and plots.

Usage:
  python -m training.train                               # shakespeare-char on the plays
  python -m training.train --preset nanogpt-cpu --text tinyshakespeare.txt --run-dir runs/nano
  python -m training.train --text my.txt --run-dir runs/mine --max-steps 2000 --tokenizer bpe
  python -m training.train --run-dir runs/x              # resumes runs/x if it has checkpoints
  python -m training.train --cpu-devices 4 --devices 4 --shard-params true
  python -m training.train --coordinator HOST0:5000 --num-processes 2 --process-id 0   # on
  python -m training.train --coordinator HOST0:5000 --num-processes 2 --process-id 1   # each

`--preset` picks a TrainConfig preset (training/config.py) and every TrainConfig field is a
flag overriding it, e.g. `--batch-size 64`; the resolved config is saved as
train_config.json. On CPU the host is split into one XLA device per core (`--cpu-devices`)
and the batch is data-parallel over them. A run resumes from its latest good checkpoint; the
batch for step s depends only on (seed, s), so a resumed run sees exactly the data an
uninterrupted run would have seen. Several processes (hosts) train one model through
`jax.distributed`: training/distributed.py, and training/README.md for SLURM and ssh.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import jax
import jax.numpy as jnp
import numpy as np
import tyro
from tqdm import tqdm

from gpt_jax import checkpoint
from gpt_jax.config import GPTConfig
from gpt_jax.params import param_count
from gpt_jax.tokenizer import BPETokenizer, CharTokenizer
from training import data, distributed, report, sharding
from training.config import TRAIN_PRESETS, TrainConfig
from training.process import closed_pipe_is_quiet, restart_with_huge_pages
from training.step import TrainState, evaluate, init_state, make_optimizer, make_train_steps


# With a time budget, max_steps is fitted to it after the first FIT_STEPS steps (or at the end
# of the warmup, if sooner and at least FIT_MIN_STEPS measured), each step expected to take
# FIT_MARGIN longer than the median of the last FIT_STEPS measured (at most one evaluation
# interval's), and fitted again after each evaluation when the steps have slowed enough to
# lower it by more than REFIT_SLACK (each fit compiles the step again): `Loop.fit_to_budget`.
FIT_STEPS, FIT_MIN_STEPS, FIT_MARGIN, REFIT_SLACK = 50, 5, 0.05, 0.02


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


def step_batch(cfg: TrainConfig, batches: data.Batches, step: int):
    """The global batch of optimizer step `step`: `(x, y)` int32 `[A, B, T]`, a pure
    function of (seed, step)."""
    x, y = data.get_batch(batches.train, cfg.grad_accum * cfg.batch_size, batches.block,
                          cfg.seed, step)
    shape = (cfg.grad_accum, cfg.batch_size, batches.block)
    return x.reshape(shape), y.reshape(shape)


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
        block is longer than the model's max_seq_len, or the run directory holds a run of
        another model, tokenizer or BPE vocabulary size than `cfg`'s.
    """
    run_dir = Path(cfg.run_dir)
    text = load_corpus(cfg)
    if not text:
        raise ValueError("the corpus is empty: a corpus needs text")
    if (run_dir / "config.json").exists():
        saved = run_dir / "train_config.json"
        was = json.loads(saved.read_text()) if saved.exists() else {}
        fixed = ("model", "tokenizer") + (("bpe_vocab_size",) if cfg.tokenizer == "bpe" else ())
        for name in fixed:  # what the saved config and tokenizer are made of
            if name in was and was[name] != getattr(cfg, name):
                raise ValueError(f"{run_dir} holds a run with {name} {was[name]!r}; it cannot "
                                 f"resume with {name} {getattr(cfg, name)!r} (start a new "
                                 "--run-dir for that)")
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


def train(cfg: TrainConfig, *, on_eval=None) -> dict[str, Any]:
    """Train (or resume) a run. Returns a summary: steps, losses, tokens/s, seconds.

    A time budget (`cfg.time_budget_s`) counts from this call: setup, compiling, the steps
    and the final evaluation and checkpoint all fit in it (`Loop.out_of_time`), and
    max_steps is lowered to what fits in it (`Loop.fit_to_budget`).
    `on_eval(step, params)` is called after each evaluation; the next step donates those
    params' buffers, so copy them (`jax.device_get`) to keep them.
    """
    started = time.perf_counter()
    mesh = sharding.make_mesh(cfg.devices)
    if cfg.batch_size % mesh.devices.size:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the "
                         f"{mesh.devices.size} devices of the mesh (set --devices, or "
                         "--cpu-devices on CPU)")
    config, tokenizer, batches = prepare_run(cfg)
    check_same_corpus(batches, config)
    cfg = dataclasses.replace(cfg, block_size=batches.block)
    optimizer = make_optimizer(cfg)
    state, shardings = init_state(cfg, config, optimizer, mesh)
    mngr = checkpoint.manager(cfg.run_dir, cfg.keep_checkpoints)
    state, start, elapsed0 = start_or_resume(cfg, config, tokenizer, state, mngr)
    flops_per_token = report.flops_per_token(config, state.params, batches.block)
    peak = cfg.peak_flops or report.measure_peak_flops(mesh)
    if distributed.is_primary():
        print(f"model {cfg.model}: {param_count(state.params) / 1e6:.2f}M params, vocab "
              f"{config.vocab_size}, block {batches.block}, {len(batches.train):,} train "
              f"tokens, {mesh.devices.size} device(s) in {jax.process_count()} process(es), "
              f"peak {peak / 1e9:.0f} GFLOP/s")

    def make_step(cfg: TrainConfig):  # a new max_steps only moves the schedule's end
        return make_train_steps(config, make_optimizer(cfg), jnp.dtype(cfg.compute_dtype),
                                shardings)

    loop = Loop(cfg, config, tokenizer, batches, mesh, mngr, flops_per_token, peak, elapsed0,
                started)
    loop.run(make_step, state, start, on_eval)
    mngr.close()  # not on a failure: after a lost process its barriers could wait long
    return loop.summary()


class Loop:
    """The training loop's bookkeeping: timing, the time budget, progress bar, evaluation,
    checkpoints. In a multi-process run every process runs it; process 0 alone prints and
    logs, and decides when the budget is spent."""

    def __init__(self, cfg, config, tokenizer, batches, mesh, mngr, flops_per_token, peak,
                 elapsed0, started):
        self.cfg, self.config, self.tokenizer, self.batches = cfg, config, tokenizer, batches
        self.mesh, self.mngr, self.flops_per_token, self.peak = mesh, mngr, flops_per_token, peak
        self.elapsed0, self.train_seconds, self.steps_run = elapsed0, 0.0, 0
        self.step, self.loss, self.losses, self.evals = 0, math.nan, [], {}
        self.step_times = []  # every step's wall time since the last evaluation (a call's
        # wall time over its steps)
        self.next_batch = (-1, None)  # (step, (x, y)): a call's batches, placed ahead of it
        self.saved_step, self.primary = None, distributed.is_primary()
        self.started = started  # perf_counter() when the run began: the budget counts from it
        self.step_s = 0.0  # the last call's wall time per step, calls that compile left out
        self.finish_s = 0.0  # the last evaluation + checkpoint's: what ending the run takes
        # the longest call that compiled (the first, one after a fit); the last FIT_STEPS
        # other steps' (per step of their calls)
        self.compile_s, self.fit_times = 0.0, collections.deque(maxlen=FIT_STEPS)
        self.compile_step = None  # the step whose call compiles: the first, the first after a fit
        self.fit_at = None  # the step of the first fit to the budget (None: no fit)
        # batches placed for a call: as many as its steps can be (fits only lower max_steps)
        self.call_size = min(cfg.steps_per_call, cfg.eval_interval, cfg.max_steps)

    def run(self, make_step, state: TrainState, start, on_eval) -> TrainState:
        """Train from step `start` with `make_step(cfg)`'s jitted `train_steps` (made again
        when `fit_to_budget` moves max_steps), `call_steps` steps a call.

        Raises RunAborted (with where to resume) when a step fails in a multi-process
        run: that is how another process stopping shows on this one."""
        cfg = self.cfg
        self.step = self.saved_step = self.compile_step = start
        if cfg.time_budget_s and start < cfg.max_steps:
            self.warm_up(state)
        train_steps = make_step(cfg)
        self.fit_at = min(cfg.warmup_steps, start + FIT_STEPS)
        if not (cfg.time_budget_s and self.fit_at - start > FIT_MIN_STEPS):
            self.fit_at = None  # no budget, or too little warmup left to measure in
        bar = tqdm(initial=start, total=cfg.max_steps, unit="step", file=sys.stdout,
                   mininterval=1.0, disable=not self.primary)
        step = start
        while step < self.cfg.max_steps:
            n = self.call_steps(step)
            try:
                state, stop = self.run_call(train_steps, state, step, n, bar, on_eval)
                if not stop and self.fit_due() and self.fit_to_budget(
                        bar, first=self.step == self.fit_at):
                    train_steps = make_step(self.cfg)
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
            step += n
            if stop:
                break
        bar.close()
        return state

    def call_steps(self, step: int) -> int:
        """Steps in the call that starts at `step`: `steps_per_call`, cut at the next
        evaluation, the first fit (`fit_at`) and max_steps, so those come between calls;
        one in a call that compiles, so that the steps after it are measured."""
        cfg = self.cfg
        if step == self.compile_step:
            return 1
        ends = [step + cfg.steps_per_call, cfg.max_steps,
                (step // cfg.eval_interval + 1) * cfg.eval_interval]
        if self.fit_at is not None and step < self.fit_at:
            ends.append(self.fit_at)
        return min(ends) - step

    def fit_due(self) -> bool:
        """Whether to fit max_steps to the budget after this call: at `fit_at` (None: no
        budget, or too short a warmup to measure in), then after each evaluation."""
        return self.fit_at is not None and (self.step == self.fit_at or (
            self.step > self.fit_at and self.step % self.cfg.eval_interval == 0))

    def fit_to_budget(self, bar, first: bool) -> bool:
        """Lower `max_steps` to the steps the time budget still holds, so that the cosine
        schedule ends with the run instead of the budget cutting it off at a high learning
        rate (a budget-aware schedule: Li, Yumer & Ramanan 2020, "Budgeted Training").
        First called inside the warmup, whose learning rates do not depend on max_steps: the
        run then equals one started with the lower max_steps (same batches, same updates).
        Called again after each evaluation, it lowers max_steps once more when the steps
        have slowed (a machine that got busier): the rest of the cosine is compressed, so
        the learning rate steps down once, and the schedule still ends within the budget.
        train_config.json records each value, so a resumed run keeps it. Each step is
        expected to take the median of the last `FIT_STEPS` (at most the last evaluation
        interval's: a median over both sides of a slowdown would still be fast) plus
        `FIT_MARGIN`, each evaluation as long as the last, the recompile as long as the
        longest call that compiled. Returns whether it changed: past the `first` fit, only
        by more than `REFIT_SLACK` and with an evaluation interval of steps left (each fit
        compiles the step again; near the end `out_of_time` stops the run instead)."""
        cfg, now = self.cfg, time.perf_counter()
        recent = list(self.fit_times)[-cfg.eval_interval:]  # at most one interval's
        step_s = float(np.median(recent)) * (1 + FIT_MARGIN)
        left = self.started + cfg.time_budget_s - now - self.compile_s - self.finish_s
        per_step = step_s + self.finish_s / cfg.eval_interval
        steps = max(self.step + 1, self.step + int(left // per_step))
        if jax.process_count() > 1:  # process 0's clock decides for all (before any return)
            from jax.experimental import multihost_utils

            steps = int(multihost_utils.broadcast_one_to_all(np.int64(steps)))
        if not first and steps - self.step < cfg.eval_interval:
            return False  # too few steps left to pay for a recompile: the guard ends the run
        if steps >= cfg.max_steps * (1 if first else 1 - REFIT_SLACK):
            return False
        self.say(bar, f"time budget of {cfg.time_budget_s:g} s: max_steps {cfg.max_steps} -> "
                      f"{steps}, so the learning-rate schedule ends within it "
                      f"({1e3 * step_s / (1 + FIT_MARGIN):.1f} ms/step measured)")
        self.cfg = dataclasses.replace(cfg, max_steps=steps)
        self.compile_step, bar.total = self.step, steps
        if self.primary:
            checkpoint.write_json_atomic(Path(cfg.run_dir) / "train_config.json",
                                         dataclasses.asdict(self.cfg))
        return True

    def run_call(self, train_steps, state, step, n, bar, on_eval):
        """Steps `step .. step + n - 1` in one call, then evaluate and checkpoint when it is
        time. Returns `(state, stop)`; `stop` when the time budget has no room for another
        call."""
        cfg = self.cfg
        tick = time.perf_counter()
        batch = self.next_batch if self.next_batch[0] == step else self.place_batches(step)
        state, losses = train_steps(state, *batch[1], np.int32(n))
        if step + n < cfg.max_steps:  # made and placed while the call runs (it is async)
            self.next_batch = self.place_batches(step + n)
        losses = jax.device_get(losses)[:n].tolist()  # syncs, so the timing below is real
        call_s = time.perf_counter() - tick
        if step != self.compile_step:  # a call that compiles is neither throughput nor
            self.train_seconds += call_s  # what the next steps are expected to take
            self.steps_run += n
            self.step_s = call_s / n
            self.fit_times.extend([self.step_s] * n)
        else:
            self.compile_s = max(self.compile_s, call_s)
        self.step, self.loss = step + n, losses[-1]
        self.losses.extend(losses)
        self.step_times.extend([call_s / n] * n)
        bar.set_postfix_str(self.postfix(), refresh=False)
        bar.update(n)
        due = self.step % cfg.eval_interval == 0 or self.step == cfg.max_steps
        out_of_time = self.out_of_time(due)
        if due or out_of_time:
            self.checkpoint(state, bar)
            if on_eval:
                on_eval(self.step, state.params)
        if out_of_time:
            self.say(bar, f"time budget of {cfg.time_budget_s:g} s: stopped at step "
                          f"{self.step} of the schedule's {cfg.max_steps}, "
                          f"{time.perf_counter() - self.started:.0f} s in")
        return state, out_of_time

    def place_batches(self, step: int):
        """`(step, (x, y))`: the batches of steps `step .. step + K - 1` (`step_batch`,
        K = `call_size`) on the mesh, int32 `[K, A, B, T]` each; a call runs the first n."""
        xy = [step_batch(self.cfg, self.batches, s) for s in range(step, step + self.call_size)]
        x, y = (np.stack(arrays) for arrays in zip(*xy))
        return step, (sharding.put_batch(x, self.mesh, 2), sharding.put_batch(y, self.mesh, 2))

    def out_of_time(self, due: bool) -> bool:
        """Would one more call and then the final evaluation and checkpoint end past the
        budget (after this call's own checkpoint, when one is `due`)? Each is expected to
        take as long as it last did: a call's steps as long as the last measured call's,
        or, before one is measured, the call as long as the one that compiled (once, not
        per step: that charged a cold compile to each of the next call's steps and stopped
        budgeted runs at step 1). Process 0 decides for all: the clocks differ."""
        if not self.cfg.time_budget_s:
            return False
        next_call_s = self.step_s * self.call_steps(self.step) if self.steps_run \
            else self.compile_s
        ends = time.perf_counter() + (self.finish_s if due else 0.0) + next_call_s \
            + self.finish_s
        out = ends > self.started + self.cfg.time_budget_s
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            out = bool(multihost_utils.broadcast_one_to_all(np.bool_(out)))
        return out

    def warm_up(self, state: TrainState) -> None:
        """Run the evaluation (and sample) before training: once to compile them, once
        timed, so the budget knows what an evaluation takes before the first checkpoint
        measures one (with its save)."""
        for _ in range(2):
            tick = time.perf_counter()
            evaluate(state.params, self.config, self.cfg, self.batches, self.mesh)
            self.sample(state)
        self.finish_s = time.perf_counter() - tick

    def sample(self, state: TrainState) -> str | None:
        """A sample of `cfg.sample_tokens` from the current params, on process 0 (None on
        the others, or when samples are off)."""
        if not self.cfg.sample_tokens:
            return None
        local = distributed.local_copy(state.params)  # joined by all when they span processes
        if not self.primary:  # on process 0's own device: no other process takes part
            return None
        return report.sample(local, self.config, self.tokenizer, self.batches.val[:1],
                             self.cfg.sample_tokens, self.step)

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

    def checkpoint(self, state: TrainState, bar):
        """Evaluate, log a metrics line, print a sample, save a checkpoint, redraw the loss
        plot (every process takes part in the evaluation and the save; process 0 logs,
        samples and plots). Timed: the budget keeps room for one more."""
        tick = time.perf_counter()
        elapsed = self.elapsed0 + tick - self.started
        # train_loss: the mean since the last line, in the summary too (not the last step's)
        self.evals = {"train_loss": float(np.mean(self.losses)),
                      **evaluate(state.params, self.config, self.cfg, self.batches, self.mesh)}
        record = {"step": self.step, **self.evals, "elapsed_s": elapsed,
                  "tokens_per_s": self.tokens_per_s(),
                  "train_losses": self.losses,  # every step's loss since the last line
                  "step_seconds": self.step_times}  # and its wall time (the first compiles)
        self.losses, self.step_times = [], []
        if self.primary:  # one writer when several processes train together
            report.append_metrics(self.cfg.run_dir, record)
        self.say(bar, f"step {self.step}: train {record['train_loss']:.4f} val "
                      f"{self.evals['val_loss']:.4f} nats/token "
                      f"({self.evals['val_loss_per_char']:.4f}/char), {elapsed:.0f}s")
        if (text := self.sample(state)) is not None:
            bar.write(text)
        checkpoint.save(self.mngr, self.step, state.params, state.opt_state,
                        {"step": self.step, "elapsed_s": elapsed}, self.evals["val_loss"])
        self.saved_step = self.step
        if self.primary:
            report.plot_losses(self.cfg.run_dir)
        self.finish_s = time.perf_counter() - tick

    def summary(self) -> dict[str, Any]:
        """steps; max_steps, the schedule's length (fitted to a time budget: steps falls
        short of it when the budget stopped the run first); the last evaluation's
        train_loss (the mean over the steps since the one before, as metrics.jsonl logs it)
        and val losses; train_seconds, the wall time of the steps run, those that compile
        left out (not setup, evaluations or checkpoints), and tokens_per_s over those same
        steps. With no step run (a finished run resumed), train_loss is null, not NaN."""
        return {"steps": self.step, "max_steps": self.cfg.max_steps, "train_loss": None,
                **self.evals, "train_seconds": self.train_seconds,
                "tokens_per_s": self.tokens_per_s()}


def _parse_bool(args: list[str]) -> bool:
    value = args[0].lower()
    if value not in ("1", "0", "true", "false", "yes", "no"):
        raise ValueError(f"expected true or false, got {args[0]!r}")
    return value in ("1", "true", "yes")


# Boolean flags take a value (`--shard-params true`), in any case, as they always have.
_FLAG_TYPES = tyro.constructors.ConstructorRegistry()


@_FLAG_TYPES.primitive_rule
def _bool_flag(info: tyro.constructors.PrimitiveTypeInfo):
    if info.type is not bool:
        return None
    return tyro.constructors.PrimitiveConstructorSpec(
        nargs=1, metavar="{true,false}", instance_from_str=_parse_bool,
        is_instance=lambda x: isinstance(x, bool), str_from_instance=lambda x: [str(x).lower()])


def _unchecked(cls):
    """`cls` (a frozen dataclass) without its `__post_init__` checks, for tyro to fill in:
    tyro turns a ValueError raised while it builds a class into its own error box (exit 2),
    where the command line's errors are one `train: MESSAGE` line. `parse_args` builds
    `cls` itself from the values, which checks them. Help, defaults and names are
    inherited."""
    namespace = {"__post_init__": lambda self: None, "__doc__": cls.__doc__,
                 "__module__": cls.__module__}
    return dataclasses.dataclass(frozen=True)(type(cls.__name__, (cls,), namespace))


_TrainFlags = _unchecked(TrainConfig)
_DistributedFlags = _unchecked(distributed.DistributedConfig)
_PRESET_HELP = (f"one of {sorted(TRAIN_PRESETS)}; without it, the run directory's saved "
                "train_config.json, else shakespeare-char; the flags below override it")


@dataclasses.dataclass(frozen=True)
class Flags:
    """The command line: a preset, every TrainConfig field over it, how to join others."""

    preset: Annotated[str | None, tyro.conf.arg(help=_PRESET_HELP)] = None
    train: Annotated[_TrainFlags, tyro.conf.OmitArgPrefixes] = _TrainFlags()
    distributed: Annotated[_DistributedFlags, tyro.conf.OmitArgPrefixes] = _DistributedFlags()


# The title and the usage lines: tyro joins the lines of a paragraph into one, unwrapped.
_DESCRIPTION = "\n\n".join(__doc__.split("\n\n")[:2])


def _flags(argv: list[str], default: Flags, first_pass: bool = False):
    """`tyro.cli` over `Flags`; the first pass ignores what it does not know and --help."""
    return tyro.cli(Flags, args=argv, default=default, description=_DESCRIPTION,
                    prog="gpt-jax train",  # as `gpt-jax serve` and `gpt-jax export` name theirs
                    registry=_FLAG_TYPES, config=(tyro.conf.FlagConversionOff,),
                    add_help=not first_pass, return_unknown_args=first_pass)


def base_config(preset: str | None, run_dir: str) -> TrainConfig:
    """What the flags given override: the `preset` named, else the run directory's saved
    train_config.json (so `--run-dir DIR` alone resumes that run as it was started, and
    `--max-steps N` extends it), else the shakespeare-char preset."""
    saved = Path(run_dir) / "train_config.json"
    if preset is None and saved.exists():
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        return TrainConfig(**{k: v for k, v in json.loads(saved.read_text()).items()
                              if k in fields})
    return TrainConfig.preset(preset or "shakespeare-char")


def parse_args(argv=None) -> tuple[TrainConfig, distributed.DistributedConfig]:
    """The TrainConfig of the flags given over `base_config`, and how this process joins a
    multi-process run. `--help` lists every flag with its help and its default here (the
    base's value).

    Raises:
      ValueError: an unknown preset, or a value out of range (TrainConfig's and
        DistributedConfig's messages).
      SystemExit: an unknown flag or a value of the wrong type (tyro's message), or --help.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # A first pass reads where the defaults come from (--preset, --run-dir); the second
    # parses every flag over them.
    first, _ = _flags([a for a in argv if a not in ("-h", "--help")], Flags(), True)
    base = base_config(first.preset, first.train.run_dir)
    flags = _flags(argv, Flags(first.preset, _TrainFlags(**dataclasses.asdict(base))))
    dist = distributed.DistributedConfig(**dataclasses.asdict(flags.distributed))
    return TrainConfig(**dataclasses.asdict(flags.train)), dist


def config_from_args(argv=None) -> TrainConfig:
    """The TrainConfig of `parse_args`."""
    return parse_args(argv)[0]


def large_buffers(cfg: TrainConfig) -> bool:
    """Whether a train step of `cfg`'s model allocates buffers past glibc's largest mmap
    threshold (32 MiB on 64-bit: each such allocation is a fresh mmap, mapped on first touch):
    its stacked MLP weight or its embedding table is that large (the gradients, moments and
    logits are of the same order).

    Such steps spend much of their time in page faults, which huge pages (see
    `training.process.restart_with_huge_pages`) remove; a small model's step (arrays the heap
    reuses) runs slower with them, so small models keep 4 KiB pages (figures:
    training/README.md, "One flat all-reduce, and huge pages")."""
    config = GPTConfig.preset(cfg.model)
    largest = max(config.n_layers * config.d_model * config.d_ff,
                  config.vocab_size * config.d_model) * 4
    return largest >= 32 << 20


def main(argv=None, own_process: bool = False):
    """Parse, join the other processes (if any) before any JAX work, check they all run the
    same flags, train; process 0 prints the summary. `own_process` (the command line, not a
    call from Python): a large model's run first restarts itself with huge pages
    (`large_buffers`)."""
    try:
        cfg, dist = parse_args(argv)
        if own_process and large_buffers(cfg):
            restart_with_huge_pages("training.train", sys.argv[1:] if argv is None else argv)
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
        # bad input: a one-line error, naming the flag (TrainConfig.max_steps: --max-steps)
        flags = re.sub(r"\bTrainConfig\.(\w+)",
                       lambda m: "--" + m.group(1).replace("_", "-"), str(error))
        raise SystemExit(f"train: {flags}") from None
    if distributed.is_primary():
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(closed_pipe_is_quiet(main)(own_process=True))
