"""A traced model (SkipModel: an nn.ModuleList of blocks between an embedding and a head, and a
skip connection from before the first block to after the last) equals one process, and
comm_bytes() equals what its shapes say.

At pp = 4 the skip goes from stage 0 straight to stage 3 (or 7): the stages between send nothing
for it. At pp = 2 it travels with the boundary's own activation, two tensors in one message.
Tied and untied heads, (2, 2, 1) with FSDP and (2, 1, 2) with a `tp_plan=`, schedules from every
family. The losses of 2 AdamW steps and every parameter after them equal the same model trained in
one process (fp32, relative 1e-5); under activation checkpointing with one backward, the blocks a
traced stage calls are checkpointed one by one. One 4-rank launch runs every case.
"""

from multiprocess import run_on_ranks
from sequential_cases import (
    BLOCK_TP_PLAN,
    DIM,
    SEQ,
    SkipModel,
    data,
    expected_bytes,
    outcome_failures,
    parallel,
    reference,
    stage_ranks,
    token_loss,
    worst,
)
from torch.distributed.tensor import DTensor

import mesh3d

BATCH = 16
# (pp, dp, tp), tied, parallelize options
CASES = [
    ((4, 1, 1), False, {"schedule": "gpipe", "microbatches": 4}),
    ((4, 1, 1), True, {"schedule": "1f1b", "microbatches": 4, "activation_checkpoint": "always"}),
    ((4, 1, 1), True, {"schedule": "interleaved_1f1b", "virtual_stages": 2, "microbatches": 4}),
    ((4, 1, 1), False, {"schedule": "zbv", "microbatches": 4}),
    ((2, 2, 1), True, {"schedule": "zero_bubble", "microbatches": 4, "split_points": ["blocks.3"]}),
    ((2, 1, 2), False, {"schedule": "1f1b", "microbatches": 2, "tp_plan": BLOCK_TP_PLAN}),
    (
        (2, 1, 2),
        True,
        {
            "schedule": "zero_bubble",
            "virtual_stages": 2,
            "microbatches": 4,
            "tp_plan": BLOCK_TP_PLAN,
            "activation_checkpoint": "except_last",
        },
    ),
]


def _run(references):
    layouts, outcome, checkpointed = {}, {}, {}
    for index, (sizes, tied, options) in enumerate(CASES):
        if sizes not in layouts:
            layouts[sizes] = mesh3d.build_mesh(pp=sizes[0], dp=sizes[1], tp=sizes[2])
        layout = layouts[sizes]
        batches = data("tokens", BATCH)
        m = options["microbatches"]
        rows = BATCH // layout.dp // m
        example = (batches[0][0][:rows],)
        losses, state, sent, pm = parallel(
            SkipModel(tied), layout, token_loss, batches, example_inputs=example, **options
        )
        v = pm.schedule.virtual_stages
        want = expected_bytes(
            layout.pp_rank, stage_ranks(options["schedule"], layout.pp, v), m, rows * SEQ * DIM * 4, skip=True
        )
        sharded = layout.tp == 1 or all(isinstance(p, DTensor) for n, p in pm.named_parameters() if ".up." in n)
        outcome[index] = (worst((losses, state), references[index]), sent, want, sharded)
        if options.get("activation_checkpoint") and not pm.schedule.splits_backward:
            # a traced stage's graph calls each block as a module: its patched forward checkpoints it
            checkpointed[index] = (bool(pm._runtime.checkpointing.per_block_stages), pm.counters.checkpointed_blocks)
    return outcome, checkpointed


def test_traced_model_matches_one_process_and_sends_skips_straight_to_their_consumer():
    references = {
        i: reference(SkipModel(tied), token_loss, data("tokens", BATCH)) for i, (_, tied, _) in enumerate(CASES)
    }
    failures = []
    for rank, (outcome, checkpointed) in enumerate(run_on_ranks(_run, 4, references, timeout=300)):
        for index, result in outcome.items():
            sizes, tied, options = CASES[index]
            failures += outcome_failures(f"rank {rank} {sizes} tied={tied} {options.get('schedule')}", result)
        for index, (has_blocks, blocks) in checkpointed.items():
            if has_blocks and blocks == 0:
                failures.append(f"rank {rank} case {index}: its stages have blocks, none was checkpointed")
    assert not failures, "\n".join(failures)
