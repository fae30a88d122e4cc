"""A transformers mixture of experts' router load-balancing loss, across pipeline stages.

With `output_router_logits` set, transformers' causal LM adds `router_aux_loss_coef` times a
load-balancing loss to the cross-entropy: every layer's router logits of the batch reduced to
three sums (model/router_aux.py says which, and how they cross stages). A stage records its
layers' router logits where transformers records them (the base model's `_can_record_outputs`
names the module class and which of its outputs), with forward hooks placed once when the stage
is made, and adds them to the sums it received. Whether this equals the architecture's own
`aux_loss` is checked on a small instance (exactness.py); an architecture whose loss is
computed otherwise is refused by name.
"""

from __future__ import annotations

import contextlib
import functools

from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.model.router_aux import RouterAux


def router_aux_of(model: nn.Module) -> tuple[RouterAux | None, str | None]:
    """(the router loss the config asks for, None) or (None, why mesh3d cannot compute it); (None,
    None) where the config asks for none."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None, None
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    experts = getattr(model, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None)
    recorder = _recorder(model)
    if not isinstance(coef, (int, float)) or not isinstance(experts, int) or not isinstance(top_k, int):
        return None, (
            "its config asks for the router's auxiliary loss (output_router_logits=True), but the model does not "
            "name its coefficient, expert count and top-k as transformers' mixtures of experts do "
            f"(router_aux_loss_coef={coef}, num_experts={experts}, num_experts_per_tok={top_k}); "
            "set config.output_router_logits = False"
        )
    if recorder is not None and not any(_is_router(name, module, recorder) for name, module in model.named_modules()):
        return None, None  # no block routes (a dense configuration): transformers adds no router loss either
    if recorder is None:
        return None, (
            "its config asks for the router's auxiliary loss (output_router_logits=True), but the architecture does "
            "not declare where its router logits are recorded (_can_record_outputs['router_logits']); set "
            "config.output_router_logits = False"
        )
    return RouterAux(float(coef), experts, top_k), None


def _recorder(model: nn.Module) -> tuple[type | None, str | None, int, str | None] | None:
    """(module class, class-name suffix, output index, module-name part) of transformers' router-logit recorder."""
    base = getattr(model, model.base_model_prefix, model)
    spec = (getattr(type(base), "_can_record_outputs", None) or {}).get("router_logits")
    if isinstance(spec, type):
        return spec, None, 0, None
    target = getattr(spec, "target_class", None)
    if spec is None or (target is None and getattr(spec, "class_name", None) is None):
        return None
    return target, spec.class_name, spec.index, spec.layer_name


# The router logits of the stage forward running now (the last list), empty between forwards:
# module state rather than the stage's, so hooks stay valid in copies of the stage, and a plain
# list, which torch.compile traces through (a ContextVar breaks a compiled block's graph).
_RECORDING: list[list] = []


def record_router_logits(stage: nn.Module, model_like: nn.Module) -> None:
    """Hooks on `stage`'s router modules that add each one's logits to the records of
    `recorded_router_logits` while a forward runs inside it."""
    recorder = _recorder(model_like)
    for name, module in stage.named_modules():
        if _is_router(name, module, recorder):
            module.register_forward_hook(functools.partial(_record, recorder[2]))


def _is_router(name: str, module: nn.Module, recorder: tuple) -> bool:
    target, class_name, _, layer_name = recorder
    matches = isinstance(module, target) if target is not None else type(module).__name__.endswith(class_name)
    return matches and (layer_name is None or f".{layer_name}." in f".{name}.")  # whole path parts


@contextlib.contextmanager
def recorded_router_logits():
    """The router logits the stage's hooked modules give while inside, in the order they ran."""
    records: list = []
    _RECORDING.append(records)
    try:
        yield records
    finally:
        _RECORDING.pop()


def _record(index: int, module: nn.Module, args, output) -> None:
    if _RECORDING:
        logits = output[index] if isinstance(output, (tuple, list)) else output
        if logits is not None:  # transformers skips a router that gave none
            _RECORDING[-1].append(logits.full_tensor() if isinstance(logits, DTensor) else logits)
