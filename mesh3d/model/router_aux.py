"""A mixture of experts' load-balancing loss, made of sums that cross pipeline stages exactly.

transformers' causal LMs with `output_router_logits` add `router_aux_loss_coef` times a
load-balancing loss to the cross-entropy (Switch Transformer's, eqs. 4-6): over every layer's
router logits of the microbatch, the share of top-k assignments each expert gets times the mean
probability the router gives it, summed over experts, times the expert count. transformers (5.x)
computes it from three sums accumulated layer by layer: the top-k assignments per expert (a
histogram, no gradient), the routing probabilities per expert, and the rows counted. Sums over
layers are sums over stages, so each stage adds its own layers to the sums it received and sends
them on with its activation (`RouterAux.add_layer`, `to_wire`); the last stage holds the
microbatch's sums over every layer and computes the loss from them, and its gradient reaches each
stage's routers back through the messages, as the activations' does. No schedule changes: the
sums ride messages the schedule sends anyway.

The sums travel in the message's dtype: under 16-bit activations as the fp32 sums' bit patterns
(two 16-bit elements per value, gradients likewise), so no rounding enters on the wire.

Under context parallelism a microbatch's tokens are spread over the cp ranks: the assignment
counts and rows are summed over the cp group (they carry no gradient; one small all-reduce in
the last stage's loss, and again where that loss is recomputed) and each rank's loss term takes
its own probability sums, the terms adding up, over the cp ranks, to the microbatch's loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RouterAux:
    """What a model's load-balancing loss needs: its coefficient, the routed experts and top-k."""

    coef: float
    num_experts: int
    top_k: int

    @property
    def size(self) -> int:
        """fp32 values per microbatch row of sums: assignments (E), probabilities (E), rows (1)."""
        return 2 * self.num_experts + 1

    def start(self, device: torch.device) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float32, device=device)

    def add_layer(self, sums: torch.Tensor, router_logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """`sums` with one layer's router logits (rows x experts) added, as transformers adds them
        (its `load_balancing_loss_func`): softmax, top-k, a histogram of the choices; rows weighted
        by a 2-d padding mask where one is given."""
        e = self.num_experts
        weights = torch.nn.functional.softmax(router_logits.reshape(-1, e).to(sums.device), dim=-1)
        _, chosen = torch.topk(weights, self.top_k, dim=-1)
        if mask is None:
            # transformers' choice of dtype: histc takes floats on the CPU, integers (deterministic) on CUDA
            histc_dtype = torch.float32 if weights.device.type in ("cpu", "mps") else torch.int32
            counts = torch.histc(chosen.reshape(-1).to(histc_dtype), bins=e, min=0, max=e)
            probs = weights.float().sum(dim=0)
            rows = torch.full((1,), float(weights.shape[0]), device=sums.device)
        else:
            flat = mask.reshape(-1).to(device=weights.device, dtype=torch.float32)
            counts = torch.zeros(e, dtype=torch.float32, device=weights.device)
            counts = counts.scatter_add_(0, chosen.reshape(-1), flat.repeat_interleave(self.top_k))
            probs = (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
            rows = flat.sum().reshape(1)
        counts_so_far, probs_so_far, rows_so_far = sums.split([e, e, 1])
        return torch.cat([counts_so_far.detach() + counts.float(), probs_so_far + probs, rows_so_far.detach() + rows])

    def loss(self, sums: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of a microbatch from its sums over every layer."""
        e = self.num_experts
        counts, probs, rows = sums.split([e, e, 1])
        total = rows.reshape(())
        return torch.sum((counts / total) * (probs / total).unsqueeze(0)) * e

    def over_group(self, sums: torch.Tensor, group) -> torch.Tensor:
        """The sums with the assignments and rows of every rank of `group` (the cp ranks sharing a
        microbatch's tokens) and this rank's own probabilities: `loss` of it, summed over the group,
        is the microbatch's loss."""
        e = self.num_experts
        counted = sums.detach().clone()
        dist.all_reduce(counted, group=group)
        counts, _, rows = counted.split([e, e, 1])
        return torch.cat([counts, sums[e : 2 * e], rows])


def to_wire(sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 sums as a message component of `dtype`: bit patterns where it is 16-bit (the
    gradient comes back the same way), the values themselves otherwise (exact either way)."""
    if dtype.itemsize == 2:
        return _BitsOnTheWire.apply(sums, dtype)
    return sums.to(dtype)


def from_wire(wire: torch.Tensor) -> torch.Tensor:
    """What `to_wire` sent, as fp32 sums again (differentiable)."""
    if wire.dtype.itemsize == 2:
        return _BitsOffTheWire.apply(wire)
    return wire.float()


class _BitsOnTheWire(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return sums.detach().clone().view(dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # clone first: a view of a message at an odd offset cannot be reinterpreted in place
        return grad.clone().view(torch.float32), None


class _BitsOffTheWire(torch.autograd.Function):
    @staticmethod
    def forward(ctx, wire: torch.Tensor) -> torch.Tensor:
        ctx.dtype = wire.dtype
        return wire.detach().clone().view(torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.clone().view(ctx.dtype)
