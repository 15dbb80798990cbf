"""`make device-check` on a machine without an NVIDIA GPU: it installs nothing and fails in
one line saying so (never a silent run on the CPU)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NO_GPU = ("device-check: no NVIDIA GPU found (nvidia-smi lists none and there is no "
          "/dev/nvidia0); it runs only on a machine with one\n")
has_gpu = pytest.mark.skipif(
    Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") is not None,
    reason="this machine has an NVIDIA GPU: device-check would run")


@has_gpu
def test_without_a_gpu_the_script_says_so_in_one_line_and_installs_nothing(tmp_path):
    done = subprocess.run([sys.executable, str(REPO / ".ci" / "device_check.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", NO_GPU)


@has_gpu
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_device_check_fails_without_a_gpu():
    venv = {p: p.stat().st_mtime_ns for p in (REPO / ".venv").glob(".*-installed")}
    done = subprocess.run(["make", "-s", "device-check"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0 and done.stdout == ""
    assert done.stderr.startswith(NO_GPU) and "Traceback" not in done.stderr
    assert {p: p.stat().st_mtime_ns for p in (REPO / ".venv").glob(".*-installed")} == venv
