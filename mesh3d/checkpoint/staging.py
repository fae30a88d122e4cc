"""A host copy of the state a save writes, so that training may change the parameters meanwhile.

`HostCopy.stage(entries)` copies a save's flat state (flat_state.py: DTensors, plain tensors,
hyperparameters) into CPU tensors (pinned on CUDA), kept and refilled by the next save of the same
shapes: at most one copy of the rank's checkpointed state is ever held. The copies keep each
DTensor's mesh and placements, so DCP records the same chunks as for the parameters themselves;
strided entries are turned into ShardedTensors after the copy (strided_entries.as_checkpointable
on the copy), so they are views of the copy, not of the parameters.

The copying is torch's own (torch.distributed._state_dict_utils, what DCP's BlockingAsyncStager
runs), called directly rather than through BlockingAsyncStager: its cached buffers are always
pinned, which a CPU-only torch refuses, and it would reuse them for a state of other shapes. Two
gaps of torch's are filled here: a 0-dim DTensor is handed back as itself (not copied), and the
copy to pinned memory is asynchronous on CUDA (waited for before `stage` returns).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.tensor import DTensor

from mesh3d.distributed.shards import local_tensor


class HostCopy:
    """One host copy of a flat state, refilled by each `stage` of the same shapes."""

    def __init__(self) -> None:
        self._buffers: dict[str, object] | None = None
        self._shapes: list | None = None

    def stage(self, entries: dict[str, object], device: torch.device) -> dict[str, object]:
        """`entries` copied to the host: tensors into the kept buffers, other values as they are now."""
        shapes = _shapes_of(entries)
        if shapes != self._shapes:
            self._buffers = self._shapes = None  # freed before the new ones are made: one copy at most
            self._buffers = _create_cpu_state_dict(entries, pin_memory=device.type == "cuda")
            for key, value in entries.items():
                if self._buffers[key] is value:  # a 0-dim DTensor: torch hands it back uncopied
                    self._buffers[key] = copy.deepcopy(value)
            self._shapes = shapes
        staged = _copy_state_dict(entries, self._buffers, non_blocking=device.type == "cuda", type_check=False)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the copies to pinned memory have landed
        return staged


def _shapes_of(entries: dict[str, object]) -> list:
    """What the buffers depend on: each tensor's kind, dtype, global and local shape and placement."""
    shapes = []
    for key, value in entries.items():
        if isinstance(value, DTensor):
            shapes.append((key, "dtensor", value.dtype, tuple(value.shape), tuple(local_tensor(value).shape)))
            shapes.append((value.device_mesh, value.placements))
        elif isinstance(value, torch.Tensor):
            shapes.append((key, "tensor", value.dtype, tuple(value.shape)))
        else:
            shapes.append((key, "value", _structure(value)))
    return shapes


def _structure(value: object) -> object:
    """A value's type and, for a sequence or dict, its length or keys (torch copies them element by element)."""
    if isinstance(value, (list, tuple)):
        return [_structure(item) for item in value]
    if isinstance(value, dict):
        return {key: _structure(item) for key, item in value.items()}
    return type(value).__name__
