"""Tokens to the ranks that hold their experts, and the experts' outputs back: two all-to-alls.

Each of the ep ranks of a group holds E/ep experts whole (rank e the experts e*E/ep ...). A rank
sorts its (token, chosen expert) pairs by expert, which groups them by owner; one small all-to-all
of the per-expert counts tells every rank how many rows it will receive for each of its experts
(the counts are read to the host, the layer's one host stop per microbatch, counted by
tests/distributed/test_expert_parallel.py: the splits are uneven, nothing is dropped, no capacity
factor; the backward reuses them);
the rows go out in one all-to-all, the owners run their experts on them (each row with its one
expert, weight 1), and the results come back in a second all-to-all, in the order they left. The
sender weights each result by its routing weight and sums a token's k results, as transformers'
experts do.

The ranks of a tp group hold the same tokens: each takes its own 1/tp of them before sending, so no
token is computed twice, and the group all-gathers the combined rows afterwards.

Gradients take the same routes backwards: an all-to-all's backward is the all-to-all with the
splits swapped.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

# experts_forward(rows, local expert id per row as (n, 1), weight per row as (n, 1)) -> (n, hidden)
ExpertsForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _AllToAll(torch.autograd.Function):
    """Rows to the group's ranks, `send[j]` of them to rank j, `recv[j]` from it (dist.all_to_all_single)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (send, recv), group
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        send, recv = ctx.splits
        back = grad.new_empty((sum(send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), send, recv, group=ctx.group)
        return back, None, None, None


def _own_rows(tensor: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """This tp rank's rows of a tensor the group holds alike; backward, the rows' gradients gathered."""
    return (
        DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(0)]).to_local()
    )


def _all_rows(rows: torch.Tensor, tp_mesh: DeviceMesh, total: int) -> torch.Tensor:
    """Every tp rank's rows, in order (`total` of them, split as torch.chunk splits them)."""
    hidden = rows.shape[-1]
    sharded = DTensor.from_local(rows.contiguous(), tp_mesh, [Shard(0)], shape=(total, hidden), stride=(hidden, 1))
    return sharded.full_tensor()


def dispatch_to_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    experts_forward: ExpertsForward,
    num_local: int,
    ep_group: dist.ProcessGroup,
    tp_mesh: DeviceMesh | None,
    connect: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """The routed experts' weighted sum for each token (rows of `hidden`, (tokens, hidden)), computed
    where the experts live. `top_k_index` holds global expert ids; `connect()` returns a 0-dim zero
    that depends on the local experts' parameters, added when no row arrives here so the parameters
    still get a (zero) gradient and every rank's data-parallel reduction holds the same tensors."""
    total = hidden.shape[0]
    if tp_mesh is not None:
        hidden, top_k_index, top_k_weights = (_own_rows(t, tp_mesh) for t in (hidden, top_k_index, top_k_weights))
    ep = dist.get_world_size(ep_group)
    top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # grouped by expert, so by owner rank
    send_rows = hidden[order // top_k]
    send_counts = torch.zeros(num_local * ep, dtype=torch.long, device=expert_ids.device)
    send_counts = send_counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids)).view(ep, num_local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=ep_group)
    send, recv = torch.stack([send_counts.sum(dim=1), recv_counts.sum(dim=1)]).tolist()  # the one host stop

    rows = _AllToAll.apply(send_rows, send, recv, ep_group)
    # the rows arrive by sender, each sender's by expert: the local expert of each row
    local_ids = torch.arange(num_local, device=rows.device).repeat(ep)
    local_ids = local_ids.repeat_interleave(recv_counts.reshape(-1), output_size=rows.shape[0]).unsqueeze(-1)
    if rows.shape[0]:
        ones = torch.ones(rows.shape[0], 1, dtype=top_k_weights.dtype, device=rows.device)
        out = experts_forward(rows, local_ids, ones)
    else:  # nothing routed here: no kernel runs on zero rows, and the experts still get a (zero) gradient
        out = rows + connect()
    back = _AllToAll.apply(out, recv, send, ep_group)

    per_choice = torch.empty_like(back).index_copy(0, order, back)  # back in (token, choice) order
    per_choice = per_choice.view(*top_k_weights.shape, back.shape[-1])
    combined = (per_choice * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden.dtype)
    return combined if tp_mesh is None else _all_rows(combined, tp_mesh, total)
