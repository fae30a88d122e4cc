"""mesh3d.train.expert_load_record: a mixture's loads as a metrics row's columns and a progress
line's (train.py on ranks, a MoE model: test_train_hf_moe.py)."""

import pytest
import torch

from mesh3d.train import expert_load_record, imbalance_column


def test_the_worst_block_and_every_load_are_recorded():
    loads = {
        "model.layers.0.mlp.experts": torch.tensor([8, 8, 8, 8]),  # even: 1.00
        "model.layers.1.mlp.experts": torch.tensor([20, 4, 4, 4]),  # 20 / 8
        "model.layers.2.mlp.experts": torch.tensor([0, 0, 0, 0]),  # counted nothing: no ratio
    }
    record = expert_load_record(loads)
    assert record["expert_load"] == {name: load.tolist() for name, load in loads.items()}
    assert record["expert_imbalance"] == pytest.approx(2.5)
    assert record["expert_imbalance_block"] == "model.layers.1.mlp.experts"
    assert imbalance_column(record) == "  experts max/mean 2.50"


def test_a_model_without_experts_adds_nothing():
    assert expert_load_record({}) == {} and imbalance_column({}) == ""
    idle = expert_load_record({"experts": torch.zeros(4, dtype=torch.long)})
    assert "expert_imbalance" not in idle and imbalance_column(idle) == ""
