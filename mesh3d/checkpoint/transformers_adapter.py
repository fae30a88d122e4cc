"""The adapter of a Hugging Face model as transformers builds it, derived from the model itself.

A transformers model already has Hugging Face names, so nothing is renamed: its export is the
directory `save_pretrained` would write and its import reads what `from_pretrained` reads. What
the adapter derives, with no table per architecture:

- the config written: the unsplit model's config (a stage's own lists only its blocks'
  `layer_types`) with `architectures` naming the model's class, as `save_pretrained` writes it;
- the tied pair: what the class declares in `_tied_weights_keys` ({output head: embedding});
- the checkpoint tensors it deliberately does not read: the class's
  `_keys_to_ignore_on_load_unexpected` (regular expressions, as transformers matches them);
- config_mismatch: every field of the architecture's config (both sides read through its config
  class, so transformers 4 and 5 spellings compare alike), except the generic ones every
  transformers config has and those that only initialize or generate (`_NOT_COMPUTATION`).
"""

from __future__ import annotations

import re

from mesh3d.checkpoint.hf_adapter import HFAdapter

# Fields of an architecture's config that do not change what its weights compute: the
# initialization scale, the generation cache and special token ids (which only the data uses),
# and the tie (export and import check it against the model's own tie).
_NOT_COMPUTATION = frozenset({"initializer_range", "use_cache", "bos_token_id", "eos_token_id", "tie_word_embeddings"})


class TransformersAdapter(HFAdapter):
    """Identity names, the model's own config, its declared tie and ignored keys."""

    def __init__(self, architecture: type, config):
        self.architecture = architecture
        self.config = config
        declared = getattr(architecture, "_tied_weights_keys", None)
        if isinstance(declared, dict) and len(declared) == 1:
            ((head, embedding),) = declared.items()
            self.tied_pair = (embedding, head)
        self._ignored = [re.compile(p) for p in getattr(architecture, "_keys_to_ignore_on_load_unexpected", None) or []]

    def ignores(self, hf_name: str) -> bool:
        """transformers' own rule: a pattern found anywhere in the name."""
        return any(p.search(hf_name) for p in self._ignored)

    def hf_config(self) -> dict:
        """config.json as save_pretrained writes it: the config, `architectures` naming the class."""
        return {**self.config.to_dict(), "architectures": [self.architecture.__name__]}

    def config_mismatch(self, theirs: dict) -> str | None:
        """The first field of the architecture's config on which a checkpoint's config.json and this
        model differ, among those that change the computation (module docstring)."""
        ours_type, their_type = self.config.model_type, theirs.get("model_type")
        if their_type is not None and their_type != ours_type:
            return f"model_type is {their_type!r} there but {ours_type!r} in this model ({self.architecture.__name__})"
        config_class = type(self.config)
        try:  # through the config class: defaults filled in, older spellings converted
            their_fields = config_class.from_dict(dict(theirs)).to_dict()
        except Exception as error:  # noqa: BLE001 - a config transformers itself cannot read
            return f"its config.json is not a valid {config_class.__name__} ({type(error).__name__}: {error})"
        generic = _generic_fields()
        our_fields = self.config.to_dict()
        for key in sorted(set(our_fields) | set(their_fields)):
            if key in generic or key in _NOT_COMPUTATION or key.startswith("_"):
                continue
            if _differs(our_fields.get(key), their_fields.get(key)):
                return f"{key} is {their_fields.get(key)!r} there but {our_fields.get(key)!r} in this model"
        return None


def _generic_fields() -> set[str]:
    """The fields every transformers config has (names, dtype, output switches): not the architecture's."""
    import transformers  # a transformers model is being exported or imported: it is installed

    return set(transformers.PretrainedConfig().to_dict())


def _differs(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) != set(b) or any(_differs(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return abs(a - b) > 1e-9 * max(abs(a), abs(b))
    return a != b
