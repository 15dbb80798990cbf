"""The persistent compilation cache (`inference.compile_cache`): a second `gpt-jax serve` start
loads every program instead of compiling it, and a broken entry is compiled again, with a
warning, never a crash, and replaced."""

import logging
import os
import re
import signal
import subprocess
import sys
import warnings

import httpx2 as httpx
import jax
import pytest

from conftest import free_port
from inference import compile_cache
from live_server import save_run

LOADED = re.compile(r"(\d+) programs loaded from cache, (\d+) compiled in")


def serve_once(run_dir, cache, prompt="ABC"):
    """Start `gpt-jax serve` with the compilation cache in `cache`, answer one completion,
    read /metrics, stop it. Returns (what it printed, the text, the metrics text)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpt_jax.cli", "serve", "--run-dir", str(run_dir), "--port",
         str(port), "--max-slots", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu", compile_cache.ENV: str(cache)})
    base = f"http://127.0.0.1:{port}"
    try:
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if " ready on " in line or "failed to load" in line:
                break
        printed = "".join(printed)
        assert " ready on " in printed, printed
        body = {"model": "run", "prompt": prompt, "max_tokens": 20, "temperature": 0}
        text = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()[
            "choices"][0]["text"]
        metrics = httpx.get(f"{base}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        return printed, text, metrics
    finally:
        if proc.poll() is None:
            proc.kill()


def counted(printed: str) -> tuple[int, int]:
    found = LOADED.search(printed)
    assert found, printed
    return int(found.group(1)), int(found.group(2))


def metric(metrics: str, name: str) -> float:
    return float(re.search(rf"^gpt_jax:{name} (\S+)$", metrics, re.M).group(1))


def test_a_second_serve_start_loads_every_program_and_compiles_nothing(tmp_path, config,
                                                                      params):
    run_dir = save_run(tmp_path / "run", config, params)
    cache = tmp_path / "xla"
    printed, text, metrics = serve_once(run_dir, cache)
    loaded, compiled = counted(printed)
    assert (loaded, compiled > 0) == (0, True)
    assert metric(metrics, "xla_programs_loaded") == 0

    # the second start: every program of the warmup, the load and the request from disk
    printed, again, metrics = serve_once(run_dir, cache)
    assert counted(printed) == (compiled, 0)
    read = re.search(r"\((\d+) exported programs read, 0 written\)", printed)
    assert read and int(read.group(1)) > 0, printed  # the engine's Python not traced again
    assert metric(metrics, "xla_programs_compiled") == 0  # the whole process, request included
    assert metric(metrics, "xla_programs_loaded") >= compiled
    assert again == text  # the CPU kernels run from a loaded program too


# One program in a process of its own, with the cache in argv[1]; prints what it counted.
ONE_PROGRAM = """
import sys, warnings
import numpy as np
warnings.simplefilter("always")
from inference import compile_cache
compile_cache.enable(sys.argv[1])
import jax
print(jax.jit(lambda x: x * 2 + 1)(np.arange(4, dtype=np.float32)).tolist())
print(compile_cache.programs())
"""


def run_one_program(cache):
    done = subprocess.run([sys.executable, "-c", ONE_PROGRAM, str(cache)], text=True,
                          capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[1.0, 3.0, 5.0, 7.0]" in done.stdout
    return done.stdout + done.stderr


def test_a_truncated_entry_is_compiled_again_with_a_warning_and_replaced(tmp_path):
    """JAX alone warns and compiles a broken entry at every start (it never replaces it)."""
    assert "Programs(compiled=1, loaded=0)" in run_one_program(tmp_path)
    [entry] = tmp_path.glob("*/*-cache")
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # a killed writer
    printed = run_one_program(tmp_path)
    assert f"compilation cache entry {entry} is broken" in printed
    assert "Programs(compiled=1, loaded=0)" in printed and "Traceback" not in printed
    # written anew, whole: the next start loads it
    assert entry.exists() and compile_cache.discard_corrupt(entry.parent) == []


def test_the_cache_directory_names_what_jax_key_leaves_out(tmp_path, monkeypatch):
    """The jax version, the kernels' source and the CPU are in the directory's name: a
    changed kernel source finds another directory."""
    first = compile_cache.key_dir(tmp_path)
    assert first.parent == tmp_path and first == compile_cache.key_dir(tmp_path)
    monkeypatch.setattr(compile_cache.builder, "cpu_id", lambda: "another CPU")
    assert compile_cache.key_dir(tmp_path) != first


def test_an_entry_that_does_not_decompress_is_removed_with_a_warning_once(tmp_path):
    good = tmp_path / "jit_f-1-cache"
    good.write_bytes(compile_cache.compilation_cache.compress_executable(b"\0" * 4 + b"exe"))
    bad = tmp_path / "jit_g-2-cache"
    bad.write_bytes(b"not compressed")
    with pytest.warns(UserWarning, match="jit_g-2-cache is broken"):
        assert compile_cache.discard_corrupt(tmp_path) == ["jit_g-2-cache"]
    assert good.exists() and not bad.exists()
    bad.write_bytes(b"not compressed either")  # written after the check: read next time
    os.utime(bad, (0, 0))  # ... unless older than the check
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert compile_cache.discard_corrupt(tmp_path) == []


def run(engine, stagger=False):
    """Two requests through `engine` (`stagger`: the second added once the first decodes):
    each one's tokens, log-probs and finish reason."""
    from inference import SamplingParams

    sampling = SamplingParams(max_new_tokens=12, temperature=0.8, seed=3, logprobs=2)
    for i, prompt in enumerate([[1, 2, 3], [9, 8, 7, 6, 5, 4, 3]]):
        engine.add_request(str(i), prompt, sampling)
        for _ in range(2 if stagger and i == 0 else 0):  # its prefill, then a decode chunk
            engine.step()
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    return {k: (o.token_ids, o.logprobs, o.finish_reason) for k, o in done.items()}


def test_exported_programs_give_the_jitted_engine_s_tokens_and_load_on_a_second_start(
        tmp_path, config, params):
    """`inference.exported`: the engine's programs exported (the CPU kernel kept) give the
    tokens the jitted ones give; a second engine loads every artifact and exports none; a
    truncated artifact is exported again with a warning."""
    from inference import Engine, exported

    expected = run(Engine(params, config, max_slots=2))
    first = Engine(params, config, max_slots=2)
    programs = exported.attach(first, tmp_path)
    assert run(first) == expected
    assert programs.exported >= 2 and programs.loaded == 0

    second = Engine(params, config, max_slots=2)
    again = exported.attach(second, tmp_path)
    assert run(second) == expected
    assert (again.loaded, again.exported) == (programs.exported, 0)

    artifact = next(tmp_path.glob("*.jaxexport"))
    artifact.write_bytes(artifact.read_bytes()[:100])
    third = Engine(params, config, max_slots=2)
    last = exported.attach(third, tmp_path)
    with pytest.warns(UserWarning, match=f"exported program {artifact} is broken"):
        assert run(third) == expected
    assert (last.loaded, last.exported) == (programs.exported - 1, 1)


def test_an_exported_engine_s_warmup_compiles_without_running_and_serving_lowers_nothing(
        tmp_path, config, params, caplog):
    """`warmup.compile_all` on exported programs: each listed program is compiled (in a
    thread pool), none run (the engine's state is the same object: a run donates it), and
    requests afterwards (seeded sampling with log-probs) compile nothing, neither an
    exported program nor their host arrays' staging, with the jitted engine's tokens."""
    from inference import Engine, exported, warmup

    sizes = {"max_slots": 2, "max_prefill_tokens": 16, "prefill_chunk_tokens": 16}
    engine = Engine(params, config, **sizes)
    store = exported.attach(engine, tmp_path)
    state = engine.state  # committed by attach
    engine.warmup()
    assert engine.state is state
    assert len(store.programs) == len(warmup.programs(engine)) == 3  # prefill 1x16, decode 1, 2
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        served = run(engine)
    assert not [r.getMessage()[:40] for r in caplog.records
                if r.getMessage().startswith("Compiling ")]
    assert served == run(Engine(params, config, **sizes))


def test_an_exported_engine_with_mixed_steps_gives_the_jitted_engine_s_tokens(
        tmp_path, config, params):
    """`serve --mixed-steps` attaches exported programs too: warmup exports every listed
    program (the mixed chunk's decode rows `n_rows` are static, as the decode chunk's), and
    a prompt arriving while another decodes runs a mixed step with the jitted engine's
    tokens."""
    from inference import Engine, exported, warmup

    sizes = {"max_slots": 2, "max_prefill_tokens": 16, "prefill_chunk_tokens": 16,
             "mixed_steps": True}
    engine = Engine(params, config, **sizes)
    store = exported.attach(engine, tmp_path)
    engine.warmup()
    assert len(store.programs) == len(warmup.programs(engine))
    mixed, calls = engine.mixed_program, []
    engine.mixed_program = lambda *args, **kwargs: calls.append(1) or mixed(*args, **kwargs)
    assert run(engine, stagger=True) == run(Engine(params, config, **sizes), stagger=True)
    assert calls
