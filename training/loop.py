"""The training loop: calls of the jitted step, their timing, the time budget, evaluations,
checkpoints and the progress bar.

The run's setup (`training.run_dir`) and its command line (`training.train`) are elsewhere;
`Loop` starts from a state and a step and trains to max_steps, fitting max_steps to what a
time budget holds (`Loop.fit_to_budget`) and stopping when one more call would not fit in it
(`Loop.out_of_time`). The batch for step s depends only on (seed, s) (`step_batch`), so a
resumed run sees exactly the data an uninterrupted run would have seen.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from gpt_jax import checkpoint
from training import data, distributed, report, sharding
from training.config import TrainConfig
from training.process import interrupts_deferred
from training.step import TrainState, evaluate


# With a time budget, max_steps is fitted to it after the first FIT_STEPS steps (or at the end
# of the warmup, if sooner and at least FIT_MIN_STEPS measured), raised or lowered, each step
# expected to take FIT_MARGIN longer than the median of those steps; then fitted again after
# each evaluation, raised or lowered, from the mean of the last evaluation interval's steps,
# when that moves it by more than REFIT_SLACK of the steps left (each fit compiles the step
# again): `Loop.fit_to_budget`.
FIT_STEPS, FIT_MIN_STEPS, FIT_MARGIN, REFIT_SLACK = 50, 5, 0.05, 0.02


def step_batch(cfg: TrainConfig, batches: data.Batches, step: int):
    """The global batch of optimizer step `step`: `(x, y)` int32 `[A, B, T]`, a pure
    function of (seed, step)."""
    x, y = data.get_batch(batches.train, cfg.grad_accum * cfg.batch_size, batches.block,
                          cfg.seed, step)
    shape = (cfg.grad_accum, cfg.batch_size, batches.block)
    return x.reshape(shape), y.reshape(shape)


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
        # the longest call that compiled (the first, one after a fit); the last FIT_STEPS or
        # evaluation interval's other steps' (whichever is more; per step of their calls)
        self.compile_s = 0.0
        self.fit_times = collections.deque(maxlen=max(FIT_STEPS, cfg.eval_interval))
        self.compile_step = None  # the step whose call compiles: the first, the first after a fit
        self.fit_at = None  # the step of the first fit to the budget (None: no fit)
        self.resumed = False  # started from a checkpoint: keeps its fitted max_steps
        self.fits = []  # each fit that changed max_steps: step, from, to, ms/step, first?
        # batches placed for a call: as many as its steps can be (made again at a fit)
        self.call_size = min(cfg.steps_per_call, cfg.eval_interval, cfg.max_steps)

    def run(self, make_step, state: TrainState, start, on_eval) -> TrainState:
        """Train from step `start` with `make_step(cfg)`'s jitted `train_steps` (made again
        when `fit_to_budget` moves max_steps), `call_steps` steps a call.

        Raises RunAborted (with where to resume) when a step fails in a multi-process
        run: that is how another process stopping shows on this one."""
        cfg = self.cfg
        self.step = self.saved_step = self.compile_step = start
        self.resumed = start > 0
        if cfg.time_budget_s and start < cfg.max_steps:
            self.warm_up(state)
        train_steps = make_step(cfg)
        self.fit_at = self.first_fit_step(start)
        # None: no bar where stdout is not a terminal (a log file would get its \r updates)
        bar = tqdm(initial=start, total=cfg.max_steps, unit="step", file=sys.stdout,
                   mininterval=1.0, disable=None if self.primary else True)
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

    def first_fit_step(self, start: int) -> int | None:
        """The step after which max_steps is first fitted to the budget: FIT_STEPS in, or
        the warmup's end when sooner with more than FIT_MIN_STEPS measured. None without a
        budget, or when the run ends first. A resumed run (`start` > 0) keeps the max_steps
        it was fitted to (train_config.json): `start` itself, so that it is only lowered,
        after an evaluation, if the steps got slower."""
        cfg = self.cfg
        if not cfg.time_budget_s:
            return None
        if start:
            return start
        warmup_end = cfg.warmup_steps if cfg.warmup_steps > FIT_MIN_STEPS else FIT_STEPS
        fit_at = min(FIT_STEPS, warmup_end)
        return fit_at if fit_at < cfg.max_steps else None

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
        budget, or a run too short to measure in), then after each evaluation."""
        return self.fit_at is not None and (self.step == self.fit_at or (
            self.step > self.fit_at and self.step % self.cfg.eval_interval == 0))

    def fit_to_budget(self, bar, first: bool) -> bool:
        """Fit `max_steps` to the steps the time budget still holds, so that the cosine
        schedule ends with the run: neither cut off by the budget at a high learning rate
        on a slow machine, nor ended early with the budget unused on a fast one (a
        budget-aware schedule: Li, Yumer & Ramanan 2020, "Budgeted Training"). The `first`
        fit raises or lowers it, inside the warmup when the warmup is long enough, whose
        learning rates do not depend on max_steps: the run then equals one started with the
        fitted max_steps (same batches, same updates); past the warmup the schedule is
        made again at the fitted length. Called again after each evaluation, it raises or
        lowers max_steps once more when the steps' speed has moved (a machine that got
        busier or quieter, or the margin below not needed): the rest of the cosine is
        stretched or compressed, so the learning rate steps up or down once, and the
        schedule still ends with the run. A resumed run keeps the value it was fitted to
        (train_config.json records each) and is only lowered.

        Each step is expected to take `FIT_MARGIN` longer than measured: at the first fit
        the median of its (at most `FIT_STEPS`) steps, a few calls where one slow call
        should not count; at a re-fit the mean of the last evaluation interval's steps,
        what those steps took, slow calls included (the median of the last 50 steps, 34.8
        ms at step 2000 of an idle `make demo`, lowered it by 1218 steps where the next
        10,000 averaged 33.1 ms), and a slowdown seen within one interval. Each evaluation
        is expected to take as long as the last, the recompile as long as the longest call
        that compiled. The margin leaves room for steps slower than measured after the
        last fit (under load only the first fit may come before the run ends); as re-fits
        raise max_steps too, what it leaves unused on a steady machine is its share of the
        time after the last re-fit. Returns whether it changed: past the `first` fit, only
        by more than `REFIT_SLACK` of the steps left, and raised only with an evaluation
        interval of steps left (each fit compiles the step again); lowered even in the last
        interval, so that a run that slowed down there still ends its schedule (`out_of_time`
        stopped one beside `make test` at step 4430 of 4687)."""
        cfg, now = self.cfg, time.perf_counter()
        recent = list(self.fit_times)[-cfg.eval_interval:]  # at most one interval's
        measured_s = float(np.median(recent) if first else np.mean(recent))
        left = self.started + cfg.time_budget_s - now - self.compile_s - self.finish_s
        per_step = measured_s * (1 + FIT_MARGIN) + self.finish_s / cfg.eval_interval
        steps = max(self.step + 1, self.step + int(left // per_step))
        if jax.process_count() > 1:  # process 0's clock decides for all (before any return)
            from jax.experimental import multihost_utils

            steps = int(multihost_utils.broadcast_one_to_all(np.int64(steps)))
        if not first:
            if steps > cfg.max_steps and steps - self.step < cfg.eval_interval:
                return False  # too few steps left to pay for a recompile to raise it
            if self.resumed:
                steps = min(steps, cfg.max_steps)
            if abs(steps - cfg.max_steps) <= REFIT_SLACK * (cfg.max_steps - self.step):
                return False
        if steps == cfg.max_steps:
            return False
        measured_ms = 1e3 * measured_s
        self.say(bar, f"time budget of {cfg.time_budget_s:g} s: max_steps {cfg.max_steps} -> "
                      f"{steps} at step {self.step} ({measured_ms:.1f} ms/step, the "
                      f"{'median' if first else 'mean'} of the last {len(recent)} measured), "
                      "so the learning-rate schedule ends with the run")
        self.fits.append({"step": self.step, "from": cfg.max_steps, "to": steps,
                          "ms_per_step": round(measured_ms, 2), "first": first})
        self.cfg = dataclasses.replace(cfg, max_steps=steps)
        self.call_size = min(cfg.steps_per_call, cfg.eval_interval, steps)
        self.next_batch = (-1, None)  # placed for the old call size: placed again
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
        # at the schedule's end the run is over: no "stopped" line for its last call
        out_of_time = self.step < cfg.max_steps and self.out_of_time(due)
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
        """`(step, (x, y))`: the batches of steps `step .. step + call_size - 1`
        (`step_batch`) on the mesh, int32 `[call_size, A, B, T]` each (A micro-batches:
        `training.step`); a call runs the first n."""
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
        """Rehearse the run's end before training, once to compile and import, once timed,
        so the budget keeps room for the whole final checkpoint from the first fit on: an
        evaluation and sample, and (one process) the checkpoint's save, metrics line and
        loss plot written to a scratch directory. Timing the evaluation alone left out the
        save's and the plot's first calls (Orbax, matplotlib's import): a 200 s budget on a
        loaded machine (load 15-18) ended 7 s past it. In a multi-process run, where every
        process saves into one directory, the evaluation alone is rehearsed."""
        rehearse_save = jax.process_count() == 1
        with tempfile.TemporaryDirectory(prefix="budget-rehearsal-") as scratch:
            mngr = checkpoint.manager(scratch, 1) if rehearse_save else None
            for step in range(2):
                tick = time.perf_counter()
                evals = evaluate(state.params, self.config, self.cfg, self.batches, self.mesh)
                self.sample(state)
                if rehearse_save:
                    report.append_metrics(scratch, {"step": step, "train_loss": math.nan,
                                                    **evals, "elapsed_s": 0.0})
                    self.save(state, mngr, scratch, step, {"step": step}, evals["val_loss"])
            self.finish_s = time.perf_counter() - tick
            if mngr is not None:
                mngr.close()

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
            with interrupts_deferred():
                report.append_metrics(self.cfg.run_dir, record)
        per_char = self.evals["val_loss_per_char"]
        chars = "" if per_char == self.evals["val_loss"] else f" ({per_char:.4f}/char)"
        self.say(bar, f"step {self.step}: train {record['train_loss']:.4f} val "
                      f"{self.evals['val_loss']:.4f} nats/token{chars}, {elapsed:.0f}s")
        if (text := self.sample(state)) is not None:
            bar.write(text)
        with interrupts_deferred():  # Ctrl-C now stops the run after these writes
            self.save(state, self.mngr, self.cfg.run_dir, self.step,
                      {"step": self.step, "elapsed_s": elapsed}, self.evals["val_loss"])
            self.saved_step = self.step
        self.finish_s = time.perf_counter() - tick

    def save(self, state: TrainState, mngr, run_dir, step: int, meta: dict,
             val_loss: float) -> None:
        """Save a checkpoint at `step` with `mngr` and redraw `run_dir`'s loss plot (process
        0): the writes of `checkpoint`, which `warm_up` rehearses in a scratch directory."""
        checkpoint.save(mngr, step, state.params, state.opt_state, meta, val_loss)
        if self.primary:
            report.plot_losses(run_dir)

    def summary(self) -> dict[str, Any]:
        """steps; max_steps, the schedule's length (fitted to a time budget: steps falls
        short of it when the budget stopped the run first); the last evaluation's
        train_loss (the mean over the steps since the one before, as metrics.jsonl logs it)
        and val losses; train_seconds, the wall time of the steps run, those that compile
        left out (not setup, evaluations or checkpoints), and tokens_per_s over those same
        steps; budget_fits, each change of max_steps by the time budget (`fit_to_budget`:
        the step it was made at, from, to, the ms per step it measured, and whether it was
        the first fit or a re-fit after an evaluation). With no step run (a finished run
        resumed), train_loss is null, not NaN."""
        return {"steps": self.step, "max_steps": self.cfg.max_steps, "train_loss": None,
                **self.evals, "train_seconds": self.train_seconds,
                "tokens_per_s": self.tokens_per_s(), "budget_fits": self.fits}
