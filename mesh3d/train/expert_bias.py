"""DeepSeek-V3's auxiliary-loss-free load balancing: after each step, every router's
`e_score_correction_bias` moves by a fixed rate toward balance, up for an expert that got fewer
tokens than its block's mean, down for one that got more (bias += rate x sign(mean - load)).

The loads are the step's routed-token counts summed over every rank (`pm.expert_load()`), so every
rank, whatever the layout, applies the same update to its copy of each router. A router is found
beside its experts (`<block>.mlp.gate` beside `<block>.mlp.experts`); an architecture that keeps
its bias elsewhere is not moved.
"""

from __future__ import annotations

import torch
from torch import nn

from mesh3d.parallel_model import ParallelModel

BIAS = "e_score_correction_bias"


@torch.no_grad()
def update_expert_bias(pm: ParallelModel, loads: dict[str, torch.Tensor], rate: float) -> int:
    """Move each router bias of this rank's stages by `rate` toward balance, by the load of the experts
    module beside it (`loads`: `pm.expert_load()`, called on every rank); returns how many moved."""
    moved = 0
    for stage in pm.stages.values():
        for name, module in stage.named_modules():
            bias = getattr(module, BIAS, None)
            load = loads.get(f"{name.rpartition('.')[0]}.experts")  # the router's block's experts
            if not isinstance(bias, torch.Tensor) or load is None:
                continue
            if isinstance(bias, nn.Parameter):  # e.g. sharded by FSDP: its optimizer owns it
                raise ValueError(
                    f"update_expert_bias: {name}.{BIAS} is a trained parameter, not DeepSeek-V3's buffer moved by "
                    "the loads; leave the bias to the optimizer (train.py: --expert-bias-rate 0)"
                )
            load = load.to(device=bias.device, dtype=torch.float32)
            bias.add_(torch.sign(load.mean() - load).to(bias.dtype), alpha=rate)
            moved += 1
    return moved
