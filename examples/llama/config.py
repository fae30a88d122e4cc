"""Shapes of the LLaMA-style models: a tiny `debug` config and the published Llama 3 sizes."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1-style frequency scaling for long contexts (the `rope_scaling` of HF's config)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: same as n_heads (no grouped-query attention)
    vocab_size: int = 128256
    multiple_of: int = 256  # the FFN width is rounded up to a multiple of this
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_seq_len: int = 8192
    tie_embeddings: bool = False

    def __post_init__(self):
        kv_heads = self.kv_heads
        if self.dim % self.n_heads != 0:
            raise ValueError(f"ModelArgs: dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if (self.dim // self.n_heads) % 2 != 0:
            raise ValueError(f"ModelArgs: head_dim={self.dim // self.n_heads} must be even for rotary embeddings")
        if self.n_heads % kv_heads != 0:
            raise ValueError(f"ModelArgs: n_heads={self.n_heads} is not divisible by n_kv_heads={kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_hidden_dim(self) -> int:
        """LLaMA's rule: 2/3 of 4*dim, times the multiplier, rounded up to `multiple_of`."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def with_(self, **changes) -> "ModelArgs":
        return replace(self, **changes)


_LLAMA3_COMMON = dict(rope_theta=500000.0, vocab_size=128256, norm_eps=1e-5)

CONFIGS: dict[str, ModelArgs] = {
    # Byte-level vocabulary (256) so it trains on the default corpus. Heads (16), kv heads (8),
    # FFN width (352) and vocabulary all divide by every tp <= 8; 8 layers fill pp=4 x v=2 stages.
    "debug": ModelArgs(
        dim=128, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=256, multiple_of=32,
        rope_theta=10000.0, max_seq_len=1024, tie_embeddings=False,
    ),
    # Llama 3.2 1B and 3B (tied embeddings, rope scaling factor 32).
    "1B": ModelArgs(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
        rope_scaling=RopeScaling(factor=32.0), max_seq_len=131072, tie_embeddings=True, **_LLAMA3_COMMON,
    ),
    "3B": ModelArgs(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn_dim_multiplier=1.0, multiple_of=256,
        rope_scaling=RopeScaling(factor=32.0), max_seq_len=131072, tie_embeddings=True, **_LLAMA3_COMMON,
    ),
    # Llama 3.1 8B and 70B.
    "8B": ModelArgs(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024,
        rope_scaling=RopeScaling(factor=8.0), max_seq_len=131072, **_LLAMA3_COMMON,
    ),
    "70B": ModelArgs(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=4096,
        rope_scaling=RopeScaling(factor=8.0), max_seq_len=131072, **_LLAMA3_COMMON,
    ),
}


def get_config(name: str, **overrides) -> ModelArgs:
    """A named config, optionally with some fields changed (e.g. `n_layers=4`)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose one of {sorted(CONFIGS)}")
    return CONFIGS[name].with_(**overrides)
