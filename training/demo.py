"""`gpt-jax demo` (`make demo`): the corpus, a shakespeare-char run trained within a time
budget (once), and the four speakers generated from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from inference import cli as generate_command
from training.config import TrainConfig
from training.data import main as data_main

PROMPTS = ["Romeo.\n", "Juliet.\n", "Ham.\n", "MACBETH.\n"]  # as the plays mark speakers
NEW_TOKENS = 500  # characters per speaker, as nanoGPT's sample.py writes
DEFAULT_TRAIN_SECONDS = 450.0  # the Makefile's TRAIN_SECONDS too


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="gpt-jax demo", description=__doc__)
    parser.add_argument("--run-dir", default="runs/shakespeare-char",
                        help="the run: trained once, then reused (default: %(default)s)")
    parser.add_argument("--train-seconds", type=float, default=DEFAULT_TRAIN_SECONDS,
                        help="time budget of the training phase; max_steps is fitted to it, "
                             "0 = no limit (default: %(default)g)")
    parser.add_argument("--retrain", action="store_true",
                        help="train again; the old run directory is kept as RUN_DIR.old-TIME")
    parser.add_argument("--max-new-tokens", type=int, default=NEW_TOKENS,
                        help="characters per speaker; past the model's context each is "
                             "predicted from the last max_seq_len (nanoGPT's crop)")
    return parser.parse_args(argv)


def too_short(summary: dict) -> bool:
    """Whether the budget stopped the run before its first fit to the budget (FIT_STEPS
    steps, `training.loop`) and before its schedule's end: setup and compiling took the
    budget (a 90 s demo under load 16 stopped at step 1), and the model is untrained."""
    from training.loop import FIT_STEPS

    return summary["steps"] < min(FIT_STEPS, summary.get("max_steps", summary["steps"]))


def trained_summary(run_dir: Path, train_seconds: float, retrain: bool) -> dict:
    """The run's summary: trained now (the old run kept aside first with `retrain`), or read
    back when the run finished before (metrics.jsonl's last line if it trained further).
    A run stopped `too_short` is not the demo's model: its summary is not written (and one
    written before this check is not reused), so the next demo resumes it. Raises
    SystemExit saying so."""
    if retrain and run_dir.exists():
        kept = run_dir.with_name(f"{run_dir.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
        os.rename(run_dir, kept)
        print(f"previous run kept as {kept}")
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        from training.report import read_metrics

        summary = json.loads(summary_path.read_text())
        print(f"reusing the trained model in {run_dir} (RETRAIN=1 make demo, or gpt-jax demo "
              "--retrain, trains it again)")
        last = (read_metrics(run_dir) or [{"step": -1}])[-1]  # a line per checkpoint
        if last["step"] > summary["steps"]:  # trained further since (gpt-jax train resumed)
            print(f"{summary_path} is from step {summary['steps']}, but the run has trained "
                  f"to step {last['step']} since: figures from metrics.jsonl's last line")
            summary = {**last, "steps": last["step"]}
        if not too_short(summary):
            return summary
        print(f"{summary_path} is from a run its budget stopped at step {summary['steps']}: "
              "training resumes it")
    started = time.perf_counter()  # the budget covers the train phase, imports included
    from gpt_jax.checkpoint import write_json_atomic
    from training.train import base_config, split_host, train

    # A demo run stopped part-way resumes as it was started: max_steps as its time
    # budget fitted them, so the schedule does not change under it.
    cfg = dataclasses.replace(base_config(None, run_dir), run_dir=str(run_dir),
                              time_budget_s=train_seconds)
    split_host(cfg)
    summary = train(cfg, started=started)
    if too_short(summary):
        raise SystemExit(
            f"gpt-jax demo: the {train_seconds:g} s budget ended the run at step "
            f"{summary['steps']} of {summary['max_steps']}: setup and compiling took it "
            f"(load average {os.getloadavg()[0]:.1f}), too soon for a model worth sampling. "
            f"Give it more time (TRAIN_SECONDS={DEFAULT_TRAIN_SECONDS:g} make demo, or "
            f"gpt-jax demo --train-seconds {DEFAULT_TRAIN_SECONDS:g}): the next demo resumes "
            f"this run from step {summary['steps']}")
    write_json_atomic(summary_path, summary)
    return summary


def budget_line(summary: dict) -> str | None:
    """How the time budget changed the run's step count, in one line: each fit of max_steps
    that changed it (the first raised on a machine faster than the preset assumes, lowered
    on a slower one; each later one after an evaluation whose steps were faster or slower
    than the fit before allowed for; so the learning-rate schedule ends with the run), with
    the step time it measured, and a stop before the schedule's end. None when it changed
    nothing (or the summary predates the fits)."""
    notes = []
    for i, fit in enumerate(summary.get("budget_fits") or []):
        measured = f"{fit['ms_per_step']:.1f} ms/step"
        if fit.get("first", i == 0):
            than = "faster" if fit["to"] > fit["from"] else "slower"
            notes.append(f"max_steps {fit['from']} -> {fit['to']} at step {fit['step']} "
                         f"({measured}, {than} than the preset assumes)")
        else:
            notes.append(f"-> {fit['to']} at step {fit['step']} ({measured})")
    line = ", ".join(notes)
    if summary.get("max_steps", summary["steps"]) > summary["steps"]:  # past the first fit
        line += ("; " if line else "") + (  # (a run `too_short` is not kept)
            f"stopped at step {summary['steps']} of {summary['max_steps']} (the steps got "
            "slower than the last fit expected)")
    return f"time budget: {line}" if line else None


def main(argv=None):
    """The main job: corpus, training (skipped when the run finished before), generation."""
    args = parse_args(argv)
    run_dir = Path(args.run_dir)
    try:  # bad input stops here, before the previous run is touched
        TrainConfig(run_dir=str(run_dir), time_budget_s=args.train_seconds)
    except ValueError as error:
        raise SystemExit(f"gpt-jax demo: {error}") from None

    phases = {}
    tick = time.perf_counter()
    data_main([])
    phases["data"] = time.perf_counter() - tick

    tick = time.perf_counter()
    summary = trained_summary(run_dir, args.train_seconds, args.retrain)
    phases["train"] = time.perf_counter() - tick
    cut = summary.get("max_steps", summary["steps"]) > summary["steps"]  # the budget ended it
    steps = f"{summary['steps']} of {summary['max_steps']}" if cut else summary["steps"]
    print(f"training: {steps} steps, {summary['tokens_per_s']:,.0f} tokens/s, "
          f"train loss {summary['train_loss']:.3f}, val loss {summary['val_loss']:.3f} "
          f"nats/char; model in {run_dir}")

    tick = time.perf_counter()
    # The four speakers in one batch, each well past the model's context (crop): the
    # generate command itself, as `gpt-jax generate` runs it.
    generate_command.main(["--run-dir", str(run_dir), "--max-new-tokens",
                           str(args.max_new_tokens), "--context-overflow", "crop", "--report"]
                          + [a for p in PROMPTS for a in ("--prompt", p)])
    phases["generate"] = time.perf_counter() - tick
    print("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in phases.items()))
    if (line := budget_line(summary)) is not None:
        print(line)  # last, where it is seen: why the run has the steps it has
