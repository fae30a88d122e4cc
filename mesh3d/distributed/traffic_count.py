"""Counting a rank's collectives and point-to-point messages, by the kind of group they run on.

Every collective reaches torch's dispatcher as one op, whoever issues it: `dist.all_reduce` and
`dist.isend` as c10d's (FSDP's all-gathers and reduce-scatters, the pipeline's messages, the ties'
all-reduces), tensor parallelism's DTensors as functional collectives. A dispatch mode sees them
all, with their tensors and their group, so the count is of what the code issued, not of what a
model of it expects. The group's kind is its description: the mesh's dims ("pp", "dp", "tp", "cp",
torch's flattened "dp_cp"), mesh3d's own groups ("pipeline", "tie"), the world ("default_pg").
Under torch's fake process group (a dry run) the ops return at once and carry nothing, but their
sizes are those a real run sends.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# c10d ops whose first argument is the output and second the input; every other op (and every
# functional collective) takes its input first.
_OUTPUT_FIRST = {
    "allgather_",
    "_allgather_base_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "alltoall_",
    "alltoall_base_",
}
# ops that move nothing of their own (a wait, autograd's wrapper around a functional result)
_NOT_TRAFFIC = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"}
_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")


def group_kind(group: dist.ProcessGroup) -> str:
    """A group's kind, from its description: "pp", "pipeline", "tie", "dp_cp", "default_pg"..."""
    desc = getattr(group, "group_desc", "") or "undescribed"
    return desc.removeprefix("mesh3d ").removeprefix("mesh_")


def _group_of(args: tuple) -> dist.ProcessGroup | None:
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except (RuntimeError, TypeError):
                continue
        if isinstance(arg, str):  # a functional collective names its group
            try:
                return c10d._resolve_process_group(arg)
            except (RuntimeError, ValueError, KeyError):
                continue
    return None


def wire_bytes(op: str, given: int, ranks: int) -> float:
    """The bytes a rank puts on the wire for one call of `op` whose input is `given` bytes, in a
    group of `ranks`, by the ring algorithms NCCL runs (the planner's unit, planner/predict/): an
    all-gather sends the others its part, a reduce-scatter (n-1)/n of its whole, an all-reduce
    twice that, an all-to-all all but its own share; a send its message, a receive nothing."""
    if op.startswith(("allgather", "_allgather", "all_gather")):
        return (ranks - 1) * given
    if op.startswith(("reduce_scatter", "_reduce_scatter", "all_to_all", "alltoall")):
        return (ranks - 1) * given / ranks
    if op.startswith(("allreduce", "all_reduce")):
        return 2 * (ranks - 1) * given / ranks
    if op.startswith("send"):
        return given
    return 0.0  # a receive, a broadcast's receivers...: nothing this rank sends of its own


class TrafficCount(TorchDispatchMode):
    """While active, `counts[group kind][op] = [calls, bytes]`: the bytes of each call's input (what
    this rank sends, or for a receive what it takes in); `sent[group kind]`: the bytes it put on
    the wire (`wire_bytes`)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.sent: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if func.namespace in _NAMESPACES and name not in _NOT_TRAFFIC:
            group = _group_of(args)
            kind = group_kind(group) if group is not None else "unknown"
            sent = args[1] if name in _OUTPUT_FIRST else args[0]
            record = self.counts[kind][name]
            given = sum(t.numel() * t.element_size() for t in tree_leaves(sent) if isinstance(t, torch.Tensor))
            record[0] += 1
            record[1] += given
            self.sent[kind] += wire_bytes(name, given, group.size() if group is not None else 1)
        return func(*args, **(kwargs or {}))

    def as_dict(self) -> dict[str, dict[str, tuple[int, int]]]:
        """The counts as plain dicts: group kind -> op -> (calls, bytes)."""
        return {kind: {op: (c, b) for op, (c, b) in ops.items()} for kind, ops in self.counts.items()}
