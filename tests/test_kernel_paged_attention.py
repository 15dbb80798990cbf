"""The CPU decode-attention kernel (gpt_jax/kernels/paged_attention.cc): a vmapped batch of rows with
their own lengths and page tables into one shared pool equals full attention row by row
(output and log-sum-exp), it never reads a slot past a row's length nor a page outside its
table, and a kernel that cannot be built leaves the XLA path running, with a warning."""

import os
import stat
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close
from gpt_jax.kernels import paged_attention
from gpt_jax.cache import NO_PAGE

N, S, PAGE = 4, 24, 4  # rows of 24 slots: six pages of 4
PAGES_PER_ROW = 6


def _rows(K, lengths, dtype, H=8, seed=0, heads=N):
    """Queries `[B, K, G, H]` (G = heads / K), each row's slots `[B, K, S, H]` per k and v, and the pools and
    page tables that hold them: row b's pages at shuffled ids of a pool with spare pages.
    Slots past each row's length and every page no row owns hold NaN, which any read of
    them would carry into the output."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    q = rng.normal(size=(B, K, heads // K, H)).astype(np.float32)
    slots = [np.array(jnp.asarray(rng.normal(size=(B, K, S, H)), dtype).astype(jnp.float32))
             for _ in range(2)]
    for x in slots:
        for b, length in enumerate(lengths):
            x[b, :, length:] = np.nan
    num_pages = B * PAGES_PER_ROW + 5
    ids = rng.permutation(num_pages)[: B * PAGES_PER_ROW].reshape(B, PAGES_PER_ROW)
    pools = []
    for x in slots:
        pool = np.full((num_pages, K, PAGE, H), np.nan, np.float32)
        padded = np.pad(x, ((0, 0), (0, 0), (0, PAGES_PER_ROW * PAGE - S), (0, 0)),
                        constant_values=np.nan)
        pool[ids] = padded.reshape(B, K, PAGES_PER_ROW, PAGE, H).transpose(0, 2, 1, 3, 4)
        pools.append(jnp.asarray(pool, dtype))
    table = np.full((B, PAGES_PER_ROW + 2), NO_PAGE, np.int32)  # unused entries at the end
    table[:, :PAGES_PER_ROW] = ids
    return q, slots, pools, table


def _reference(q_KGH, k_KSH, v_KSH, length):
    """Full attention of one row over its first `length` slots, in float64 numpy (zeros for
    none): softmax(q k^T / sqrt(H)) v, and the log of the softmax denominator."""
    H = q_KGH.shape[-1]
    if length == 0:
        return np.zeros(q_KGH.shape), np.full(q_KGH.shape[:2], -1e30)
    scores_KGS = np.einsum("kgh,ksh->kgs", q_KGH, k_KSH[:, :length], dtype=np.float64) / np.sqrt(H)
    top_KG1 = scores_KGS.max(-1, keepdims=True)
    total_KG = np.exp(scores_KGS - top_KG1).sum(-1)
    probs_KGS = np.exp(scores_KGS - top_KG1) / total_KG[..., None]
    return np.einsum("kgs,ksh->kgh", probs_KGS, v_KSH[:, :length]), top_KG1[..., 0] + np.log(total_KG)


@pytest.mark.parametrize("H", [8, 32, 64, 128])  # any head dim; those compiled for registers
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("K", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_kernel_batch_equals_full_attention_row_by_row(K, dtype, H):
    assert paged_attention.available(), "the CPU attention kernel did not build"
    lengths = [0, 1, 3, 4, 5, 21, 23, 24, 25]  # none, page edges, the last slot, past it (all)
    q, (k, v), (k_pool, v_pool), table = _rows(K, lengths, dtype, H)
    run = jax.jit(jax.vmap(paged_attention.paged_decode_attention, in_axes=(0, None, None, 0, 0)))
    out, lse = run(jnp.asarray(q), k_pool, v_pool, table, jnp.asarray(lengths, jnp.int32))
    assert out.dtype == lse.dtype == jnp.float32 and out.shape == q.shape
    for b, length in enumerate(lengths):
        want_out, want_lse = _reference(q[b], k[b], v[b], min(length, S))
        what = f"row {b} (length {length}, {K} kv heads, H {H})"
        assert_close(out[b], want_out, 2e-6, what)
        if length == 0:
            assert (np.asarray(lse[b]) <= -1e29).all(), what  # no slot: the mask value
        else:
            assert_close(lse[b], want_lse, 2e-5, what + " log-sum-exp")


def test_runs_of_heads_that_cross_rows_equal_full_attention():
    """The kernel hands each thread task a run of (row, kv head) items, B * K / 8 of them:
    9 rows of 8 kv heads make runs of 9, so most tasks take the end of one row's heads and
    the start of the next's."""
    lengths = [0, 1, 3, 4, 5, 21, 23, 24, 25]
    q, (k, v), (k_pool, v_pool), table = _rows(8, lengths, jnp.float32, 32, heads=8)
    run = jax.jit(jax.vmap(paged_attention.paged_decode_attention, in_axes=(0, None, None, 0, 0)))
    out, _ = run(jnp.asarray(q), k_pool, v_pool, table, jnp.asarray(lengths, jnp.int32))
    for b, length in enumerate(lengths):
        assert_close(out[b], _reference(q[b], k[b], v[b], min(length, S))[0], 2e-6, f"row {b}")


def test_kernel_runs_one_row_without_vmap():
    assert paged_attention.available()
    q, (k, v), (k_pool, v_pool), table = _rows(2, [13], jnp.float32, 64)
    out, _ = jax.jit(paged_attention.paged_decode_attention)(jnp.asarray(q[0]), k_pool, v_pool,
                                                           table[0], 13)
    assert_close(out, _reference(q[0], k[0], v[0], 13)[0], 2e-6, "one row")


def test_a_kernel_that_does_not_compile_warns_and_is_not_used(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails
    with pytest.warns(RuntimeWarning, match="did not compile .*`false -O3 .* exited with 1"):
        assert paged_attention.available.__wrapped__() is False  # uncached: build again
    built = [p.name for p in (tmp_path / "gpt-jax").iterdir() if p.suffix != ".lock"]
    assert built == []  # no library, whole or partial
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="CPU attention kernel unavailable"):
        assert paged_attention.available.__wrapped__() is False


def test_the_kernel_can_be_switched_off(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("GPT_JAX_CPU_KERNEL", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert paged_attention.available.__wrapped__() is False
    assert not (tmp_path / "gpt-jax").exists()  # nothing built


def _logging_compiler(tmp_path, sleep=0):
    """A `$CXX` that logs each compile to `log` (not `--version` calls), sleeps, then runs g++."""
    log, script = tmp_path / "compiles.log", tmp_path / "cxx"
    script.write_text(f"""#!/bin/sh
[ "$1" = --version ] || {{ echo $$ >> {log}; sleep {sleep}; }}
exec g++ "$@"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), log


def test_concurrent_builds_compile_once_and_all_get_the_library(monkeypatch, tmp_path):
    """Four threads and another process build at once: one compiler run, one library, no
    partial file left (a lock file serializes them)."""
    cxx, log = _logging_compiler(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", cxx)
    other = subprocess.Popen([sys.executable, "-c", "from gpt_jax.kernels import paged_attention as c; "
                              "print(c.build())"], stdout=subprocess.PIPE, text=True,
                             env=os.environ | {"JAX_PLATFORMS": "cpu"})
    paths, errors = [], []

    def one():
        try:
            paths.append(paged_attention.build())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(paths)) == 1
    assert Path(other.communicate(timeout=120)[0].strip()) == paths[0]
    assert len(log.read_text().split()) == 1, "the kernel was compiled more than once"
    leftovers = [p.name for p in paths[0].parent.iterdir() if p.name.endswith(".partial")]
    assert paths[0].exists() and leftovers == []


def test_a_hung_compiler_is_stopped_and_another_compiler_builds_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    slow, _ = _logging_compiler(tmp_path, sleep=30)
    monkeypatch.setenv("CXX", slow)
    with pytest.raises(subprocess.TimeoutExpired):
        paged_attention.build(timeout=1)
    assert not any(p.name.endswith((".so", ".partial")) for p in (tmp_path / "gpt-jax").iterdir())
    assert paged_attention.library_path([slow]) != paged_attention.library_path(["g++"])
    monkeypatch.setenv("CXX", "g++ -DGPT_JAX_OTHER")  # same compiler, other arguments
    assert paged_attention.library_path() != paged_attention.library_path(["g++"])
