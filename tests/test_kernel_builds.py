"""The CPU kernels' AVX2 and scalar builds (machines without AVX-512, or without AVX at
all) compute what XLA computes.

This machine's compiler builds for its own CPU (`-march=native`); the older code paths in
the kernels (`#if defined(__AVX512F__) ... #elif defined(__AVX2__) ... #else`) are compiled
by turning the newer instruction sets off on the compiler's command line (`$CXX`, which is
part of each library's cache key). Each build runs the kernels' equality tests in a
subprocess, and its libraries are read back to check the instruction set really was off.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Vector registers that must not appear in a build: AVX-512's zmm, AVX's ymm.
BUILDS = {
    "avx2": ("g++ -mno-avx512f", "zmm"),
    "scalar": ("g++ -mno-avx -mno-avx2 -mno-fma -mno-f16c -mno-avx512f", "ymm"),
}
# One case of each kernel's equality test per tile path: paged decode attention (grouped-
# query, float32 and bfloat16), causal attention forward and backward (grouped-query, T off
# the tiles), int8 matmul (whole tiles with rows and panels left over; a GPT-2 vocabulary),
# the few-rows matmul (inputs off its vectors; several weights over the thread pool, 1 to 8 rows),
# float32 panels (inputs off the vectors, a tile of rows and one left over; several weights).
TESTS = [
    "tests/test_kernel_paged_attention.py::test_kernel_batch_equals_full_attention_row_by_row"
    "[2-float32-64]",
    "tests/test_kernel_paged_attention.py::test_kernel_batch_equals_full_attention_row_by_row"
    "[2-bfloat16-32]",
    "tests/test_kernel_causal_attention.py::test_kernels_equal_attention_forward_and_backward"
    "[2-67-2-64]",
    "tests/test_quantize.py::test_kernel_equals_xla_and_both_stay_within_the_rounding_bound"
    "[17-37-29]",
    "tests/test_quantize.py::test_kernel_equals_xla_and_both_stay_within_the_rounding_bound"
    "[8-96-50257]",
    "tests/test_kernel_few_rows.py::test_kernel_equals_xla_alone_and_vmapped[2-37-29]",
    "tests/test_panels.py::test_float32_panel_kernel_equals_the_exact_product_alone_and_vmapped"
    "[17-96-112]",
    "tests/test_panels.py::test_several_weights_in_one_call_and_xlas_contraction_equal_the_products",
    "tests/test_kernel_few_rows.py::test_several_weights_in_one_call_equal_xla_for_1_to_8_rows",
]


@pytest.mark.parametrize("build", BUILDS)
def test_the_older_instruction_set_builds_equal_xla(build, tmp_path):
    cxx, banned = BUILDS[build]
    env = {**os.environ, "CXX": cxx, "XDG_CACHE_HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", *TESTS], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"{len(TESTS)} passed" in run.stdout, run.stdout[-2000:]
    libraries = sorted((tmp_path / "gpt-jax").glob("*.so"))
    assert {p.name.split("-")[0] for p in libraries} >= {
        "paged_attention", "causal_attention", "panel_matmul"}, libraries
    for library in libraries:
        code = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)],
                              capture_output=True, text=True, check=True).stdout
        assert f"%{banned}" not in code, f"{library.name} ({build}) uses {banned} registers"
