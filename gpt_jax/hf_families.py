"""The Hugging Face families we read and write, each as data: how its `config.json` maps to a
`GPTConfig` (and which of its features we refuse), and how its tensor names and layouts map
to our params. `gpt_jax.hf` does the directory I/O around them.

GPT-2 (transformers `modeling_gpt2.py`): linear layers are `Conv1D` with weights `[in, out]`,
so `y = x @ W + b` with no transpose. Per block `h.{i}`: `ln_1`, `attn.c_attn` `[D, 3D]`
(query, key, value concatenated along the output axis; head n owns columns `n*H .. n*H + H
- 1` of each), `attn.c_proj` `[D, D]`, `ln_2`, `mlp.c_fc` `[D, F]`, `mlp.c_proj` `[F, D]`;
then `ln_f`, `wte` `[V, D]`, `wpe` `[n_positions, D]`, and an output projection tied to
`wte`. `GPT2LMHeadModel` prefixes every name with `transformer.`; a bare `GPT2Model` (the
released `gpt2` checkpoint) does not, and older files also carry the causal-mask buffers
`attn.bias` / `attn.masked_bias`, which hold no weights.

The Llama family (`modeling_llama.py`, `modeling_qwen2.py`, `modeling_qwen3.py`,
`modeling_mistral.py`): `nn.Linear` weights `[out, in]`. `model.embed_tokens`, per block
`model.layers.{i}`: `input_layernorm`, `self_attn.{q,k,v,o}_proj` (q/k/v biases in Qwen2,
all four with `attention_bias`), `self_attn.{q,k}_norm` `[H]` (Qwen3), `post_attention_
layernorm`, `mlp.{gate,up,down}_proj` (biases with `mlp_bias`); `model.norm`, and `lm_head`
unless `tie_word_embeddings`. Rotary embeddings use `rotate_half` (the two halves of a
head), as `gpt_jax.layers.rope` does, so q and k need no permutation.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from gpt_jax.config import LLAMA, GPTConfig, RopeScaling
from gpt_jax.params import Params, init_params

# model_type -> the architectures we load with it (the first is the one we write).
ARCHITECTURES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Model"),
    "llama": ("LlamaForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "mistral": ("MistralForCausalLM",),
}
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")  # the GELU tanh approximation our MLP uses
_GPT2_BUFFERS = ("attn.bias", "attn.masked_bias")  # causal-mask buffers, not weights
_ROPE_BUFFERS = ("rotary_emb.inv_freq",)  # older Llama files store the frequencies
_MOE = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
        "moe_intermediate_size")  # mixture-of-experts fields: none of these models has them


def family(hf: dict, where: Path) -> str:
    """The model_type of a config.json we load, checked against its architectures.

    Raises:
      ValueError: an architecture or model_type we do not load (naming it, the file, and
        the ones we do).
    """
    model_type = hf.get("model_type")
    known = ARCHITECTURES.get(model_type, ())
    unknown = [a for a in hf.get("architectures") or known[:1] if a not in known]
    if not known or unknown:
        supported = ", ".join(a for archs in ARCHITECTURES.values() for a in archs)
        raise ValueError(f"{where}: architecture {(unknown or [None])[0]!r} (model_type "
                         f"{model_type!r}) is not supported; supported: {supported}")
    return model_type


def _refuse(where: Path, feature: str, value, allowed) -> None:
    raise ValueError(f"{where}: {feature}={value!r} is not supported "
                     f"(supported: {', '.join(map(repr, allowed))})")


def _sizes(hf: dict, where: Path, names) -> None:
    missing = [k for k in names if k not in hf]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")


# ------------------------------------------------------------------------- config.json


def read_config(hf: dict, where: Path) -> GPTConfig:
    """The GPTConfig of a config.json (`hf`, read from `where`) of any family we load.

    Raises:
      ValueError: an unknown architecture; a size missing; a feature we do not implement
        (named with its value and the supported ones: Mistral's sliding window, a rope
        scaling type other than "llama3", mixture-of-experts fields, an activation...).
    """
    model_type = family(hf, where)
    return _gpt2_config(hf, where) if model_type == "gpt2" else _llama_config(hf, where)


def _gpt2_config(hf: dict, where: Path) -> GPTConfig:
    unsupported = {
        "activation_function": (hf.get("activation_function", "gelu_new"), _TANH_GELUS),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False),
                                            (False,)),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), (True,)),
        "add_cross_attention": (hf.get("add_cross_attention", False), (False,)),
    }
    _sizes(hf, where, ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"))
    for name, (value, allowed) in unsupported.items():
        if value not in allowed:
            _refuse(where, name, value, allowed)
    d_model = hf["n_embd"]
    d_ff = hf.get("n_inner") or 4 * d_model
    if d_ff % d_model:
        raise ValueError(f"{where}: n_inner={d_ff} must be a multiple of n_embd={d_model}")
    return GPTConfig(
        vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"], n_layers=hf["n_layer"],
        n_heads=hf["n_head"], d_model=d_model, mlp_ratio=d_ff // d_model,
        layer_norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def _refuse_llama_features(hf: dict, where: Path) -> None:
    """Refuse, by name, what the Llama-family files may ask for that we do not implement."""
    for name in _MOE:
        if hf.get(name):
            raise ValueError(f"{where}: {name}={hf[name]!r} (mixture of experts) is not "
                             "supported")
    window = hf.get("sliding_window")
    if (hf.get("model_type") == "mistral" and window is not None
            and window < hf["max_position_embeddings"]):
        raise ValueError(f"{where}: sliding_window={window!r} (sliding-window attention, "
                         f"shorter than max_position_embeddings="
                         f"{hf['max_position_embeddings']}) is not supported; null is")
    sliding = [t for t in hf.get("layer_types") or () if t != "full_attention"]
    if hf.get("use_sliding_window") or sliding:
        raise ValueError(f"{where}: sliding-window attention (use_sliding_window="
                         f"{hf.get('use_sliding_window')!r}, layer_types {sorted(set(sliding))}) "
                         "is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        _refuse(where, "hidden_act", hf["hidden_act"], ("silu",))


def _rope(hf: dict, where: Path) -> tuple[float, RopeScaling | None]:
    """`(rope_theta, rope_scaling)` from either spelling: transformers 5's `rope_parameters`,
    or the `rope_theta` and `rope_scaling` of the files on the Hub; `rope_scaling` first
    where both are given, as transformers' `convert_rope_params_to_dict` takes it (a
    transformers 5 config with a `rope_scaling` added by hand)."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        _refuse(where, "rope_scaling type", kind, ("default", "llama3"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse(where, "partial_rotary_factor", partial, (1.0,))
    if kind == "default":
        return theta, None
    return theta, RopeScaling(float(params["factor"]), float(params["low_freq_factor"]),
                              float(params["high_freq_factor"]),
                              int(params["original_max_position_embeddings"]))


def _llama_config(hf: dict, where: Path) -> GPTConfig:
    _sizes(hf, where, ("vocab_size", "max_position_embeddings", "num_hidden_layers",
                       "num_attention_heads", "hidden_size", "intermediate_size"))
    _refuse_llama_features(hf, where)
    rope_theta, rope_scaling = _rope(hf, where)
    model_type = hf["model_type"]
    attention_bias = bool(hf.get("attention_bias", False))
    qkv_bias = True if model_type == "qwen2" else attention_bias
    out_bias = False if model_type == "qwen2" else attention_bias
    D, N = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or (128 if model_type == "qwen3" else D // N)
    return GPTConfig(
        vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
        n_layers=hf["num_hidden_layers"], n_heads=N, d_model=D,
        n_kv_heads=hf.get("num_key_value_heads") or N,
        layer_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta, rope_scaling=rope_scaling,
        intermediate_size=hf["intermediate_size"],
        head_size=None if head_dim * N == D else head_dim,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        **{**LLAMA, "qkv_bias": qkv_bias, "out_bias": out_bias,
           "mlp_bias": bool(hf.get("mlp_bias", False))},
    )


def write_family(config: GPTConfig) -> str:
    """The model_type that expresses `config` (a Mistral file's config comes back as Llama,
    which runs the same model).

    Raises:
      ValueError: no family we write has this combination of fields (naming them).
    """
    gpt2 = GPTConfig(config.vocab_size, config.max_seq_len, config.n_layers, config.n_heads,
                     config.d_model, mlp_ratio=config.mlp_ratio,
                     layer_norm_eps=config.layer_norm_eps)
    if config.replace(n_kv_heads=None) == gpt2:
        if config.kv_heads != config.n_heads:
            raise ValueError(f"GPT-2 has one key/value head per query head; this config has "
                             f"n_kv_heads={config.kv_heads} < n_heads={config.n_heads}")
        return "gpt2"
    shape = dict(norm=config.norm, positions=config.positions, mlp=config.mlp)
    if shape == {k: LLAMA[k] for k in shape}:
        if config.qk_norm and config.qkv_bias == config.out_bias and not config.mlp_bias:
            return "qwen3"
        if config.qkv_bias and not config.out_bias and not config.mlp_bias:
            return "qwen2"
        if not config.qk_norm and config.qkv_bias == config.out_bias:
            return "llama"
    raise ValueError(f"no Hugging Face family we write expresses this config ({config}): "
                     "GPT-2, or RMSNorm + rope + gated_silu with q/k/v and output biases "
                     "both on or both off (Llama, Qwen3 with qk_norm) or q/k/v only (Qwen2)")


def hf_config(config: GPTConfig, model_type: str) -> dict:
    """The config.json of `config` as `model_type` (see `write_family`)."""
    common = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type][0]],
              "vocab_size": config.vocab_size,
              # Our models know no special tokens; a family's default id may be out of range.
              "bos_token_id": None, "eos_token_id": None}
    if model_type == "gpt2":
        return common | {
            "n_positions": config.max_seq_len, "n_layer": config.n_layers,
            "n_head": config.n_heads, "n_embd": config.d_model, "n_inner": config.d_ff,
            "layer_norm_epsilon": config.layer_norm_eps, "activation_function": "gelu_new",
            "tie_word_embeddings": True}
    s = config.rope_scaling
    scaling = None if s is None else {
        "rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_seq_len}
    return common | {
        "max_position_embeddings": config.max_seq_len, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads,
        "hidden_size": config.d_model, "intermediate_size": config.d_ff,
        "head_dim": config.head_dim, "rms_norm_eps": config.layer_norm_eps,
        "hidden_act": "silu", "rope_theta": config.rope_theta, "rope_scaling": scaling,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.qkv_bias, "mlp_bias": config.mlp_bias,
        "use_sliding_window": False, "sliding_window": None}


# ------------------------------------------------------------------------- tensors


def _llama_names(config: GPTConfig) -> list[tuple[str, tuple[str, ...], tuple[int, ...], bool]]:
    """Every tensor of a Llama-family file: `(name, our path, its shape in the file,
    stored as nn.Linear [out, in])`; per-layer names have `{i}` for the layer."""
    D, N, K, H, F, V = (config.d_model, config.n_heads, config.kv_heads, config.head_dim,
                        config.d_ff, config.vocab_size)
    attn = [("q", N * H, D), ("k", K * H, D), ("v", K * H, D), ("o", D, N * H)]
    mlp = [("gate", "w_gate", F, D), ("up", "w_in", F, D), ("down", "w_out", D, F)]
    names = [("model.embed_tokens.weight", ("wte",), (V, D), False),
             ("model.norm.weight", ("ln_f", "scale"), (D,), False)]
    if not config.tie_embeddings:
        names.append(("lm_head.weight", ("lm_head",), (V, D), False))
    layer = "model.layers.{i}."
    names += [(layer + "input_layernorm.weight", ("ln1", "scale"), (D,), False),
              (layer + "post_attention_layernorm.weight", ("ln2", "scale"), (D,), False)]
    for n, out, inp in attn:
        names.append((layer + f"self_attn.{n}_proj.weight", ("attn", f"w_{n}"), (out, inp), True))
        if config.out_bias if n == "o" else config.qkv_bias:
            names.append((layer + f"self_attn.{n}_proj.bias", ("attn", f"b_{n}"), (out,), False))
    if config.qk_norm:
        names += [(layer + f"self_attn.{n}_norm.weight", ("attn", f"{n}_norm", "scale"), (H,),
                   False) for n in ("q", "k")]
    for hf, ours, out, inp in mlp:
        names.append((layer + f"mlp.{hf}_proj.weight", ("mlp", ours), (out, inp), True))
        if config.mlp_bias:
            names.append((layer + f"mlp.{hf}_proj.bias", ("mlp", "b" + ours[1:]), (out,), False))
    return names


def _ours(shapes: Params, path: tuple[str, ...], per_layer: bool) -> tuple[int, ...]:
    node = shapes["blocks"] if per_layer else shapes
    for key in path:
        node = node[key]
    return node.shape[1:] if per_layer else node.shape


def _params_shapes(config: GPTConfig) -> Params:
    return jax.eval_shape(lambda key: init_params(config, key), jax.random.key(0))


def _check_names(tensors: dict, expected: dict, where: Path, ignore=()) -> None:
    """Every tensor expected, of its shape, and no other (but buffers in `ignore`)."""
    for name, array in tensors.items():
        if name.endswith(ignore):
            continue
        if name not in expected:
            raise ValueError(f"{where}: unexpected tensor {name!r} of shape {array.shape}")
        if tuple(array.shape) != expected[name]:
            raise ValueError(f"{where}: tensor {name!r} has shape {tuple(array.shape)}, "
                             f"expected {expected[name]} from config.json")
    missing = [name for name in expected if name not in tensors]
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r}"
                         + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


def _check_tied(tensors: dict, head: str, table: str, where: Path) -> None:
    """A tied model's file may still hold its output matrix: it must be the embedding."""
    if head in tensors and not np.array_equal(tensors.pop(head), tensors[table]):
        raise ValueError(f"{where}: {head} differs from {table}, but the config ties them "
                         "(tie_word_embeddings)")


def _llama_params(tensors: dict, config: GPTConfig, where: Path) -> Params:
    names = _llama_names(config)
    per_layer = [entry for entry in names if "{i}" in entry[0]]
    expected = {name: shape for name, _, shape, _ in names if "{i}" not in name}
    expected |= {name.format(i=i): shape for name, _, shape, _ in per_layer
                 for i in range(config.n_layers)}
    if config.tie_embeddings:
        _check_tied(tensors, "lm_head.weight", "model.embed_tokens.weight", where)
    _check_names(tensors, expected, where, ignore=_ROPE_BUFFERS)
    shapes, params = _params_shapes(config), {"blocks": {}}
    for name, path, _, linear in names:
        layered = "{i}" in name
        arrays = [tensors[name.format(i=i)] for i in range(config.n_layers)] if layered \
            else [tensors[name]]
        ours = [(a.T if linear else a).reshape(_ours(shapes, path, layered)) for a in arrays]
        node = params["blocks"] if layered else params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = np.stack(ours) if layered else ours[0]
    return params


def _llama_tensors(params: Params, config: GPTConfig) -> dict[str, np.ndarray]:
    tensors = {}
    for name, path, shape, linear in _llama_names(config):
        layered = "{i}" in name
        node = params["blocks"] if layered else params
        for key in path:
            node = node[key]
        for i in range(config.n_layers) if layered else [None]:
            array = node[i] if layered else node
            array = array.reshape(shape[::-1]).T if linear else array.reshape(shape)
            tensors[name.format(i=i)] = array
    return tensors


def _gpt2_expected(config: GPTConfig) -> dict[str, tuple[int, ...]]:
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


def _gpt2_params(tensors: dict, config: GPTConfig, where: Path) -> Params:
    t = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    if "lm_head.weight" in t and not np.array_equal(t.pop("lm_head.weight"), t["wte.weight"]):
        raise ValueError(f"{where}: lm_head.weight differs from wte.weight; only the tied "
                         f"output projection of GPT-2 is supported")
    _check_names(t, _gpt2_expected(config), where, ignore=_GPT2_BUFFERS)
    L, D, N, H = config.n_layers, config.d_model, config.n_heads, config.head_dim

    def stack(name: str) -> np.ndarray:
        return np.stack([t[f"h.{i}.{name}"] for i in range(L)])

    def norm(prefix: str, lead: bool = True) -> Params:
        get = stack if lead else (lambda name: t[name])
        return {"scale": get(f"{prefix}.weight"), "bias": get(f"{prefix}.bias")}

    qkv_w, qkv_b = stack("attn.c_attn.weight"), stack("attn.c_attn.bias")  # [L, D, 3D], [L, 3D]
    w_q, w_k, w_v = (w.reshape(L, D, N, H) for w in np.split(qkv_w, 3, axis=-1))
    b_q, b_k, b_v = (b.reshape(L, N, H) for b in np.split(qkv_b, 3, axis=-1))
    return {
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


def _gpt2_tensors(p: Params, config: GPTConfig) -> dict[str, np.ndarray]:
    L, D = config.n_layers, config.d_model
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
    return tensors


def to_params(tensors: dict[str, np.ndarray], config: GPTConfig, model_type: str,
              where: Path) -> Params:
    """Our params (numpy, stacked layout) from a file's tensors, checked first.

    Raises:
      ValueError: a tensor missing, unexpected, or of the wrong shape (named, with its
        shape and the expected one); a tied model's output matrix unlike its embedding.
    """
    fn = _gpt2_params if model_type == "gpt2" else _llama_params
    return fn(dict(tensors), config, where)


def to_tensors(params: Params, config: GPTConfig, model_type: str) -> dict[str, np.ndarray]:
    """The file's tensors (numpy, contiguous) from our params (host arrays, stacked)."""
    fn = _gpt2_tensors if model_type == "gpt2" else _llama_tensors
    return {k: np.ascontiguousarray(v) for k, v in fn(params, config).items()}

