"""An nn.Sequential given as it is equals one process, and comm_bytes() equals what its shapes say.

An nn.Sequential of 8 residual blocks (float vectors in, mean-squared error) and one with an
embedding and a head around them (tied and untied, cross-entropy), no split points: the stage
split is the balanced one. pp = 4, (2, 2, 1) with FSDP and (2, 1, 2) with a `tp_plan=`, schedules
from every family. The losses of 2 AdamW steps and every parameter after them equal the same model
trained in one process (fp32, relative 1e-5); every step's `pm.comm_bytes()` equals the bytes the
boundary shapes give (batch / dp / microbatches rows of DIM floats, or of SEQ x DIM), on the
stages' ranks as the schedule lays them out. One 4-rank launch runs every case.
"""

from multiprocess import run_on_ranks
from sequential_cases import (
    BLOCK_TP_PLAN,
    DIM,
    SEQ,
    blocks_model,
    data,
    expected_bytes,
    mse,
    outcome_failures,
    parallel,
    reference,
    stage_ranks,
    token_loss,
    token_model,
    worst,
)
from torch.distributed.tensor import DTensor

import mesh3d

BATCH = 16
# (pp, dp, tp), model ("blocks", "tied", "untied"), parallelize options
CASES = [
    ((4, 1, 1), "blocks", {"schedule": "gpipe", "microbatches": 4}),
    ((4, 1, 1), "tied", {"schedule": "1f1b", "microbatches": 4}),
    ((4, 1, 1), "blocks", {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 4}),
    ((4, 1, 1), "untied", {"schedule": "zbv", "microbatches": 4}),
    ((2, 2, 1), "blocks", {"schedule": "1f1b", "microbatches": 2}),
    ((2, 2, 1), "tied", {"schedule": "zero_bubble", "microbatches": 4}),
    (
        (2, 1, 2),
        "blocks",
        {"schedule": "zero_bubble", "virtual_stages": 2, "microbatches": 4, "tp_plan": BLOCK_TP_PLAN},
    ),
    ((2, 1, 2), "untied", {"schedule": "1f1b", "microbatches": 2, "tp_plan": BLOCK_TP_PLAN}),
]


def model_of(kind: str):
    return blocks_model() if kind == "blocks" else token_model(tied=kind == "tied")


def _run(references):
    layouts, outcome = {}, {}
    for index, (sizes, kind, options) in enumerate(CASES):
        if sizes not in layouts:
            layouts[sizes] = mesh3d.build_mesh(pp=sizes[0], dp=sizes[1], tp=sizes[2])
        layout = layouts[sizes]
        loss_fn = mse if kind == "blocks" else token_loss
        losses, state, sent, pm = parallel(model_of(kind), layout, loss_fn, data(kind, BATCH), **options)
        m, v = pm.schedule.microbatches, pm.schedule.virtual_stages
        rows = BATCH // layout.dp // m
        boundary = rows * DIM * 4 if kind == "blocks" else rows * SEQ * DIM * 4
        want = expected_bytes(layout.pp_rank, stage_ranks(options["schedule"], layout.pp, v), m, boundary)
        # under tp the plan must have reached every block (a plan matching nothing would pass too)
        sharded = layout.tp == 1 or all(isinstance(p, DTensor) for n, p in pm.named_parameters() if ".up." in n)
        outcome[index] = (worst((losses, state), references[index]), sent, want, sharded)
    return outcome


def test_sequential_matches_one_process_and_sends_what_its_shapes_say():
    references = {}
    for index, (_, kind, _) in enumerate(CASES):
        references[index] = reference(model_of(kind), mse if kind == "blocks" else token_loss, data(kind, BATCH))
    failures = []
    for rank, outcome in enumerate(run_on_ranks(_run, 4, references, timeout=240)):
        for index, result in outcome.items():
            case = f"rank {rank} {CASES[index][0]} {CASES[index][1]} {CASES[index][2].get('schedule')}"
            failures += outcome_failures(case, result)
    assert not failures, "\n".join(failures)
