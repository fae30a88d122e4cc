"""How many tokens each expert of each block was routed in the last training step, summed over every
rank: what an auxiliary-loss-free balance (DeepSeek-V3's `e_score_correction_bias`) steers by.

A pre-hook on each experts module counts the expert ids it is called with (the router's top-k
choices, every token of the microbatch, before any dispatch) into one row per experts module of
the unsplit model. `gather()` all-reduces the rows over the world: the ranks of other stages fill
their own blocks' rows, dp and cp ranks add their tokens, and only tp rank 0 counts (a tp group's
ranks see the same tokens). A recompute (activation checkpointing, inside backward) is not counted
again, nor is an evaluation.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch import nn

from mesh3d.expert_parallel.plan import ExpertPlan
from mesh3d.mesh import Layout


class ExpertLoad:
    """Per-expert routed-token counts of the experts modules `plan` names, in this rank's stages."""

    def __init__(self, plan: ExpertPlan, unsplit_names: list[str], stages: dict[int, nn.Module], layout: Layout):
        self.layout = layout
        self.names = [name for name in unsplit_names if plan.matches(name)]  # the unsplit model's order
        self.num_experts = plan.num_experts
        self.counts = torch.zeros(len(self.names), plan.num_experts, dtype=torch.long, device=layout.device)
        self._counting = False
        row_of = {name: row for row, name in enumerate(self.names)}
        # Run as written under a compiled block: its flag and counts are read at each call. Wrapped
        # here, not at import: torch.compiler.disable imports torch._dynamo (about 1 s per process).
        count = torch.compiler.disable(self._count)
        for stage in stages.values():
            for name, module in stage.named_modules():
                if name in row_of:
                    module.register_forward_pre_hook(functools.partial(count, row_of[name]), with_kwargs=True)

    @contextlib.contextmanager
    def counting(self):
        """Count the forwards of one training step (the counts start from zero)."""
        self.counts.zero_()
        self._counting = True
        try:
            yield
        finally:
            self._counting = False

    def _count(self, row: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._counting or torch._C._current_graph_task_id() != -1:  # -1: not inside a backward
            return
        chosen = (args[1] if len(args) > 1 else kwargs["top_k_index"]).reshape(-1)
        # scatter_add, not bincount: bincount reads its input's range to the host
        self.counts[row].scatter_add_(0, chosen, torch.ones_like(chosen, dtype=self.counts.dtype))

    def gather(self) -> dict[str, torch.Tensor]:
        """{experts module name: tokens routed to each of its experts in the last step}, on CPU, the same
        on every rank. A collective: call it on every rank."""
        total = self.counts * (self.layout.tp_rank == 0)
        if self.layout.world_size > 1:
            dist.all_reduce(total)
        return dict(zip(self.names, total.cpu().unbind(0)))
