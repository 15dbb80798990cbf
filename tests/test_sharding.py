"""Data-parallel and sharded training and generation on 4 host CPU devices.

XLA reads --xla_force_host_platform_device_count when jax starts, so the checks run in a
subprocess (`python tests/test_sharding.py`) that sets it first, and print JSON results.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
N_DEVICES = 4


def test_four_device_step_and_generate_match_one_device():
    import jax
    import numpy as np

    from conftest import TEST_XLA_FLAGS
    from gpt_jax import checkpoint, forward

    env = {**os.environ, "XLA_FLAGS": f"{TEST_XLA_FLAGS} --xla_force_host_platform_device_count={N_DEVICES}",
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, __file__], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    assert results["devices"] == N_DEVICES
    for mode in ("data_parallel", "sharded_params"):
        r = results[mode]
        assert r["batch_devices"] == N_DEVICES, r
        assert r["loss_diff"] <= 1e-5 and r["param_diff"] <= 1e-5, r
        assert r["finite"], r
    assert results["sharded_params"]["param_shards"] == N_DEVICES
    # data parallelism averages the gradients as one flat array: one all-reduce of one buffer
    # (XLA:CPU runs a tuple all-reduce as one rendezvous per array), the loss riding in it
    n_params = sum(int(np.prod(s)) for s in results["param_shapes"])
    assert results["data_parallel"]["all_reduces"] == [f"f32[{n_params + 1}]"]
    assert results["single_tokens"] == results["sharded_tokens"]
    assert len(set(results["single_tokens"][0])) >= 5  # lively, so a mismatch would show
    # a run saved from the 4-device mesh (params sharded) loads in this one-device process,
    # as `generate` loads it (Orbax checks the topology; the saved digests check the values)
    config, params, _ = checkpoint.load_params(results["run_dir"])
    assert params["wte"].sharding.device_set == {jax.devices()[0]}
    assert np.isfinite(np.asarray(forward(params, np.array([[1, 2, 3]]), config))).all()
    # the default mesh is every device; a batch they do not divide is refused before any work
    assert results["indivisible_batch"] == [
        "batch_size 6 must be divisible by the 4 devices of the mesh (set --devices, or "
        "--cpu-devices on CPU)", False]


def test_split_host_cpu_refuses_once_jax_has_started():
    import jax
    import pytest

    from training import sharding

    jax.numpy.zeros(1).block_until_ready()
    with pytest.raises(RuntimeError, match="jax_num_cpu_devices config should be updated "
                                           "before backends are initialized"):
        sharding.split_host_cpu(2)
    with pytest.raises(ValueError, match="n_devices must be >= 1, got 0"):
        sharding.split_host_cpu(0)


def _max_diff(a, b):
    import jax
    import numpy as np

    return max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _step(mesh, shard_params, config, cfg, x, y):
    """One train step on `mesh`: `(loss, params, devices holding x, distinct wte shards,
    the shapes its compiled program all-reduces)`."""
    import dataclasses
    import re

    import jax
    import numpy as np

    from training import sharding, step

    cfg = dataclasses.replace(cfg, shard_params=shard_params)
    optimizer = step.make_optimizer(cfg)
    state, shardings = step.init_state(cfg, config, optimizer, mesh)
    train_steps = step.make_train_steps(config, optimizer, shardings=shardings)
    xs, ys = sharding.put_batch(x[None], mesh, 2), sharding.put_batch(y[None], mesh, 2)
    one = np.int32(1)
    hlo = train_steps.lower(state, xs, ys, one).compile().as_text()
    all_reduces = [re.sub(r"\{[^}]*\}", "", shape)  # layouts dropped
                   for shape in re.findall(r"= (.+?) all-reduce\(", hlo)]
    state, losses = train_steps(state, xs, ys, one)
    loss = losses[0]
    wte_shards = len({str(s.index) for s in state.params["wte"].addressable_shards})
    return (float(loss), jax.device_get(state.params), len(xs.sharding.device_set), wte_shards,
            all_reduces)


def main():
    import jax
    import numpy as np

    from conftest import lively_params
    from gpt_jax.config import GPTConfig
    from inference import SamplingParams, generate
    from training import sharding, train
    from training.config import TrainConfig

    config = GPTConfig.preset("tiny")
    cfg = TrainConfig.preset("tiny", grad_accum=2)
    rng = np.random.default_rng(0)
    x = rng.integers(0, config.vocab_size, (2, 8, 32)).astype(np.int32)  # [A, B, T]
    y = np.roll(x, -1, axis=2)
    one, four = sharding.make_mesh(1), sharding.make_mesh(N_DEVICES)
    loss1, params1, _, _, _ = _step(one, False, config, cfg, x, y)
    results = {"devices": len(jax.devices()),
               "param_shapes": [p.shape for p in jax.tree.leaves(params1)]}
    for mode, shard in (("data_parallel", False), ("sharded_params", True)):
        loss4, params4, batch_devices, param_shards, all_reduces = _step(
            four, shard, config, cfg, x, y)
        results[mode] = {"loss_diff": abs(loss4 - loss1), "param_diff": _max_diff(params4, params1),
                         "batch_devices": batch_devices, "param_shards": param_shards,
                         "finite": bool(np.isfinite(loss4)), "all_reduces": all_reduces}
    params = lively_params(config)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    single = generate(params, config, prompts, greedy)
    split = generate(sharding.put_tree(params, four, True), config, prompts, greedy)
    results["single_tokens"] = [c.tokens for c in single]
    run_dir = Path(tempfile.mkdtemp()) / "run"
    try:
        train.train(TrainConfig.preset("tiny", batch_size=6, run_dir=str(run_dir)))
    except ValueError as error:
        results["indivisible_batch"] = [str(error), run_dir.exists()]
    # A short run on all 4 devices, params sharded, for the parent process to load.
    train.train(TrainConfig.preset("tiny", max_steps=2, eval_interval=2, eval_batches=1,
                                   shard_params=True, run_dir=str(run_dir)))
    results["run_dir"] = str(run_dir)
    results["sharded_tokens"] = [c.tokens for c in split]
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
