"""The LLaMA example's adapter to Hugging Face Llama checkpoints: names and config fields.

The example's names (Meta's and torchtitan's: tok_embeddings, layers.N.attention.wq, ...) map
one to one onto transformers' LlamaForCausalLM names. The rotary convention needs no conversion
because the model rotates halves (`rotate_half`, as transformers does): the q/k weights are then
the same matrices in both. `Transformer.hf_adapter()` returns this adapter, and
`mesh3d.checkpoint.export_safetensors` / `import_safetensors` ask it.
"""

from __future__ import annotations

import re

from examples.llama.config import ModelArgs
from mesh3d.checkpoint import HFAdapter

# This model's name within a block -> transformers' name within `model.layers.{i}`.
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


class LlamaHFAdapter(HFAdapter):
    """The LLaMA example's state <-> transformers' LlamaForCausalLM, and its LlamaConfig."""

    tied_pair = ("tok_embeddings.weight", "output.weight")
    # Checkpoints of transformers before 4.31 saved the rotary table, which this model recomputes.
    ignored_hf = ("model.layers.*.self_attn.rotary_emb.inv_freq",)

    def __init__(self, args: ModelArgs):
        self.args = args

    def to_hf(self, name: str) -> str:
        """The transformers LlamaForCausalLM name of this model's state entry `name`."""
        if name in _END_NAMES:
            return _END_NAMES[name]
        match = _LAYER.fullmatch(name)
        if match and match.group(2) in _LAYER_NAMES:
            return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
        raise ValueError(
            f"parameter {name!r} has no Hugging Face Llama counterpart; the LLaMA example's adapter maps "
            f"{', '.join(sorted(_END_NAMES))} and layers.N.{{{', '.join(sorted(_LAYER_NAMES))}}}"
        )

    def hf_config(self) -> dict:
        """The model as transformers LlamaConfig contents (architectures, model_type, shapes, rotary)."""
        return self.args.to_hf_config()

    def config_mismatch(self, theirs: dict) -> str | None:
        """The first field on which a checkpoint's Llama config and this model disagree that
        changes the shapes or the computation (shapes, rotary settings, norm epsilon, activation)."""
        ours = self.hf_config()
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


def _effective(config: dict, key: str):
    """A field's value, with transformers' defaults for the fields a Llama config may leave out."""
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
