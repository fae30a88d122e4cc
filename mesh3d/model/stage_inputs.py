"""Which per-sample inputs a stage takes: the tensors besides the tokens that `pm.step(inputs,
targets, **per_sample)` hands a stage's forward by keyword (position ids, document ids, a mask).

A stage declares them by its forward's keyword-only parameters (`def forward(self, tokens, *,
document_ids=None)`), or, where the forward is generic, by a `per_sample_inputs` attribute (a
collection of names) that overrides the signature. Every rank already holds its batch, so these
inputs never cross a stage boundary: each stage that takes one is handed its microbatch's slice.
"""

from __future__ import annotations

import inspect

from torch import nn


def stage_input_names(stage: nn.Module) -> frozenset[str]:
    """The per-sample inputs `stage` takes by keyword: its `per_sample_inputs` attribute when it has
    one, else the keyword-only parameters of its forward."""
    declared = getattr(stage, "per_sample_inputs", None)
    if declared is not None:
        if isinstance(declared, str) or not all(isinstance(name, str) for name in declared):
            raise TypeError(
                f"{type(stage).__name__}.per_sample_inputs must be a collection of input names, got {declared!r}"
            )
        return frozenset(declared)
    parameters = inspect.signature(stage.forward).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def declared_index_bounds(model: nn.Module) -> dict[str, int]:
    """The model's `input_index_bounds`: {input name: n} for per-sample inputs that index something
    (position ids index the rotary table); each must then be an integer tensor in [0, n). Checked."""
    bounds = getattr(model, "input_index_bounds", None) or {}
    if not isinstance(bounds, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v > 0 for k, v in bounds.items()
    ):
        raise ValueError(
            f"{type(model).__name__}.input_index_bounds must map input names to positive ints, got {bounds!r}"
        )
    return dict(bounds)
