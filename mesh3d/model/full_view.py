"""Initializing sharded parameters with exactly the values one process would give them.

`parallelize` shards a model given on meta before it allocates anything (tensor and data
parallelism on meta, then `to_empty`), so a rank holds only its shards. The model's own
initializer (its `init_weights`, a Hugging Face model's `_init_weights`, each module's
`reset_parameters`) was written for whole tensors and draws from the global RNG in order. Inside
`FullView(stage)` it still sees whole tensors: the first operation that touches a sharded
parameter gives it a full-size stand-in on the rank's device, every operation on the parameter
runs on the stand-in (so the RNG is consumed exactly as in one process), and when the initializer
moves on to another parameter the stand-in's window (this rank's shard) is copied into the shard
and the stand-in dropped. At most one whole parameter exists at a time (two for an operation
that reads one parameter into another, such as copying a tied weight).

An initializer that already handles sharded parameters runs untouched: one that writes the local
shard itself (the LLaMA example fills `to_local()` windows) or passes a DTensor of its own. A
parameter touched again after its stand-in was dropped gets it back gathered from the shards
(every rank of the parameter's mesh runs the same initializer, so the gather is collective on all
of them alike).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from mesh3d.distributed.shards import local_blocks, local_tensor

# Reading what a tensor is, not what it holds: answered by the sharded parameter itself (a DTensor
# reports its global shape), so asking costs no stand-in.
_METADATA = {
    "dim",
    "size",
    "numel",
    "nelement",
    "element_size",
    "is_floating_point",
    "is_complex",
    "__len__",
    "shape",
    "ndim",
    "dtype",
    "device",
    "requires_grad",
    "is_cuda",
    "is_meta",
    "layout",
    "is_sparse",
    "names",
    "__hash__",
    "__eq__",
    "__format__",
    "__repr__",
    "__bool__",
    "__class__",
    "requires_grad_",
}


def _name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property getter: Tensor.shape.__get__ and the like
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class FullView(TorchFunctionMode):
    """While active, every parameter of `module` looks whole to whatever initializes it; writes land
    in this rank's shard. Use under `torch.no_grad()`; parameters that are not DTensors are left alone."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._params = {id(p): p for p in module.parameters() if isinstance(p, DTensor)}
        self._stand_ins: dict[int, torch.Tensor] = {}  # id(parameter) -> its whole stand-in
        self._written: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        touched = [self._param_of(t) for t in leaves if isinstance(t, torch.Tensor)]
        touched = [p for p in touched if p is not None]
        own_dtensors = any(
            isinstance(t, DTensor) and self._param_of(t) is None for t in leaves if isinstance(t, torch.Tensor)
        )
        name = _name(func)
        if not touched or own_dtensors or name in _METADATA:
            return func(*args, **kwargs)
        if name == "data" and len(args) == 1:  # `param.data`: the parameter stands for itself
            return args[0]
        stand_ins = self._stand_ins_for({id(p): p for p in touched})
        swapped = tree_map(lambda t: self._stand_in_or_itself(t, stand_ins), (args, kwargs))
        result = func(*swapped[0], **swapped[1])
        for param_id, stand_in in stand_ins.items():
            if result is stand_in:  # an in-place op returns its target: give back the parameter
                return self._params[param_id]
        return result

    def __exit__(self, exc_type, exc, tb):
        result = super().__exit__(exc_type, exc, tb)  # the mode first, so writing back is not seen by it
        if exc_type is None:
            for param_id in list(self._stand_ins):
                self._write_back(param_id)
        self._stand_ins.clear()
        return result

    def _stand_in_or_itself(self, value, stand_ins: dict[int, torch.Tensor]):
        param = self._param_of(value) if isinstance(value, torch.Tensor) else None
        return value if param is None else stand_ins[id(param)]

    def _param_of(self, tensor: torch.Tensor) -> nn.Parameter | None:
        return self._params.get(id(tensor))

    def _stand_ins_for(self, params: dict[int, nn.Parameter]) -> dict[int, torch.Tensor]:
        """Whole stand-ins for exactly `params` (an op reading two, as a copy between tied
        weights, holds two): the others are written back into their shards and dropped."""
        for param_id in [i for i in self._stand_ins if i not in params]:
            self._write_back(param_id)
        for param_id, param in params.items():
            if param_id not in self._stand_ins:
                local = local_tensor(param)
                if param_id in self._written:  # written earlier and dropped: its values come back from the shards
                    self._stand_ins[param_id] = param.full_tensor()
                else:
                    self._stand_ins[param_id] = torch.empty(param.shape, dtype=local.dtype, device=local.device)
        return dict(self._stand_ins)

    def _write_back(self, param_id: int) -> None:
        param, whole = self._params[param_id], self._stand_ins.pop(param_id)
        local = local_tensor(param)
        for global_window, local_window in local_blocks(param):  # one window, or a strided shard's several
            local[local_window].copy_(whole[global_window])
        self._written.add(param_id)
