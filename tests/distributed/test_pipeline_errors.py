"""Bad pipeline configurations fail with a clear message on every rank, and never hang.

All cases run in one launch of 4 ranks, through the errors-on-every-rank harness (rank_errors.py):
after each expected error every rank enters a barrier, so a rank that had started a collective
before raising would hang the launch, which the harness turns into a failure within seconds.
"""

import functools

import torch
from multiprocess import run_on_ranks
from pipeline_cases import batches, meta_model
from rank_errors import assert_raised_on_every_rank, message_of, messages_of
from torch import nn

import mesh3d
from mesh3d.pipeline import SCHEDULES


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
        "dualpipev with the default microbatches": lambda: mesh3d.parallelize(
            meta_model(False), layout, schedule="dualpipev"
        ),
        "more stages than layers": lambda: mesh3d.parallelize(
            meta_model(False, n_layers=6), layout, virtual_stages=2, microbatches=4
        ),
        "no layers": lambda: mesh3d.parallelize(NoLayers(), layout, schedule="gpipe"),
        "virtual stages with one-stage schedule": lambda: mesh3d.parallelize(
            meta_model(False), layout, schedule="1f1b", virtual_stages=2, microbatches=4
        ),
        "bad checkpoint mode": lambda: mesh3d.parallelize(
            meta_model(False), layout, schedule="gpipe", activation_checkpoint="sometimes"
        ),
        "bad layers_per_stage": lambda: mesh3d.parallelize(
            meta_model(False), layout, schedule="gpipe", layers_per_stage=[4, 4]
        ),
        "different configs on ranks": lambda: mesh3d.parallelize(
            meta_model(False), layout, schedule="gpipe", microbatches=4 + rank % 2
        ),
        "never-drain without an optimizer": lambda: mesh3d.parallelize(
            meta_model(False), layout, schedule="pipedream_2bw"
        ),
        "optimizer not callable": lambda: mesh3d.parallelize(
            meta_model(False), layout, schedule="1f1b", optimizer="adamw"
        ),
        "never-drain with two stages per rank": lambda: mesh3d.parallelize(
            meta_model(True),
            layout,
            schedule="pipedream",
            virtual_stages=2,
            microbatches=4,
            optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        ),
    }
    messages = messages_of(cases, (ValueError, NotImplementedError))
    never_drain = mesh3d.parallelize(
        meta_model(False),
        layout,
        schedule="pipedream_2bw",
        microbatches=4,
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
    )
    messages["clipping under a never-drain schedule"] = message_of(lambda: never_drain.clip_grad_norm_(1.0))
    pm = mesh3d.parallelize(meta_model(False), layout, schedule="1f1b", microbatches=4)
    messages["batch does not split"] = message_of(lambda: pm.step(*batches(6)[0]))
    inputs, targets = batches(8)[0]
    messages["still works"] = torch.isfinite(pm.step(inputs, targets)).item()
    return messages


EXPECTED = {
    "unknown schedule": f"unknown pipeline schedule 'zero_bubble_v'; choose one of {sorted(SCHEDULES)}",
    "too few microbatches": "schedule '1f1b' needs microbatches >= pp, got microbatches=3 with pp=4; use at least 4",
    "too few microbatches interleaved": (
        "schedule 'interleaved_1f1b' needs microbatches >= pp, got microbatches=2 with pp=4"
    ),
    "dualpipev with the default microbatches": (
        "schedule 'dualpipev' needs microbatches >= 2*pp, got microbatches=4 with pp=4; "
        "use at least 8 microbatches (or schedule='zbv', which needs microbatches >= pp)"
    ),
    "more stages than layers": "cannot split 6 layers into 8 pipeline stages (pp x virtual_stages)",
    "no layers": "NoLayers has no nn.ModuleDict attribute 'layers' (found nothing)",
    "virtual stages with one-stage schedule": (
        "schedule '1f1b' runs one stage per rank, but virtual_stages=2; use virtual_stages=1"
    ),
    "bad checkpoint mode": (
        "activation_checkpoint='sometimes'; choose one of ['never', 'always', 'except_last', 'selective']"
    ),
    "bad layers_per_stage": "layers_per_stage=[4, 4] must list 4 counts (pp x virtual_stages) of at least one layer "
    "each; the first and the last may be 0 (a stage of its end alone), adding up to the model's 8 layers",
    "different configs on ranks": "ranks were given different pipeline configurations",
    "never-drain without an optimizer": "schedule 'pipedream_2bw' updates the weights inside the pipeline, stage by "
    "stage, so mesh3d must own the optimizer: pass optimizer=functools.partial(",
    "optimizer not callable": "optimizer='adamw' is not callable; pass a factory taking the parameters",
    "never-drain with two stages per rank": "schedule 'pipedream' runs one stage per rank, but virtual_stages=2",
    "clipping under a never-drain schedule": (
        "pm.clip_grad_norm_ under schedule 'pipedream_2bw': its updates run inside the pipeline"
    ),
    "batch does not split": "a batch of 6 samples does not split into microbatches=4 equal microbatches",
}


def test_errors_on_every_rank_without_hanging():
    per_rank = run_on_ranks(_bad_configs, 4, timeout=90)
    assert all(messages.pop("still works") is True for messages in per_rank)
    assert_raised_on_every_rank(per_rank, EXPECTED)
