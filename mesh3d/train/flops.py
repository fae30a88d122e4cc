"""Model FLOPs utilization (MFU): FLOPs counted, the device's peak looked up, never guessed.

    per_token = flops_per_token(meta_model, seq_len)      # before parallelize, on the meta model
    peak = peak_flops(layout.device)                       # None on CPU or an unknown GPU
    mfu(per_token, tokens_per_s, peak, layout.world_size)  # a fraction, or None

`flops_per_token` runs one forward and backward of the whole model on the meta device under
torch's FlopCounterMode: no memory, no compute, only the shapes, so it is exact for the model as
written (attention's quadratic term included, at the sequence length trained on) and costs
milliseconds even for a large model. Recomputation by activation checkpointing is not counted:
MFU counts the model's FLOPs, not the hardware's.

The peak is the dense bf16 tensor-core rate of the device's datasheet, whatever the compute
dtype (as torchtitan does), so an fp32 run reads low. A device not in the table has no peak,
and no MFU is reported rather than a made-up one.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from mesh3d.pipeline.shape_ops import ShapeRunOps

# Dense bf16 FLOP/s per device (without 2:4 sparsity, which datasheets often quote doubled), from
# NVIDIA's datasheets: the SXM parts unless a PCIe or NVL part is named. A key matches a whole
# word of torch.cuda.get_device_name() ("B200" is not "GB200", "H20" not "H200"); first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB300", 2.5e15),  # GB300 NVL72: 360 PFLOPS sparse over 72 GPUs
    ("GB200", 2.5e15),  # GB200 NVL72: 360 PFLOPS sparse over 72 GPUs
    ("B300", 2.25e15),  # HGX B300: 36 PFLOPS sparse over 8 GPUs
    ("B200", 2.25e15),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800 PCIe", 756e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("L40S", 362e12),
    ("A100", 312e12),
    ("A800", 312e12),
)


def device_name(device: torch.device) -> str:
    """The device's name as the progress line shows it: "cpu", or the GPU's name."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s, or None when it is not a GPU in PEAK_BF16_FLOPS."""
    if torch.device(device).type != "cuda":
        return None
    return peak_flops_of(device_name(device))


def peak_flops_of(gpu_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of the GPU of this name ("NVIDIA H100 80GB HBM3"), or None."""
    return next((peak for key, peak in PEAK_BF16_FLOPS if re.search(rf"\b{re.escape(key)}\b", gpu_name)), None)


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """aten._grouped_mm (transformers' grouped-mm experts and their backward): each row of the
    stacked operand meets one group's matrix. 2-d x 3-d (tokens routed to experts) and 2-d x 2-d
    (a weight's gradient, grouped along the contraction) both cost 2 x rows x cols of the 2-d left
    operand x the right's columns; 3-d x 2-d (the groups along the right's columns) 2 x the
    right's elements x the left's rows; 3-d x 3-d is a batched matmul."""
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2 * a_shape[-2] * b_shape[0] * b_shape[1]
    return 2 * math.prod(a_shape) * b_shape[-1]


# FlopCounterMode has no formula for grouped matmuls (torch 2.13): without this, an experts layer
# would count nothing. The planner's probe takes the same mapping.
GROUPED_MM_FLOPS = {torch.ops.aten._grouped_mm: _grouped_mm_flops}


def flops_per_token(model: nn.Module, seq_len: int, batch: int = 1) -> float:
    """FLOPs of one forward and backward per token, counted on `model` with FlopCounterMode.

    `model` is the whole model on the meta device (as built for `parallelize`, before it), and
    takes a (batch, seq_len) tensor of token ids. Gradients are taken with torch.autograd.grad,
    so nothing is accumulated on the model's parameters.
    """
    if seq_len < 1 or batch < 1:
        raise ValueError(f"flops_per_token: seq_len and batch must be >= 1, got seq_len={seq_len}, batch={batch}")
    device = next(model.parameters()).device
    if device.type != "meta":
        raise ValueError(
            f"flops_per_token: pass the model on the meta device (it is on {device}); "
            "counting runs a forward and backward, which costs nothing only on meta"
        )
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    weights = [p for p in model.parameters() if p.requires_grad]
    counter = FlopCounterMode(display=False, custom_mapping=GROUPED_MM_FLOPS)
    with ShapeRunOps(), counter:  # the counter above: it sees grouped matmuls before their meta shapes
        output = model(tokens)
        output = getattr(output, "logits", output)  # a Hugging Face model returns a ModelOutput
        torch.autograd.grad(output.float().sum(), weights)
    return counter.get_total_flops() / (batch * seq_len)


def mfu(flops_per_token: float, tokens_per_s: float, peak: float | None, world_size: int) -> float | None:
    """The fraction of the devices' peak the model's FLOPs reach; None when the peak is unknown."""
    if peak is None or peak <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak * world_size)
