"""What `plan` is handed, as a model on the meta device: a model, a Hugging Face config, or a preset.

The presets are the published Llama 3 / 3.1 shapes (Meta's model cards and their config.json on
the Hugging Face Hub), built with transformers' own LlamaForCausalLM so the planner measures the
model as transformers computes it.
"""

from __future__ import annotations

import torch
from torch import nn

# name -> LlamaConfig fields (meta-llama/Llama-3.1-{8B,70B,405B} config.json)
PRESETS: dict[str, dict] = {
    "llama3-8b": dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336
    ),
    "llama3-70b": dict(
        hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672
    ),
    "llama3-405b": dict(
        hidden_size=16384,
        num_hidden_layers=126,
        num_attention_heads=128,
        num_key_value_heads=8,
        intermediate_size=53248,
    ),
}
_COMMON = dict(
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    hidden_act="silu",
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "plan: presets and Hugging Face configs are built with transformers; "
            "pip install 'mesh3d[hf]' (or pass a model on the meta device)"
        ) from error
    return transformers


def preset_config(name: str):
    """The transformers LlamaConfig of a preset."""
    if name not in PRESETS:
        raise ValueError(
            f"plan: unknown model preset {name!r}; choose one of {sorted(PRESETS)}, or pass a model "
            "on the meta device or a Hugging Face config"
        )
    transformers = _transformers()
    config = transformers.LlamaConfig(**_COMMON, **PRESETS[name])
    return config


def meta_model(model) -> nn.Module:
    """`model` as a module on the meta device (see the module docstring for what it may be)."""
    if isinstance(model, str):
        model = preset_config(model)
    if isinstance(model, nn.Module):
        devices = {t.device.type for t in list(model.parameters()) + list(model.buffers())}
        if devices - {"meta"}:
            raise ValueError(
                f"plan: pass the model on the meta device (its tensors are on {sorted(devices)}); "
                "build it under `with torch.device('meta'):`"
            )
        return model
    transformers = _transformers()
    if isinstance(model, transformers.PretrainedConfig):
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(model)
    raise TypeError(
        f"plan: model must be a module on the meta device, a Hugging Face config or a preset name "
        f"({sorted(PRESETS)}), got {type(model).__name__}"
    )


def max_sequence_length(model: nn.Module) -> int | None:
    """The longest sequence the model declares it takes, if it declares one."""
    config = getattr(model, "config", None)
    for holder, name in (
        (config, "max_position_embeddings"),
        (getattr(model, "args", None), "max_seq_len"),
        (model, "max_seq_len"),
    ):
        value = getattr(holder, name, None) if holder is not None else None
        if isinstance(value, int):
            return value
    return None
