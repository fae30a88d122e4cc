"""Hugging Face Llama conventions: parameter names, and the config fields a model must agree on.

mesh3d's LLaMA protocol names (Meta's/torchtitan's: tok_embeddings, layers.N.attention.wq, ...)
map one to one onto transformers' LlamaForCausalLM names. The rotary convention needs no
conversion as long as the model rotates halves (`rotate_half`, as transformers does; the LLaMA
example does): the q/k weights are then the same matrices in both.
"""

from __future__ import annotations

import re

# (mesh3d name pattern, Hugging Face name template); {i} is the layer number.
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_END_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")

EMBEDDING = "tok_embeddings.weight"
OUTPUT = "output.weight"

# Config fields that decide tensor shapes; they must match to load weights.
STRUCTURAL_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)


def to_hf(name: str) -> str:
    """The transformers LlamaForCausalLM name of a mesh3d LLaMA parameter name."""
    if name in _END_NAMES:
        return _END_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(
        f"parameter {name!r} has no Hugging Face Llama counterpart; export/import follow the LLaMA protocol names "
        f"({', '.join(sorted(_END_NAMES))}, layers.N.{{{', '.join(sorted(_LAYER_NAMES))}}})"
    )


def from_hf(name: str) -> str:
    """The mesh3d name of a transformers LlamaForCausalLM parameter name."""
    for ours, theirs in _END_NAMES.items():
        if name == theirs:
            return ours
    match = _HF_LAYER.fullmatch(name)
    if match:
        for ours, theirs in _LAYER_NAMES.items():
            if match.group(2) == theirs:
                return f"layers.{match.group(1)}.{ours}"
    raise ValueError(f"{name!r} is not a Hugging Face Llama parameter name that mesh3d knows")


def _effective(config: dict, key: str):
    if key == "head_dim" and config.get("head_dim") is None and config.get("num_attention_heads"):
        return config["hidden_size"] // config["num_attention_heads"]
    if key == "num_key_value_heads" and config.get(key) is None:
        return config.get("num_attention_heads")
    return config.get(key)


def rope(config: dict) -> dict:
    """A config's rotary settings in one form, whether written by transformers 4 (rope_theta,
    rope_scaling) or 5 (rope_parameters)."""
    legacy = dict(config.get("rope_scaling") or {})
    fields = {**legacy, **dict(config.get("rope_parameters") or {})}
    fields.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    fields["rope_type"] = fields.get("rope_type") or fields.pop("type", None) or "default"
    fields.pop("type", None)
    return fields


def _differs(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) > 1e-9 * max(abs(a), abs(b))
    return a != b


def config_mismatch(ours: dict, theirs: dict) -> str | None:
    """The first field on which two Llama configs disagree that changes the shapes or the
    computation (shapes, rotary settings, norm epsilon, activation), described; None if none."""
    for key in STRUCTURAL_FIELDS:
        a, b = _effective(ours, key), _effective(theirs, key)
        if a != b:
            return f"{key} is {b!r} there but {a!r} in this model"
    for key in ("rms_norm_eps", "hidden_act"):
        a, b = ours.get(key), theirs.get(key)
        if a is not None and b is not None and _differs(a, b):
            return f"{key} is {b!r} there but {a!r} in this model"
    a, b = rope(ours), rope(theirs)
    for key in sorted(set(a) | set(b)):
        if _differs(a.get(key), b.get(key)):
            return f"rotary setting {key} is {b.get(key)!r} there but {a.get(key)!r} in this model"
    return None
