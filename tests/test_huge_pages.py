"""Weights in 2 MB pages (`gpt_jax.huge_pages.pack`, issue 35): the arrays of a parameter tree
are copied into one huge-page-advised mapping that jax uses in place, in tree order, with
their values, dtypes and shapes; `inference_params` (what `LLM` and `Engine` run) returns them
so, and the tokens stay those of the unpacked weights."""

import mmap
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax import huge_pages
from gpt_jax.params import decode_layout, inference_params
from inference.generation import generate
from inference.sampling_params import SamplingParams


def _pointers(tree):
    return [leaf.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree)]


def test_pack_copies_every_array_into_one_aligned_region_in_tree_order():
    tree = {"a": jnp.arange(1000, dtype=jnp.float32),  # 4,000 bytes: padded to 4,032
            "b": jnp.linspace(-2, 2, 15, dtype=jnp.bfloat16).reshape(3, 5),
            "c": jnp.arange(-7, 7, dtype=jnp.int8),
            "d": jnp.ones((700, 3), jnp.float32) * 3,
            "e": jax.device_put(jnp.ones(4, jnp.float32), jax.devices()[0])}  # committed
    packed = huge_pages.pack(tree)
    assert jax.tree.structure(packed) == jax.tree.structure(tree)
    for name in tree:
        assert packed[name] is not tree[name]
        assert packed[name].dtype == tree[name].dtype and packed[name].shape == tree[name].shape
        assert packed[name].committed == tree[name].committed  # else jit would recompile
        np.testing.assert_array_equal(np.asarray(packed[name]), np.asarray(tree[name]))
    leaves = jax.tree.leaves(packed)
    starts = _pointers(packed)
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    padded = [-(-leaf.nbytes // huge_pages.ALIGN) * huge_pages.ALIGN for leaf in leaves]
    assert starts == [starts[0] + sum(padded[:k]) for k in range(len(leaves))]
    assert np.asarray(jax.jit(lambda t: t["d"].sum() + t["a"][-1])(packed)) == 700 * 3 * 3 + 999
    assert [tree[name].committed for name in "ade"] == [False, False, True]
    assert huge_pages.pack(packed) is packed  # packed once: never copied again


def test_the_packed_region_is_in_huge_pages_where_the_kernel_grants_them():
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    big = {"w": jnp.ones((8 << 20) // 4, jnp.float32)}  # 8 MB: four 2 MB pages
    packed = huge_pages.pack(big)
    start = packed["w"].unsafe_buffer_pointer()
    if not hasattr(mmap, "MADV_HUGEPAGE") or "[never]" in enabled.read_text():
        assert packed is big or start % huge_pages.HUGE_PAGE == 0
        return
    smaps = Path("/proc/self/smaps").read_text()
    for header, body in re.findall(r"^([0-9a-f]+-[0-9a-f]+) .*\n((?:[A-Z].*\n)+)", smaps, re.M):
        low, high = (int(x, 16) for x in header.split("-"))
        if low <= start < high:
            assert re.search(r"^VmFlags:.* hg", body, re.M), body  # advised MADV_HUGEPAGE
            return
    raise AssertionError("the packed array's mapping is not in /proc/self/smaps")


def test_inference_params_are_packed_and_give_the_tokens_of_unpacked_weights(config, params):
    packed = inference_params(params, config)
    starts = _pointers(packed)
    assert starts[0] % huge_pages.HUGE_PAGE == 0 and starts == sorted(starts)
    assert starts[-1] - starts[0] < sum(leaf.nbytes + 64 for leaf in jax.tree.leaves(packed))
    assert inference_params(packed, config) is packed  # an LLM's params, given to its Engine
    int8 = inference_params(params, config, quantize_method="int8")
    assert _pointers(int8)[0] % huge_pages.HUGE_PAGE == 0
    assert inference_params(int8, config) is int8
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    want = [c.tokens for c in generate(jax.jit(decode_layout)(params), config, prompts, greedy)]
    assert [c.tokens for c in generate(packed, config, prompts, greedy)] == want


def test_arrays_on_no_single_cpu_device_are_left_as_they_are():
    assert huge_pages.pack({}) == {}
    tree = {"a": jnp.ones(3), "n": np.ones(3)}  # a numpy array is not a device array
    assert huge_pages.pack(tree) is tree
