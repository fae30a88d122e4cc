"""The warning for a model given on meta that mesh3d can only fill with `reset_parameters()`.

Without `init_weights()` (model/initialize.py) each stage runs its modules' `reset_parameters()`
with the RNG reseeded per stage (seed + stage index): the model trains, but its values differ
from the same model built whole on a device, and from one parallelized under another layout
(another first loss). That used to be silent; it is said once, on global rank 0, with what to
add. A parameter whose own module has no `reset_parameters()` is worse: nothing fills it, and it
trains from whatever memory `to_empty()` allocated; the warning names each one.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch.distributed as dist
from torch import nn

# How many unfilled parameters the warning names before it counts the rest.
_NAMED = 8


class ResetParametersWarning(UserWarning):
    """A model given on meta was filled by its modules' `reset_parameters()`, not `init_weights()`."""


def warn_if_reset_parameters(name: str, meta_stages: Iterable[nn.Module], has_init_stage: bool) -> None:
    """Warn (global rank 0) when a stage of `name`, allocated from meta, has no `init_weights()`
    and no anatomy initializer (`has_init_stage`, a Hugging Face model's), naming the parameters
    that no `reset_parameters()` fills. `meta_stages`: every stage of the model, on meta."""
    stages = list(meta_stages)
    if has_init_stage or all(callable(getattr(stage, "init_weights", None)) for stage in stages):
        return
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    unfilled = list(dict.fromkeys(unfilled_parameters(stages)))
    message = (
        f"{name} was given on the meta device and has no init_weights(): mesh3d filled it with each module's "
        "reset_parameters(), the RNG reseeded per stage, so its values (and its first loss) differ from the same "
        "model built whole on a device, and from the model parallelized under another layout. For one set of "
        "values under every layout, add `init_weights(self, seed=None)` filling each parameter from `seed` and its "
        "unsplit name (a protocol model: docs/model_protocol.md), or build the model on a device: parallelize "
        "keeps the values it is given"
    )
    if unfilled:
        shown = ", ".join(unfilled[:_NAMED]) + (f" and {len(unfilled) - _NAMED} more" if len(unfilled) > _NAMED else "")
        message += (
            f". No reset_parameters() fills {shown}: they hold the uninitialized memory to_empty() allocated; give "
            "their modules a reset_parameters() or the model an init_weights()"
        )
    warnings.warn(message, ResetParametersWarning, stacklevel=3)


def unfilled_parameters(stages: Iterable[nn.Module]) -> list[str]:
    """The unsplit names of parameters held directly by a module without `reset_parameters()`."""
    names = []
    for stage in stages:
        for path, module in stage.named_modules():
            if callable(getattr(module, "reset_parameters", None)):
                continue
            names += [f"{path}.{attr}" if path else attr for attr, p in module._parameters.items() if p is not None]
    return names
