"""Tied weights across pipeline stages.

The engine finds ties itself: names in the unsplit model that share one Parameter. After the split
each rank that holds any of those names keeps one copy, shared by all its local stages. When
copies live on several pp ranks they start identical (broadcast from the lowest of those pp
ranks, the primary), the gradients a step adds are summed among exactly those ranks after the
schedule, and the gradient norm counts the weight once (on the primary). With every end on one
rank nothing is sent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from mesh3d.mesh import Layout


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def find_ties(model: nn.Module) -> list[list[str]]:
    """Groups of parameter names (in registration order) that share one Parameter."""
    by_tensor: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor[id(param)].append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


def set_parameter(module: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, leaf, param)


def get_parameter(module: nn.Module, name: str) -> nn.Parameter | None:
    owner, _, leaf = name.rpartition(".")
    try:
        holder = module.get_submodule(owner) if owner else module
    except AttributeError:
        return None
    return holder._parameters.get(leaf) if holder is not None else None


@dataclass
class TiedWeight:
    """One tie: its names, the pp ranks holding a copy, and this rank's copy (if any)."""

    names: list[str]
    ranks: list[int]  # pp ranks holding a copy, ascending; ranks[0] is the primary
    param: nn.Parameter | None = None
    group: dist.ProcessGroup | None = None  # among the copies' ranks; None when only one holds it
    group_ranks: list[int] | None = None  # global ranks of `group`

    @property
    def counted_here(self) -> bool:
        """Whether this rank's copy enters the gradient norm (only the primary's does)."""
        return self.param is not None and (self.group is None or dist.get_rank() == self.group_ranks[0])


class TiedWeights:
    """All ties of a split model, as seen from one rank."""

    def __init__(
        self,
        ties: list[list[str]],
        stage_names: dict[int, set[str]],
        stage_rank: Callable[[int], int],
        layout: Layout,
    ):
        """
        ties: groups of tied names; stage_names: every stage's parameter names; stage_rank: stage
        -> pp rank. Tie groups come from layout.subgroup: created once, by every rank for every pp
        group of the mesh in the same order, and reused by later calls.
        """
        self.pp_rank = layout.pp_rank
        self.ties: list[TiedWeight] = []
        for names in ties:
            ranks = sorted({stage_rank(s) for s, held in stage_names.items() if held & set(names)})
            tie = TiedWeight(names, ranks)
            if len(ranks) > 1:
                for pp_group in layout.axis_groups("pp"):
                    members = [pp_group[r] for r in ranks]
                    group = layout.subgroup(members)
                    if group is not None:
                        tie.group, tie.group_ranks = group, members
            self.ties.append(tie)
        self._earlier_grads: list[torch.Tensor | None] = []

    def tie_locally(self, stages: dict[int, nn.Module]) -> None:
        """Make every local stage holding a tied name use one Parameter (the first stage's)."""
        for tie in self.ties:
            tie.param = None
            for index in sorted(stages):
                for name in tie.names:
                    param = get_parameter(stages[index], name)
                    if param is None:
                        continue
                    if tie.param is None:
                        tie.param = param
                    elif param is not tie.param:
                        set_parameter(stages[index], name, tie.param)
            if tie.param is None and self.pp_rank in tie.ranks:
                raise RuntimeError(f"tied weight {tie.names} expected on pp rank {self.pp_rank} but not found")

    def is_secondary_copy(self, param: torch.Tensor) -> bool:
        """A copy whose twin on another rank is the one the gradient norm counts."""
        return any(t.param is param and not t.counted_here for t in self.ties)

    @torch.no_grad()
    def sync_values(self) -> None:
        """Copies take the primary's values (after init and after every load)."""
        for tie in self.ties:
            if tie.group is not None:
                dist.broadcast(local_tensor(tie.param.data), src=tie.group_ranks[0], group=tie.group)

    def set_aside_grads(self) -> None:
        """Before a step: keep the gradients earlier steps accumulated out of the coming sum."""
        self._earlier_grads = []
        for tie in self.ties:
            grad = tie.param.grad if tie.group is not None else None
            self._earlier_grads.append(grad)
            if grad is not None:
                tie.param.grad = None

    @torch.no_grad()
    def sync_grads(self) -> None:
        """After a step: every copy adds the sum of the gradients this step gave all copies.

        Every rank holding a copy joins the all-reduce, frozen or not: `requires_grad` is set per
        copy, so ranks may disagree on it, and skipping would mismatch the collectives.
        """
        earlier = self._earlier_grads or [None] * len(self.ties)
        for tie, before in zip(self.ties, earlier):
            if tie.group is None:
                continue
            grad = tie.param.grad if tie.param.grad is not None else torch.zeros_like(tie.param)
            dist.all_reduce(local_tensor(grad), group=tie.group)
            if not tie.param.requires_grad:
                tie.param.grad = before  # a frozen copy keeps what it had
            else:
                tie.param.grad = grad if before is None else grad + before
        self._earlier_grads = []
