"""The backward of one stage and microbatch in two halves, for zero-bubble schedules.

I computes the gradient with respect to the stage input only (the previous stage waits for it).
On its way it records, at each node of the input-gradient chain where a weight's gradient branches
off, the gradient that arrived there. W later starts from those recorded gradients and walks only
the branches that lead to weights: each part of the graph is walked once, so I + W costs what one
full backward costs (the idea of torch's `stage_backward_input`/`stage_backward_weight`; written
here over the graph's own nodes, so that what the graph's leaves are does not matter: plain or
DTensor parameters, FSDP's unsharded parameters, tied copies).

Data-parallel wrappers see W as a backward that their autograd hooks do not reach (it starts
inside the graph); the runtime therefore tells them when a W has finished (see
data_parallel/gradient_sync.py).

A compiled block is one node whose backward computes its input and weight gradients together, at
I already: I keeps those weight gradients (instead of what arrived at the node), and W only
accumulates them. A compiled block's I then costs its whole backward and its W almost nothing; the
sum is still one backward.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, _engine_run_backward


@dataclass(eq=False)  # groups are told apart by identity
class _BranchGroup:
    """Weights whose gradients start at the same chain nodes, and what arrived at those nodes."""

    weights: list[torch.Tensor]
    chain_nodes: list[Node]
    arrived: list[tuple[torch.Tensor | None, ...] | None] = field(default_factory=list)
    # When the chain node already computed its branches' gradients at I (a compiled block's
    # backward is one node that computes them all): those, to start W past the node.
    computed: list[tuple[GradientEdge, torch.Tensor]] | None = None


@dataclass
class PendingWeightGrad:
    """What I leaves for W: the branch groups and the gradients I recorded for them."""

    groups: list[_BranchGroup]


def backward_input(
    output: torch.Tensor, output_grad: torch.Tensor | None, stage_input: torch.Tensor
) -> tuple[torch.Tensor, PendingWeightGrad | None]:
    """I: the gradient of `output` (with `output_grad`, or a scalar loss) with respect to the leaf
    `stage_input`, and what W needs. Returns (input gradient, pending) with pending None when the
    input does not reach the output (W must then run a whole backward)."""
    root = output.grad_fn
    input_node = _accumulator(stage_input)
    parents, weight_nodes = _reverse_edges(root)
    chain = _reaches(input_node, parents)
    if root is None or root not in chain:
        return torch.zeros_like(stage_input), None
    groups = _branch_groups(weight_nodes, chain, parents)
    handles = []
    for group in groups:
        group.arrived = [None] * len(group.chain_nodes)
        for index, node in enumerate(group.chain_nodes):
            handles.append(node.register_prehook(_recorder(group.arrived, index)))
        # Only a Python autograd.Function (a compiled block is one) computes every gradient
        # whatever is needed; a post-hook on a built-in node costs ~15 % of I on a LLaMA block.
        # (With more than one chain node, W pins them; keep to one way there.)
        if len(group.chain_nodes) == 1 and isinstance(group.chain_nodes[0], BackwardCFunction):
            handles.append(group.chain_nodes[0].register_hook(_branch_keeper(group, chain)))
    try:
        (input_grad,) = torch.autograd.grad(output, stage_input, output_grad, retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return input_grad, PendingWeightGrad(groups)


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate every weight's gradient into its `.grad`, from what I recorded."""
    for group in pending.groups:
        roots, grads = [], []
        if group.computed is not None:
            roots, grads = [edge for edge, _ in group.computed], [grad for _, grad in group.computed]
        for node, arrived in zip(group.chain_nodes, group.arrived if group.computed is None else ()):
            for index, grad in enumerate(arrived or ()):
                if grad is not None:
                    roots.append(GradientEdge(node, index))
                    grads.append(grad)
        if not roots:
            continue
        handles = []
        if len(group.chain_nodes) > 1:
            # One chain node may lie downstream of another of the same group: pin what reaches it
            # to what I recorded, or the upstream one's gradient would be counted there twice.
            handles = [
                node.register_prehook(lambda _grads, recorded=arrived: recorded)
                for node, arrived in zip(group.chain_nodes, group.arrived)
            ]
        try:
            # torch.autograd.backward less its checks of the gradients' shapes (they are the ones
            # autograd itself recorded at I), which cost more than a small branch's backward. The
            # graph is kept: another group's branch may share nodes with this one's.
            _engine_run_backward(
                tuple(roots),
                tuple(grads),
                True,
                False,
                tuple(group.weights),
                allow_unreachable=True,
                accumulate_grad=True,
            )
        finally:
            for handle in handles:
                handle.remove()
    pending.groups.clear()


def _recorder(arrived: list, index: int):
    def record(grad_outputs):
        arrived[index] = tuple(grad_outputs)

    return record


def _branch_keeper(group: _BranchGroup, chain: set[Node]):
    """A post-hook for a group's single chain node: if the node computed the gradients of every
    edge leaving the chain, keep them (and drop what arrived: W will not run the node again)."""
    node = group.chain_nodes[0]
    branches = [
        (k, GradientEdge(child, nr))
        for k, (child, nr) in enumerate(node.next_functions)
        if child is not None and child not in chain
    ]

    def keep(grad_inputs, _grad_outputs):
        if branches and all(grad_inputs[k] is not None for k, _ in branches):
            group.computed = [(edge, grad_inputs[k]) for k, edge in branches]
            group.arrived = [None]

    return keep


def _accumulator(leaf: torch.Tensor) -> Node | None:
    """The AccumulateGrad node of a leaf (autograd creates it lazily; a view makes it exist)."""
    view = leaf.view_as(leaf)
    return view.grad_fn.next_functions[0][0] if view.grad_fn is not None else None


def _reverse_edges(root: Node | None) -> tuple[dict[Node, list[Node]], list[Node]]:
    """For every node under `root`: the nodes that send it gradient; and the weight leaves found."""
    parents: dict[Node, list[Node]] = defaultdict(list)
    leaves: list[Node] = []
    if root is None:
        return parents, leaves
    seen, queue = {root}, deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            parents[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
                if hasattr(child, "variable"):  # AccumulateGrad: a leaf that wants a gradient
                    leaves.append(child)
    return parents, leaves


def _reaches(start: Node | None, parents: dict[Node, list[Node]]) -> set[Node]:
    """The nodes whose gradient flows into `start` (`start` included): the input-gradient chain."""
    if start is None or start not in parents:
        return set()
    found, queue = {start}, deque([start])
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in found:
                found.add(parent)
                queue.append(parent)
    return found


def _branch_groups(weight_nodes: list[Node], chain: set[Node], parents: dict[Node, list[Node]]) -> list[_BranchGroup]:
    """For each weight, the chain nodes where its branch leaves the chain; weights that share one
    are grouped (W must start them together)."""
    group_of: dict[Node, _BranchGroup] = {}
    groups: list[_BranchGroup] = []
    for weight_node in weight_nodes:
        if weight_node in chain:
            continue  # the stage input itself
        starts, seen, queue = [], {weight_node}, deque([weight_node])
        while queue:
            for parent in parents[queue.popleft()]:
                if parent in seen:
                    continue
                seen.add(parent)
                if parent in chain:
                    starts.append(parent)
                else:
                    queue.append(parent)
        merged = {id(group_of[node]): group_of[node] for node in starts if node in group_of}
        group = _BranchGroup([weight_node.variable], [n for n in starts if n not in group_of])
        for other in merged.values():
            group.weights += other.weights
            group.chain_nodes += other.chain_nodes
            groups.remove(other)
        for node in group.chain_nodes:
            group_of[node] = group
        groups.append(group)
    return groups
