"""Tied weights across pipeline stages.

The engine finds ties itself: names in the unsplit model that share one Parameter. After the split
each rank that holds any of those names keeps one copy, shared by all its local stages (under
data parallelism one copy per local stage instead, each stage being its own FSDP/DDP root, kept
equal the same way as copies on other ranks). When
copies live on several pp ranks they start identical (broadcast from the lowest of those pp
ranks, the primary), the gradients a step adds are summed among exactly those ranks after the
schedule, and the gradient norm counts the weight once (on the primary). With every end on one
rank nothing is sent.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from mesh3d.distributed.shards import local_tensor
from mesh3d.mesh import Layout


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
    """One tie: its names, the pp ranks holding a copy, and this rank's copies (if any)."""

    names: list[str]
    ranks: list[int]  # pp ranks holding a copy, ascending; ranks[0] is the primary
    stages: dict[int, nn.Module] = field(default_factory=dict, repr=False)  # this rank's stages
    group: dist.ProcessGroup | None = None  # among the copies' ranks; None when only one holds it
    group_ranks: list[int] | None = None  # global ranks of `group`

    @property
    def copies(self) -> list[nn.Parameter]:
        """This rank's distinct Parameters under the tie's names, in stage order: one, or one per
        local stage under data parallelism. Looked up each time, so tensor or data parallelism
        replacing a parameter needs no bookkeeping."""
        found: list[nn.Parameter] = []
        for index in sorted(self.stages):
            for name in self.names:
                param = get_parameter(self.stages[index], name)
                if param is not None and all(param is not c for c in found):
                    found.append(param)
        return found

    @property
    def param(self) -> nn.Parameter | None:
        """This rank's first copy (None when this rank holds none)."""
        copies = self.copies
        return copies[0] if copies else None

    @property
    def counted_here(self) -> bool:
        """Whether this rank's first copy enters the gradient norm (only the primary rank's does)."""
        return bool(self.copies) and (self.group is None or dist.get_rank() == self.group_ranks[0])

    @property
    def needs_sync(self) -> bool:
        return self.group is not None or len(self.copies) > 1


class TiedWeights:
    """All ties of a split model, as seen from one rank."""

    def __init__(
        self,
        ties: list[list[str]],
        meta_stages: list[nn.Module],
        stage_rank: Callable[[int], int],
        layout: Layout,
        stages: dict[int, nn.Module],
    ):
        """
        ties: groups of tied names; meta_stages: every stage (on meta); stage_rank: stage -> pp
        rank; stages: this rank's stage modules. Each tie's groups are groups of their own
        (layout.own_groups), never the pp group the pipeline's messages use: a never-drain
        schedule's TIE runs between those messages, and on NCCL a collective on a communicator
        waits for every operation issued there before it. Created once, one kind per tie (its pp ranks in
        every pp group of the mesh), by every rank in the same order, and reused by later calls.
        """
        self.pp_rank = layout.pp_rank
        self.ties: list[TiedWeight] = []
        for names in ties:
            holders = [
                s for s, stage in enumerate(meta_stages) if any(get_parameter(stage, n) is not None for n in names)
            ]
            ranks = sorted({stage_rank(s) for s in holders})
            tie = TiedWeight(names, ranks, stages)
            if len(ranks) > 1:
                # one kind of group: the tie's pp ranks in every pp group of the mesh
                lists = [[pp_group[r] for r in ranks] for pp_group in layout.axis_groups("pp")]
                key = tuple(ranks)
                tie.group = layout.own_groups("tie", {key: lists})[key]
                if tie.group is not None:
                    tie.group_ranks = next(members for members in lists if layout.rank in members)
            self.ties.append(tie)
        self._earlier_grads: list[list[torch.Tensor | None]] = []  # per tie, per local copy

    def tie_locally(self) -> None:
        """Make every local stage holding a tied name use one Parameter (the first stage's): the
        split gave each stage a copy of its own."""
        for tie in self.ties:
            shared = tie.param
            if shared is None and self.pp_rank in tie.ranks:
                raise RuntimeError(f"tied weight {tie.names} expected on pp rank {self.pp_rank} but not found")
            for stage in tie.stages.values():
                for name in tie.names:
                    if get_parameter(stage, name) is not None:
                        set_parameter(stage, name, shared)

    def separate_stages(self) -> None:
        """Give each local stage its own copy of a tied weight, kept equal like copies on other ranks.

        Data parallelism wraps every stage as its own FSDP/DDP root; one Parameter shared by two
        roots would be managed twice (FSDP re-points a padded shard's storage, and the other root
        keeps gathering the old one). Within a stage the names stay one Parameter.
        """
        for tie in self.ties:
            first = True
            for index in sorted(tie.stages):
                stage = tie.stages[index]
                names = [n for n in tie.names if get_parameter(stage, n) is not None]
                if not names:
                    continue
                if not first:
                    original = get_parameter(stage, names[0])
                    copy = nn.Parameter(original.detach().clone(), requires_grad=original.requires_grad)
                    for name in names:
                        set_parameter(stage, name, copy)
                first = False

    def check_sharded_alike(self, meta_stages: list[nn.Module]) -> None:
        """The tie all-reduce adds local shards: every copy must be split the same way by the tp plan."""
        for tie in self.ties:
            layouts = {}
            for stage in meta_stages:
                for name in tie.names:
                    param = get_parameter(stage, name)
                    if param is not None:
                        layouts[name] = tuple(getattr(param, "placements", ()))
            if len(set(layouts.values())) > 1:
                raise ValueError(
                    f"tied weights are sharded differently by the tp plan ({layouts}); "
                    "give both modules styles that split the shared weight along the same dim "
                    "(e.g. RowwiseParallel embedding and ColwiseParallel head both split the vocabulary)"
                )

    def is_secondary_copy(self, param: torch.Tensor) -> bool:
        """A copy whose twin (on this rank or another) is the one the gradient norm counts."""
        for tie in self.ties:
            for position, copy in enumerate(tie.copies):
                if copy is param:
                    return position > 0 or not tie.counted_here
        return False

    @torch.no_grad()
    def sync_values(self) -> None:
        """Copies take the primary's values (after init and after every load)."""
        for tie in self.ties:
            if tie.group is not None:
                dist.broadcast(local_tensor(tie.param.data), src=tie.group_ranks[0], group=tie.group)
            for copy in tie.copies[1:]:
                local_tensor(copy.data).copy_(local_tensor(tie.param.data))

    def set_aside_grads(self) -> None:
        """Before a step: keep the gradients earlier steps accumulated out of the coming sum."""
        self._earlier_grads = []
        for tie in self.ties:
            grads = [c.grad if tie.needs_sync else None for c in tie.copies]
            self._earlier_grads.append(grads)
            for copy, grad in zip(tie.copies, grads):
                if grad is not None:
                    copy.grad = None

    def restore_set_aside(self) -> None:
        """After a failed step: put back what set_aside_grads took (the step's own partial grads are dropped)."""
        for tie, grads in zip(self.ties, self._earlier_grads):
            if not tie.needs_sync:
                continue  # nothing was set aside
            for copy, grad in zip(tie.copies, grads):
                copy.grad = grad
        self._earlier_grads = []

    @torch.no_grad()
    def sync_grads(self) -> None:
        """After a step: every copy adds the sum of the gradients this step gave all copies.

        Every rank holding a copy joins the all-reduce, frozen or not: `requires_grad` is set per
        copy, so ranks may disagree on it, and skipping would mismatch the collectives. On one
        rank, freezing any local copy freezes them all (in the unsplit model both names are one
        Parameter, so freezing either freezes the weight).
        """
        earlier = self._earlier_grads or [[None] * len(t.copies) for t in self.ties]
        for tie, befores in zip(self.ties, earlier):
            if not tie.needs_sync:
                continue
            total = None
            for copy in tie.copies:
                if copy.grad is not None:
                    total = copy.grad.clone() if total is None else total + copy.grad
            if total is None:
                total = torch.zeros_like(tie.param)
            if tie.group is not None:
                dist.all_reduce(local_tensor(total), group=tie.group)
            frozen_here = any(not c.requires_grad for c in tie.copies)
            for copy, before in zip(tie.copies, befores):
                if frozen_here:
                    copy.grad = before  # a frozen copy keeps what it had
                else:
                    copy.grad = total.clone() if before is None else total + before
        self._earlier_grads = []


def ties_across_stages(
    schedule: str, ties: list[list[str]], meta_stages: list[nn.Module]
) -> tuple[tuple[int, ...], ...]:
    """The stages holding each weight tied across stages (pure: every rank sees the same meta
    stages and raises the same error). A never-drain schedule joins the copies' updates with one
    collective per update (schedule/never_drain.py), for one such weight."""
    across = []
    for names in ties:
        holders = tuple(
            s for s, stage in enumerate(meta_stages) if any(get_parameter(stage, n) is not None for n in names)
        )
        if len(holders) > 1:
            across.append((names, holders))
    if len(across) > 1:
        raise ValueError(
            f"schedule {schedule!r} supports one weight tied across pipeline stages, got {len(across)} "
            f"({[names for names, _ in across]}); untie all but one, or use a schedule that drains"
        )
    return tuple(holders for _, holders in across)


def tied_copies(tied: TiedWeights, stages: dict[int, nn.Module], tie_holders) -> dict:
    """Per stage of this rank holding the tie: (its copy, the tie's process group, the first stage holding it)."""
    copies = {}
    for holders in tie_holders:
        tie = next(t for t in tied.ties if len(t.ranks) > 1)
        for index in holders:
            if index in stages:
                param = next(p for p in (get_parameter(stages[index], n) for n in tie.names) if p is not None)
                copies[index] = (param, tie.group, holders[0])
    return copies
