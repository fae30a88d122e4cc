"""Tensor-parallel plans: module-name patterns -> torch ParallelStyles, resolved and checked.

A plan is a dict such as {"layers.*.attn.q_proj": ColwiseParallel(), ...}. Patterns are fnmatch
patterns over the unsplit model's module names (FQNs). Everything here is arithmetic on the meta
model, so every rank raises the same error before any collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from mesh3d.distributed.shards import splits_a_dim
from mesh3d.tensor.local_styles import LocalParameters


@dataclass(frozen=True)
class TensorParallelConfig:
    """How the tp axis shards each stage, after the argument checks (see `resolve`)."""

    plan: dict[str, ParallelStyle] = field(default_factory=dict)  # {module FQN: style}; empty when tp == 1
    loss_parallel: bool = False  # the loss runs on vocab-sharded logits (only with tp > 1)

    @classmethod
    def resolve(
        cls,
        model: nn.Module,
        tp: int,
        tp_plan: dict[str, ParallelStyle] | None,
        loss_parallel: bool,
        declared_sizes: dict[str, int] | None = None,
        refusal: str | None = None,
    ) -> TensorParallelConfig:
        """Check parallelize's tp arguments (the plan: the user's or the model's own) against the
        (meta) model and the sizes it declares tp must divide: pure, the same on every rank.
        `refusal`: why the model's own declaration gives no plan, raised when tp > 1 and no plan is given."""
        if tp == 1:
            return cls()
        return cls(check_plan(model, model_plan(model, tp_plan, refusal), tp, declared_sizes), bool(loss_parallel))

    @property
    def sequence_parallel(self) -> bool:
        """Whether activations between blocks (and stages) are sharded along the sequence."""
        return uses_sequence_parallel(self.plan)

    def __str__(self) -> str:
        summary = sorted((pattern, _describe(style)) for pattern, style in self.plan.items())
        return f"plan={summary} loss_parallel={self.loss_parallel}"


def _describe(style: ParallelStyle) -> str:
    """A style's arguments where its repr shows them; its class otherwise (a default repr has an address)."""
    text = repr(style)
    return type(style).__name__ if " object at 0x" in text else text


def model_plan(
    model: nn.Module, tp_plan: dict[str, ParallelStyle] | None, refusal: str | None = None
) -> dict[str, ParallelStyle]:
    """The plan to use (parallelize's `tp_plan`, else the model's own), checked for its type."""
    plan = tp_plan
    if plan is None and refusal:
        raise ValueError(refusal)
    if plan is None:
        raise ValueError(
            f"tp > 1 needs a tensor-parallel plan: give {type(model).__name__} a `tp_plan` attribute or pass "
            "tp_plan={module-name pattern: ParallelStyle} to parallelize (docs/parallelize.md)"
        )
    if not isinstance(plan, dict) or not all(isinstance(s, ParallelStyle) for s in plan.values()):
        raise TypeError("tp_plan must be a dict from module-name patterns (str) to torch ParallelStyle objects")
    return plan


def resolve_plan(module: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """{module FQN: style} for every module of `module` that a pattern matches.

    A module matched by two patterns is an error: the styles would fight over its parameters.
    """
    resolved: dict[str, ParallelStyle] = {}
    matched_by: dict[str, str] = {}
    for name, _ in module.named_modules():
        if not name:
            continue
        for pattern, style in plan.items():
            if fnmatchcase(name, pattern):
                if name in matched_by:
                    raise ValueError(
                        f"tp_plan: module '{name}' matches two patterns, '{matched_by[name]}' and '{pattern}'; "
                        "make the patterns disjoint"
                    )
                resolved[name], matched_by[name] = style, pattern
    return resolved


def check_plan(
    model: nn.Module, plan: dict[str, ParallelStyle], tp: int, declared: dict[str, int] | None = None
) -> dict[str, ParallelStyle]:
    """Check the plan against the whole (meta) model for tensor-parallel degree `tp`; return it resolved.

    Raises ValueError naming the module and the sizes when a pattern matches nothing, when tp does
    not divide a sharded weight dimension, or when it does not divide one of the sizes the model
    declares (`declared`: heads, kv heads, FFN width, vocabulary, ...).
    """
    resolved = resolve_plan(model, plan)
    unused = [p for p in plan if not any(fnmatchcase(name, p) for name in resolved)]
    if unused:
        raise ValueError(f"tp_plan: patterns {unused} match no module of {type(model).__name__}; check their spelling")
    declared = declared or {}
    for what, size in declared.items():
        if size % tp != 0:
            raise ValueError(
                f"tp={tp} does not divide {what}={size} of {type(model).__name__}; choose tp among "
                f"{_common_divisors(declared.values())}"
            )
    for name, style in resolved.items():
        for param_name, dim, size in _sharded_dims(model.get_submodule(name), style):
            if size % tp != 0:
                raise ValueError(
                    f"tp={tp} does not divide dim {dim} (size {size}) of '{name}.{param_name}', which "
                    f"{type(style).__name__} shards; choose tp dividing {size}"
                )
    return resolved


def uses_sequence_parallel(plan: dict[str, ParallelStyle]) -> bool:
    """Whether activations between blocks (and stages) are sharded along the sequence."""
    return any(isinstance(style, SequenceParallel) for style in plan.values())


def _sharded_dims(module: nn.Module, style: ParallelStyle) -> list[tuple[str, int, int]]:
    """(parameter, dim, size tp must divide) for each parameter the style splits over tp: torch's rules for
    Linear and Embedding, the named placements of a style on local shards (a strided split divides each
    of its parts)."""
    if isinstance(style, LocalParameters):
        out = []
        for param_name, placement in style.placements.items():
            param = module._parameters.get(param_name)
            if param is not None and splits_a_dim(placement):
                parts = getattr(placement, "split_factor", 1)
                dim = placement.dim % param.dim()
                out.append((param_name, dim, int(param.shape[dim]) // parts))
        return out
    weight = getattr(module, "weight", None)
    if weight is None or not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return []
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Embedding):
        dim = 1 if colwise else 0
    else:
        dim = 0 if colwise else 1
    return [("weight", dim, int(weight.shape[dim]))]


def _common_divisors(sizes) -> list[int]:
    sizes = list(sizes)
    smallest = min(sizes)
    return [d for d in range(1, smallest + 1) if all(s % d == 0 for s in sizes)]
