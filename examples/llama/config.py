"""Shapes of the LLaMA-style models: a tiny `debug` config and the published Llama 3 sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

# The vocabulary taken from a tokenizer is padded to a multiple of this (and of tp, where tp does
# not divide it): every power-of-two tp up to 64 divides it, so the padded size is the same under
# every such layout and a checkpoint resumes under any of them; 64 rows also keep the embedding
# and output matmuls in tensor-core-friendly shapes (as nanoGPT's 50257 -> 50304).
VOCAB_MULTIPLE = 64


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
    ffn_hidden_dim_override: int | None = None  # an explicit FFN width (Hugging Face's intermediate_size)
    # The ids the tokenizer makes, when fewer than vocab_size: rows from here on are padding, never
    # an input or a target; the model declares this many to mesh3d's batch check. None: all rows.
    tokenizer_vocab_size: int | None = None
    # The tokenizer's document separator, for an export's config.json (generation stops there). None: unknown.
    eos_token_id: int | None = None

    def __post_init__(self):
        kv_heads = self.kv_heads
        if self.tokenizer_vocab_size is not None and not 1 <= self.tokenizer_vocab_size <= self.vocab_size:
            raise ValueError(
                f"ModelArgs: tokenizer_vocab_size={self.tokenizer_vocab_size} must be in "
                f"[1, vocab_size={self.vocab_size}]"
            )
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
        """LLaMA's rule: 2/3 of 4*dim, times the multiplier, rounded up to `multiple_of` (unless overridden)."""
        if self.ffn_hidden_dim_override is not None:
            return self.ffn_hidden_dim_override
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    def with_(self, **changes) -> "ModelArgs":
        return replace(self, **changes)

    def to_hf_config(self) -> dict:
        """The equivalent transformers LlamaConfig, as config.json contents (v4 and v5 rope fields both)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        scaling = None
        if self.rope_scaling is not None:
            s = self.rope_scaling
            scaling = {
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position,
            }
            rope = {**scaling, "rope_theta": self.rope_theta}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.norm_eps,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            **({"eos_token_id": self.eos_token_id} if self.eos_token_id is not None else {}),
        }

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelArgs":
        """ModelArgs from a transformers LlamaConfig (config.json contents or `config.to_dict()`).

        Raises ValueError for what this model does not implement (biases, another activation,
        a head_dim other than hidden_size / heads, a rope type other than default or llama3).
        """
        unsupported = {
            "hidden_act": (config.get("hidden_act", "silu"), "silu"),
            "attention_bias": (bool(config.get("attention_bias", False)), False),
            "mlp_bias": (bool(config.get("mlp_bias", False)), False),
        }
        heads = config["num_attention_heads"]
        if config.get("head_dim") is not None:
            unsupported["head_dim"] = (config["head_dim"], config["hidden_size"] // heads)
        for key, (got, supported) in unsupported.items():
            if got != supported:
                raise ValueError(
                    f"Hugging Face config has {key}={got!r}; the LLaMA example supports only {supported!r}"
                )
        rope = dict(config.get("rope_parameters") or {})
        legacy = config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = None
        if rope_type == "llama3":
            fields = {**legacy, **rope}
            scaling = RopeScaling(
                factor=float(fields["factor"]),
                low_freq_factor=float(fields["low_freq_factor"]),
                high_freq_factor=float(fields["high_freq_factor"]),
                original_max_position=int(fields["original_max_position_embeddings"]),
            )
        elif rope_type != "default":
            raise ValueError(
                f"Hugging Face config has rope_type={rope_type!r}; the LLaMA example supports default and llama3"
            )
        return cls(
            dim=config["hidden_size"],
            n_layers=config["num_hidden_layers"],
            n_heads=heads,
            n_kv_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_seq_len=config.get("max_position_embeddings", 2048),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            ffn_hidden_dim_override=config["intermediate_size"],
            eos_token_id=config["eos_token_id"] if isinstance(config.get("eos_token_id"), int) else None,
        )


_LLAMA3_COMMON = dict(rope_theta=500000.0, vocab_size=128256, norm_eps=1e-5)

CONFIGS: dict[str, ModelArgs] = {
    # Byte-level vocabulary (256) so it trains on the default corpus. Heads (16), kv heads (8),
    # FFN width (352) and vocabulary all divide by every tp <= 8; 8 layers fill pp=4 x v=2 stages.
    "debug": ModelArgs(
        dim=128,
        n_layers=8,
        n_heads=16,
        n_kv_heads=8,
        vocab_size=256,
        multiple_of=32,
        rope_theta=10000.0,
        max_seq_len=1024,
        tie_embeddings=False,
    ),
    # Llama 3.2 1B and 3B (tied embeddings, rope scaling factor 32).
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.5,
        multiple_of=256,
        rope_scaling=RopeScaling(factor=32.0),
        max_seq_len=131072,
        tie_embeddings=True,
        **_LLAMA3_COMMON,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim_multiplier=1.0,
        multiple_of=256,
        rope_scaling=RopeScaling(factor=32.0),
        max_seq_len=131072,
        tie_embeddings=True,
        **_LLAMA3_COMMON,
    ),
    # Llama 3.1 8B and 70B.
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=1024,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=131072,
        **_LLAMA3_COMMON,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim_multiplier=1.3,
        multiple_of=4096,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=131072,
        **_LLAMA3_COMMON,
    ),
}


def padded_vocab_size(tokens: int, tp: int = 1, multiple: int = VOCAB_MULTIPLE) -> int:
    """`tokens` rounded up to a multiple of lcm(`multiple`, `tp`): rows that tensor parallelism splits evenly."""
    step = math.lcm(multiple, tp)
    return -(-tokens // step) * step


def get_config(name: str, **overrides) -> ModelArgs:
    """A named config, optionally with some fields changed (e.g. `n_layers=4`)."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose one of {sorted(CONFIGS)}")
    return CONFIGS[name].with_(**overrides)
