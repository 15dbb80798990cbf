"""The package as a user installs it: a wheel built from this tree, installed with its
dependencies taken from the test environment into a fresh venv outside the checkout, trains
a step and runs `gpt-jax generate`, and both CPU attention kernels (paged decode and causal
training attention) compile from the sources the wheel ships (package data). A source left
out of the wheel shows as a missing kernel library."""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ("pyproject.toml", "README.md", "gpt_jax", "inference", "training")  # what a wheel needs
KERNELS = ("paged_attention", "causal_attention")  # the kernels these two commands build


def _run(command, **kwargs):
    """`command` run to completion; its output in the failure message."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, **kwargs)
    assert done.returncode == 0, \
        f"{command} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`(python, env, home)`: a fresh venv holding the wheel, an environment with PYTHONPATH
    unset and HOME (so the kernel cache) in a temporary directory."""
    tmp = tmp_path_factory.mktemp("wheel")
    # PYTHONPATH unset for pip too: on a path holding the checkout (and its egg-info from an
    # editable install), pip takes gpt-jax as installed already and skips the wheel.
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "XDG_CACHE_HOME", "GPT_JAX_CPU_KERNEL")}
    source = tmp / "source"  # a copy, so the build writes nothing into the checkout
    source.mkdir()
    for name in SHIPPED:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", str(tmp / "dist"), str(source)], cwd=tmp, env=env)
    wheel, = (tmp / "dist").glob("gpt_jax-*.whl")
    env_dir = tmp / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=tmp, env=env)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"]).stdout.strip())
    # The dependencies (jax, flax, ...) from this environment: a path in a .pth file is
    # appended to sys.path after the venv's own packages (this environment's editable
    # install of the checkout is a .pth of its own there, which is not read).
    paths = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    (site / "test_dependencies.pth").write_text("\n".join(sorted(paths)) + "\n")
    home = tmp / "home"
    home.mkdir()
    env.update(HOME=str(home), PATH=f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}")
    return python, env, home


def test_installed_wheel_trains_generates_and_builds_both_kernels(installed, tmp_path):
    python, env, home = installed
    where = _run([str(python), "-c", "import gpt_jax; print(gpt_jax.__file__)"], env=env,
                 cwd=tmp_path).stdout
    assert str(python.parent.parent) in where and str(ROOT) not in where, where
    (tmp_path / "corpus.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    # shakespeare-char: its head dim (32) is one the causal-attention kernel is built for.
    train = _run(["gpt-jax", "train", "--preset", "tiny", "--model", "shakespeare-char",
                  "--text", "corpus.txt", "--run-dir", "run", "--max-steps", "1",
                  "--eval-interval", "1", "--steps-per-call", "1", "--eval-batches", "1",
                  "--batch-size", "2", "--block-size", "16", "--cpu-devices", "1",
                  "--peak-flops", "1e12"],
                 env=env, cwd=tmp_path)
    out = _run(["gpt-jax", "generate", "--run-dir", "run", "--prompt", "To be",
                "--max-new-tokens", "4", "--temperature", "0", "--json"],
               env=env, cwd=tmp_path)
    assert '"tokens"' in out.stdout, out.stdout
    for done in (train, out):  # a kernel that cannot be built warns and XLA's path runs
        assert "gpt-jax CPU" not in done.stderr, done.stderr
    built = {path.name.split("-")[0] for path in (home / ".cache" / "gpt-jax").glob("*.so")}
    assert set(KERNELS) <= built, f"kernel libraries built from the wheel: {sorted(built)}"
