"""Tensor-parallel styles for modules that compute on their own shards as plain tensors.

torch's ColwiseParallel and RowwiseParallel cover linear layers and embeddings. Mixture-of-experts
blocks, attention sinks and latent-attention projections hold parameters of other shapes, and their
forwards (grouped mm, an expert loop, a softmax with a sink per head) run on plain tensors. These
styles shard such a module's named parameters as DTensors (so checkpoints, optimizers and FSDP see
the global tensor) and run its forward on the local shards, which torch's `to_local` keeps
differentiable: each shard's gradient lands in the DTensor parameter's gradient.

- LocalParameters: the parameters' shards, nothing else (an attention module whose per-head sink
  is split with its heads, its projections sharded by their own styles);
- ExpertsParallel: every expert split along its intermediate features (transformers'
  "moe_tp_experts" with "packed_colwise" gate_up and "rowwise" down): each rank computes a part of
  every expert's output, the parts are summed over tp (all-reduce forward), and the gradient of each
  input, which every part reads whole, is summed over tp (all-reduce backward);
- ScaledInput: an input divided by tp (transformers' "moe_identity_expert", a zero-cost expert whose
  output the experts' sum would otherwise count tp times);
- LatentKvProjection: the last `rope_dim` outputs of a replicated latent projection (MLA's
  kv_a_proj_with_mqa) feed every head directly, so their gradient is summed over tp; the rest reach
  the heads through a column-wise projection, whose own backward already sums it.

Placements are plain DTensor ones; a packed gate_up weight is a torch `_StridedShard` (gate and up
each split, so a rank holds matching halves).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torch.utils._pytree import tree_map


def _summed_in_backward(tensor, mesh: DeviceMesh):
    """The tensor itself forward; its gradient summed over the mesh backward (a floating tensor that
    needs a gradient; anything else passes through)."""
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor) or not tensor.is_floating_point():
        return tensor
    if not tensor.requires_grad:
        return tensor
    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _summed_in_forward(tensor, mesh: DeviceMesh):
    """The sum over the mesh of every rank's tensor forward; the gradient as it is backward."""
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, DTensor) or not tensor.is_floating_point():
        return tensor
    partial = DTensor.from_local(tensor, mesh, [Partial()], run_check=False)
    return partial.redistribute(mesh, [Replicate()]).to_local()


class LocalParameters(ParallelStyle):
    """Shard the module's parameters named in `placements` ({name: DTensor placement}) over the tp
    mesh; its forward sees every DTensor parameter as this rank's plain shard."""

    def __init__(self, placements: dict[str, Placement]):
        super().__init__()
        self.placements = dict(placements)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.placements})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, placement in self.placements.items():
            param = module._parameters.get(name)
            if param is None:
                continue  # a pattern covers variants of a module (attention with and without sinks)
            sharded = distribute_tensor(param.data, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module._parameters[name] = nn.Parameter(sharded, requires_grad=param.requires_grad)
        module.register_forward_pre_hook(_swap_in_local_shards, with_kwargs=True)
        module.register_forward_hook(_swap_back_parameters, always_call=True)
        return module


def _swap_in_local_shards(module: nn.Module, args, kwargs):
    held = {name: p for name, p in module._parameters.items() if isinstance(p, DTensor)}
    module._mesh3d_held_parameters = held
    for name, param in held.items():
        module._parameters[name] = param.to_local()


def _swap_back_parameters(module: nn.Module, args, output):
    held = getattr(module, "_mesh3d_held_parameters", None) or {}
    module._parameters.update(held)
    module._mesh3d_held_parameters = None


class ExpertsParallel(LocalParameters):
    """Every expert split along its intermediate features: the parts of the output summed over tp."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        super()._apply(module, device_mesh)

        def inputs(_, args, kwargs):
            return tree_map(lambda t: _summed_in_backward(t, device_mesh), (args, kwargs))

        def output(_, args, out):
            return tree_map(lambda t: _summed_in_forward(t, device_mesh), out)

        # prepend: the inputs are wrapped before the shards are swapped in, the sum taken after the swap back
        module.register_forward_pre_hook(inputs, with_kwargs=True, prepend=True)
        module.register_forward_hook(output)
        return module


class ScaledInput(ParallelStyle):
    """The module's first input divided by the tp degree."""

    def __repr__(self) -> str:
        return "ScaledInput()"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()

        def scale(_, args):
            return (args[0] / size, *args[1:])

        module.register_forward_pre_hook(scale)
        return module


class LatentKvProjection(ParallelStyle):
    """A replicated projection whose last `rope_dim` outputs reach every head directly: their
    gradient is summed over tp (each rank's heads give a part)."""

    def __init__(self, rope_dim: int):
        super().__init__()
        self.rope_dim = rope_dim

    def __repr__(self) -> str:
        return f"LatentKvProjection(rope_dim={self.rope_dim})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim

        def output(_, args, out):
            latent, rope = out.split([out.shape[-1] - rope_dim, rope_dim], dim=-1)
            return torch.cat([latent, _summed_in_backward(rope, device_mesh)], dim=-1)

        module.register_forward_hook(output)
        return module
