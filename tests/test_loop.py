"""`training/loop.py`: the training loop's time budget (the whole run ends within it, and
max_steps is fitted to it, again when the steps slow down), a compile charged once, the
batches a call places; run through `train`, mostly on a virtual clock."""

import dataclasses
import json
import re
import types

import jax
import numpy as np
import pytest

from gpt_jax import checkpoint
from training import loop as L
from training import report
from training import train as T
from training.config import TrainConfig


def virtual_clock(monkeypatch) -> list[float]:
    """A clock moved by hand, `[seconds]`, made the run's `time.perf_counter` (where `train`
    starts the budget and where the loop times it): setup, compiles and evaluations take no
    time."""
    clock = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(T, "time", fake)
    monkeypatch.setattr(L, "time", fake)
    return clock


def taking(clock, seconds, fn):
    """`fn`, each call of it taking `seconds` on the virtual `clock`."""
    def slow(*args, **kwargs):
        clock[0] += seconds
        return fn(*args, **kwargs)

    return slow


def test_the_time_budget_covers_the_whole_run(corpus, tmp_path, monkeypatch):
    """Fault: the budget counted from the first step and left out the final evaluation (a
    60 s budget ran 84-94 s). Now setup, compiling, the steps and the final evaluation and
    checkpoint end within it. On the virtual clock (`steps_taking`) the setup before the
    first step takes 2 s, each step program's first call 1.5 s (a compile: the first, and
    one after each fit), every step 10 ms, every evaluation 0.3 s and every checkpoint's
    save 0.5 s: the run ends within the budget, its last step evaluated and saved, and
    not far before the budget's end."""
    clock, schedules = virtual_clock(monkeypatch), []
    for owner, name, seconds in ((T, "prepare_run", 2.0), (L, "evaluate", 0.3),
                                 (L.checkpoint, "save", 0.5)):
        monkeypatch.setattr(owner, name, taking(clock, seconds, getattr(owner, name)))
    steps_taking(monkeypatch, clock, 0.01, schedules, compile_s=1.5)
    budget = 15.0
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=100_000, eval_interval=100, time_budget_s=budget)
    summary = T.train(cfg)
    assert clock[0] <= budget, f"a {budget} s budget took {clock[0]:.3f} s"
    rows = report.read_metrics(cfg.run_dir)
    assert rows[-1]["step"] == summary["steps"] < cfg.max_steps  # the budget stopped it...
    # one train loss for one step (a new user saw the last step's in the summary)
    assert summary["train_loss"] == rows[-1]["train_loss"] == np.mean(rows[-1]["train_losses"])
    assert max(checkpoint.manager(cfg.run_dir).all_steps()) == summary["steps"]  # ...saved
    assert rows[-1]["elapsed_s"] < budget  # counted from the start of the run
    # not far too early: less than a compile's time unused (at 253 steps, 0.47 s)
    assert clock[0] > budget - 1.5, f"a {budget} s budget stopped after {clock[0]:.3f} s"


def test_a_time_budget_ends_the_learning_rate_schedule_with_the_run(corpus, tmp_path,
                                                                   monkeypatch):
    """Fault: with a time budget, a slow machine stopped the run partway through its cosine
    schedule, at a high learning rate. Now max_steps is fitted to the budget inside the
    warmup: train_config.json records the fitted value (what a resume keeps), the run ends
    at it, and its params equal those of a run started with that max_steps and no budget,
    at the same step (the warmup's learning rates do not depend on max_steps). On a virtual
    clock (the loop's `time.perf_counter`: setup, compiles and evaluations take no time),
    every step 5 ms: on the real clock, a loaded machine's compile once took most of an 8 s
    budget and the run stopped before the fit."""
    clock = virtual_clock(monkeypatch)
    make_train_steps = T.make_train_steps

    def five_ms(*args, **kwargs):
        steps = make_train_steps(*args, **kwargs)

        def timed_steps(state, x, y, n):
            clock[0] += 0.005 * int(n)
            return steps(state, x, y, n)

        return timed_steps

    monkeypatch.setattr(T, "make_train_steps", five_ms)
    budget = 8.0
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "budget"),
                             max_steps=100_000, warmup_steps=L.FIT_STEPS,
                             eval_interval=100_000, time_budget_s=budget)
    seen = {"budget": {}, "fitted": {}}

    def keep(name):
        return lambda step, params: seen[name].__setitem__(step, jax.device_get(params))

    steps = T.train(cfg, on_eval=keep("budget"))["steps"]
    fitted = json.loads((tmp_path / "budget" / "train_config.json").read_text())["max_steps"]
    assert steps == fitted == 1525, (steps, fitted)  # 8 s at 5.25 ms a step (a 5% margin)
    assert clock[0] <= budget
    T.train(dataclasses.replace(cfg, run_dir=str(tmp_path / "fitted"), max_steps=fitted,
                                eval_interval=steps, time_budget_s=0.0), on_eval=keep("fitted"))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 seen["budget"][steps], seen["fitted"][steps])


def steps_taking(monkeypatch, clock, step_s, schedules, stop_at=None, compile_s=0.0):
    """Make `train`'s steps take `step_s` seconds each on the virtual `clock` (or
    `step_s(k)` for the k-th step run, from 0) and the first call of each step program
    made `compile_s` more (its compile), note the length of each learning-rate schedule
    made (`schedules`), and Ctrl-C the run at step `stop_at`."""
    from training.step import make_optimizer, make_train_steps  # not an earlier call's

    done = [0]

    def noting(cfg):
        schedules.append(cfg.max_steps)
        return make_optimizer(cfg)

    def timed(*args, **kwargs):
        steps, first = make_train_steps(*args, **kwargs), [True]

        def timed_steps(state, x, y, n):
            if stop_at is not None and done[0] + int(n) > stop_at:
                raise KeyboardInterrupt
            clock[0] += compile_s if first[0] else 0.0
            first[0] = False
            for _ in range(int(n)):
                clock[0] += step_s(done[0]) if callable(step_s) else step_s
                done[0] += 1
            return steps(state, x, y, n)

        return timed_steps

    monkeypatch.setattr(T, "make_optimizer", noting)
    monkeypatch.setattr(T, "make_train_steps", timed)


def test_the_budget_keeps_room_for_the_final_checkpoints_save(corpus, tmp_path, monkeypatch):
    """Fault: the budget timed an evaluation before training but not a checkpoint's save and
    plot, so a run without a checkpoint before its last (a 200 s `make demo` under load,
    222 steps) fitted max_steps as if the final checkpoint were an evaluation alone, and
    ended 7 s past its budget. Now the warm-up rehearses the whole checkpoint in a scratch
    directory. On the virtual clock every step takes 5 ms and every save 0.5 s: the run is
    fitted with room for the final save, ends at its fit (the schedule ended) and within
    the budget, where timing the evaluation alone ran to step 1525 and 8.125 s."""
    clock = virtual_clock(monkeypatch)
    save, schedules = L.checkpoint.save, []
    monkeypatch.setattr(L.checkpoint, "save", lambda *args, **kwargs: (
        clock.__setitem__(0, clock[0] + 0.5), save(*args, **kwargs)))
    steps_taking(monkeypatch, clock, 0.005, schedules)
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=100_000, warmup_steps=L.FIT_STEPS,
                             eval_interval=100_000, sample_tokens=0, time_budget_s=8.0)
    summary = T.train(cfg)
    # at step 50: 1.0 s of rehearsal + 0.25 s of steps spent, 0.005 s kept for the
    # recompile and 0.5 s for the final checkpoint, 6.245 s left at 5.25 ms a step
    assert summary["steps"] == summary["max_steps"] == schedules[-1] == 50 + 1188, summary
    assert summary["budget_fits"] == [
        {"step": 50, "from": 100_000, "to": 50 + 1188, "ms_per_step": 5.0, "first": True}]
    assert 7.5 < clock[0] <= cfg.time_budget_s, clock


@pytest.mark.parametrize("step_s, fitted, refitted", [(0.002, 477, 489), (0.01, 96, 96)])
def test_the_budget_fit_raises_or_lowers_max_steps_and_a_resume_keeps_it(
        corpus, tmp_path, monkeypatch, step_s, fitted, refitted):
    """Fault: the fit only ever lowered max_steps, so on a fast machine `make demo` ended
    its schedule in a third of its budget. Now the first fit (in the warmup, at step 50)
    raises max_steps on a fast machine (2 ms a step: 200 -> 477) and lowers it on a slow
    one (10 ms: 200 -> 96); the schedule is made again at the fitted length (the lengths
    made: the state's, the first step's, the fit's), the run ends there, and the summary
    records the change. On the fast machine the re-fit at the evaluation at step 300
    raises it again, to 489 (0.398 s left at 2.1 ms: the 5% margin was not needed);
    Ctrl-C'd at step 350 (checkpoint at 300) and resumed as the demo resumes (the saved
    train_config.json and the same budget) on a machine twice as fast, the run keeps the
    fitted value instead of fitting again (a resumed run is only lowered). Virtual clock:
    setup, compiles and evaluations take no time; the fit expects each step to take 5%
    longer than measured (1 s budget, 0.1 s spent at step 50, at 2.1 ms: 50 + 427 steps;
    0.002 s kept for the recompile)."""
    clock, schedules = virtual_clock(monkeypatch), []
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=200, warmup_steps=L.FIT_STEPS, eval_interval=150,
                             sample_tokens=0, time_budget_s=1.0)
    saved = tmp_path / "run" / "train_config.json"
    if fitted < 350:  # lowered: the run ends before the Ctrl-C
        steps_taking(monkeypatch, clock, step_s, schedules)
        summary = T.train(cfg)
        assert schedules == [200, 200, fitted]
        assert summary["steps"] == summary["max_steps"] == fitted
        assert summary["budget_fits"] == [
            {"step": 50, "from": 200, "to": fitted, "ms_per_step": 1e3 * step_s,
             "first": True}]
        assert json.loads(saved.read_text())["max_steps"] == fitted
        assert clock[0] <= cfg.time_budget_s
        return
    steps_taking(monkeypatch, clock, step_s, schedules, stop_at=350)
    with pytest.raises(KeyboardInterrupt):
        T.train(cfg)
    assert schedules == [200, 200, fitted, refitted]
    assert json.loads(saved.read_text())["max_steps"] == refitted
    clock[0], schedules[:] = 0.0, []
    steps_taking(monkeypatch, clock, step_s / 2, schedules)
    resumed = dataclasses.replace(T.base_config(None, cfg.run_dir), time_budget_s=1.0)
    summary = T.train(resumed)
    assert schedules == [refitted, refitted]
    assert summary["steps"] == summary["max_steps"] == refitted
    assert summary["budget_fits"] == []  # resumed at 300, from the checkpoint there:
    assert [row["step"] for row in report.read_metrics(cfg.run_dir)] == [150, 300, 450, refitted]
    assert json.loads(saved.read_text())["max_steps"] == refitted


def test_a_slow_compile_is_charged_once_not_to_every_step_of_the_next_call(corpus, tmp_path,
                                                                          monkeypatch):
    """Fault (found by a new user): with several steps a call, the budget's guard charged
    the first call's compile to each step of the next call, and every budgeted run on a
    cold compilation cache stopped at step 1 (`make demo` with a 60 s budget: 1 step, val
    4.35). On a virtual clock, each compiled program's first call takes 1.5 s more (a
    compile), every step 5 ms: the run is fitted at step 50 and ends at its fit."""
    clock = virtual_clock(monkeypatch)
    make_train_steps = T.make_train_steps

    def compiling(*args, **kwargs):
        steps, first = make_train_steps(*args, **kwargs), [True]

        def timed_steps(state, x, y, n):
            clock[0] += 0.005 * int(n) + (1.5 if first[0] else 0.0)
            first[0] = False
            return steps(state, x, y, n)

        return timed_steps

    monkeypatch.setattr(T, "make_train_steps", compiling)
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=100_000, warmup_steps=L.FIT_STEPS,
                             eval_interval=100_000, time_budget_s=8.0)
    summary = T.train(cfg)
    # at step 50: 1.75 s spent, 1.505 s kept for the recompile, 4.745 s left at 5.25 ms
    assert summary["steps"] == summary["max_steps"] == 50 + 903, summary
    assert clock[0] <= cfg.time_budget_s


def test_a_huge_steps_per_call_places_only_the_batches_a_call_can_run(corpus, tmp_path,
                                                                      monkeypatch):
    """Fault (found by a new user): `--steps-per-call 200000` drew and placed 200,000
    batches per call (2.4 GB; ~6 GB on the demo's preset) where a call runs at most an
    evaluation interval of steps. Now a call's batches are capped at min(steps_per_call,
    eval_interval, max_steps), and the calls still end at every evaluation."""
    shapes = []
    put_batch = L.sharding.put_batch
    monkeypatch.setattr(L.sharding, "put_batch",
                        lambda x, *a: shapes.append(x.shape) or put_batch(x, *a))
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=30, eval_interval=25, steps_per_call=200_000,
                             sample_tokens=0)
    T.train(cfg)
    calls = [shape for shape in shapes if len(shape) == 4]  # [call_size, A, B, T]; 2-D: evaluation
    assert calls and {shape[0] for shape in calls} == {25}, calls
    rows = report.read_metrics(cfg.run_dir)
    assert [(r["step"], len(r["train_losses"])) for r in rows] == [(25, 25), (30, 5)]


def test_a_run_that_slows_down_fits_its_schedule_again(corpus, tmp_path, monkeypatch, capsys):
    """Fault (found by two new users): the fit measured the warmup's steps only, so a machine
    that got busier later stopped `make demo` at 73% and 84% of its fitted schedule. Now
    max_steps is fitted again after each evaluation when the steps have slowed. On a virtual
    clock (the loop's `time.perf_counter`: setup, compiles and evaluations take no time)
    every step takes 5 ms until the first fit at step 50, then 25 ms: the run is fitted
    again at the next evaluation from the mean of both sides of the slowdown, again at
    the one after from the slow steps alone, records the last fit (train_config.json, the
    summary) and ends at it, where the warmup's fit alone stopped the run at a quarter of
    its schedule."""
    clock = virtual_clock(monkeypatch)
    done = [0]
    make_train_steps = T.make_train_steps

    def slowing(*args, **kwargs):
        steps = make_train_steps(*args, **kwargs)

        def slow_steps(state, x, y, n):
            for _ in range(int(n)):
                done[0] += 1
                clock[0] += 0.005 if done[0] <= L.FIT_STEPS else 0.025
            return steps(state, x, y, n)

        return slow_steps

    monkeypatch.setattr(T, "make_train_steps", slowing)
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=100_000, warmup_steps=L.FIT_STEPS, eval_interval=100,
                             time_budget_s=8.0)
    summary = T.train(cfg)
    fits = [(int(a), int(b)) for a, b in
            re.findall(r"max_steps (\d+) -> (\d+)", capsys.readouterr().out)]
    # 8 s at 5.25 ms a step (the 5% margin); then, at the evaluation at step 100 (1.5 s in,
    # the recompiling one-step call at step 50 taking 25 ms, kept for the next recompile),
    # 6.475 s left at 1.05 x 15 ms (the mean of 49 steps at 5 ms and 49 at 25): 411 more;
    # at step 200 (4 s in), 3.975 s left at 1.05 x 25 ms: 151 more
    assert fits == [(100_000, 1525), (1525, 511), (511, 351)], fits
    final = json.loads((tmp_path / "run" / "train_config.json").read_text())["max_steps"]
    assert summary["steps"] == summary["max_steps"] == final == 351, summary
    assert clock[0] <= cfg.time_budget_s


def test_a_run_that_slows_down_in_its_last_interval_is_lowered_to_end_its_schedule(
        corpus, tmp_path, monkeypatch, capsys):
    """Fault: a re-fit needed an evaluation interval of steps left, so `make demo` beside
    `make test`, slowed after its fit at step 2000, was not lowered at step 4000 (687 steps
    left of 4687) and the budget stopped it at step 4430, its schedule not ended. On the
    virtual clock, steps take 5 ms until the first fit at step 50, then 8 ms: the evaluation
    at step 100, fewer than an interval before the fitted end, lowers max_steps and the run
    ends with it."""
    clock, schedules = virtual_clock(monkeypatch), []
    steps_taking(monkeypatch, clock, lambda k: 0.005 if k < L.FIT_STEPS else 0.008, schedules)
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=100_000, warmup_steps=L.FIT_STEPS, eval_interval=50,
                             time_budget_s=1.0)
    summary = T.train(cfg)
    fits = [(int(a), int(b), int(at)) for a, b, at in re.findall(
        r"max_steps (\d+) -> (\d+) at step (\d+)", capsys.readouterr().out)]
    assert [at for *_, at in fits] == [L.FIT_STEPS, 100], fits
    first_to, last_to = fits[0][1], fits[-1][1]
    assert last_to - 100 < cfg.eval_interval and last_to < first_to, fits
    assert summary["steps"] == summary["max_steps"] == last_to == schedules[-1], summary
    assert clock[0] <= cfg.time_budget_s


def test_a_run_that_speeds_up_is_fitted_again_to_a_longer_schedule(corpus, tmp_path,
                                                                   monkeypatch):
    """Fault: after the first fit, a re-fit could only lower max_steps, from the median of
    the last 50 steps, so a run whose steps went faster ended its schedule with the budget
    unused (an idle `make demo`: lowered at step 2000 from 50 steps at 34.8 ms where the
    next 10,000 took 33.1 ms: 39 s of 450 unused, val 1.5008 for a 1.50 target). Now a
    re-fit after an evaluation raises it too, from the mean of the evaluation interval's
    steps. On the virtual clock steps take 10 ms until the first fit, then 4 ms (1.1 s
    budget, an evaluation every 50 steps): the first fit (step 50, 0.5 s spent, 0.01 s kept
    for the recompile) lowers 200 to 50 + 56 (0.59 s at 10.5 ms), the re-fit at step 100
    (the last 50 steps' mean: one at 10 ms, 49 at 4 ms, 4.12 ms) raises it to 100 + 90
    (0.39 s at 4.33 ms), the schedule is made again at each length, and the run ends at
    the last with the schedule, within the budget and using all but 0.04 s of it (at step
    150 too few steps are left to pay for another recompile)."""
    clock, schedules = virtual_clock(monkeypatch), []
    steps_taking(monkeypatch, clock, lambda k: 0.010 if k < L.FIT_STEPS else 0.004, schedules)
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=200, warmup_steps=L.FIT_STEPS, eval_interval=50,
                             sample_tokens=0, time_budget_s=1.1)
    summary = T.train(cfg)
    fits = [(f["step"], f["from"], f["to"], f["ms_per_step"], f["first"])
            for f in summary["budget_fits"]]
    assert fits == [(50, 200, 106, 10.0, True), (100, 106, 190, 4.12, False)], fits
    assert schedules == [200, 200, 106, 190], schedules
    assert summary["steps"] == summary["max_steps"] == 190, summary
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["max_steps"] == 190
    assert cfg.time_budget_s - 0.05 < clock[0] <= cfg.time_budget_s, clock


@pytest.mark.parametrize("spent_s, max_steps, changed",
                         [(9.5, 905, False), (9.5, 2000, True), (5.0, 2000, True)])
def test_every_process_takes_part_in_each_fit(tmp_path, monkeypatch, spent_s, max_steps,
                                              changed):
    """In a multi-process run process 0's step count is broadcast to all at every fit,
    before any process decides anything from it: a process that returned first (here, too
    few steps left to raise max_steps for) would leave the others waiting in the
    broadcast."""
    from jax.experimental import multihost_utils

    sent = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all",
                        lambda x: sent.append(int(x)) or x)
    cfg = TrainConfig.preset("tiny", run_dir=str(tmp_path), max_steps=max_steps,
                             eval_interval=100, time_budget_s=10.0)
    loop = L.Loop(cfg, None, None, None, None, None, 1.0, 1.0, 0.0,
                  started=L.time.perf_counter() - spent_s)
    loop.step, loop.primary = 900, False
    loop.fit_times.extend([0.01] * L.FIT_STEPS)
    assert loop.fit_to_budget(types.SimpleNamespace(write=print), first=False) is changed
    # 0.5 s left: ~47 steps, fewer than an interval (lowered, not raised); 5 s: ~476
    assert len(sent) == 1
    assert loop.cfg.max_steps == (sent[0] if changed else max_steps)
