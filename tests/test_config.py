"""`GPTConfig`: the architecture as data. GPT-2's values are the defaults (so configs saved
before the family fields existed mean what they meant), bad values are refused naming the
field and the allowed ones, and the Llama-family presets have the released models' sizes."""

import json
import math

import jax
import pytest

from gpt_jax import GPTConfig, init_params
from gpt_jax.checkpoint import load_config, save_config
from gpt_jax.config import RopeScaling


def test_a_config_saved_before_the_family_fields_loads_as_gpt2(tmp_path):
    old = {"vocab_size": 65, "max_seq_len": 64, "n_layers": 4, "n_heads": 4, "d_model": 128,
           "n_kv_heads": None, "mlp_ratio": 4, "layer_norm_eps": 1e-5}
    (tmp_path / "config.json").write_text(json.dumps(old))
    config = load_config(tmp_path)
    assert config == GPTConfig.preset("nanogpt-cpu")
    assert (config.norm, config.positions, config.mlp, config.tie_embeddings) == (
        "layernorm", "learned", "gelu", True)
    assert config.qkv_bias and config.out_bias and config.mlp_bias and not config.qk_norm
    assert (config.head_dim, config.d_ff) == (32, 512)


@pytest.mark.parametrize("name", ["tiny-llama", "llama-3.2-1b", "gpt2"])
def test_configs_round_trip_through_a_run_directory(name, tmp_path):
    config = GPTConfig.preset(name)
    save_config(tmp_path, config)
    assert load_config(tmp_path) == config
    hash(config)  # a static jit argument


@pytest.mark.parametrize("name, count", [
    # The released checkpoints' parameter counts (their safetensors headers).
    ("smollm2-135m", 134_515_008), ("qwen2.5-0.5b", 494_032_768),
    ("llama-3.2-1b", 1_235_814_400), ("gpt2", 124_439_808),
])
def test_presets_have_the_released_sizes(name, count):
    config = GPTConfig.preset(name)
    shapes = jax.eval_shape(lambda key: init_params(config, key), jax.random.key(0))
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(shapes)) == count


def test_head_size_and_intermediate_size_override_the_derived_widths():
    config = GPTConfig(vocab_size=8, max_seq_len=8, n_layers=1, n_heads=4, d_model=30,
                       head_size=24, intermediate_size=50)
    assert (config.head_dim, config.d_ff) == (24, 50)


@pytest.mark.parametrize("changes, message", [
    ({"norm": "batchnorm"},
     r"GPTConfig\.norm must be one of 'layernorm', 'rmsnorm', got 'batchnorm'"),
    ({"positions": "alibi"}, r"GPTConfig\.positions must be one of 'learned', 'rope'"),
    ({"mlp": "relu"}, r"GPTConfig\.mlp must be one of 'gelu', 'gated_silu'"),
    ({"head_size": 0}, r"GPTConfig\.head_size must be a positive int, got 0"),
    ({"intermediate_size": 1.5}, r"GPTConfig\.intermediate_size must be a positive int"),
    ({"rope_theta": 5e5}, r"rope_theta and rope_scaling apply only to positions='rope'"),
    ({"positions": "rope", "rope_theta": 0.0}, r"GPTConfig\.rope_theta must be > 0"),
    ({"positions": "rope", "rope_scaling": {"factor": 8}}, r"rope_scaling must be a RopeScaling"),
    ({"positions": "rope", "head_size": 7}, r"even head dim, got 7"),
    ({"d_model": 30}, r"d_model=30 must be divisible by n_heads=4 \(or set head_size\)"),
])
def test_bad_values_are_refused_naming_the_field(changes, message):
    fields = dict(vocab_size=8, max_seq_len=8, n_layers=1, n_heads=4, d_model=32) | changes
    with pytest.raises(ValueError, match=message):
        GPTConfig(**fields)


def test_rope_scaling_is_checked():
    with pytest.raises(ValueError, match="high_freq_factor > low_freq_factor"):
        RopeScaling(8.0, 4.0, 1.0, 8192)
