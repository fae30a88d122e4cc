"""How a model's state maps to and from a Hugging Face checkpoint: the model says, mesh3d asks.

mesh3d knows no model's parameter names. A model whose names are not the Hugging Face ones
declares an adapter: a method `hf_adapter()` on the model (so on every pipeline stage, which is
the same class with parts deleted) returning an `HFAdapter`. The safetensors export and import
(`safetensors_io.py`) ask it, one name at a time, for the Hugging Face name of each state
entry, so an import still opens only each rank's slices; for the config the export writes and
the check an import makes against a checkpoint's config; and for the embedding/output-head pair
that Hugging Face ties by writing the embedding alone.

A Hugging Face model as transformers builds it needs no `hf_adapter()`: its adapter is derived
from the model (transformers_adapter.py: its own names, its config, its declared tie).

Any other model without `hf_adapter()` gets the identity: its own names are the Hugging Face
names (a model built with transformers' module names), its config is its `config` attribute when
that is a dict or has `to_dict()`, and nothing in a checkpoint's config is compared (each
tensor's shape still is).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any


class HFAdapter:
    """What a model provides so that its state maps to a Hugging Face checkpoint and config.

    Subclass it and override what differs from the identity; every method is called with the
    unsplit model's state names (`layers.5.<...>.weight`), the same on every rank.
    """

    # (embedding, output head) as this model names them: the pair a Hugging Face checkpoint with
    # tie_word_embeddings stores once, under the embedding's name. None: the model has no such pair.
    tied_pair: tuple[str, str] | None = None
    # fnmatch patterns of checkpoint tensors that this model deliberately does not read (for
    # example buffers that older checkpoints saved and the model recomputes); any other tensor of
    # the checkpoint that no state entry reads makes an import refuse.
    ignored_hf: tuple[str, ...] = ()

    def ignores(self, hf_name: str) -> bool:
        """Whether the checkpoint tensor `hf_name` is one this model deliberately does not read
        (default: it matches a pattern of `ignored_hf`)."""
        return any(fnmatchcase(hf_name, pattern) for pattern in self.ignored_hf)

    def to_hf(self, name: str) -> str:
        """The Hugging Face name of the state entry `name`; raise ValueError for a name with none."""
        return name

    def hf_config(self) -> dict | None:
        """The Hugging Face config (config.json contents: architectures, model_type, the shapes)
        that export writes; None if the model has none (export then needs config=)."""
        return None

    def config_mismatch(self, theirs: dict) -> str | None:
        """The first difference between a checkpoint's config.json and this model that would make
        its weights compute something else, described ("rms_norm_eps is 1e-06 there but 1e-05 in
        this model"); None if they agree. The base compares nothing."""
        return None


class IdentityAdapter(HFAdapter):
    """The adapter of a model that declares none: its names as they are, its `config` attribute."""

    def __init__(self, config: dict | None, tied_pair: tuple[str, str] | None):
        self._config = config
        self.tied_pair = tied_pair

    def hf_config(self) -> dict | None:
        return self._config


def as_config_dict(config: Any) -> dict:
    """A Hugging Face config as a plain dict: a dict, or anything with `to_dict()` (a transformers config)."""
    if isinstance(config, dict):
        return dict(config)
    if callable(getattr(config, "to_dict", None)):
        return dict(config.to_dict())
    raise ValueError(
        f"config must be a dict (the contents of a Hugging Face config.json) or a transformers config (an object "
        f"with to_dict()); got {type(config).__name__}"
    )
