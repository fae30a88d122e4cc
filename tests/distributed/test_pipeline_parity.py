"""Pipelined training equals one process: losses, clipped grad norms and parameters after 2 AdamW steps.

For pp in {2, 4}: every schedule (interleaved with 2 stages per rank), microbatches pp, 2*pp and
pp+1, tied and untied, the activation-checkpoint modes never, always and except_last (a third of
the combinations, in which every pair of those values meets); the
zero-bubble schedules (ZB-H1, interleaved zero bubble with 2 stages per rank, ZBV) with those modes
spread over their cases; "selective" once per schedule; DualPipeV at microbatches 2*pp (the fewest
it takes) with each mode once. ZBV and DualPipeV put both ends of a tie on rank 0, so no tie group
is built. One process-group launch per pp runs all its cases; the single-process
references are computed once, here, and shipped to the ranks.
Each rank also checks its runtime's peak live activations against the simulator's, and how many
forwards it checkpointed: under the schedules with one backward, every block of every checkpointed
stage forward on its own; under a split backward, whole stages.

The cases: 36 for schedule x microbatches x tie x checkpoint mode (18 per pp), 36 zero-bubble, 12
"selective", 8 DualPipeV. The references travel to the ranks as numpy arrays: tensors would travel
as shared-memory file descriptors, and too many of them break the fork server. The learning rate
is pipeline_cases.LR (1e-4, see docs/testing.md).
"""

import itertools

import pytest
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE, batches, pipeline_run, reference_run, worst_error

import mesh3d
from mesh3d.pipeline import simulate

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)]  # (name, virtual stages)
ZERO_BUBBLE = [("zero_bubble", 1), ("zero_bubble", 2), ("zbv", 2)]
DUALPIPE_V = ("dualpipev", 2)  # needs microbatches >= 2*pp: runs at 2*pp only
SPLIT_BACKWARD = ZERO_BUBBLE + [DUALPIPE_V]
V_PLACEMENT = ("zbv", "dualpipev")  # both ends of the model on rank 0
AC_MODES = ("never", "always", "except_last")
MICROBATCH_SIZE = 2


def cases(pp):
    counts = (pp, 2 * pp, pp + 1)
    every = list(itertools.product(SCHEDULES, counts, (False, True), AC_MODES))
    # every pair of schedule, microbatches, tie and mode meets, in a third of the product
    every = [(s, m, tied, ac) for s, m, tied, ac in every if _covering(s, m, tied, ac, counts)]
    spread = [
        (s, m, tied, AC_MODES[i % 3])
        for i, (s, m, tied) in enumerate(itertools.product(ZERO_BUBBLE, counts, (False, True)))
    ]
    # "selective" once per schedule (split backward included: its cache is read at I), ties alternating.
    selective = [(s, counts[i % 3], i % 2 == 1, "selective") for i, s in enumerate(SCHEDULES + ZERO_BUBBLE)]
    dualpipe_v = [
        (DUALPIPE_V, 2 * pp, tied, ac)
        for tied, ac in ((False, "never"), (True, "always"), (False, "except_last"), (True, "selective"))
    ]
    return every + spread + selective + dualpipe_v


def _covering(schedule, m, tied, ac, counts) -> bool:
    """The mode that makes (schedule, microbatches, tie) x mode cover every pair of the four values."""
    return (SCHEDULES.index(schedule) + counts.index(m) + tied) % 3 == AC_MODES.index(ac)


def _run_cases(pp, references):
    layout = mesh3d.build_mesh(pp=pp, dp=1, tp=1)
    outcome = {}
    for (schedule, v), m, tied, ac in cases(pp):
        data = batches(MICROBATCH_SIZE * m)
        result = pipeline_run(
            layout, tied, data, schedule=schedule, microbatches=m, virtual_stages=v, activation_checkpoint=ac
        )
        error, where = worst_error(result, references[(tied, m)])
        pm = result[-1]
        simulated = simulate(schedule, pp, m, v).peak_activations[layout.pp_rank]
        recomputed = (
            pm.counters.recomputed_forwards,
            pm.counters.checkpointed_blocks,
            sum(len(stage.layers) for stage in pm._runtime.stages.values()),
        )
        tie_groups = sum(tie.group is not None for tie in pm._tied.ties)
        outcome[((schedule, v), m, tied, ac)] = (
            error,
            where,
            pm.peak_live_activations,
            simulated,
            recomputed,
            tie_groups,
        )
    return outcome


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_process(pp):
    references = {
        (tied, m): reference_run(tied, batches(MICROBATCH_SIZE * m))
        for tied in (False, True)
        for m in (pp, 2 * pp, pp + 1)
    }
    per_rank = run_on_ranks(_run_cases, pp, pp, references, timeout=450)
    failures = []
    for rank, outcome in enumerate(per_rank):
        assert len(outcome) == len(cases(pp))
        for ((schedule, v), m, tied, ac), (error, where, peak, simulated, recomputed, tie_groups) in outcome.items():
            case = f"rank {rank} {schedule} v={v} m={m} tied={tied} ac={ac}"
            if error > TOLERANCE:
                failures.append(f"{case}: relative error {error:.2e} at {where}")
            if peak != simulated:
                failures.append(f"{case}: runtime peak live activations {peak}, simulator {simulated}")
            if schedule in V_PLACEMENT and tie_groups:
                failures.append(f"{case}: {schedule} holds both tie ends on rank 0, yet a tie group was built")
            stage_forwards = v * m
            want_recomputed = {
                "never": 0,
                "always": stage_forwards,
                "except_last": stage_forwards - v,
                "selective": stage_forwards,
            }[ac]
            recomputed, checkpointed_blocks, local_blocks = recomputed
            if recomputed != want_recomputed:
                failures.append(f"{case}: {recomputed} checkpointed forwards, expected {want_recomputed}")
            # Per block under a whole backward; a split backward checkpoints whole stages.
            want_blocks = 0 if (schedule, v) in SPLIT_BACKWARD else local_blocks * want_recomputed // v
            if checkpointed_blocks != want_blocks:
                failures.append(f"{case}: {checkpointed_blocks} blocks checkpointed one by one, expected {want_blocks}")
    assert not failures, "\n".join(failures)


# Stages of an end alone (layers_per_stage 0 at the first or the last stage: the embedding alone, the
# output layer and loss alone), on the LLaMA example and on transformers' models (a mixture of
# experts' router loss through an empty first stage included): (name, model, parallelize options).
ENDS_ALONE = [
    (
        "interleaved both ends",
        "example",
        dict(schedule="interleaved_1f1b", virtual_stages=2, layers_per_stage=[0, 2, 2, 0]),
    ),
    (
        "zbv both ends tied",
        "example tied",
        dict(schedule="zbv", layers_per_stage=[0, 2, 2, 0], activation_checkpoint="always"),
    ),
    ("1f1b first alone", "example", dict(schedule="1f1b", layers_per_stage=[0, 4], activation_checkpoint="selective")),
    ("gpipe last alone tied", "example tied", dict(schedule="gpipe", layers_per_stage=[4, 0])),
    ("dualpipev both ends", "example", dict(schedule="dualpipev", layers_per_stage=[0, 2, 2, 0])),
    # the head fused with the loss, alone on its stage and checkpointed whole
    (
        "fused head alone",
        "example tied",
        dict(schedule="1f1b", layers_per_stage=[4, 0], fused_loss=True, loss_fn=None, activation_checkpoint="always"),
    ),
    (
        "llama interleaved both ends",
        "llama",
        dict(schedule="interleaved_1f1b", virtual_stages=2, layers_per_stage=[0, 2, 2, 0]),
    ),
    ("qwen3_moe zbv both ends", "qwen3_moe", dict(schedule="zbv", layers_per_stage=[0, 2, 2, 0])),
]
ENDS_ALONE_MICROBATCHES = 4


def _ends_alone_on_ranks(references):
    import hf_cases
    from pipeline_cases import tiny_args

    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    outcome = {}
    for name, model, options in ENDS_ALONE:
        options = dict(options, microbatches=ENDS_ALONE_MICROBATCHES)
        if model.startswith("example"):
            tied = model.endswith("tied")
            data = batches(MICROBATCH_SIZE * ENDS_ALONE_MICROBATCHES)
            outcome[name] = worst_error(
                pipeline_run(layout, tied, data, args=tiny_args(tied, 4), **options), references[model]
            )
        else:
            data = hf_cases.masked_batches(MICROBATCH_SIZE * ENDS_ALONE_MICROBATCHES)
            outcome[name] = hf_cases.worst_error(
                hf_cases.pipeline_run(model, layout, data, **options), references[model]
            )
    return outcome


def test_stages_of_an_end_alone_match_single_process():
    pytest.importorskip("transformers")
    import hf_cases
    from pipeline_cases import tiny_args

    data = batches(MICROBATCH_SIZE * ENDS_ALONE_MICROBATCHES)
    references = {f"example{' tied' * tied}": reference_run(tied, data, tiny_args(tied, 4)) for tied in (False, True)}
    hf_data = hf_cases.masked_batches(MICROBATCH_SIZE * ENDS_ALONE_MICROBATCHES)
    references.update({arch: hf_cases.reference_run(arch, hf_data) for arch in ("llama", "qwen3_moe")})
    per_rank = run_on_ranks(_ends_alone_on_ranks, 2, references, timeout=300)
    failures = [
        f"rank {rank} {name}: relative error {error:.2e} at {where}"
        for rank, outcome in enumerate(per_rank)
        for name, (error, where) in outcome.items()
        if error > TOLERANCE
    ]
    assert not failures and all(len(outcome) == len(ENDS_ALONE) for outcome in per_rank), failures
