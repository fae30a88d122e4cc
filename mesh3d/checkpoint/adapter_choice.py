"""Which adapter a model's state maps to Hugging Face names through: the one the model declares
(`hf_adapter()`), the one derived from a transformers model (transformers_adapter.py), or the
identity (hf_adapter.py says what each does).
"""

from __future__ import annotations

from torch import nn

from mesh3d.checkpoint.hf_adapter import HFAdapter, IdentityAdapter, as_config_dict
from mesh3d.checkpoint.transformers_adapter import TransformersAdapter
from mesh3d.model.hugging_face.causal_lm import architecture_of, unsplit_config


def adapter_of(stage: nn.Module, ties: list[list[str]]) -> HFAdapter:
    """The adapter `stage` (any pipeline stage of the model) declares, the one derived from a
    transformers model, or the identity.

    ties: the model's tied name groups; for a model without an adapter, a tie of exactly two
    names is taken as its embedding/output pair (the embedding registered first).
    """
    architecture = architecture_of(stage)
    if architecture is not None:
        return TransformersAdapter(architecture, unsplit_config(stage))
    declared = getattr(stage, "hf_adapter", None)
    if callable(declared):
        adapter = declared()
        if not isinstance(adapter, HFAdapter):
            raise TypeError(
                f"{type(stage).__name__}.hf_adapter() returned {type(adapter).__name__}; it must return a "
                "mesh3d.checkpoint.HFAdapter (subclass it and override what differs from the identity)"
            )
        return adapter
    config = getattr(stage, "config", None)
    config = as_config_dict(config) if isinstance(config, dict) or callable(getattr(config, "to_dict", None)) else None
    pairs = [tuple(names) for names in ties if len(names) == 2]
    return IdentityAdapter(config, pairs[0] if len(pairs) == 1 else None)
