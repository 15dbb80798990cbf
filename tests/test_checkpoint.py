"""`gpt_jax/checkpoint.py`: a saved run loads to the same logits, JSON files are written
whole with the mode `open` gives, the manager keeps the last k and the best, and a damaged
checkpoint is reported and the previous one used."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from gpt_jax import checkpoint, forward

REPO = Path(__file__).resolve().parents[1]


def test_checkpoint_round_trip_gives_identical_logits(trained):
    cfg, _, seen = trained
    config, params, tokenizer = checkpoint.load_params(cfg.run_dir)
    tokens = jnp.asarray([tokenizer.encode("The king speaks")], jnp.int32)
    expected = np.asarray(forward(seen[300], tokens, config))
    np.testing.assert_array_equal(np.asarray(forward(params, tokens, config)), expected)

def test_json_files_get_the_mode_open_gives(tmp_path):
    """Fault: config.json, summary.json ... were 0600 (tempfile.mkstemp) beside 0644 files."""
    old = os.umask(0o022)
    try:
        checkpoint.write_json_atomic(tmp_path / "summary.json", {"step": 3})
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "summary.json").st_mode & 0o777 == 0o644
    assert json.loads((tmp_path / "summary.json").read_text()) == {"step": 3}
    assert os.listdir(tmp_path) == ["summary.json"]  # no temporary file left

def test_manager_keeps_the_last_k_and_the_best(tmp_path):
    mngr = checkpoint.manager(tmp_path, keep=2)
    params = {"w": jnp.ones((2, 3))}
    for step, val_loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 4.0), (5, 5.0)]:
        checkpoint.save(mngr, step, params, params, {"step": step}, val_loss)
    assert sorted(mngr.all_steps()) == [2, 4, 5]  # the best (2) and the last two

def test_the_manager_keeps_the_last_k_and_the_best_across_resumes(tmp_path):
    """Fault (issue 41, found by a new user: keep 3 ended with 11 checkpoints): the val
    losses were kept in memory only, so a resumed run's manager saw checkpoints without
    metrics, which Orbax's BestN keeps forever. Three managers, as a run resumed twice."""
    params = {"w": jnp.ones((2, 3))}
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 4.0, 5: 5.0, 6: 6.0, 7: 7.0}
    for steps in ([1, 2, 3], [4, 5], [6, 7]):
        with checkpoint.manager(tmp_path, keep=2) as mngr:
            for step in steps:
                checkpoint.save(mngr, step, params, params, {"step": step}, losses[step])
    folders = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())
    assert folders == [2, 6, 7]  # the best (2) and the last two, nothing else on disk

def _damage(run_dir: Path, step: int, how: str) -> Path:
    """Truncate or flip bytes in the middle of the checkpoint's largest params file."""
    files = sorted((p for p in (run_dir / "checkpoints" / str(step) / "params").rglob("*")
                    if p.is_file()), key=lambda p: p.stat().st_size)
    victim = files[-1]  # the largest: the array data
    raw = victim.read_bytes()
    if how == "truncate":
        victim.write_bytes(raw[: len(raw) // 2])
    else:  # flip bytes in the middle, size unchanged
        middle = len(raw) // 2
        victim.write_bytes(raw[:middle] + bytes(b ^ 0xFF for b in raw[middle:middle + 64])
                           + raw[middle + 64:])
    return victim

def _damaged_copy(run_dir: Path, tmp_path: Path, how: str) -> tuple[Path, list[int]]:
    """A copy of the run with its newest checkpoint damaged; its steps, oldest first."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    steps = sorted(checkpoint.manager(copy).all_steps())
    _damage(copy, steps[-1], how)
    return copy, steps

def test_a_run_with_no_usable_checkpoint_is_one_line_for_each_command(trained, tmp_path):
    """Found by a new user: a damaged checkpoint printed a traceback from `generate` and
    `export` (CorruptCheckpointError was not among the errors a command answers in one line)."""
    from inference import cli, export

    cfg, _, _ = trained
    run_dir, steps = _damaged_copy(Path(cfg.run_dir), tmp_path, "flip")
    for step in steps[:-1]:
        _damage(run_dir, step, "flip")
    with pytest.raises(SystemExit) as refused:
        cli.main(["--run-dir", str(run_dir), "--prompt", "a", "--max-new-tokens", "1"])
    assert str(refused.value).startswith("gpt-jax generate: no usable checkpoint in ")
    with pytest.raises(SystemExit) as refused:
        export.main(["--run-dir", str(run_dir), "--out", str(tmp_path / "x.jaxexport"),
                     "--batch", "1", "--prompt-len", "4", "--max-new-tokens", "4"])
    assert str(refused.value).startswith("gpt-jax export: no usable checkpoint in ")


@pytest.mark.parametrize("how, file_digests, found", [
    # The file digests refuse it before Orbax reads a byte.
    ("truncate", True, "is corrupt: its file params/"),
    ("flip", True, "is corrupt: its file params/"),
    # Saved without them (an older version; killed before they were written): a sequential
    # read of every stored value fails before Orbax's concurrent reads start (one failing
    # among them left the others running: "Exception ignored in <coroutine ...>" at exit),
    # or the restored arrays miss their digest.
    ("truncate", False, "cannot be read: its params store: OUT_OF_RANGE: "),
    ("flip", False, "is corrupt: its params do not match the digest saved with them"),
], ids=["truncate", "flip", "truncate-no-file-digests", "flip-no-file-digests"])
def test_damaged_checkpoint_is_reported_and_the_previous_one_used(
        trained, tmp_path, capsys, how, file_digests, found):
    cfg, _, seen = trained
    run_dir, steps = _damaged_copy(Path(cfg.run_dir), tmp_path, how)
    if not file_digests:
        (run_dir / "checkpoints" / str(steps[-1]) / checkpoint.FILE_DIGESTS).unlink()
    config, params, _ = checkpoint.load_params(run_dir)
    out = capsys.readouterr().out
    assert f"checkpoint {run_dir.absolute()}/checkpoints/{steps[-1]} {found}" in out
    assert "trying the previous checkpoint" in out
    assert f"restored checkpoint {run_dir.absolute()}/checkpoints/{steps[-2]} instead" in out
    tokens = jnp.arange(8, dtype=jnp.int32)[None]
    np.testing.assert_array_equal(np.asarray(forward(params, tokens, config)),
                                  np.asarray(forward(seen[steps[-2]], tokens, config)))

@pytest.mark.parametrize("file_digests", [True, False], ids=["file-digests", "no-file-digests"])
def test_a_damaged_checkpoint_leaves_no_read_running_inside_orbax(trained, tmp_path,
                                                                  file_digests):
    """Fault: when one array read of a damaged checkpoint failed, Orbax raised while its
    other reads were still in flight and closed their event loop; they ended later against
    the closed loop ("RuntimeError: Event loop is closed", "Exception ignored in <coroutine
    ...>" at exit). Which read ends first depends on the machine's load, so here every read
    but the first is held back 0.5 s, as a busy machine can do."""
    cfg, _, _ = trained
    run_dir, steps = _damaged_copy(Path(cfg.run_dir), tmp_path, "truncate")
    if not file_digests:  # then a sequential read of every stored value finds the damage
        (run_dir / "checkpoints" / str(steps[-1]) / checkpoint.FILE_DIGESTS).unlink()
    script = f"""
import asyncio, time
from orbax.checkpoint._src.serialization import serialization
from gpt_jax import checkpoint

read_shard, calls = serialization._read_shard, []
async def held_back(*args, **kwargs):
    calls.append(None)
    if len(calls) > 1:
        await asyncio.to_thread(time.sleep, 0.5)
    return await read_shard(*args, **kwargs)
serialization._read_shard = held_back
checkpoint.load_params({str(run_dir)!r})
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"checkpoints/{steps[-2]} instead" in result.stdout
    for symptom in ("Event loop is closed", "Exception ignored", "Task was destroyed",
                    "was never awaited", "Traceback"):
        assert symptom not in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("text, message", [
    ("{}", "GPTConfig fields: missing vocab_size, max_seq_len, n_layers, n_heads, d_model"),
    ('{"vocab_size": 65', "is not valid JSON: Expecting ',' delimiter: line 2 column 1"),
    ("[1, 2]", "expected an object of GPTConfig fields, got [1, 2]"),
    ('{"vocab_size": 9, "max_seq_len": 8, "n_layers": 1, "n_heads": 1, "d_model": 8, '
     '"dmodel": 8}', "GPTConfig fields: unknown dmodel"),
])
def test_a_bad_config_json_is_one_line_naming_the_file(tmp_path, text, message):
    """Fault (a new user's trial): a run directory's config.json of `{}` ended `gpt-jax
    generate` in a TypeError traceback, and invalid JSON in a line without the file."""
    from inference.cli import main

    (tmp_path / "config.json").write_text(text + "\n")
    with pytest.raises(SystemExit) as stop:
        main(["--run-dir", str(tmp_path)])
    path = tmp_path / "config.json"
    assert str(stop.value).startswith((f"gpt-jax generate: {path}: {message}",
                                       f"gpt-jax generate: {path} {message}"))
    assert "\n" not in str(stop.value)


def test_a_hugging_face_config_json_that_is_not_json_names_the_file(tmp_path):
    from inference.cli import main

    (tmp_path / "config.json").write_text("{x")
    with pytest.raises(SystemExit, match=rf"^gpt-jax generate: {tmp_path}/config.json is not "
                                         r"valid JSON: Expecting property name"):
        main(["--hf-checkpoint", str(tmp_path)])
