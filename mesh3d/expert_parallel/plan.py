"""A Hugging Face mixture of experts' expert-parallel plan: transformers' `base_model_ep_plan`, read
as model/hugging_face/tp_plan.py reads the tensor-parallel one.

transformers declares, per architecture, which modules hold experts: "layers.*.mlp.experts":
"ep_dispatch_experts" (each rank holds E/ep whole experts, tokens reach them through a dispatch),
with the experts' 3-d weights "layers.*.mlp.experts.gate_up_proj": "grouped_gemm" (split along
their first dim, the expert). mesh3d translates exactly that pair; any other style in the plan (a
dense MLP's "colwise" where an architecture mixes them in, a norm inside the experts) is refused
by name when ep > 1, as is an experts module holding a parameter the plan does not split by expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import nn

DISPATCH_STYLE = "ep_dispatch_experts"
PARAMETER_STYLE = "grouped_gemm"


@dataclass(frozen=True)
class ExpertPlan:
    """The experts modules of a model, by pattern over the unsplit model's module names."""

    patterns: tuple[str, ...]
    num_experts: int  # experts per block (ep must divide it)

    def matches(self, name: str) -> bool:
        return any(fnmatchcase(name, pattern) for pattern in self.patterns)


def declared_ep_plan(model: nn.Module) -> dict[str, str]:
    """transformers' expert-parallel plan, its patterns from the causal LM's root."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_ep_plan", None) if config is not None else None
    if not base:
        text = config.get_text_config() if hasattr(config, "get_text_config") else None
        base = getattr(text, "base_model_ep_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    return {f"{prefix}.{pattern}" if prefix else pattern: style for pattern, style in base.items()}


def translate_ep_plan(model: nn.Module) -> tuple[ExpertPlan | None, str | None]:
    """(the plan, None), or (None, why mesh3d cannot split this model's experts exactly).

    Pure: parallelize raises the refusal only when ep > 1, on every rank before any collective.
    """
    arch = f"{type(model).__name__} ({model.config.model_type})"
    declared = declared_ep_plan(model)
    if not declared:
        return None, (
            f"{arch}: transformers declares no expert-parallel plan for it (config.base_model_ep_plan is empty), "
            "so mesh3d does not know which modules hold experts; use ep=1"
        )
    modules = dict(model.named_modules())
    dispatch = [p for p, s in declared.items() if s == DISPATCH_STYLE]
    for pattern, style in declared.items():
        owner = pattern.rpartition(".")[0]
        if style == PARAMETER_STYLE and owner in dispatch:
            continue
        if style != DISPATCH_STYLE:
            return None, (
                f"{arch}: its expert-parallel plan gives {pattern!r} the style {style!r}; mesh3d translates only "
                f"{DISPATCH_STYLE!r} modules with {PARAMETER_STYLE!r} parameters exactly; use ep=1"
            )
    counts = set()
    for pattern in dispatch:
        named = {
            p.rpartition(".")[2] for p, s in declared.items() if s == PARAMETER_STYLE and p.startswith(pattern + ".")
        }
        for name, module in modules.items():
            if not fnmatchcase(name, pattern):
                continue
            declared = getattr(module, "num_experts", None)
            weights = {int(p.shape[0]) for p in module.parameters()}
            if not isinstance(declared, int) or weights != {declared}:
                return None, (
                    f"{arch}: its experts module {name!r} declares num_experts={declared!r} but holds weights of "
                    f"{sorted(weights)} experts; mesh3d splits only a count its weights share; use ep=1"
                )
            for param_name, param in module.named_parameters():
                if param_name not in named:
                    return None, (
                        f"{arch}: its experts module {name!r} holds {param_name!r}, which the expert-parallel plan "
                        "does not split by expert (each rank would hold all of it); use ep=1"
                    )
                counts.add(int(param.shape[0]))
    if not counts:
        return None, f"{arch}: its expert-parallel plan's patterns {dispatch} match no experts module; use ep=1"
    if len(counts) > 1:
        return None, f"{arch}: its experts modules hold different expert counts {sorted(counts)}; use ep=1"
    return ExpertPlan(tuple(dispatch), counts.pop()), None


def check_expert_parallel(plan: ExpertPlan | None, refusal: str | None, ep: int, sequence_parallel: bool) -> None:
    """Raise ValueError for an ep the model cannot take (pure: every rank alike, before any message)."""
    if ep == 1:
        return
    if plan is None:
        raise ValueError(refusal or "ep > 1 needs a model whose experts modules are declared; use ep=1")
    if plan.num_experts % ep != 0:
        divisors = [d for d in range(1, plan.num_experts + 1) if plan.num_experts % d == 0]
        raise ValueError(
            f"ep={ep} does not divide the {plan.num_experts} experts of each block; choose ep among {divisors} "
            "(and dividing dp*cp*tp)"
        )
    if sequence_parallel:
        raise ValueError(
            "ep > 1 with a sequence-parallel tp plan: the experts would see each tp rank's part of the sequence, "
            "and mesh3d splits a tp group's shared tokens itself; use a tp plan without SequenceParallel, or ep=1"
        )
