"""A mixture of experts' loads in a metrics row and a progress line: how evenly each block's router
spread the step's tokens over its experts.

    loads = pm.expert_load()            # a collective (every rank): train.py reads it on logging steps only
    row.update(expert_load_record(loads))
    # {"expert_imbalance": 1.84, "expert_imbalance_block": "model.layers.1.mlp.experts",
    #  "expert_load": {"model.layers.0.mlp.experts": [130, 98, 40, 244], ...}}
    print(imbalance_column(row))        # "experts max/mean 1.84"

The imbalance is a block's most loaded expert over its mean load: 1 when every expert got the same
tokens, the number of experts when one took them all; the row's is its worst block's (the one whose
busiest expert bounds the step). A block that counted no tokens (its stage did not train) has no
ratio. A model without experts (`loads` empty) gives an empty record and no column.
"""

from __future__ import annotations

import torch


def expert_load_record(loads: dict[str, torch.Tensor]) -> dict:
    """The metrics row's columns of `loads` (`pm.expert_load()`): every block's tokens per expert,
    and the worst block's max/mean load with its name; {} without experts."""
    if not loads:
        return {}
    record: dict = {"expert_load": {name: load.tolist() for name, load in loads.items()}}
    ratios = {name: _imbalance(load) for name, load in loads.items()}
    ratios = {name: ratio for name, ratio in ratios.items() if ratio is not None}
    if ratios:
        worst = max(ratios, key=ratios.__getitem__)
        record.update(expert_imbalance=ratios[worst], expert_imbalance_block=worst)
    return record


def imbalance_column(record: dict) -> str:
    """The progress line's column of a row with an imbalance ("experts max/mean 1.84"), else ""."""
    return f"  experts max/mean {record['expert_imbalance']:.2f}" if "expert_imbalance" in record else ""


def _imbalance(load: torch.Tensor) -> float | None:
    mean = load.double().mean().item()
    return load.max().item() / mean if mean > 0 else None
