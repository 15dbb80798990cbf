"""Model configuration: one frozen, hashable dataclass with named presets.

Being frozen and hashable, a `GPTConfig` can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT-2 style decoder-only transformer.

    Raises:
      ValueError: a size is not positive, `d_model` is not divisible by `n_heads`, or
        `n_heads` is not divisible by `n_kv_heads`.
    """

    vocab_size: int  # V, number of token ids
    max_seq_len: int  # longest sequence the learned position table covers
    n_layers: int  # L, transformer blocks
    n_heads: int  # N, query heads
    d_model: int  # D, residual stream width
    n_kv_heads: int | None = None  # K, key/value heads (None: same as n_heads; fewer is GQA/MQA)
    mlp_ratio: int = 4  # MLP hidden width is mlp_ratio * d_model
    layer_norm_eps: float = 1e-5  # GPT-2 uses 1e-5

    def __post_init__(self):
        for name in ("vocab_size", "max_seq_len", "n_layers", "n_heads", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}"
            )
        if self.n_kv_heads is not None and (
            self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads
        ):
            raise ValueError(
                f"GPTConfig.n_kv_heads={self.n_kv_heads} must be a positive divisor of "
                f"n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        """H, width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """K, the number of key/value heads actually used."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def d_ff(self) -> int:
        """MLP hidden width."""
        return self.mlp_ratio * self.d_model

    def replace(self, **changes) -> GPTConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides) -> GPTConfig:
        """A named configuration, with optional field overrides.

        Raises:
          ValueError: `name` is not one of `PRESETS`.
        """
        if name not in PRESETS:
            raise ValueError(f"unknown GPTConfig preset {name!r}; choose one of {sorted(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


PRESETS: dict[str, GPTConfig] = {
    # Small enough for fast tests, big enough to have two layers and two heads.
    "tiny": GPTConfig(vocab_size=64, max_seq_len=128, n_layers=2, n_heads=2, d_model=32),
    # Character-level Shakespeare for `make demo`: nanoGPT's CPU model (width 128, context 64).
    # Longer contexts learn far more slowly per step with learned positions (in a fixed time:
    # training/README.md). vocab_size is replaced by the tokenizer's when training.
    "shakespeare-char": GPTConfig(
        vocab_size=96, max_seq_len=64, n_layers=4, n_heads=4, d_model=128
    ),
    # nanoGPT's shakespeare_char model with its README's CPU overrides (n_layer 4, n_head 4,
    # n_embd 128, block_size 64); vocab_size is replaced by the tokenizer's (65 on that corpus).
    "nanogpt-cpu": GPTConfig(vocab_size=65, max_seq_len=64, n_layers=4, n_heads=4, d_model=128),
    # GPT-2 small (124M), the shape of the released checkpoint.
    "gpt2": GPTConfig(vocab_size=50257, max_seq_len=1024, n_layers=12, n_heads=12, d_model=768),
}
