"""`make device-check`: the project on an NVIDIA GPU, in one command.

On a machine with an NVIDIA GPU (`nvidia-smi -L` lists one, or /dev/nvidia0 exists): set up
`.venv` as `make test` does (from the lock), install the CUDA build of jax into it
(`jax[cuda12]`, as jax documents, at the locked jax version), run the invariant tests that
matter on the GPU (`INVARIANTS`: cached = naive, batched = solo, HF parity, engine equals
generate), then `gpt-jax bench throughput` (gpt2, batch 1/8/32) and `gpt-jax bench serving
decode-step`, and write one JSON, `runs/device-check.json` (its schema: README, "Running on
a GPU"). Exits 0 when every test passed and both benchmarks ran.

Without a GPU it installs nothing: one line saying no GPU was found, exit 1.

This file runs with any Python 3 (the standard library only): it is started before the
venv exists.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"
OUT = ROOT / "runs" / "device-check.json"
RESULTS = ROOT / "benchmarks" / "results"
INVARIANTS = [  # pytest node ids
    "tests/test_generate.py::test_greedy_generate_equals_naive",
    "tests/test_generate.py::test_paged_decode_loop_equals_naive_across_many_pages",
    "tests/test_generate.py::test_batch_rows_equal_solo_runs",
    "tests/test_generate.py::test_sampled_batch_rows_equal_solo_runs",
    "tests/test_hf.py::test_logits_match_transformers",
    "tests/test_hf.py::test_greedy_generation_matches_transformers_and_batching",
    "tests/test_engine.py::test_requests_joining_at_random_steps_equal_each_request_alone",
    "tests/test_engine.py::test_a_small_page_pool_preempts_and_changes_no_output",
    "tests/test_engine.py::test_prefix_caching_shares_pages_and_changes_no_output",
    "tests/test_engine.py::test_chunked_prefill_equals_one_prefill",
]
# name: (the gpt-jax bench arguments, the result files it writes under benchmarks/results)
BENCHMARKS = {
    "throughput": (["throughput", "--presets", "gpt2", "--batches", "1", "8", "32",
                    "--new-tokens", "128", "--no-hf", "--tag=-device-check"],
                   "throughput-device-check"),
    "serving_decode_step": (["serving", "decode-step", "--preset", "gpt2"],
                            "serving-decode-step"),
}
# The GPU's float32 matmuls in full float32 (jax's GPU default is TF32, whose rounding the
# tests' float32 tolerances do not allow: the invariants, not TF32, are what is checked).
GPU_ENV = {"JAX_PLATFORMS": "cuda", "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
TRANSFORMERS = ("not run: `bench throughput` runs transformers on the CPU only (the lock's "
                "torch is the CPU build), so its figures would not be the same GPU's")


def gpus() -> list[str]:
    """The NVIDIA GPUs this machine shows (`nvidia-smi -L` lines), or ["/dev/nvidia0"] when
    only the device file is there; empty when there is none."""
    if shutil.which("nvidia-smi"):
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        lines = [line for line in listed.stdout.splitlines() if line.startswith("GPU")]
        if listed.returncode == 0 and lines:
            return lines
    return ["/dev/nvidia0"] if Path("/dev/nvidia0").exists() else []


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    """Run a step from the repository root, its output shown as it goes."""
    print("device-check:", " ".join(map(str, command)), flush=True)
    return subprocess.run(command, cwd=ROOT, **kwargs)


def install() -> None:
    """`.venv` as `make test` makes it, then the CUDA build of jax at the locked version."""
    run(["make", "-s", ".venv/.test-installed"], check=True)
    run([PY, "-m", "pip", "install", "-q", "-c", ".ci/constraints.txt", "jax[cuda12]"],
        check=True)


def gpu_devices() -> list[str]:
    """jax's devices under JAX_PLATFORMS=cuda (it fails rather than fall back to the CPU)."""
    code = "import jax; print('\\n'.join(str(d) for d in jax.devices()))"
    done = run([PY, "-c", code], env={**os.environ, **GPU_ENV}, capture_output=True,
               text=True, check=True)
    return done.stdout.split("\n")[:-1]


def invariant_tests(report: Path) -> dict:
    """The INVARIANTS on the GPU: counts and each test's outcome."""
    run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
         *INVARIANTS], env={**os.environ, **GPU_ENV})
    cases = []
    for case in ET.parse(report).iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        skipped = case.find("skipped") is not None
        cases.append({"id": f"{case.get('classname')}::{case.get('name')}",
                      "outcome": "failed" if failed else "skipped" if skipped else "passed",
                      "seconds": float(case.get("time", 0))})
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    return {**counts, "cases": cases}


def benchmark(args: list[str], name: str) -> dict:
    """One `gpt-jax bench` run on the GPU; its result JSON (the committed CPU figures under
    benchmarks/results are put back as they were)."""
    files = [RESULTS / f"{name}.{ext}" for ext in ("json", "png")]
    kept = {f: f.read_bytes() for f in files if f.exists()}
    try:
        done = run([PY, "-m", "gpt_jax.cli", "bench", *args], env={**os.environ, **GPU_ENV})
        if done.returncode:
            return {"error": f"gpt-jax bench {' '.join(args)} exited {done.returncode}"}
        return json.loads(files[0].read_text())
    finally:
        for f in files:
            f.unlink(missing_ok=True)
            if f in kept:
                f.write_bytes(kept[f])


def main() -> int:
    found = gpus()
    if not found:
        print("device-check: no NVIDIA GPU found (nvidia-smi lists none and there is no "
              "/dev/nvidia0); it runs only on a machine with one", file=sys.stderr)
        return 1
    started = time.time()
    install()
    record = {"gpus": found, "jax_devices": gpu_devices(), "env": GPU_ENV}
    record["tests"] = invariant_tests(ROOT / "runs" / "device-check-tests.xml")
    for key, (args, name) in BENCHMARKS.items():
        record[key] = benchmark(args, name)
    record["transformers"] = TRANSFORMERS
    record["ok"] = (record["tests"]["failed"] == 0 and record["tests"]["passed"] > 0
                    and not any("error" in record[k] for k in BENCHMARKS))
    record["seconds"] = round(time.time() - started, 1)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(record, indent=1))
    print(f"device-check: wrote {OUT.relative_to(ROOT)}; tests {record['tests']['passed']} "
          f"passed, {record['tests']['failed']} failed; {'ok' if record['ok'] else 'NOT ok'}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
