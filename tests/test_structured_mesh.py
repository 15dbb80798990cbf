"""Structured output on a tensor-parallel mesh (`gpt_jax.tensor_parallel`, 2 host CPU
devices): a batch mixing a JSON schema, a regex, a choice and an unconstrained row gives the
same tokens through `generate(..., mesh=...)` as on one device, and every constrained output
fits. (The `Engine` builds its rows' tables with the same `constraint_arrays`; left out to
keep the test cheap.)

XLA reads --xla_force_host_platform_device_count when JAX starts, so a subprocess (this file
run as a script) computes the tokens and prints them as JSON (as tests/test_tensor_parallel.py).
"""

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHARS = sorted('{}[]":, 0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRST')  # 64
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["ab", "cd"]}},
          "required": ["n", "tag"]}
REGEX = "[a-f]{2,5}:[0-9]{3}"
CHOICE = ["yes", "no", "yesno"]


@pytest.fixture(scope="module")
def results():
    from conftest import run_on_host_devices

    return run_on_host_devices(__file__, 2, timeout=900)


def test_constrained_rows_on_a_mesh_equal_one_device(results):
    one, two = results["1"], results["2"]
    assert two == one
    schema, regex, choice, free = one
    assert set(json.loads(schema)) == {"n", "tag"}
    assert re.fullmatch(REGEX, regex) and choice in CHOICE
    assert len(set(free)) >= 5  # lively: a mismatch would show


# ---------------------------------------------------------------- the subprocess


def _sampling():
    from inference import SamplingParams

    return [SamplingParams(json_schema=SCHEMA, seed=1, max_new_tokens=40),
            SamplingParams(regex=REGEX, seed=2, max_new_tokens=12),
            SamplingParams(choice=CHOICE, seed=3, max_new_tokens=8),
            SamplingParams(seed=4, max_new_tokens=12)]


def main():
    from conftest import lively_params
    from gpt_jax import tensor_parallel
    from gpt_jax.config import GPTConfig
    from gpt_jax.tokenizer import CharTokenizer
    from inference import generate

    config = GPTConfig.preset("tiny")  # 2 heads: one per device
    params = lively_params(config)
    tokenizer = CharTokenizer(CHARS)
    prompts = [tokenizer.encode(p) for p in ("a{", "ab", "yes", "hello")]
    results = {}
    for n, mesh in ((1, None), (2, tensor_parallel.make_mesh(2))):
        outs = generate(params, config, prompts, _sampling(), tokenizer=tokenizer, mesh=mesh)
        results[str(n)] = [tokenizer.decode(o.tokens) for o in outs]
    print(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    main()
