"""Parity with Hugging Face `transformers` GPT-2 (torch, CPU) as the external reference:
checkpoint import and export, logits, greedy generation, and the `--hf-checkpoint` CLI.

Random transformers models get every parameter randomised (biases and LayerNorm too, so a
mapping mistake in any tensor shows) and their matrices scaled up so logits and greedy
outputs are far from trivial.
"""

import importlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import assert_close, assert_lively
from gpt_jax import GPTConfig, forward, init_params, load_hf_gpt2, save_hf_gpt2
from gpt_jax.tokenizer import CharTokenizer
from inference import SamplingParams, generate, init_cache, prefill
from training import data


def _require(name):
    """In CI a missing reference library is a failure, never a skip."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(name)
    return pytest.importorskip(name)


os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never wait on a hub
torch = _require("torch")
transformers = _require("transformers")
safetensors_numpy = _require("safetensors.numpy")

SHAPES = {
    # n_inner and layer_norm_epsilon off their defaults, so the config mapping is checked.
    "small": dict(n_layer=2, n_head=4, n_embd=64, vocab_size=100, n_positions=80,
                  n_inner=128, layer_norm_epsilon=1e-6),
    # GPT-2 small's width and depth with a small vocabulary and position table.
    "gpt2-width": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=96, n_positions=32),
}
LENGTHS = (5, 17, 11)  # three sequences of different lengths in one batch


def hf_model(seed: int, scale: float, **shape):
    """A random `GPT2LMHeadModel`: matrices N(0, 0.02 * scale), biases N(0, 0.1), LayerNorm
    scales N(1, 0.1)."""
    config = transformers.GPT2Config(bos_token_id=None, eos_token_id=None, **shape)
    model = transformers.GPT2LMHeadModel(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02 * scale, generator=gen)
            elif name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.normal_(1.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, 0.1, generator=gen)
    return model


def torch_logits(model, ids_BT: np.ndarray, mask_BT: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(ids_BT, dtype=torch.long),
                    attention_mask=torch.tensor(mask_BT, dtype=torch.long))
    return out.logits.numpy()


def padded_batch(vocab_size: int, lengths, side: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids, mask = np.zeros((len(lengths), T), np.int32), np.zeros((len(lengths), T), np.int32)
    for b, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(T - n, T)
        ids[b, cols], mask[b, cols] = rng.integers(0, vocab_size, n), 1
    return ids, mask


@pytest.fixture(scope="module")
def lively_hf(tmp_path_factory):
    """The small shape with matrices at std 0.24, saved; greedy decoding from it is varied."""
    model = hf_model(1, 12.0, **SHAPES["small"])
    path = tmp_path_factory.mktemp("lively")
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("shape", list(SHAPES))
def test_logits_match_transformers(shape, tmp_path):
    model = hf_model(0, 3.0, **SHAPES[shape])
    model.save_pretrained(tmp_path)
    config, params = load_hf_gpt2(tmp_path)
    s = SHAPES[shape]
    assert config == GPTConfig(
        vocab_size=s["vocab_size"], max_seq_len=s["n_positions"], n_layers=s["n_layer"],
        n_heads=s["n_head"], d_model=s["n_embd"],
        mlp_ratio=(s.get("n_inner") or 4 * s["n_embd"]) // s["n_embd"],
        layer_norm_eps=s.get("layer_norm_epsilon", 1e-5),
    )
    ids, mask = padded_batch(config.vocab_size, LENGTHS, "right")
    ref = torch_logits(model, ids, mask)
    assert ref[2, : LENGTHS[2]].std() > 0.25  # logits large enough for 1e-4 to be a real bound
    ours = forward(params, jnp.asarray(ids), config)
    for b, n in enumerate(LENGTHS):
        assert_close(ours[b, :n], ref[b, :n], 1e-4, f"{shape} logits of sequence {b}")

    # The same sequences left-padded through our cached prefill: the last real token's logits.
    left, _ = padded_batch(config.vocab_size, LENGTHS, "left")
    cache = init_cache(config, len(LENGTHS), ids.shape[1])
    last, _ = prefill(params, config, jnp.asarray(left), jnp.array(LENGTHS), cache,
                      padding_side="left")
    for b, n in enumerate(LENGTHS):
        assert_close(last[b], ref[b, n - 1], 1e-4, f"{shape} prefill logits of sequence {b}")


def assert_same_greedy(ours, ref, ref_logits, what):
    """Equal token streams, except after a step whose top-2 logit margin in the reference is
    under 1e-3 (a near-tie is float noise, not a bug)."""
    assert len(ours) == len(ref), what
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = np.sort(ref_logits[: i + 1], axis=-1)[:, -2:]
            margin = (top2[:, 1] - top2[:, 0]).min()
            assert margin < 1e-3, f"{what}: token {i} is {a}, transformers gives {b}"
            return


def test_greedy_generation_matches_transformers_and_batching(lively_hf):
    model, path = lively_hf
    config, params = load_hf_gpt2(path)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (1, 6, 29)]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    batched = generate(params, config, prompts, greedy)
    for prompt, row in zip(prompts, batched):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=40, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )
        ref = out.sequences[0, len(prompt):].tolist()
        ref_logits = torch.stack(out.logits)[:, 0].numpy()
        assert_lively(ref, 10)
        (solo,) = generate(params, config, [prompt], greedy)
        assert_same_greedy(solo.tokens, ref, ref_logits, f"prompt of length {len(prompt)}")
        assert row.tokens == solo.tokens, f"prompt of length {len(prompt)}: batched != alone"


def test_model_trained_here_round_trips_through_transformers(tmp_path):
    text = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind\n" * 8
    tokenizer = CharTokenizer.from_text(text)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, max_seq_len=32, n_layers=2, n_heads=2,
                       d_model=32)
    optimizer = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state, x_BT, y_BT):
        def loss_fn(p):
            logits = forward(p, x_BT, config)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y_BT).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.jit(init_params, static_argnums=0)(config, jax.random.key(0))
    opt_state = optimizer.init(params)
    tokens = np.array(tokenizer.encode(text), np.int32)
    losses = []
    for i in range(40):
        params, opt_state, loss = step(params, opt_state, *data.get_batch(tokens, 8, 32, 0, i))
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.0, losses  # it did learn

    save_hf_gpt2(config, params, tmp_path)
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch(config.vocab_size, (32, 9, 20), "right", seed=4)
    ref = torch_logits(model, ids, mask)
    ours = forward(params, jnp.asarray(ids), config)
    for b, n in enumerate((32, 9, 20)):
        assert_close(ours[b, :n], ref[b, :n], 1e-4, f"round-tripped logits of sequence {b}")

    loaded_config, loaded = load_hf_gpt2(tmp_path)
    assert loaded_config == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 loaded, params)


# ------------------------------------------------------------------- files and errors


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    model = hf_model(2, 3.0, n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=16)
    path = tmp_path_factory.mktemp("small")
    model.save_pretrained(path)
    return model, path


def _copy_config(src, dst, **changes):
    dst.mkdir(exist_ok=True)
    config = json.loads((src / "config.json").read_text()) | changes
    (dst / "config.json").write_text(json.dumps(config))


def _tensors(path):
    return safetensors_numpy.load_file(path / "model.safetensors")


def test_pytorch_bin_sharded_and_unprefixed_layouts_load_the_same(small_dir, tmp_path):
    model, path = small_dir
    _, expected = load_hf_gpt2(path)

    as_bin = tmp_path / "bin"
    _copy_config(path, as_bin)
    torch.save(model.state_dict(), as_bin / "pytorch_model.bin")

    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()

    # The released gpt2 checkpoint's layout: GPT2Model names and causal-mask buffers.
    released = tmp_path / "released"
    _copy_config(path, released)
    tensors = {k.removeprefix("transformer."): v for k, v in _tensors(path).items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), np.float32))
    safetensors_numpy.save_file(tensors, released / "model.safetensors")

    for where in (as_bin, sharded, released):
        _, params = load_hf_gpt2(where)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                     params, expected)


def test_missing_files_are_named(small_dir, tmp_path):
    _, path = small_dir
    with pytest.raises(FileNotFoundError, match=r"config\.json does not exist"):
        load_hf_gpt2(tmp_path)
    _copy_config(path, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"holds no GPT-2 weights: expected .*model\.safetensors"):
        load_hf_gpt2(tmp_path)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "llama"}, r"model_type is 'llama', only 'gpt2' checkpoints can be loaded"),
    ({"activation_function": "relu"}, r"activation_function='relu' is not supported"),
    ({"scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx=True is not supported"),
])
def test_unsupported_configs_are_rejected(small_dir, tmp_path, change, message):
    _, path = small_dir
    _copy_config(path, tmp_path, **change)
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        load_hf_gpt2(tmp_path)


def test_missing_config_sizes_are_named(small_dir, tmp_path):
    _, path = small_dir
    config = json.loads((path / "config.json").read_text())
    del config["n_embd"], config["n_positions"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: missing n_embd, n_positions"):
        load_hf_gpt2(tmp_path)


def test_wrong_or_missing_tensors_are_named(small_dir, tmp_path):
    _, path = small_dir
    _copy_config(path, tmp_path)
    tensors = _tensors(path)
    tensors["transformer.h.1.mlp.c_fc.weight"] = np.zeros((16, 32), np.float32)
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'h\.1\.mlp\.c_fc\.weight' has shape \(16, 32\), "
                                         r"expected \(16, 64\)"):
        load_hf_gpt2(tmp_path)
    del tensors["transformer.h.1.mlp.c_fc.weight"]
    safetensors_numpy.save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor 'h\.1\.mlp\.c_fc\.weight'"):
        load_hf_gpt2(tmp_path)


def test_grouped_query_attention_cannot_be_saved_as_gpt2(tmp_path):
    config = GPTConfig(vocab_size=32, max_seq_len=16, n_layers=1, n_heads=4, n_kv_heads=2,
                       d_model=32)
    with pytest.raises(ValueError, match="n_kv_heads=2 < n_heads=4"):
        save_hf_gpt2(config, {}, tmp_path)  # the config is refused before params are read
    assert not (tmp_path / "model.safetensors").exists()


# ------------------------------------------------------------------ gpt-jax generate


CLI_TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind\n" * 4


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory):
    """A GPT-2 directory whose vocabulary is a byte-level BPE tokenizer's, without the
    tokenizer files (each test adds the ones it needs)."""
    from gpt_jax.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.from_text(CLI_TEXT, vocab_size=300)
    model = hf_model(3, 12.0, n_layer=2, n_head=2, n_embd=32,
                     vocab_size=tokenizer.vocab_size, n_positions=64)
    path = tmp_path_factory.mktemp("cli")
    model.save_pretrained(path)
    return path, tokenizer


def _bare_copy(src, dst):
    """`dst` with src's config and weights (linked), and no tokenizer."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        (dst / name).symlink_to(src / name)
    return dst


def run_cli(capsys, *argv):
    from inference.cli import main

    main(["--temperature", "0", "--max-new-tokens", "12", *argv])
    return capsys.readouterr().out


def test_cli_generates_token_ids_from_a_directory_without_tokenizer(cli_dir, tmp_path, capsys):
    path = _bare_copy(cli_dir[0], tmp_path / "ids")
    out = run_cli(capsys, "--hf-checkpoint", str(path), "--prompt-ids", "5,6,7")
    config, params = load_hf_gpt2(path)
    (expected,) = generate(params, config, [[5, 6, 7]],
                           SamplingParams(temperature=0.0, max_new_tokens=12))
    assert_lively(expected.tokens, 4)
    assert out == ",".join(map(str, expected.tokens)) + "\n"
    with pytest.raises(SystemExit, match="has no tokenizer .*; pass --prompt-ids"):
        run_cli(capsys, "--hf-checkpoint", str(path), "--prompt", "To be")
    V = config.vocab_size
    with pytest.raises(SystemExit, match=rf"token id {V} is outside \[0, {V}\)"):
        run_cli(capsys, "--hf-checkpoint", str(path), "--prompt-ids", f"5,{V}")


@pytest.mark.parametrize("files", ["tokenizer.json", "vocab.json + merges.txt"])
def test_cli_generates_text_through_the_directorys_tokenizer(cli_dir, tmp_path, capsys, files):
    src, tokenizer = cli_dir
    path = _bare_copy(src, tmp_path / "text")
    if files == "tokenizer.json":
        tokenizer.save(path / "tokenizer.json")
    else:
        tokenizer.tokenizer.model.save(str(path))
    out = json.loads(run_cli(capsys, "--hf-checkpoint", str(path), "--prompt", "To be", "--json"))
    config, params = load_hf_gpt2(path)
    (expected,) = generate(params, config, [tokenizer.encode("To be")],
                           SamplingParams(temperature=0.0, max_new_tokens=12))
    assert_lively(expected.tokens, 4)
    assert out[0]["tokens"] == expected.tokens
    assert out[0]["text"] == tokenizer.decode(expected.tokens)
