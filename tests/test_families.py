"""The Llama family (Llama, Qwen2, Qwen3, Mistral) against Hugging Face `transformers` (torch,
CPU) as the external reference, on small random models saved with `save_pretrained` and
read with `gpt_jax.load_hf`: logits of a padded batch, greedy generation, cached against
naive, batched against alone, `save_hf` back into `transformers`, bfloat16 and sharded
files, int8, and the features we refuse.

Every model sets what its family may vary off the defaults: grouped-query attention 4:1 and
2:1, rope_theta other than 10000, Llama 3 rope scaling with a short original context (so
the scaled, interpolated and kept frequencies all occur), q/k/v biases, all attention and
MLP biases, q/k norm, a head dim that is not hidden_size / heads, tied and untied output.
Every parameter is random (norm scales and biases too, so a mapping mistake in any tensor
shows), matrices large enough that greedy outputs are varied.
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, assert_lively, lively_params
from gpt_jax import GPTConfig, forward, load_hf, save_hf
from gpt_jax.layers import Int8Weight
from gpt_jax.params import quantization_error, quantize
from inference import Engine, SamplingParams, generate, init_cache, naive_generate, prefill
from test_hf import assert_same_greedy, padded_batch, safetensors_numpy, torch, torch_logits, \
    transformers
from test_crop import cropped_greedy
from test_quantize import assert_within_bound

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             max_position_embeddings=96, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    # GQA 4:1, Llama 3 rope scaling, rope_theta 5e5, untied.
    "llama": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2,
                                  rope_theta=500000.0, rope_scaling=LLAMA3,
                                  rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # Every bias (attention_bias, mlp_bias), head_dim 32 != 64 / 4, GQA 2:1, tied.
    "llama-biases": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32, attention_bias=True, mlp_bias=True,
                                         rope_theta=20000.0, tie_word_embeddings=True)),
    # q/k/v biases (not o), GQA 2:1, rope_theta 1e6, tied.
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                  rope_theta=1000000.0, tie_word_embeddings=True)),
    # q/k norm, head_dim 24 != 64 / 4, GQA 4:1, untied.
    "qwen3": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=24,
                                  rope_theta=50000.0, tie_word_embeddings=False)),
    # GQA 2:1, no sliding window, untied.
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                      sliding_window=None, rope_theta=30000.0,
                                      tie_word_embeddings=False)),
}
LENGTHS = (5, 23, 12)  # three prompts of different lengths in one batch
NEW_TOKENS = 32


def hf_model(family: str, seed: int = 0, std: float = 0.2, **changes):
    """A random `transformers` model of `family`: matrices N(0, std) (0.2: lively),
    biases N(0, 0.1), norm scales N(1, 0.1)."""
    config_class, settings = FAMILIES[family]
    config = getattr(transformers, config_class)(**SMALL, **settings, **changes)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean = 1.0 if name.endswith("norm.weight") else 0.0
            p.normal_(mean, std if p.ndim >= 2 else 0.1, generator=gen)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory):
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def _hf_greedy(model, prompt):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].numpy()


def test_config_maps_each_family(family_dir):
    family, model, path = family_dir
    config, _ = load_hf(path)
    hf = model.config
    assert (config.norm, config.positions, config.mlp) == ("rmsnorm", "rope", "gated_silu")
    assert (config.n_heads, config.kv_heads, config.head_dim, config.d_ff) == (
        hf.num_attention_heads, hf.num_key_value_heads,
        getattr(hf, "head_dim", None) or 64 // hf.num_attention_heads, 96)
    assert config.tie_embeddings == hf.tie_word_embeddings
    assert config.qk_norm == (family == "qwen3")
    assert config.qkv_bias == (family in ("qwen2", "llama-biases"))
    assert config.out_bias == config.mlp_bias == (family == "llama-biases")
    assert config.rope_theta == FAMILIES[family][1]["rope_theta"]
    assert (config.rope_scaling is not None) == (family == "llama")


def test_logits_match_transformers(family_dir):
    family, model, path = family_dir
    config, params = load_hf(path)
    ids, mask = padded_batch(config.vocab_size, LENGTHS, "right")
    ref = torch_logits(model, ids, mask)
    scale = np.abs(ref).max()
    assert ref[1, :LENGTHS[1]].std() > 0.5  # logits large enough for the bound to mean much
    ours = forward(params, jnp.asarray(ids), config)
    for b, n in enumerate(LENGTHS):
        assert_close(ours[b, :n], ref[b, :n], 1e-4 * scale, f"{family} logits of sequence {b}")

    # Left-padded through the cached prefill: the last real token's logits.
    left, _ = padded_batch(config.vocab_size, LENGTHS, "left")
    cache = init_cache(config, len(LENGTHS), ids.shape[1])
    last, _ = prefill(params, config, jnp.asarray(left), jnp.array(LENGTHS), cache,
                      padding_side="left")
    for b, n in enumerate(LENGTHS):
        assert_close(last[b], ref[b, n - 1], 1e-4 * scale, f"{family} prefill of sequence {b}")


def test_greedy_generation_matches_transformers_naive_and_alone(family_dir):
    family, model, path = family_dir
    config, params = load_hf(path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (1, 9, 30)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    batched = generate(params, config, prompts, greedy)
    naive = naive_generate(params, config, prompts, greedy)
    for prompt, row, slow in zip(prompts, batched, naive):
        ref, ref_logits = _hf_greedy(model, prompt)
        assert_lively(ref, 8)
        (solo,) = generate(params, config, [prompt], greedy)
        what = f"{family}, prompt of length {len(prompt)}"
        assert len(solo.tokens) == NEW_TOKENS, what
        assert_same_greedy(solo.tokens, ref, ref_logits, what)
        assert row.tokens == solo.tokens, f"{what}: batched != alone"
        assert slow.tokens == solo.tokens, f"{what}: cached != naive"


def test_save_hf_opens_in_transformers_with_the_same_logits(family_dir, tmp_path):
    family, model, path = family_dir
    config, params = load_hf(path)
    save_hf(config, params, tmp_path)
    reopened = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch(config.vocab_size, LENGTHS, "right", seed=1)
    ref, again = torch_logits(model, ids, mask), torch_logits(reopened, ids, mask)
    for b, n in enumerate(LENGTHS):
        assert_close(again[b, :n], ref[b, :n], 1e-6 * np.abs(ref).max(), f"{family} row {b}")
    loaded_config, loaded = load_hf(tmp_path)
    assert loaded_config == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded, params)


def test_engine_equals_generate(family_dir):
    """Continuous batching with prefix caching and preemption: requests sharing a prompt
    prefix, added while others run, in too few pages for two at once, give `generate`'s
    tokens (greedy and seeded sampling)."""
    family, _, path = family_dir
    config, params = load_hf(path)
    rng = np.random.default_rng(7)
    shared = rng.integers(0, config.vocab_size, 20).tolist()
    requests = [(f"r{i}", shared + rng.integers(0, config.vocab_size, 3 + i).tolist(),
                 SamplingParams(temperature=0.0 if i % 2 else 0.8, top_k=20, seed=i,
                                max_new_tokens=16)) for i in range(4)]
    # Each request needs 5-6 pages of 8 by its end (the first 2 shared): 7 hold one and a bit.
    engine = Engine(params, config, max_slots=2, num_pages=7, page_size=8, prefix_caching=True)
    finals, pending = {}, list(requests)
    while pending or engine.has_unfinished_requests():
        if pending:
            engine.add_request(*pending.pop(0))
        finals |= {out.request_id: out for out in engine.step() if out.finished}
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    # One batch: a row's tokens do not depend on the others (batched == alone, above).
    expected = generate(params, config, [r[1] for r in requests], [r[2] for r in requests])
    for (request_id, _, _), alone in zip(requests, expected):
        assert finals[request_id].token_ids == alone.tokens, (family, request_id)


def test_bfloat16_sharded_directory_runs_in_bfloat16_and_float32(tmp_path):
    model = hf_model("llama", seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32).eval()
    ids, mask = padded_batch(160, LENGTHS, "right", seed=2)
    ref = torch_logits(reference, ids, mask)
    scale = np.abs(ref).max()
    for dtype, tolerance in ((jnp.float32, 1e-4), (jnp.bfloat16, 0.1)):
        config, params = load_hf(tmp_path, dtype=dtype)
        assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
        ours = forward(params, jnp.asarray(ids), config)
        for b, n in enumerate(LENGTHS):
            assert_close(ours[b, :n], ref[b, :n], tolerance * scale, f"{dtype.__name__} row {b}")
        (out,) = generate(params, config, [ids[0, :LENGTHS[0]].tolist()],
                          SamplingParams(temperature=0.0, max_new_tokens=8), cache_dtype=dtype)
        assert len(out.tokens) == 8


def test_int8_untied_model_stays_within_the_bound(tmp_path):
    """At transformers' initializer_range (0.02, GPT-2's std, which test_quantize's GPT-2
    shape uses): the bound is first order, and the lively models' gains amplify errors."""
    hf_model("llama", seed=2, std=0.02).save_pretrained(tmp_path)
    config, params = load_hf(tmp_path)
    q = quantize(params, "int8")
    assert isinstance(q["lm_head"], Int8Weight) and isinstance(q["wte"], Int8Weight)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (4, 32)))
    logits, reference = (np.asarray(forward(p, tokens, config), np.float64) for p in (q, params))
    eps = quantization_error(params, q)
    assert 0.005 < eps < 0.1, eps
    assert_within_bound(logits, reference, eps, "untied llama int8")


def _config_only(tmp_path, family, **changes):
    """A directory holding only a config.json of `family`, edited: no weights at all, so a
    refusal shows that the config was refused before any weight was read."""
    config = hf_model(family).config.to_dict() | changes
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("family, changes, message", [
    ("llama", {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"},
     r"architecture 'GemmaForCausalLM' \(model_type 'gemma'\) is not supported"),
    ("llama", {"architectures": ["LlamaForSequenceClassification"]},
     r"architecture 'LlamaForSequenceClassification'"),
    ("mistral", {"sliding_window": 32}, r"sliding_window=32 \(sliding-window attention"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32,
               "layer_types": ["sliding_attention"] * 2}, r"sliding-window attention"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0},
               "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"rope_scaling type='yarn' is not supported \(supported: 'default', 'llama3'\)"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0},  # was read as default,
               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},  # transformers
     r"rope_scaling type='yarn' is not supported"),  # takes rope_scaling first
    ("mistral", {"num_local_experts": 8}, r"num_local_experts=8 \(mixture of experts\)"),
    ("qwen3", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
])
def test_unsupported_features_are_refused_by_name_before_weights(tmp_path, family, changes,
                                                                 message):
    path = _config_only(tmp_path, family, **changes)
    with pytest.raises(ValueError, match=message) as refused:
        load_hf(path)
    assert str(path / "config.json") in str(refused.value)


def test_a_sliding_window_as_long_as_the_context_is_no_window(tmp_path):
    path = _config_only(tmp_path, "mistral", sliding_window=96)
    with pytest.raises(FileNotFoundError, match="holds no model weights"):
        load_hf(path)  # the config passed; only the weights are missing


def test_a_truncated_safetensors_file_is_named_in_one_line(tmp_path):
    """Fault: a model.safetensors cut short (an interrupted download) raised safetensors'
    SafetensorError with a traceback through `gpt-jax generate`/`serve`/`LLM`."""
    path = _config_only(tmp_path, "llama")
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors "
                                         r"file \(.+\); allowed: a complete file"):
        load_hf(path)


def test_wrong_tensors_are_named(family_dir, tmp_path):
    _, _, path = family_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    tensors = safetensors_numpy.load_file(path / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((96, 32), np.float32)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has "
                                         r"shape \(96, 32\), expected \(96, 64\)"):
        load_hf(tmp_path)


def test_a_gpt2_directory_loads_through_load_hf(tmp_path):
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_head=2, n_embd=32, vocab_size=50, n_positions=16)).eval()
    model.save_pretrained(tmp_path)
    config, params = load_hf(tmp_path)
    assert config == GPTConfig(vocab_size=50, max_seq_len=16, n_layers=1, n_heads=2, d_model=32)
    ids, mask = padded_batch(50, (7, 16), "right")
    ref = torch_logits(model, ids, mask)
    assert_close(forward(params, jnp.asarray(ids), config)[0, :7], ref[0, :7], 1e-5)


def test_a_llama_style_preset_trains_resumes_and_round_trips_through_transformers(corpus,
                                                                                    tmp_path):
    """`training.train` with the tiny-llama preset (GQA, rope, RMSNorm, gated SiLU, untied)
    learns, resumes from its checkpoint, and its `save_hf` opens in transformers with the
    same logits."""
    from gpt_jax import checkpoint
    from training import report
    from training import train as T
    from training.config import TrainConfig

    cfg = TrainConfig.preset("tiny", model="tiny-llama", text=str(corpus), max_steps=100,
                             eval_interval=50, run_dir=str(tmp_path / "run"))
    T.train(cfg)
    summary = T.train(dataclasses.replace(cfg, max_steps=150))  # resumes at step 100
    rows = report.read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [50, 100, 150] and summary["steps"] == 150
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] < math.log(64), rows

    config, params, _ = checkpoint.load_params(cfg.run_dir)
    assert config == GPTConfig.preset("tiny-llama", vocab_size=config.vocab_size)
    save_hf(config, params, tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    ids, mask = padded_batch(config.vocab_size, (32, 9, 20), "right", seed=4)
    ref = torch_logits(model, ids, mask)
    ours = forward(params, jnp.asarray(ids), config)
    for b, n in enumerate((32, 9, 20)):
        assert_close(ours[b, :n], ref[b, :n], 1e-4 * np.abs(ref).max(), f"trained row {b}")


def test_crop_past_the_context_reencodes_the_window_from_position_zero():
    """context_overflow="crop" with rotary positions: past max_seq_len each token comes from
    `forward` over the last max_seq_len tokens at positions 0.. (nanoGPT's sampler), as
    with learned positions."""
    config = GPTConfig.preset("tiny-llama", max_seq_len=16)
    params = lively_params(config)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (9, 16, 40)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, context_overflow="crop")
    for prompt, row in zip(prompts, generate(params, config, prompts, greedy)):
        expected = cropped_greedy(params, config, prompt, 24)
        assert_lively(expected)
        assert row.tokens == expected, len(prompt)
