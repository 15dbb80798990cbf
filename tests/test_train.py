"""`training/train.py`: a run (it learns, keeps its run dir, resumes after a kill, refuses a
bad corpus, says when it has nothing to train) and its command line. The loop's time
budget: test_loop.py; a refused resume: test_run_dir.py."""

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax import checkpoint
from gpt_jax.config import GPTConfig
from training import data, report, sharding
from training import train as T
from training.config import TRAIN_PRESETS, TrainConfig

REPO = Path(__file__).resolve().parents[1]


def unigram_entropy(text: str) -> float:
    """Entropy in nats of the character distribution of `text`."""
    counts = np.array(list(Counter(text).values()), np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_training_beats_the_unigram_entropy_within_300_steps(trained, corpus):
    cfg, summary, _ = trained
    _, val_text = data.split(np.array(list(corpus.read_text())), cfg.val_fraction)
    entropy = unigram_entropy("".join(val_text))
    rows = report.read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [100, 200, 300]
    assert summary["steps"] == 300
    assert summary["val_loss"] < 0.75 * entropy, (summary["val_loss"], entropy)
    assert summary["val_loss_per_char"] == summary["val_loss"]  # char-level: equal
    assert rows[-1]["val_loss"] < rows[0]["val_loss"]
    assert Path(cfg.run_dir, "loss.png").stat().st_size > 0


def test_run_dir_keeps_last_k_and_the_config(trained):
    cfg, _, _ = trained
    assert sorted(checkpoint.manager(cfg.run_dir).all_steps()) == [200, 300]
    saved = json.loads(Path(cfg.run_dir, "train_config.json").read_text())
    assert TrainConfig(**saved) == dataclasses.replace(cfg, block_size=32)


def test_sigkill_mid_training_then_resume_matches_an_uninterrupted_run(corpus, tmp_path):
    steps, every = 40, 4
    killed_dir, reference_dir = tmp_path / "killed", tmp_path / "reference"
    cmd = [sys.executable, "-m", "training.train", "--preset", "tiny", "--text", str(corpus),
           "--run-dir", str(killed_dir), "--max-steps", str(steps),
           "--eval-interval", str(every), "--cpu-devices", "1"]  # as this process: 1 device
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    ckpts = killed_dir / "checkpoints"
    deadline = time.time() + 240
    while not (ckpts.exists() and any(p.name.isdigit() and int(p.name) >= 2 * every
                                      for p in ckpts.iterdir())):
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(checkpoint.manager(killed_dir).all_steps())
    assert killed_at < steps

    cfg = T.config_from_args(cmd[cmd.index("--preset"):])
    resumed = T.train(cfg)
    reference = T.train(dataclasses.replace(cfg, run_dir=str(reference_dir)))
    assert resumed["steps"] == reference["steps"] == steps
    _, params, _ = checkpoint.load_params(killed_dir)
    _, expected, _ = checkpoint.load_params(reference_dir)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
        assert_close(a, b, 1e-6, "resumed params")
    rows = report.read_metrics(killed_dir)
    assert [r["step"] for r in rows] == list(range(every, steps + 1, every))


def test_keep_checkpoints_holds_across_resumes(corpus, tmp_path):
    """Fault (issue 41, found by a new user: --keep-checkpoints 3 ended with 11 checkpoints):
    a resumed run kept every checkpoint saved before it. Resumed twice (--max-steps raised
    each time, as the README extends a run), the run keeps the last k and the best."""
    cfg = TrainConfig.preset("tiny", text=str(corpus), run_dir=str(tmp_path / "run"),
                             max_steps=4, eval_interval=2, keep_checkpoints=2)
    for max_steps in (4, 6, 8):
        T.train(dataclasses.replace(cfg, max_steps=max_steps))
    rows = report.read_metrics(cfg.run_dir)
    best = min(rows, key=lambda r: r["val_loss"])["step"]
    folders = {int(p.name) for p in Path(cfg.run_dir, "checkpoints").iterdir()}
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    assert folders == {6, 8, best}


@pytest.mark.parametrize("sig, status, said", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "stopped by SIGTERM")])
def test_a_signal_mid_checkpoint_exits_in_one_line_and_leaves_whole_files(
        corpus, tmp_path, sig, status, said):
    """Faults: Ctrl-C during training printed a traceback and left an
    `orbax-checkpoint-tmp` folder (issue 41); SIGTERM ended it on the spot, saying nothing
    (a new user, 2026-12-05). The signal sent while a checkpoint is being written: the run
    finishes that checkpoint, says so in one line and exits 130 / 143; nothing
    half-written is left, and the same command resumes."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "training.train", "--preset", "tiny", "--text", str(corpus),
           "--run-dir", str(run_dir), "--max-steps", "100000", "--eval-interval", "1",
           "--cpu-devices", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    ckpts, deadline = run_dir / "checkpoints", time.time() + 240
    try:
        while not (ckpts.exists() and any("tmp" in p.name for p in ckpts.iterdir())):
            assert proc.poll() is None and time.time() < deadline, "no checkpoint was written"
            time.sleep(0.002)
        proc.send_signal(sig)  # while Orbax writes <step>.orbax-checkpoint-tmp-*
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = max(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    assert stderr.rstrip().splitlines()[-1] == (
        f"gpt-jax train: {said}; the same command resumes from the checkpoint at step {last} "
        f"in {run_dir}")
    left = [p for p in run_dir.rglob("*") if "tmp" in p.name]
    assert left == [] and all(p.name.isdigit() for p in ckpts.iterdir())
    assert (ckpts / str(last) / checkpoint.FILE_DIGESTS).exists()  # whole, digests written


def test_cli_flags_override_the_preset():
    cfg = T.config_from_args(["--preset", "nanogpt-cpu", "--batch-size", "4",
                              "--shard-params", "true", "--text", "x.txt"])
    assert cfg == dataclasses.replace(TRAIN_PRESETS["nanogpt-cpu"], batch_size=4,
                                      shard_params=True, text="x.txt")
    nano = TRAIN_PRESETS["nanogpt-cpu"]
    assert (nano.batch_size, nano.block_size, nano.max_steps, nano.learning_rate,
            nano.min_learning_rate, nano.beta2, nano.warmup_steps) == \
        (12, 64, 2000, 2e-3, 2e-4, 0.99, 100)  # nanoGPT's, at twice its learning rate
    shape = GPTConfig.preset("nanogpt-cpu")
    assert (shape.n_layers, shape.n_heads, shape.d_model, shape.max_seq_len) == (4, 4, 128, 64)


def test_run_dir_alone_resumes_with_the_runs_saved_config(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    started = TrainConfig.preset("nanogpt-cpu", text="my.txt", run_dir=str(run_dir),
                                   max_steps=300, block_size=64)
    (run_dir / "train_config.json").write_text(json.dumps(dataclasses.asdict(started)))
    # what the READMEs show: --run-dir alone (here with --max-steps to extend the run)
    assert T.config_from_args(["--run-dir", str(run_dir), "--max-steps", "400"]) == \
        dataclasses.replace(started, max_steps=400)
    # an explicit preset is still the base it names
    assert T.config_from_args(["--preset", "tiny", "--run-dir", str(run_dir)]) == \
        TrainConfig.preset("tiny", run_dir=str(run_dir))


def test_help_documents_every_field_from_its_comment(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no runs/shakespeare-char/train_config.json to default to
    with pytest.raises(SystemExit):
        T.config_from_args(["--help"])
    out = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())  # tyro's boxes
    assert "--cpu-devices INT CPU backend: XLA devices the host is split into by the command " \
           "line, before JAX starts (one program per core; see training/sharding.py); 0 = " \
           "one per core, as many as divide batch_size (default: 0)" in out
    assert "--learning-rate FLOAT peak AdamW learning rate (default: 0.002)" in out
    assert "--beta1 FLOAT (default: 0.9)" in out  # no comment: the default alone
    assert "--shard-params {true,false} split params and optimizer state over the mesh too " \
           "(default: false)" in out
    assert "--num-processes N processes in the run; the same on every process " \
           "(default: None)" in out
    assert "--preset {None}|STR one of ['nanogpt-cpu', 'shakespeare-char', 'tiny']" in out
    for field in dataclasses.fields(TrainConfig):  # every field is a flag
        assert f" --{field.name.replace('_', '-')} " in out, field.name
    # The defaults shown are the ones that apply: here the tiny preset's.
    with pytest.raises(SystemExit):
        T.config_from_args(["--preset", "tiny", "--help"])
    out = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())
    assert "--learning-rate FLOAT peak AdamW learning rate (default: 0.01)" in out


def test_boolean_flags_take_a_value_in_any_case():
    for value, expected in (("true", True), ("TRUE", True), ("1", True), ("yes", True),
                            ("false", False), ("No", False), ("0", False)):
        assert T.config_from_args(["--preset", "tiny", "--shard-params", value]) == \
            TrainConfig.preset("tiny", shard_params=expected), value


@pytest.mark.parametrize("command", [["gpt_jax.cli", "train"], ["training.train"]])
def test_help_into_a_closed_pipe_ends_without_a_traceback(command):
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head` after its lines: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", *command, "--help"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120,
                              cwd=Path(T.__file__).parents[1])
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (1, "")


def test_command_line_input_errors_are_one_line():
    with pytest.raises(SystemExit, match=r"^gpt-jax train: --grad-accum must be > 0, got 0$"):
        T.main(["--preset", "tiny", "--grad-accum", "0"])
    with pytest.raises(SystemExit, match=r"^gpt-jax train: --max-steps must be > 0, got -1$"):
        T.main(["--preset", "tiny", "--max-steps", "-1"])


def test_a_block_past_the_context_is_refused_before_the_corpus_is_read(tmp_path, monkeypatch):
    """Fault (a new user): `--block-size` past the model's max_seq_len was refused only
    after the corpus was read (and a BPE trained on it). Here no corpus file exists and
    reading it fails the test."""
    from training import run_dir

    def read(cfg):
        raise AssertionError("the corpus was read")

    monkeypatch.setattr(run_dir, "load_corpus", read)
    limit = GPTConfig.preset("tiny").max_seq_len
    said = (f"--block-size {limit + 1} exceeds the model's max_seq_len {limit}; allowed: 1 "
            f"to {limit}, or 0 for the max_seq_len")
    argv = ["--preset", "tiny", "--block-size", str(limit + 1), "--text",
            str(tmp_path / "none.txt"), "--run-dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as raised:
        T.main(argv)
    assert raised.value.code == f"gpt-jax train: {said}"
    with pytest.raises(ValueError) as raised:  # train(cfg) from Python alike
        T.train(T.config_from_args(argv))
    assert str(raised.value) == said
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("cpu_devices, cores, xla_flags, expected", [
    (0, 2, "", 2),  # one device per core
    (0, 8, "", 6),  # the most that divide the batch of 12
    (0, 5, "", 4),
    (0, 16, "", 12),  # never more than the batch
    (3, 2, "", 3),  # asked for: as asked
    (0, 2, "--xla_force_host_platform_device_count=4", None),  # the user's flag stands
    (2, 2, "--xla_force_host_platform_device_count=4", 2),
])
def test_split_host_picks_devices_that_divide_the_batch(monkeypatch, cpu_devices, cores,
                                                         xla_flags, expected):
    calls = []
    monkeypatch.setattr(sharding, "host_cores", lambda: cores)
    monkeypatch.setattr(sharding, "split_host_cpu", calls.append)
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    T.split_host(TrainConfig.preset("nanogpt-cpu", cpu_devices=cpu_devices))
    assert calls == ([] if expected is None else [expected])


def test_only_a_large_model_run_of_its_own_restarts_with_huge_pages(monkeypatch):
    from gpt_jax import cli

    class Restarted(Exception):
        pass

    class Proceeded(Exception):
        pass

    def execve(path, args, env):
        raise Restarted(args[1:], env["GLIBC_TUNABLES"])

    def split_host(*args):
        raise Proceeded

    assert T.large_buffers(TrainConfig.preset("nanogpt-cpu", model="gpt2"))  # 113 MB MLP
    for preset in ("tiny", "nanogpt-cpu", "shakespeare-char"):
        assert not T.large_buffers(TrainConfig.preset(preset)), preset
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.setattr(T, "split_host", split_host)  # where the run would start
    argv = ["--preset", "nanogpt-cpu", "--model", "gpt2"]
    with pytest.raises(Restarted) as restart:
        T.main(argv, own_process=True)
    assert restart.value.args == (["-m", "training.train", *argv], "glibc.malloc.hugetlb=1")
    with pytest.raises(Proceeded):  # called from Python: never restarts
        T.main(argv)
    with pytest.raises(Proceeded):  # a small model: no restart
        T.main(["--preset", "nanogpt-cpu"], own_process=True)
    calls = []  # `gpt-jax train` is a process of its own; cli.main([...]) is not
    monkeypatch.setattr(T, "main", lambda argv, own_process: calls.append(own_process))
    monkeypatch.setattr(sys, "argv", ["gpt-jax", "train", *argv])
    cli.main()
    cli.main(["train", *argv])
    assert calls == [True, False]


@pytest.mark.parametrize("content, message", [
    (b"", "is empty: a corpus needs text"),
    (b"Too short for a block.\n" * 2, r"the val split has 5 tokens, fewer than one block "
                                      r"of 32 \+ 1; the corpus \(46 tokens\) is too short"),
    (b"fine text then \xff\xfe", r"is not UTF-8: byte 0xff at offset 15"),
])
def test_bad_corpus_is_refused_before_training(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    path.write_bytes(content)
    cfg = TrainConfig.preset("tiny", text=str(path), run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=message):
        T.train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resuming_a_finished_run_says_so_and_its_summary_is_json(trained, tmp_path, capsys):
    """Fault (found by a new user): `train --run-dir DIR` on a run at its max_steps printed
    no reason and a summary with "train_loss": NaN, which is not JSON."""
    cfg, _, _ = trained
    run_dir = tmp_path / "done"
    shutil.copytree(cfg.run_dir, run_dir)
    summary = T.train(dataclasses.replace(cfg, run_dir=str(run_dir)))
    out = capsys.readouterr().out
    assert f"{run_dir} is at step 300, max_steps 300: nothing to train" in out
    assert summary["steps"] == 300 and summary["train_loss"] is None
    json.dumps(summary, allow_nan=False)  # raises ValueError on NaN
    # Fault: a max_steps below the run's step trained nothing but replaced the saved config
    saved = (run_dir / "train_config.json").read_text()
    T.train(dataclasses.replace(cfg, run_dir=str(run_dir), max_steps=200))
    assert "is at step 300, max_steps 200: nothing to train" in capsys.readouterr().out
    assert (run_dir / "train_config.json").read_text() == saved


