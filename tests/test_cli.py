"""The `gpt-jax` command's own dispatch (each subcommand's flags are tested with it)."""

import sys

from gpt_jax import cli


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
