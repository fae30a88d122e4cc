"""Bad pipeline configurations fail with a clear message on every rank, and never hang.

All cases run in one launch of 4 ranks. After each expected error every rank enters a barrier: a
rank that had started a collective before raising would pair with it and the launch would hang,
which the harness turns into a failure within seconds.
"""

import torch
import torch.distributed as dist
from torch import nn

import mesh3d
from multiprocess import run_on_ranks
from pipeline_cases import batches, meta_model


class NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4)])


def _bad_configs():
    layout = mesh3d.build_mesh(pp=4, dp=1, tp=1)
    rank = layout.rank
    cases = {
        "unknown schedule": lambda: mesh3d.parallelize(meta_model(False), layout, schedule="zero_bubble_v"),
        "too few microbatches": lambda: mesh3d.parallelize(meta_model(False), layout, schedule="1f1b", microbatches=3),
        "too few microbatches interleaved": lambda: mesh3d.parallelize(meta_model(False), layout, microbatches=2),
        "more stages than layers": lambda: mesh3d.parallelize(meta_model(False, n_layers=6), layout, virtual_stages=2, microbatches=4),
        "no layers": lambda: mesh3d.parallelize(NoLayers(), layout, schedule="gpipe"),
        "virtual stages with one-stage schedule": lambda: mesh3d.parallelize(meta_model(False), layout, schedule="1f1b", virtual_stages=2, microbatches=4),
        "bad checkpoint mode": lambda: mesh3d.parallelize(meta_model(False), layout, schedule="gpipe", activation_checkpoint="sometimes"),
        "bad layers_per_stage": lambda: mesh3d.parallelize(meta_model(False), layout, schedule="gpipe", layers_per_stage=[4, 4]),
        "different configs on ranks": lambda: mesh3d.parallelize(meta_model(False), layout, schedule="gpipe", microbatches=4 + rank % 2),
    }
    messages = {}
    for name, build in cases.items():
        try:
            build()
            messages[name] = None
        except (ValueError, NotImplementedError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
        dist.barrier()
    pm = mesh3d.parallelize(meta_model(False), layout, schedule="1f1b", microbatches=4)
    inputs, targets = batches(6)[0]
    try:
        pm.step(inputs, targets)
        messages["batch does not split"] = None
    except ValueError as error:
        messages["batch does not split"] = f"{type(error).__name__}: {error}"
    dist.barrier()
    inputs, targets = batches(8)[0]
    messages["still works"] = torch.isfinite(pm.step(inputs, targets)).item()
    return messages


EXPECTED = {
    "unknown schedule": "unknown pipeline schedule 'zero_bubble_v'; choose one of ['1f1b', 'gpipe', 'interleaved_1f1b', 'zbv', 'zero_bubble']",
    "too few microbatches": "schedule '1f1b' needs microbatches >= pp, got microbatches=3 with pp=4; use at least 4",
    "too few microbatches interleaved": "schedule 'interleaved_1f1b' needs microbatches >= pp, got microbatches=2 with pp=4",
    "more stages than layers": "cannot split 6 layers into 8 pipeline stages (pp x virtual_stages)",
    "no layers": "NoLayers has no nn.ModuleDict attribute 'layers' (found nothing)",
    "virtual stages with one-stage schedule": "schedule '1f1b' runs one stage per rank, but virtual_stages=2; use virtual_stages=1",
    "bad checkpoint mode": "activation_checkpoint='sometimes'; choose one of ['never', 'always', 'except_last']",
    "bad layers_per_stage": "layers_per_stage=[4, 4] must list 4 positive counts",
    "different configs on ranks": "ranks were given different pipeline configurations",
    "batch does not split": "a batch of 6 samples does not split into microbatches=4 equal microbatches",
}


def test_errors_on_every_rank_without_hanging():
    per_rank = run_on_ranks(_bad_configs, 4, timeout=90)
    for rank, messages in enumerate(per_rank):
        assert messages.pop("still works") is True
        for name, expected in EXPECTED.items():
            assert messages[name] is not None, f"rank {rank}: {name} did not raise"
            assert messages[name].startswith("ValueError"), (rank, name, messages[name])
            assert expected in messages[name], f"rank {rank}: {name}: {messages[name]}"
