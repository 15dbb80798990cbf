"""Model configuration: one frozen, hashable dataclass with named presets.

The architecture is data: GPT-2 (LayerNorm, learned positions, GELU MLP, biases everywhere,
tied output) is the default value of every field, and the Llama family (Llama, Qwen2, Qwen3,
Mistral, SmolLM: RMSNorm, rotary positions, gated SiLU MLP, no biases or q/k/v biases only,
per-head q/k norm, a head dim of its own, untied output) are other values of the same fields,
read by the one block body of `gpt_jax.model`. Being frozen and hashable, a `GPTConfig` can
be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses

NORMS = ("layernorm", "rmsnorm")  # LayerNorm (Ba et al. 2016); RMSNorm (Zhang & Sennrich 2019)
POSITIONS = ("learned", "rope")  # a learned table (GPT-2); rotary embeddings (Su et al. 2021)
MLPS = ("gelu", "gated_silu")  # GPT-2's GELU MLP; SwiGLU (Shazeer 2020) as Llama runs it


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling (transformers' `rope_type` "llama3"): wavelengths
    longer than `original_max_seq_len / low_freq_factor` are stretched by `factor`, shorter
    than `original_max_seq_len / high_freq_factor` kept, the ones between interpolated."""

    factor: float  # 8 in Llama 3.1 and 3.2
    low_freq_factor: float  # 1
    high_freq_factor: float  # 4
    original_max_seq_len: int  # the context the model was pre-trained at (8192)

    def __post_init__(self):
        if not self.factor > 0 or not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"RopeScaling needs factor > 0 and high_freq_factor > "
                             f"low_freq_factor > 0, got {self}")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and family of a decoder-only transformer (GPT-2 unless told otherwise).

    Raises:
      ValueError: a size is not positive, `d_model` is not divisible by `n_heads` (without
        an explicit `head_size`), `n_heads` is not divisible by `n_kv_heads`, a choice field
        (`norm`, `positions`, `mlp`) is not one of its values, or `rope_theta` /
        `rope_scaling` are set without rotary positions (each message names the field).
    """

    vocab_size: int  # V, number of token ids
    max_seq_len: int  # the context: the learned position table's length, the crop window
    n_layers: int  # L, transformer blocks
    n_heads: int  # N, query heads
    d_model: int  # D, residual stream width
    n_kv_heads: int | None = None  # K, key/value heads (None: same as n_heads; fewer is GQA/MQA)
    mlp_ratio: int = 4  # MLP hidden width is mlp_ratio * d_model (unless intermediate_size)
    layer_norm_eps: float = 1e-5  # epsilon of every norm, LayerNorm or RMSNorm (GPT-2: 1e-5)
    norm: str = "layernorm"  # one of NORMS; RMSNorm has a scale and no bias
    positions: str = "learned"  # one of POSITIONS; "rope" has no position table (`wpe`)
    rope_theta: float = 10000.0  # rotary base wavelength (Llama 3: 500000, Qwen2.5: 1000000)
    rope_scaling: RopeScaling | None = None  # Llama 3's frequency scaling, or none
    mlp: str = "gelu"  # one of MLPS; "gated_silu" has w_gate beside w_in (up) and w_out (down)
    intermediate_size: int | None = None  # MLP hidden width F when not mlp_ratio * d_model
    head_size: int | None = None  # H when not d_model // n_heads (Qwen3)
    qkv_bias: bool = True  # biases on the q, k, v projections (GPT-2, Qwen2)
    out_bias: bool = True  # a bias on the attention output projection (GPT-2)
    mlp_bias: bool = True  # biases on the MLP's projections (GPT-2)
    qk_norm: bool = False  # RMSNorm of each query and key head before rotary (Qwen3)
    tie_embeddings: bool = True  # output projection is `wte` (else its own `lm_head` [V, D])

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "n_layers", "n_heads", "d_model", "mlp_ratio"):
            _check_positive(name, getattr(self, name))
        for name in ("intermediate_size", "head_size"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.head_size is None and self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
                "(or set head_size)"
            )
        if self.n_kv_heads is not None and (
            self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads
        ):
            raise ValueError(
                f"GPTConfig.n_kv_heads={self.n_kv_heads} must be a positive divisor of "
                f"n_heads={self.n_heads}"
            )
        for name, allowed in (("norm", NORMS), ("positions", POSITIONS), ("mlp", MLPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {', '.join(map(repr, allowed))}"
                                 f", got {getattr(self, name)!r}")
        self._check_rope()

    def _check_rope(self):
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"GPTConfig.rope_scaling must be a RopeScaling or None, got "
                             f"{self.rope_scaling!r}")
        if self.positions == "rope":
            if not self.rope_theta > 0:
                raise ValueError(f"GPTConfig.rope_theta must be > 0, got {self.rope_theta!r}")
            if self.head_dim % 2:
                raise ValueError(f"rotary positions need an even head dim, got {self.head_dim}")
        elif self.rope_scaling is not None or self.rope_theta != 10000.0:
            raise ValueError("GPTConfig.rope_theta and rope_scaling apply only to "
                             f"positions='rope', not positions={self.positions!r}")

    @property
    def head_dim(self) -> int:
        """H, width of one attention head: `head_size`, else d_model // n_heads."""
        return self.d_model // self.n_heads if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        """K, the number of key/value heads actually used."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def d_ff(self) -> int:
        """F, the MLP hidden width: `intermediate_size`, else mlp_ratio * d_model."""
        return self.mlp_ratio * self.d_model if self.intermediate_size is None \
            else self.intermediate_size

    def replace(self, **changes) -> GPTConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The fields as JSON-ready values (`from_dict` reads them back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> GPTConfig:
        """A config from `to_dict`'s output. Fields it lacks take their defaults, so a config
        saved before a field existed (a GPT-2 run directory) means what it meant then.

        Raises:
          ValueError: `fields` is not a dict, lacks a field without a default (the sizes),
            holds a field GPTConfig does not have (naming them), or a value out of range.
        """
        if not isinstance(fields, dict):
            raise ValueError(f"expected an object of GPTConfig fields, got {fields!r:.60}")
        known = {f.name: f.default for f in dataclasses.fields(cls)}
        missing = [n for n, default in known.items()
                   if default is dataclasses.MISSING and n not in fields]
        unknown = [n for n in fields if n not in known]
        if missing or unknown:
            raise ValueError("GPTConfig fields: " + "; ".join(
                f"{what} {', '.join(names)}" for what, names in
                (("missing", missing), ("unknown", unknown)) if names))
        scaling = fields.get("rope_scaling")
        if isinstance(scaling, dict):
            fields = {**fields, "rope_scaling": RopeScaling(**scaling)}
        return cls(**fields)

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named configuration, with optional field overrides.

        Raises:
          ValueError: `name` is not one of `PRESETS`.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown GPTConfig preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")


# The Llama family's fields, as its Hugging Face configs set them (Llama, Mistral, SmolLM;
# Qwen2 adds q/k/v biases, Qwen3 q/k norm and its own head dim).
LLAMA = dict(norm="rmsnorm", positions="rope", mlp="gated_silu", qkv_bias=False,
             out_bias=False, mlp_bias=False)

PRESETS: dict[str, GPTConfig] = {
    # Small enough for fast tests, big enough to have two layers and two heads.
    "tiny": GPTConfig(vocab_size=64, max_seq_len=128, n_layers=2, n_heads=2, d_model=32),
    # The Llama-style tiny one for tests: grouped-query attention (4:2), rotary positions,
    # RMSNorm, gated SiLU, untied output.
    "tiny-llama": GPTConfig(vocab_size=64, max_seq_len=128, n_layers=2, n_heads=4, d_model=32,
                            n_kv_heads=2, intermediate_size=64, layer_norm_eps=1e-6,
                            tie_embeddings=False, **LLAMA),
    # Character-level Shakespeare for `make demo`: nanoGPT's CPU model (width 128, context 64).
    # Longer contexts learn far more slowly per step with learned positions (in a fixed time:
    # training/README.md). vocab_size is replaced by the tokenizer's when training.
    "shakespeare-char": GPTConfig(
        vocab_size=96, max_seq_len=64, n_layers=4, n_heads=4, d_model=128
    ),
    # The same width and depth as a Llama-style block (RMSNorm, rotary positions, gated SiLU
    # of about the GELU MLP's parameters, no biases, tied) with twice the context: rotary
    # positions learn long contexts where learned ones did not (training/README.md).
    "shakespeare-char-llama": GPTConfig(vocab_size=96, max_seq_len=128, n_layers=4, n_heads=4,
                                        d_model=128, intermediate_size=344, **LLAMA),
    # A draft model for it (speculative decoding, issue 38): the same block at half the width
    # and depth, about 1/8 of its parameters (0.10M against 0.80M at vocabulary 65).
    "shakespeare-char-draft": GPTConfig(vocab_size=96, max_seq_len=128, n_layers=2, n_heads=4,
                                        d_model=64, intermediate_size=160, **LLAMA),
    # Speculative decoding's benchmark pair (issue 38, benchmarks/README.md): a target whose
    # float32 weights (10.6M parameters, 42 MB) exceed a 32 MB L3 cache, so its decode step
    # reads them from memory (nanoGPT's shakespeare-char GPU shape: 6 layers, width 384,
    # context 256, as a Llama-style block), and its draft, the demo's block at context 256
    # (0.80M, 1/13 of it; a draft's context must hold the target's).
    "shakespeare-char-10m": GPTConfig(vocab_size=96, max_seq_len=256, n_layers=6, n_heads=6,
                                      d_model=384, intermediate_size=1024, **LLAMA),
    "shakespeare-char-llama-256": GPTConfig(vocab_size=96, max_seq_len=256, n_layers=4,
                                            n_heads=4, d_model=128, intermediate_size=344,
                                            **LLAMA),
    # nanoGPT's shakespeare_char model with its README's CPU overrides (n_layer 4, n_head 4,
    # n_embd 128, block_size 64); vocab_size is replaced by the tokenizer's (65 on that corpus).
    "nanogpt-cpu": GPTConfig(vocab_size=65, max_seq_len=64, n_layers=4, n_heads=4, d_model=128),
    # GPT-2 small (124M), the shape of the released checkpoint.
    "gpt2": GPTConfig(vocab_size=50257, max_seq_len=1024, n_layers=12, n_heads=12, d_model=768),
    # The shapes of released Llama-family checkpoints (their config.json files), for random
    # weights of the real size; `gpt_jax.load_hf` reads the real ones.
    # HuggingFaceTB/SmolLM2-135M: Llama, 30 layers, GQA 9:3, tied.
    "smollm2-135m": GPTConfig(vocab_size=49152, max_seq_len=8192, n_layers=30, n_heads=9,
                              n_kv_heads=3, d_model=576, intermediate_size=1536,
                              rope_theta=100000.0, **LLAMA),
    # Qwen/Qwen2.5-0.5B: q/k/v biases, GQA 14:2, tied.
    "qwen2.5-0.5b": GPTConfig(vocab_size=151936, max_seq_len=32768, n_layers=24, n_heads=14,
                              n_kv_heads=2, d_model=896, intermediate_size=4864,
                              rope_theta=1000000.0, layer_norm_eps=1e-6,
                              **{**LLAMA, "qkv_bias": True}),
    # meta-llama/Llama-3.2-1B: Llama 3 rope scaling, GQA 32:8, tied.
    "llama-3.2-1b": GPTConfig(vocab_size=128256, max_seq_len=131072, n_layers=16, n_heads=32,
                              n_kv_heads=8, d_model=2048, intermediate_size=8192,
                              rope_theta=500000.0, rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
                              **LLAMA),
}
