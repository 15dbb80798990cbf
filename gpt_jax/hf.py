"""Hugging Face GPT-2 checkpoints: import into our params layout, and export back.

A Hugging Face GPT-2 directory holds `config.json` (`model_type` "gpt2", `n_layer`,
`n_head`, `n_embd`, `n_positions`, `vocab_size`, `layer_norm_epsilon`, `n_inner`) and the
weights in `model.safetensors` (or shards listed in `model.safetensors.index.json`, or
`pytorch_model.bin` when torch is installed), optionally with a tokenizer (`tokenizer.json`,
or `vocab.json` + `merges.txt`).

Weight layout (transformers `modeling_gpt2.py`): linear layers are `Conv1D` with weights
`[in, out]`, so `y = x @ W + b` with no transpose. Per block `h.{i}`: `ln_1`, `attn.c_attn`
`[D, 3D]` (query, key, value concatenated along the output axis; head n owns columns
`n*H .. n*H + H - 1` of each), `attn.c_proj` `[D, D]`, `ln_2`, `mlp.c_fc` `[D, F]`,
`mlp.c_proj` `[F, D]`; then `ln_f`, `wte` `[V, D]`, `wpe` `[n_positions, D]`, and an output
projection tied to `wte`. `GPT2LMHeadModel` prefixes every name with `transformer.`; a bare
`GPT2Model` (the released `gpt2` checkpoint) does not, and older files also carry the
causal-mask buffers `attn.bias` / `attn.masked_bias`, which hold no weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax.checkpoint import write_atomic
from gpt_jax.config import GPTConfig
from gpt_jax.params import Params
from gpt_jax.tokenizer import BPETokenizer

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # the GELU tanh approximation our MLP uses
_BUFFERS = ("attn.bias", "attn.masked_bias")  # causal-mask buffers, not weights


def _read_config(path: Path) -> GPTConfig:
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face GPT-2 directory: "
                                f"{config_path} does not exist")
    hf = json.loads(config_path.read_text())
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"{config_path}: model_type is {hf.get('model_type')!r}, "
                         f"only 'gpt2' checkpoints can be loaded")
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new"), _TANH_GELUS),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False),
                                            (False,)),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), (True,)),
        "add_cross_attention": (hf.get("add_cross_attention", False), (False,)),
    }
    missing = [k for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size") if k not in hf]
    if missing:
        raise ValueError(f"{config_path}: missing {', '.join(missing)}")
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            raise ValueError(f"{config_path}: {name}={value!r} is not supported "
                             f"(supported: {', '.join(map(repr, allowed))})")
    d_model = hf["n_embd"]
    d_ff = hf.get("n_inner") or 4 * d_model
    if d_ff % d_model:
        raise ValueError(f"{config_path}: n_inner={d_ff} must be a multiple of n_embd={d_model}")
    return GPTConfig(
        vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"], n_layers=hf["n_layer"],
        n_heads=hf["n_head"], d_model=d_model, mlp_ratio=d_ff // d_model,
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of the checkpoint as numpy arrays, names without a `transformer.` prefix."""
    from safetensors.numpy import load_file

    if (path / SAFETENSORS).exists():
        tensors = load_file(path / SAFETENSORS)
    elif (path / SAFETENSORS_INDEX).exists():
        shards = sorted(set(json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"].values()))
        tensors = {k: v for shard in shards for k, v in load_file(path / shard).items()}
    elif (path / TORCH_BIN).exists():
        try:
            import torch
        except ImportError:
            raise ImportError(f"{path / TORCH_BIN} needs torch to be read; install torch or "
                              f"convert it to {SAFETENSORS}") from None
        state = torch.load(path / TORCH_BIN, map_location="cpu", weights_only=True)
        tensors = {k: v.float().numpy() for k, v in state.items()}
    else:
        raise FileNotFoundError(f"{path} holds no GPT-2 weights: expected {path / SAFETENSORS} "
                                f"(or {SAFETENSORS_INDEX} or {TORCH_BIN})")
    return {k.removeprefix("transformer."): v for k, v in tensors.items()}


def _expected_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    D, F, V = config.d_model, config.d_ff, config.vocab_size
    shapes = {"wte.weight": (V, D), "wpe.weight": (config.max_seq_len, D),
              "ln_f.weight": (D,), "ln_f.bias": (D,)}
    for i in range(config.n_layers):
        shapes |= {
            f"h.{i}.ln_1.weight": (D,), f"h.{i}.ln_1.bias": (D,),
            f"h.{i}.attn.c_attn.weight": (D, 3 * D), f"h.{i}.attn.c_attn.bias": (3 * D,),
            f"h.{i}.attn.c_proj.weight": (D, D), f"h.{i}.attn.c_proj.bias": (D,),
            f"h.{i}.ln_2.weight": (D,), f"h.{i}.ln_2.bias": (D,),
            f"h.{i}.mlp.c_fc.weight": (D, F), f"h.{i}.mlp.c_fc.bias": (F,),
            f"h.{i}.mlp.c_proj.weight": (F, D), f"h.{i}.mlp.c_proj.bias": (D,),
        }
    return shapes


def _check_tensors(tensors: dict[str, np.ndarray], config: GPTConfig, where: Path) -> None:
    expected = _expected_shapes(config)
    expected["lm_head.weight"] = expected["wte.weight"]  # optional; tied to wte
    for name, array in tensors.items():
        if name.endswith(_BUFFERS):
            continue
        if name not in expected:
            raise ValueError(f"{where}: unexpected tensor {name!r} of shape {array.shape}")
        if tuple(array.shape) != expected[name]:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(array.shape)}, "
                             f"expected {expected[name]} from config.json")
    missing = [name for name in _expected_shapes(config) if name not in tensors]
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    if "lm_head.weight" in tensors and not np.array_equal(tensors["lm_head.weight"],
                                                          tensors["wte.weight"]):
        raise ValueError(f"{where}: lm_head.weight differs from wte.weight; only the tied "
                         f"output projection of GPT-2 is supported")


def _to_params(t: dict[str, np.ndarray], config: GPTConfig, dtype) -> Params:
    L, D, N, H = config.n_layers, config.d_model, config.n_heads, config.head_dim

    def stack(name: str) -> np.ndarray:
        return np.stack([t[f"h.{i}.{name}"] for i in range(L)])

    def norm(prefix: str, lead: bool = True) -> Params:
        get = stack if lead else (lambda name: t[name])
        return {"scale": get(f"{prefix}.weight"), "bias": get(f"{prefix}.bias")}

    qkv_w, qkv_b = stack("attn.c_attn.weight"), stack("attn.c_attn.bias")  # [L, D, 3D], [L, 3D]
    w_q, w_k, w_v = (w.reshape(L, D, N, H) for w in np.split(qkv_w, 3, axis=-1))
    b_q, b_k, b_v = (b.reshape(L, N, H) for b in np.split(qkv_b, 3, axis=-1))
    params = {
        "wte": t["wte.weight"],
        "wpe": t["wpe.weight"],
        "blocks": {
            "ln1": norm("ln_1"),
            "attn": {
                "w_q": w_q, "b_q": b_q, "w_k": w_k, "b_k": b_k, "w_v": w_v, "b_v": b_v,
                "w_o": stack("attn.c_proj.weight").reshape(L, N, H, D),
                "b_o": stack("attn.c_proj.bias"),
            },
            "ln2": norm("ln_2"),
            "mlp": {
                "w_in": stack("mlp.c_fc.weight"), "b_in": stack("mlp.c_fc.bias"),
                "w_out": stack("mlp.c_proj.weight"), "b_out": stack("mlp.c_proj.bias"),
            },
        },
        "ln_f": norm("ln_f", lead=False),
    }
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def load_hf_config(path: str | os.PathLike) -> GPTConfig:
    """The GPTConfig of a Hugging Face GPT-2 directory, from its config.json alone (no
    weights read). Raises FileNotFoundError and ValueError as `load_hf_gpt2` does for the
    config."""
    return _read_config(Path(path))


def load_hf_gpt2(path: str | os.PathLike, dtype=np.float32) -> tuple[GPTConfig, Params]:
    """Load a Hugging Face GPT-2 directory of any size into `(GPTConfig, params)`.

    The config maps n_layer -> n_layers, n_head -> n_heads, n_embd -> d_model,
    n_positions -> max_seq_len, vocab_size, layer_norm_epsilon -> layer_norm_eps and
    n_inner / n_embd -> mlp_ratio; params have the layout of `gpt_jax.init_params`, as
    `dtype` arrays.

    Raises:
      FileNotFoundError: no config.json, or no weights file (both named).
      ImportError: only pytorch_model.bin is there and torch is not installed.
      ValueError: model_type is not "gpt2"; a size is missing from config.json; a config
        option we do not implement (named, with the supported values); a tensor is missing, unexpected, or of the wrong shape
        (named, with its shape and the expected one).
    """
    path = Path(path)
    config = _read_config(path)
    tensors = _read_tensors(path)
    _check_tensors(tensors, config, path)
    return config, _to_params(tensors, config, dtype)


def _to_tensors(params: Params, config: GPTConfig) -> dict[str, np.ndarray]:
    L, D = config.n_layers, config.d_model
    p = jax.tree.map(lambda x: np.asarray(x, np.float32), jax.device_get(params))
    attn, mlp = p["blocks"]["attn"], p["blocks"]["mlp"]
    qkv_w = np.concatenate([attn[w].reshape(L, D, D) for w in ("w_q", "w_k", "w_v")], axis=-1)
    qkv_b = np.concatenate([attn[b].reshape(L, D) for b in ("b_q", "b_k", "b_v")], axis=-1)
    per_layer = {
        "ln_1.weight": p["blocks"]["ln1"]["scale"], "ln_1.bias": p["blocks"]["ln1"]["bias"],
        "attn.c_attn.weight": qkv_w, "attn.c_attn.bias": qkv_b,
        "attn.c_proj.weight": attn["w_o"].reshape(L, D, D), "attn.c_proj.bias": attn["b_o"],
        "ln_2.weight": p["blocks"]["ln2"]["scale"], "ln_2.bias": p["blocks"]["ln2"]["bias"],
        "mlp.c_fc.weight": mlp["w_in"], "mlp.c_fc.bias": mlp["b_in"],
        "mlp.c_proj.weight": mlp["w_out"], "mlp.c_proj.bias": mlp["b_out"],
    }
    tensors = {"transformer.wte.weight": p["wte"], "transformer.wpe.weight": p["wpe"],
               "transformer.ln_f.weight": p["ln_f"]["scale"],
               "transformer.ln_f.bias": p["ln_f"]["bias"]}
    for name, stacked in per_layer.items():
        tensors |= {f"transformer.h.{i}.{name}": stacked[i] for i in range(L)}
    return {k: np.ascontiguousarray(v) for k, v in tensors.items()}


def _hf_config(config: GPTConfig) -> dict:
    return {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size, "n_positions": config.max_seq_len,
        "n_layer": config.n_layers, "n_head": config.n_heads, "n_embd": config.d_model,
        "n_inner": config.d_ff, "layer_norm_epsilon": config.layer_norm_eps,
        "activation_function": "gelu_new", "tie_word_embeddings": True,
        # Our models know no special tokens; GPT2Config's default (50256) may be out of range.
        "bos_token_id": None, "eos_token_id": None,
    }


def save_hf_gpt2(config: GPTConfig, params: Params, path: str | os.PathLike) -> None:
    """Write `params` as a Hugging Face GPT-2 directory (config.json + model.safetensors,
    float32) that `transformers.GPT2LMHeadModel.from_pretrained(path)` opens.

    Each file is written to a temporary name and renamed into place, so a failure leaves no
    half-written file behind.

    Raises:
      ValueError: the config uses grouped-query attention (n_kv_heads < n_heads), which
        GPT-2 cannot express.
    """
    from safetensors.numpy import save_file

    if config.kv_heads != config.n_heads:
        raise ValueError(f"GPT-2 has one key/value head per query head; this config has "
                         f"n_kv_heads={config.kv_heads} < n_heads={config.n_heads}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = _to_tensors(params, config)
    for name, write in (
        (SAFETENSORS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"})),
        ("config.json", lambda tmp: Path(tmp).write_text(json.dumps(_hf_config(config), indent=2))),
    ):
        write_atomic(path / name, write)


def load_hf_eos_token_id(path: str | os.PathLike) -> int | None:
    """The `eos_token_id` of the directory's config.json (50256 for OpenAI's GPT-2), or None
    when it has none (or a list, which GPT-2 configs never hold)."""
    eos = json.loads((Path(path) / "config.json").read_text()).get("eos_token_id")
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None


def load_hf_tokenizer(path: str | os.PathLike) -> BPETokenizer | None:
    """The directory's GPT-2 tokenizer, from `tokenizer.json`, else byte-level BPE from
    `vocab.json` + `merges.txt` (`tokenizers` library); None when it has neither."""
    import tokenizers

    path = Path(path)
    if (path / "tokenizer.json").exists():
        return BPETokenizer.load(path / "tokenizer.json")
    if (path / "vocab.json").exists() and (path / "merges.txt").exists():
        model = tokenizers.models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt"))
        tokenizer = tokenizers.Tokenizer(model)
        tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tokenizers.decoders.ByteLevel()
        return BPETokenizer(tokenizer)
    return None
