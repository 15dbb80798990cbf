"""Tensor-parallel inference (`gpt_jax.tensor_parallel`) on 2 and 4 host CPU devices: a
GPT-2-shaped and a Llama-style (grouped-query) random model give the same tokens as on one
device, through `generate` and through the `Engine` (continuous batching, prefix caching,
preemption, n = 2; greedy and seeded sampling), logits within 1e-5; each device holds 1/n
of the KV pools; the compiled decode program all-reduces activations and gathers no weight.

XLA reads --xla_force_host_platform_device_count when JAX starts, so one subprocess (this
file run as a script) computes every result and prints them as JSON; the tests check them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_hf_dirs import hf_dir  # noqa: F401 (a fixture)

REPO = Path(__file__).resolve().parents[1]
N_DEVICES = 4


@pytest.fixture(scope="module")
def results():
    import jax

    from conftest import TEST_XLA_FLAGS

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO),
           "XLA_FLAGS": f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={N_DEVICES}",
           # the session's persistent compilation cache (conftest.pytest_configure)
           "JAX_COMPILATION_CACHE_DIR": str(jax.config.jax_compilation_cache_dir or ""),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    out = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["gpt2", "llama"])
@pytest.mark.parametrize("n", [2, 4])
def test_generate_and_engine_equal_one_device(results, model, n):
    one, split = results[model]["1"], results[model][str(n)]
    assert len(set(one["generate"][0])) >= 5  # lively: a mismatch would show
    assert split["generate"] == one["generate"]
    assert split["engine"] == one["engine"]
    assert split["logit_diff"] <= 1e-5
    assert one["preemptions"] > 0 and one["prefix_cache_hits"] > 0  # the paths were taken
    assert split["mesh"]["devices"] == n and split["mesh"]["axes"] == {"model": n}


def test_int8_weights_shard_the_same_way(results):
    assert len(set(results["int8"]["1"][0])) >= 5
    assert results["int8"]["2"] == results["int8"]["1"]


def test_kv_heads_that_do_not_divide_the_mesh_are_replicated(results):
    # tiny-llama has 2 kv heads: over 4 devices each holds a copy of the one its queries read
    assert results["llama"]["4"]["mesh"]["kv_heads_per_device"] == 1
    assert results["llama"]["2"]["mesh"]["kv_heads_per_device"] == 1
    assert results["gpt2"]["4"]["mesh"]["kv_heads_per_device"] == 1
    assert results["bad_mesh"].startswith("tensor parallelism over 3 devices needs n_heads=4")


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_each_device_holds_its_share_of_the_kv_pools(results, model):
    one, two = results[model]["1"], results[model]["2"]
    assert two["pool_shard_bytes"] * 2 == one["pool_shard_bytes"]
    assert two["mesh"]["kv_cache_bytes_per_device"] * 2 == one["mesh"]["kv_cache_bytes_per_device"]
    assert two["mesh"]["kv_cache_bytes_per_device"] == two["pool_shard_bytes"] * two["pools"]


def test_the_decode_program_all_reduces_activations_and_gathers_no_weight(results):
    hlo = results["hlo"]
    assert hlo["all-gather"] == [] and hlo["all-to-all"] == []
    # two [rows, 1, D] all-reduces per layer per step (tiny-llama: 2 layers, D 32; 2 rows);
    # the embeddings and output projection are replicated, so no logits move
    assert hlo["all-reduce"] == ["f32[2,1,32]"] * 4
    assert hlo["kernels"]["gpt_jax_paged_decode_attention"] == 2  # per layer, per shard


def test_serve_tensor_parallel_answers_as_one_device_and_reports_its_mesh(hf_dir):
    """`gpt-jax serve --tensor-parallel 2` (a subprocess; the CPU host split into 2 devices):
    a greedy completion is the one-device `LLM.from_pretrained` text, and /metrics reports
    the mesh and half the KV pool bytes per device (2 kv heads, one per device)."""
    import httpx2 as httpx
    from prometheus_client.utils import floatToGoString

    from conftest import free_port, start_serve
    from inference import LLM, SamplingParams
    from test_hf_dirs import NEW_TOKENS, TEXTS

    path, _ = hf_dir
    port = free_port()
    proc = start_serve(["--hf-checkpoint", str(path), "--max-slots", "2", "--no-warmup",
                        "--tensor-parallel", "2"], port)
    try:
        body = {"model": path.name, "prompt": TEXTS[0], "max_tokens": NEW_TOKENS,
                "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        llm = LLM.from_pretrained(path)
        (expected,) = llm.generate([TEXTS[0]], SamplingParams(temperature=0.0,
                                                              max_new_tokens=NEW_TOKENS),
                                   progress=False)
        assert r.json()["choices"][0]["text"] == expected.text
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        one = llm.engine(2).stats()["mesh"]["kv_cache_bytes_per_device"]
        for line in ('gpt_jax:mesh_axis_size{axis="model"} 2.0', "gpt_jax:mesh_devices 2.0",
                     f"gpt_jax:kv_cache_bytes_per_device {floatToGoString(one // 2)}"):
            assert line in metrics, metrics
    finally:
        proc.kill()
        proc.wait(timeout=30)


# ---------------------------------------------------------------- the subprocess


def _collectives(hlo: str) -> dict:
    import collections
    import re

    found = collections.defaultdict(list)
    for shape, op in re.findall(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute)"
                                r"(?:-start)?\(", hlo):
        found[op].append(re.sub(r"\{[^}]*\}", "", shape))
    found["kernels"] = dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo)))
    return {op: found.get(op, []) for op in ("all-gather", "all-reduce", "all-to-all",
                                              "kernels")}


def _decode_hlo(engine) -> dict:
    import jax.numpy as jnp

    from inference.batching import engine_decode

    rows, stops = engine._row_arrays()
    with engine.on_mesh():
        lowered = engine_decode.lower(
            engine.params, engine.config, engine.state, engine._page_table(),
            jnp.zeros((engine.max_slots,), bool), rows, stops, jnp.zeros((0,), jnp.int32),
            n_rows=engine.max_slots, pad_id=0)
    return _collectives(lowered.compile().as_text())


def _logits(params, config, mesh):
    """Prefill logits `[2, V]` of two prompts, on `mesh` (None: one device)."""
    import contextlib

    import jax
    import numpy as np

    from gpt_jax import init_cache, tensor_parallel
    from gpt_jax.params import inference_params
    from inference import prefill

    params = inference_params(params, config)
    if mesh is not None:
        params, config = tensor_parallel.shard_params(params, config, mesh)
    cache = init_cache(config, 2, 32, page_size=8)
    tokens = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]], np.int32)
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        if mesh is not None:
            cache = tensor_parallel.replicate(cache, mesh)
        return np.asarray(prefill(params, config, tokens, np.array([6, 3], np.int32), cache)[0])


def _engine_requests():
    """Greedy and seeded requests, one with n = 2, two sharing two pages of prompt: on a
    pool of 8 pages of 4 slots for 2 slots some are preempted."""
    from inference import SamplingParams

    shared = [5, 9, 2, 7, 1, 3, 8, 6]
    specs = [([1, 2, 3], dict(temperature=0.0)),
             ([4, 5, 6, 7, 8], dict(temperature=0.9, top_k=20, seed=1, n=2)),
             (shared + [11], dict(temperature=0.0)),
             (shared + [12, 13], dict(temperature=1.0, seed=2)),
             ([9, 10], dict(temperature=0.7, top_p=0.9, seed=3)),
             ([14, 15, 16, 17], dict(temperature=0.0))]
    return [(f"r{i}", prompt, SamplingParams(max_new_tokens=18, **sp))
            for i, (prompt, sp) in enumerate(specs)]


def _engine_run(params, config, mesh, requests):
    import numpy as np

    from inference import Engine
    from test_engine import run_engine

    engine = Engine(params, config, max_slots=2, num_pages=8, page_size=4, mesh=mesh)
    finals = run_engine(engine, requests, np.random.default_rng(2))
    tokens = {f"{r}/{k}": out.token_ids for (r, k), out in sorted(finals.items())}
    return tokens, engine


def _model_results(name, params, config, meshes, reference_logits=None):
    import numpy as np

    from inference import SamplingParams, generate

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    sampling = [SamplingParams(temperature=0.0, max_new_tokens=16),
                SamplingParams(temperature=0.9, top_k=20, seed=7, n=2, max_new_tokens=16),
                SamplingParams(temperature=1.0, seed=3, max_new_tokens=12),
                SamplingParams(temperature=0.0, max_new_tokens=9)]
    requests = _engine_requests()
    out, logits = {}, _logits(params, config, None)
    for n, mesh in meshes.items():
        tokens, engine = _engine_run(params, config, mesh, requests)
        stats = engine.stats()
        pool = engine.state.model.k[0]
        out[str(n)] = {
            "generate": [c.tokens for c in generate(params, config, prompts, sampling,
                                                    mesh=mesh)],
            "engine": tokens, "mesh": stats["mesh"], "preemptions": stats["preemptions"],
            "prefix_cache_hits": stats["prefix_cache_hits"],
            "pool_shard_bytes": pool.addressable_shards[0].data.nbytes,
            "pools": 2 * config.n_layers,
            "logit_diff": float(np.abs(_logits(params, config, mesh) - logits).max())}
        if name == "llama" and n == 2:
            out["hlo"] = _decode_hlo(engine)
    return out


def main():
    from conftest import lively_params
    from gpt_jax import tensor_parallel
    from gpt_jax.config import GPTConfig
    from gpt_jax.params import inference_params, quantize
    from inference import SamplingParams, generate

    meshes = {1: None, 2: tensor_parallel.make_mesh(2), 4: tensor_parallel.make_mesh(4)}
    gpt2 = GPTConfig.preset("tiny").replace(n_heads=4, d_model=64)  # H = 16
    llama = GPTConfig.preset("tiny-llama")  # N = 4, K = 2, H = 8
    results = {}
    for name, config in (("gpt2", gpt2), ("llama", llama)):
        params = lively_params(config)
        llama_results = _model_results(name, params, config, meshes)
        results["hlo"] = llama_results.pop("hlo", results.get("hlo"))
        results[name] = llama_results
    int8 = quantize(inference_params(lively_params(gpt2), gpt2), "int8")
    results["int8"] = {str(n): [c.tokens for c in generate(
        int8, gpt2, [[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_new_tokens=12),
        mesh=meshes[n])] for n in (1, 2)}
    try:
        tensor_parallel.check_mesh(tensor_parallel.make_mesh(3), gpt2)
    except ValueError as error:
        results["bad_mesh"] = str(error)
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
