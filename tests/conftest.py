import contextlib
import os
import socket
from pathlib import Path

# XLA:CPU compile options for the whole suite (and the subprocesses it starts, which inherit
# the environment), set before JAX starts its backend. The suite's time is mostly XLA
# compiling small programs: LLVM at optimization level 0 and XLA's elemental fusion emitters
# instead of the MLIR fusion emitters halve each compile (a 15 s test ran in 7.5 s) and
# compute the same ops; the tests compare programs compiled alike, or check tolerances.
# `make test` from a cold compile cache on a shared 2-core machine: 1000 s -> 305 s.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


# Both flags are in the locked jaxlib (.ci/constraints.txt; an unknown flag aborts the process).
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # a subprocess has them already
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gpt_jax import GPTConfig, init_params

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_configure(config):
    """JAX's persistent compilation cache, in pytest's cache directory: test modules drop
    their compiled programs (`_drop_compiled_programs`), and the next module that runs the
    same program (the same HLO) loads it from disk instead of compiling it again. A cached
    program is found by a hash of its HLO, compile options and jax version, never by name."""
    directory = config.cache.mkdir("jax-compilation-cache")
    # The `gpt-jax serve` and `generate` processes tests start keep their own cache
    # (`inference.compile_cache`) here too, not in the user's ~/.cache.
    os.environ["GPT_JAX_CACHE"] = str(config.cache.mkdir("gpt-jax-xla"))
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep LONGEST_MODULES first
        config.option.loadscopereorder = False


# The modules that take longest on 2 cores (`--durations`, summed per module), longest first.
# `make test` (--dist loadfile) hands whole modules to its workers in the collected order:
# xdist's own order (most tests first) puts a long module of few tests (tensor-parallel: 9
# tests, one 4-device subprocess) after most others, where it can run on alone at the end.
# The modules of many short tests come after these and fill the gaps.
LONGEST_MODULES = (
    "test_tensor_parallel.py", "test_engine.py", "test_speculative.py", "test_loop.py",
    "test_families.py", "test_structured.py", "test_structured_bpe.py", "test_train.py",
    "test_hf.py", "test_chat.py", "test_quantize.py", "test_compile_cache.py",
    "test_hf_dirs.py", "test_export.py", "test_distributed.py")


def pytest_collection_modifyitems(config, items):
    """The LONGEST_MODULES first, in that order; the rest after them as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@contextlib.contextmanager
def taken_port():
    """A TCP port on 127.0.0.1 (the OS's pick) that a socket listens on until the block ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick)."""
    with taken_port() as port:
        return port


def start_serve(args: list[str], port: int, env: dict | None = None):
    """`gpt-jax serve ARGS --port PORT` as a subprocess on the CPU (with `env` added to the
    environment), returned once it prints that it is ready (asserted, with what it
    printed). The caller ends it (`proc.kill()`)."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt_jax.cli", "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    printed = ""
    for line in proc.stdout:  # until it listens with the model loaded
        printed += line
        if " ready on " in line:
            break
    if " ready on " not in printed:
        proc.kill()
        raise AssertionError(printed)
    return proc


def run_on_host_devices(script, n_devices: int, timeout: float) -> dict:
    """Run the test module `script` as a program on `n_devices` CPU devices (XLA's flag
    must be set before JAX starts, so in a subprocess that shares this session's persistent
    compilation cache) and return the JSON its last printed line holds (asserted to exit 0,
    with its stderr)."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(repo),
           "XLA_FLAGS": f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={n_devices}",
           "JAX_COMPILATION_CACHE_DIR": str(jax.config.jax_compilation_cache_dir or ""),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    out = subprocess.run([sys.executable, str(script)], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def lively_params(config, seed=5, scale=6.0):
    """Random params with weights scaled up (x6), so greedy decoding does not just repeat one
    token and equivalence tests can fail (see shared/cases/generation.md)."""
    params = init_params(config, jax.random.key(seed))
    return jax.tree.map(lambda x: x * scale if x.ndim >= 2 else x, params)


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
    """Drop every compiled program after each test module. XLA:CPU maps each program's code
    into memory; the whole suite's programs kept alive exceeded the kernel's limit on memory
    maps (vm.max_map_count, 65530) and LLVM aborted with "Cannot allocate memory"."""
    yield
    jax.clear_caches()


@pytest.fixture(scope="session")
def config():
    return GPTConfig.preset("tiny")


@pytest.fixture(scope="session")
def params(config):
    return lively_params(config)


def assert_close(actual, expected, atol, what="values"):
    """NaN-safe: a NaN or inf anywhere fails, it never vanishes inside max()."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert np.isfinite(actual).all(), f"non-finite {what}"
    assert np.isfinite(expected).all(), f"non-finite reference {what}"
    diff = np.abs(actual - expected).max(initial=0.0)
    assert diff <= atol, f"{what} differ by {diff:.3g} > {atol}"


def assert_lively(tokens, minimum=5):
    assert len(set(tokens)) >= minimum, f"reference output too repetitive to test: {tokens}"


@pytest.fixture(params=["cpu_kernel", "xla"])
def decode_attention(request, monkeypatch):
    """Run a test through both decode-attention paths: the CPU kernel (what CPUs run) and
    XLA's (what GPUs and TPUs run). The choice is made when a program is traced, so tests
    with this fixture jit fresh functions (jit caches are shared between `jax.jit` wrappers
    of one function)."""
    from gpt_jax.kernels import paged_attention

    if request.param == "xla":
        monkeypatch.setattr(paged_attention, "available", lambda: False)
    else:
        assert paged_attention.available(), "the CPU attention kernel did not build"
    return request.param


# A training corpus and one trained run, shared by the training and checkpoint tests.
WORDS = ("the king queen lord speaks night day love death sword crown heart blood gentle "
         "sweet noble fair good my thy and of to in what how now").split()


def synthetic_corpus(n_lines=1500, seed=0) -> str:
    """Sentences of random words: characters are far from uniform, words are learnable."""
    rng = np.random.default_rng(seed)
    lines = [" ".join(rng.choice(WORDS, rng.integers(4, 9))).capitalize() + "."
             for _ in range(n_lines)]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "words.txt"
    path.write_text(synthetic_corpus())
    return path


@pytest.fixture(scope="session")
def trained(corpus, tmp_path_factory):
    """One 300-step tiny run; the params at each evaluation are kept."""
    from training import train as T
    from training.config import TrainConfig

    cfg = TrainConfig.preset("tiny", text=str(corpus), keep_checkpoints=2,
                               run_dir=str(tmp_path_factory.mktemp("run") / "tiny"))
    seen = {}
    # The next step donates the params' buffers: keep host copies.
    summary = T.train(cfg, on_eval=lambda step, params: seen.update({step: jax.device_get(params)}))
    return cfg, summary, seen
