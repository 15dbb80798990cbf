"""`gpt-jax demo`: its budget checks, its one generation call, and what it reports of the
run it trained or resumed."""

import dataclasses
import json

import pytest

from training.config import TrainConfig


def test_demo_refuses_a_bad_budget_before_touching_the_previous_run(tmp_path):
    from training import demo

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text("{}")
    with pytest.raises(SystemExit, match="gpt-jax demo: TrainConfig.time_budget_s must be >= 0, got -1"):
        demo.main(["--run-dir", str(run), "--retrain", "--train-seconds", "-1"])
    # Fault: NaN passed the `< 0` check and crashed the budget's fit after training began
    with pytest.raises(SystemExit, match=r"^gpt-jax demo: TrainConfig.time_budget_s must be a finite "
                                         r"number, got nan$"):
        demo.main(["--run-dir", str(run), "--retrain", "--train-seconds", "nan"])
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # not renamed away

def test_demo_asks_500_characters_per_speaker_in_one_batch_by_cropping(tmp_path, monkeypatch):
    """The demo's generation call, with training and data skipped (a finished run)."""
    import inference.cli
    from training import demo

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(
        {"steps": 1, "tokens_per_s": 1.0, "train_loss": 1.0, "val_loss": 1.0}))
    monkeypatch.setattr(demo, "data_main", lambda argv: None)
    calls = []
    monkeypatch.setattr(inference.cli, "main", calls.append)
    demo.main(["--run-dir", str(run)])
    (argv,) = calls
    args = inference.cli.parse_args(argv)
    sampling = inference.cli.sampling_from_args(args)
    assert sampling.max_new_tokens == 500 and sampling.context_overflow == "crop"
    assert args.prompt == demo.PROMPTS and args.run_dir == str(run)  # one call: one batch

def test_demo_reports_training_done_since_its_summary(tmp_path, monkeypatch, capsys):
    """Fault: after `gpt-jax train --run-dir RUN --max-steps N` resumed the demo's run, the
    demo printed its old summary.json (old steps and losses) as the model's."""
    import inference.cli
    from training import demo
    from training.report import append_metrics

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(
        {"steps": 100, "tokens_per_s": 1000.0, "train_loss": 2.0, "val_loss": 2.1}))
    append_metrics(run, {"step": 100, "train_loss": 2.0, "val_loss": 2.1, "tokens_per_s": 1000.0})
    monkeypatch.setattr(demo, "data_main", lambda argv: None)
    monkeypatch.setattr(inference.cli, "main", lambda argv: None)
    demo.main(["--run-dir", str(run)])  # the summary is current: printed as it is
    assert f"training: 100 steps, 1,000 tokens/s, train loss 2.000, val loss 2.100 nats/char; " \
           f"model in {run}\n" in capsys.readouterr().out
    append_metrics(run, {"step": 300, "train_loss": 1.5, "val_loss": 1.6, "tokens_per_s": 900.0})
    demo.main(["--run-dir", str(run)])  # resumed since: metrics.jsonl's last line
    out = capsys.readouterr().out
    assert f"{run / 'summary.json'} is from step 100, but the run has trained to step 300 " \
           f"since: figures from metrics.jsonl's last line\n" in out
    assert f"training: 300 steps, 900 tokens/s, train loss 1.500, val loss 1.600 nats/char; " \
           f"model in {run}\n" in out

def test_demo_says_when_the_budget_stopped_the_run_before_its_schedule(tmp_path, monkeypatch,
                                                                      capsys):
    import inference.cli
    from training import demo

    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(
        {"steps": 100, "max_steps": 120, "tokens_per_s": 1000.0, "train_loss": 2.0,
         "val_loss": 2.1}))
    monkeypatch.setattr(demo, "data_main", lambda argv: None)
    monkeypatch.setattr(inference.cli, "main", lambda argv: None)
    demo.main(["--run-dir", str(run)])
    assert f"training: 100 of 120 steps, 1,000 tokens/s, train loss 2.000, val loss 2.100 " \
           f"nats/char; model in {run}\n" in capsys.readouterr().out

def test_a_stopped_demo_run_resumes_with_the_steps_its_budget_fitted(tmp_path, monkeypatch):
    """Fault: `make demo` started again after a stop resumed with the preset's max_steps,
    not the fewer that its time budget had fitted (train_config.json), so the learning-rate
    schedule changed in the middle of the run. A new run dir still takes the preset."""
    import inference.cli
    from training import demo
    from training import train as train_module

    seen = []
    monkeypatch.setattr(demo, "data_main", lambda argv: None)
    monkeypatch.setattr(inference.cli, "main", lambda argv: None)
    monkeypatch.setattr(train_module, "split_host", lambda cfg: None)
    monkeypatch.setattr(train_module, "train", lambda cfg, started: seen.append(cfg) or {
        "steps": cfg.max_steps, "tokens_per_s": 1.0, "train_loss": 1.0, "val_loss": 1.0})
    stopped, fresh = tmp_path / "stopped", tmp_path / "fresh"
    fitted = dataclasses.replace(TrainConfig(), run_dir=str(stopped), max_steps=3210,
                                 time_budget_s=450.0)
    stopped.mkdir()
    (stopped / "train_config.json").write_text(json.dumps(dataclasses.asdict(fitted)))
    demo.main(["--run-dir", str(stopped), "--train-seconds", "300"])
    demo.main(["--run-dir", str(fresh)])
    assert [(c.run_dir, c.max_steps, c.time_budget_s) for c in seen] == [
        (str(stopped), 3210, 300.0), (str(fresh), TrainConfig().max_steps, 450.0)]


def test_the_demo_ends_with_how_the_budget_changed_its_step_count(tmp_path, monkeypatch,
                                                                  capsys):
    """Issue 43: the demo's last line says when and why the budget changed the step count
    (raised on a fast machine; each re-fit after an evaluation, raised or lowered; stopped
    early when the steps slowed past the last fit)."""
    import inference.cli
    from training import demo

    run = tmp_path / "run"
    run.mkdir()
    summary = {"steps": 20000, "max_steps": 20000, "tokens_per_s": 1000.0, "train_loss": 2.0,
               "val_loss": 2.1, "budget_fits": [
                   {"step": 50, "from": 8000, "to": 20000, "ms_per_step": 19.04}]}
    (run / "summary.json").write_text(json.dumps(summary))
    monkeypatch.setattr(demo, "data_main", lambda argv: None)
    monkeypatch.setattr(inference.cli, "main", lambda argv: None)
    demo.main(["--run-dir", str(run)])
    assert capsys.readouterr().out.splitlines()[-1] == (
        "time budget: max_steps 8000 -> 20000 at step 50 (19.0 ms/step, faster than the preset "
        "assumes)")
    refits = [{"step": 50, "from": 8000, "to": 13235, "ms_per_step": 31.1, "first": True},
              {"step": 2000, "from": 13235, "to": 12400, "ms_per_step": 33.5, "first": False},
              {"step": 6000, "from": 12400, "to": 12700, "ms_per_step": 33.1, "first": False}]
    (run / "summary.json").write_text(json.dumps(
        {**summary, "steps": 12700, "max_steps": 12700, "budget_fits": refits}))
    demo.main(["--run-dir", str(run)])
    assert capsys.readouterr().out.splitlines()[-1] == (  # a new user's trial: 800 characters
        "time budget: max_steps 8000 -> 13235 at step 50 (31.1 ms/step, faster than the preset "
        "assumes), -> 12400 at step 2000 (33.5 ms/step), -> 12700 at step 6000 (33.1 ms/step)")
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 19990}))
    demo.main(["--run-dir", str(run)])
    assert capsys.readouterr().out.splitlines()[-1].endswith(
        "; stopped at step 19990 of 20000 (the steps got slower than the last fit expected)")
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 60, "budget_fits": []}))
    demo.main(["--run-dir", str(run)])  # fitted without a change, then slower
    assert capsys.readouterr().out.splitlines()[-1] == (
        "time budget: stopped at step 60 of 20000 (the steps got slower than the last fit "
        "expected)")
    (run / "summary.json").write_text(json.dumps({**summary, "budget_fits": []}))
    demo.main(["--run-dir", str(run)])
    assert capsys.readouterr().out.splitlines()[-1].startswith("phases: ")


def test_a_run_the_budget_stopped_before_its_first_fit_is_refused_and_resumed(
        tmp_path, monkeypatch, capsys):
    """Fault: a 90 s demo under load 16 stopped at step 1 (setup and compiling took the
    budget), sampled its untrained model, and wrote summary.json, so every later `make
    demo` reused that run ("reusing the trained model"). Now it stops in one line saying
    why and how to go on, writes no summary (the next demo resumes the run), and a
    summary.json of such a run written before is not reused."""
    import inference.cli
    from training import demo
    from training import train as train_module

    sampled, trains = [], []
    steps = iter([1, 8000, 8000])
    monkeypatch.setattr(demo, "data_main", lambda argv: None)
    monkeypatch.setattr(inference.cli, "main", sampled.append)
    monkeypatch.setattr(train_module, "split_host", lambda cfg: None)
    monkeypatch.setattr(train_module, "train", lambda cfg, started: trains.append(cfg) or {
        "steps": next(steps), "max_steps": 8000, "tokens_per_s": 1.0, "train_loss": 1.0,
        "val_loss": 1.0})
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        demo.main(["--run-dir", str(run), "--train-seconds", "90"])
    said = str(stop.value.code)
    assert said.startswith("gpt-jax demo: the 90 s budget ended the run at step 1 of 8000: "
                           "setup and compiling took it (load average ") and said.endswith(
        "Give it more time (TRAIN_SECONDS=450 make demo, or gpt-jax demo --train-seconds "
        "450): the next demo resumes this run from step 1"), said
    assert "\n" not in said
    assert not (run / "summary.json").exists() and sampled == []
    demo.main(["--run-dir", str(run), "--train-seconds", "90"])  # trains on: kept, sampled
    assert json.loads((run / "summary.json").read_text())["steps"] == 8000 and len(sampled) == 1
    (run / "summary.json").write_text(json.dumps(  # as the fault left it
        {"steps": 1, "max_steps": 8000, "tokens_per_s": 1.0, "train_loss": 4.0,
         "val_loss": 4.0}))
    demo.main(["--run-dir", str(run)])
    assert f"{run / 'summary.json'} is from a run its budget stopped at step 1: training " \
           "resumes it\n" in capsys.readouterr().out
    assert len(trains) == 3 and len(sampled) == 2
