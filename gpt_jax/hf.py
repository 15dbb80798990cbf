"""Hugging Face model directories in and out: `load_hf` / `save_hf` for every family we
run (GPT-2, Llama, Qwen2, Qwen3, Mistral; `gpt_jax.hf_families` maps each one's config and
tensors), `load_hf_gpt2` / `save_hf_gpt2` for GPT-2 alone, and a directory's tokenizer and
EOS id.

A directory holds `config.json` (its `model_type` and `architectures` name the family) and
the weights in `model.safetensors`, or shards listed in `model.safetensors.index.json`
(float32, bfloat16 or float16), or PyTorch pickles (`pytorch_model.bin`, or shards listed
in `pytorch_model.bin.index.json`) when torch is installed, optionally
with a tokenizer (`tokenizer.json`, or `vocab.json` + `merges.txt`). The config is read and
checked (an unknown architecture, or a feature we do not implement, refused by name) before
any weight is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpt_jax import hf_families
from gpt_jax.checkpoint import write_atomic
from gpt_jax.config import GPTConfig
from gpt_jax.params import Params
from gpt_jax.tokenizer import BPETokenizer

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"


def _read_json(path: Path) -> tuple[dict, Path]:
    config_path = path / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: "
                                f"{config_path} does not exist")
    try:
        hf = json.loads(config_path.read_text())
    except ValueError as error:
        raise ValueError(f"{config_path} is not valid JSON: {error}") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {hf!r:.60}")
    return hf, config_path


def _read_config(path: Path, only: str | None = None) -> tuple[GPTConfig, str]:
    """`(config, model_type)` of the directory; with `only`, refusing any other model_type."""
    hf, config_path = _read_json(path)
    if only is not None and hf.get("model_type") != only:
        raise ValueError(f"{config_path}: model_type is {hf.get('model_type')!r}, "
                         f"only {only!r} checkpoints can be loaded")
    return hf_families.read_config(hf, config_path), hf["model_type"]


def _shards(path: Path, index: str) -> list[Path]:
    """The weight files an index (`model.safetensors.index.json`, ...) lists, in order."""
    return [path / f for f in sorted(set(json.loads((path / index).read_text())["weight_map"]
                                         .values()))]


def _read_tensors(path: Path, what: str) -> dict[str, np.ndarray]:
    """All tensors of the directory as numpy arrays in their stored dtype (bfloat16 as
    `ml_dtypes.bfloat16`; float32 from PyTorch pickles), by their names in the files."""
    if (path / SAFETENSORS).exists():
        return _safetensors_file(path / SAFETENSORS)
    if (path / SAFETENSORS_INDEX).exists():
        return {k: v for shard in _shards(path, SAFETENSORS_INDEX)
                for k, v in _safetensors_file(shard).items()}
    if (path / TORCH_BIN).exists():
        return _read_torch([path / TORCH_BIN])
    if (path / TORCH_BIN_INDEX).exists():
        return _read_torch(_shards(path, TORCH_BIN_INDEX))
    raise FileNotFoundError(f"{path} holds no {what} weights: expected {path / SAFETENSORS} "
                            f"(or {SAFETENSORS_INDEX}, {TORCH_BIN} or {TORCH_BIN_INDEX})")


def _safetensors_file(file: Path) -> dict[str, np.ndarray]:
    """One safetensors file's tensors. Raises ValueError naming the file when it cannot be
    read (truncated by an interrupted download or copy, or not safetensors at all)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file as read

    try:
        return read(file)
    except SafetensorError as error:
        raise ValueError(f"{file} is not a readable safetensors file ({error}); allowed: a "
                         "complete file (download or save it again)") from None


def _read_torch(files: list[Path]) -> dict[str, np.ndarray]:
    """The tensors of PyTorch pickles (what transformers wrote before safetensors, or with
    `safe_serialization=False`) as float32 arrays. torch reads them; it is optional
    (gpt-jax runs without it), so a directory holding only these files needs it installed.
    `weights_only`: tensors alone are unpickled, never code."""
    try:
        import torch
    except ImportError:
        raise ImportError(f"{files[0]} is a PyTorch pickle, which only torch reads, and torch "
                          f"is not installed: install torch (`pip install torch`), or save "
                          f"the weights as {SAFETENSORS}") from None
    tensors = {}
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=True)
        tensors |= {k: v.float().numpy() for k, v in state.items()}
    return tensors


def _load(path, dtype, only: str | None) -> tuple[GPTConfig, Params]:
    path = Path(path)
    config, model_type = _read_config(path, only)
    what = "GPT-2" if model_type == "gpt2" else "model"
    params = hf_families.to_params(_read_tensors(path, what), config, model_type, path)
    return config, jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def load_hf_config(path: str | os.PathLike) -> GPTConfig:
    """The GPTConfig of a Hugging Face directory of any family we load, from its config.json
    alone (no weights read). Raises FileNotFoundError and ValueError as `load_hf` does for
    the config."""
    return _read_config(Path(path))[0]


def load_hf(path: str | os.PathLike, dtype=np.float32) -> tuple[GPTConfig, Params]:
    """Load a Hugging Face directory of any family we run (`GPT2LMHeadModel`,
    `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM`) into
    `(GPTConfig, params)`: params in the layout of `gpt_jax.init_params`, as `dtype` arrays
    whatever the files hold.

    Raises:
      FileNotFoundError: no config.json, or no weights file (both named).
      ImportError: only PyTorch pickles are there (pytorch_model.bin or its shards) and torch
        is not installed (naming the file).
      ValueError, before any weight is read: an architecture we do not load; a size missing
        from config.json; a feature we do not implement (named with the file: Mistral's
        sliding window, a rope scaling type other than llama3, mixture of experts, ...).
        After: a tensor missing, unexpected, or of the wrong shape (named, with its shape
        and the expected one).
    """
    return _load(path, dtype, only=None)


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
    return _load(path, dtype, only="gpt2")


def save_hf(config: GPTConfig, params: Params, path: str | os.PathLike,
            dtype=np.float32) -> None:
    """Write `params` (stacked layout) as a Hugging Face directory (config.json +
    model.safetensors, `dtype` weights) of the family that expresses `config` (GPT-2,
    Llama, Qwen2 or Qwen3; `gpt_jax.hf_families.write_family`), which
    `transformers.AutoModelForCausalLM.from_pretrained(path)` opens.

    Each file is written to a temporary name and renamed into place, so a failure leaves no
    half-written file behind.

    Raises:
      ValueError: no family we write expresses `config` (before params are read).
    """
    _save(config, params, path, dtype, hf_families.write_family(config))


def save_hf_gpt2(config: GPTConfig, params: Params, path: str | os.PathLike) -> None:
    """Write `params` as a Hugging Face GPT-2 directory (config.json + model.safetensors,
    float32) that `transformers.GPT2LMHeadModel.from_pretrained(path)` opens.

    Each file is written to a temporary name and renamed into place, so a failure leaves no
    half-written file behind.

    Raises:
      ValueError: the config uses grouped-query attention (n_kv_heads < n_heads), which
        GPT-2 cannot express, or another family's fields.
    """
    model_type = hf_families.write_family(config)
    if model_type != "gpt2":
        raise ValueError(f"this config is not GPT-2's (it is written as {model_type!r}); "
                         "use save_hf")
    _save(config, params, path, np.float32, model_type)


def _save(config: GPTConfig, params: Params, path, dtype, model_type: str) -> None:
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    host = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, dtype)), jax.device_get(params))
    tensors = hf_families.to_tensors(host, config, model_type)
    hf = hf_families.hf_config(config, model_type) | {"torch_dtype": np.dtype(dtype).name}
    for name, write in (
        (SAFETENSORS, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"})),
        ("config.json", lambda tmp: Path(tmp).write_text(json.dumps(hf, indent=2))),
    ):
        write_atomic(path / name, write)


def _eos_ids(value) -> tuple[int, ...]:
    """An `eos_token_id` entry (an int, a list of ints, or absent) as a tuple of ids."""
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def load_hf_eos_token_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """Every EOS id of the directory: `eos_token_id` (an int or a list, as Llama 3 and Qwen
    configs hold) of config.json and of generation_config.json, in that order without
    repeats; () when neither names one. Each one ends generation."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        if (Path(path) / name).exists():
            found = _eos_ids(json.loads((Path(path) / name).read_text()).get("eos_token_id"))
            ids += [i for i in found if i not in ids]
    return tuple(ids)


def load_hf_tokenizer(path: str | os.PathLike) -> BPETokenizer | None:
    """The directory's tokenizer, from `tokenizer.json` (its added and special tokens, and
    its post-processor's BOS: what decides it for `transformers.AutoTokenizer` too, whatever
    tokenizer_config.json's `add_bos_token` says), else byte-level BPE from
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
