"""The `gpt-jax` command's own dispatch (each subcommand's flags are tested with it)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gpt_jax import cli
from training import train as T


def test_bench_help_lists_the_benchmarks(capsys, monkeypatch):
    """Fault (found by a new user): `gpt-jax bench --help` was an error (status 2)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gpt-jax bench NAME [flags]; NAME one of throughput, ")
    assert all(name in out for name in ("int8_matmul", "train_vs_nanogpt", "export_cost"))


def test_a_benchmark_without_torch_says_what_to_install(capsys, monkeypatch):
    """Fault (found by a new user): after `make demo` (no torch), `gpt-jax bench throughput`
    ended in a ModuleNotFoundError traceback. Now one line, with the way round it."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as if absent
    assert cli.main(["bench", "throughput", "--presets", "gpt2", "--rounds", "1"]) == 1
    assert capsys.readouterr().err == (
        "gpt-jax bench throughput: needs torch, which `make test` installs (or `pip install "
        "torch==2.13.0 transformers`, torch first); or pass --no-hf to leave transformers "
        "out\n")


def test_a_benchmark_that_needs_an_extra_names_it_before_it_runs(capsys, monkeypatch):
    """Fault (issue 41): `gpt-jax bench serve` failed on the `make test` venv, deep in the
    `transformers serve` it starts, which needs accelerate (the `bench` extra, which no
    target installs). Now one line naming the extra, before anything runs; without the
    transformers server it needs nothing more."""
    import runpy

    ran = []
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setitem(sys.modules, "accelerate", None)  # as if not installed
    monkeypatch.setattr(runpy, "run_path", lambda path, run_name: ran.append(Path(path).name))
    assert cli.main(["bench", "serve", "--requests", "8"]) == 1
    assert capsys.readouterr().err == (
        "gpt-jax bench serve: needs accelerate, the `bench` extra: `pip install -e "
        "'.[bench]'` in the checkout; or pass --servers gpt-jax to leave transformers out\n")
    assert ran == []
    assert cli.main(["bench", "serve", "--servers", "gpt-jax"]) == 0 and ran == ["serve.py"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a glibc tunable")
def test_training_restarts_itself_with_huge_pages_once(tmp_path):
    (tmp_path / "probe_env.py").write_text(
        "import os, sys; print(os.environ['GLIBC_TUNABLES'], sys.argv[1:])")
    code = ("from training.process import restart_with_huge_pages as r; "
            "r('probe_env', ['--max-steps', '3']); print('not restarted')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(T.__file__).parents[1]),
                                                        str(tmp_path)])}

    def run(tunables):
        return subprocess.run([sys.executable, "-c", code], env={**env, "GLIBC_TUNABLES": tunables},
                              capture_output=True, text=True, timeout=60).stdout.strip()

    # the same process, restarted as `python -m MODULE ARGS` with the tunable added to the rest
    assert run("glibc.pthread.rseq=1") == \
        "glibc.pthread.rseq=1:glibc.malloc.hugetlb=1 ['--max-steps', '3']"
    assert run("") == "glibc.malloc.hugetlb=1 ['--max-steps', '3']"
    assert run("glibc.malloc.hugetlb=0") == "not restarted"  # the user's setting stands


@pytest.mark.parametrize("command", ["generate", "serve", "export"])
def test_run_dir_and_hf_checkpoint_together_are_refused(command, tmp_path, capsys):
    """Fault (a new user's trial): `generate --run-dir A --hf-checkpoint B` silently took B.
    Every command taking both refuses them together (the default --run-dir spelt out too)."""
    from gpt_jax.cli import main

    with pytest.raises(SystemExit) as stop:
        main([command, "--run-dir", "runs/shakespeare-char", "--hf-checkpoint", str(tmp_path)])
    assert stop.value.code == 2
    assert "argument --hf-checkpoint: not allowed with argument --run-dir" in \
        capsys.readouterr().err


def test_every_benchmark_help_names_the_command(capsys, monkeypatch):
    """Fault (a new user's trial): `gpt-jax bench export_cost --help` said `usage:
    export_cost.py` (runpy sets sys.argv[0] to the script's path)."""
    monkeypatch.syspath_prepend(str(Path(cli.__file__).resolve().parent.parent / "benchmarks"))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    from bench import benchmark_names

    for name in benchmark_names():
        with pytest.raises(SystemExit) as stop:
            cli.main(["bench", name, "--help"])
        assert stop.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: gpt-jax bench {name} "), name


def test_data_help_prints_help_and_downloads_nothing(capsys, monkeypatch):
    """Fault (a new user's trial): `gpt-jax data --help` ran the download."""
    from training import data

    monkeypatch.setattr(data, "shakespeare_plays", lambda: pytest.fail("it ran"))
    with pytest.raises(SystemExit) as stop:
        cli.main(["data", "--help"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.startswith("usage: gpt-jax data [-h]\n")


def test_version_and_serve_help(capsys):
    """A new user's trial: `gpt-jax --version` was an unknown command, and `serve --help`
    showed the server module's developer notes and no defaults."""
    from importlib.metadata import version

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"gpt-jax {version('gpt-jax')}\n"
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("usage: gpt-jax serve ")
    assert "An OpenAI-compatible HTTP server for a trained run" in out
    for default in ("--port PORT port to listen on (default: 8000)",
                    "--max-slots MAX_SLOTS samples decoded at once (they share the page pool) "
                    "(default: 64)",
                    "(default: runs/shakespeare- char)", "(default: 30.0)"):
        assert default in out, default
    assert "engine_loop" not in out and "This file is the app" not in out


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_missing_run_directory_says_how_to_make_one(command, tmp_path):
    """Fault (a new user before `make demo`): `gpt-jax generate --prompt hi` said only
    `runs/shakespeare-char is not a run directory: .../config.json does not exist`."""
    run = tmp_path / "none"
    argv = {"generate": ["--prompt", "hi"], "chat": []}[command]
    with pytest.raises(SystemExit) as raised:
        cli.main([command, "--run-dir", str(run), *argv])
    assert str(raised.value.code) == (
        f"gpt-jax {command}: {run} is not a run directory: {run / 'config.json'} does not "
        f"exist (`gpt-jax train --run-dir {run}` trains one; `make demo` trains "
        "runs/shakespeare-char)")
