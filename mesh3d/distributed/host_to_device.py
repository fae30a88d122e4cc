"""A batch's copy from the host to the device that does not stop the host.

On CUDA, `tensor.to("cuda")` from ordinary (pageable) host memory copies through a staging buffer
and then synchronizes the stream: the host waits for every kernel queued before it (the previous
step's optimizer update, say). A copy from page-locked memory with `non_blocking=True` is queued on
the stream like a kernel instead; the pinned staging tensor is held by torch's caching host
allocator until the copy that reads it has run, so it cannot be reused early. Pinning is a host
memcpy, which is cheap next to a step. Elsewhere (CPU, or a tensor already on the device) this is
a plain `.to`.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`; from the host to CUDA through pinned memory, without a host sync."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    source = tensor if tensor.is_pinned() else tensor.pin_memory()
    return source.to(device, non_blocking=True)
