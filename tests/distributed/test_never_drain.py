"""The never-drain schedules equal a one-process reference of their update rules.

For pipedream and pipedream_2bw at (4,1,1), (2,2,1) FSDP and (2,2,2) FSDP + tp, with SGD (momentum)
and AdamW (at (2,2,2) pipedream with SGD; pipedream_2bw with AdamW there below), with a tied embedding and
output head: the loss every call returns and every weight after 6 calls and a flush equal
tests/never_drain_cases.py's reference (fp32, relative 1e-5), which applies the rules with torch's
own optimizer on the whole model; so does pm.evaluate after them (the newest weights, not a version
of the rule), and each rank keeps, after the flush, exactly the bytes of the earlier versions the
rule still names. One launch per layout runs its cases.

At (2,2,1) they compose exactly with every activation-checkpoint mode, DDP and compile, tied and
untied; bf16 mixed precision runs, its losses within bf16's reach of the fp32 reference.

Also: pipedream_2bw saved after call 3 at (2,2,2) and resumed at (4,1,2) (from other initial
weights, with other microbatches) continues with calls 4-6 exactly as the reference's
uninterrupted run. At (2,2,1): pipedream flushed after call 3 continues as without the flush;
pipedream saved after call 3 and loaded into another model at its layout continues likewise;
under an LR scheduler stepped after each call (LambdaLR halving the rate), each update of either
rule runs at the rate of the call that handed in its batch, even where it runs during the next.

A call that fails half-way is refused until a checkpoint is loaded: at pp = 1 it then continues
exactly; at (2,2,1), failed mid-batch on both pipeline ranks, every later step, the flush and a
load into the same processes are refused on every rank, without a hang.
"""

import pytest
import torch
from multiprocess import run_on_ranks
from never_drain_cases import (
    LAYERS,
    MICROBATCH_SIZE,
    OPTIMIZERS,
    call_batches,
    mesh3d_run,
    reference,
    reference_evaluation,
    worst,
)
from pipeline_cases import TOLERANCE, meta_model

import mesh3d

pytestmark = pytest.mark.distributed

# layout: microbatches per call. tp alone, (2,1,2), is left out: (2,2,2) holds it with FSDP beside.
LAYOUTS = {(4, 1, 1): 5, (2, 2, 1): 3, (2, 2, 2): 2}


def cases(layout):
    """Both rules with both optimizers; at 8 ranks PipeDream with SGD only (every pair runs at (4,1,1)
    and (2,2,1), an 8-rank case costs two 4-rank ones, and PipeDream-2BW with AdamW at (2,2,2) is
    test_two_bw_resumes_under_another_layout's saved run)."""
    m = LAYOUTS[layout]
    pairs = [("pipedream_2bw", "sgd"), ("pipedream_2bw", "adamw"), ("pipedream", "sgd"), ("pipedream", "adamw")]
    if layout == (2, 2, 2):
        pairs = [("pipedream", "sgd")]
    return [(schedule, m, optimizer, True) for schedule, optimizer in pairs]


def _run(pp, dp, tp):
    layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    out = {}
    for schedule, m, optimizer, tied in cases((pp, dp, tp)):
        data = call_batches(MICROBATCH_SIZE * m * dp)
        losses, state, owners, pm = mesh3d_run(layout, schedule, m, tied, data, optimizer)
        kept = (pm._runtime.never_drain.versions.kept_bytes(), _kept_by_the_rule(pm, schedule, pp))
        inputs, targets = data[0]
        share = slice(layout.dp_rank * len(inputs) // dp, (layout.dp_rank + 1) * len(inputs) // dp)
        evaluated = pm.evaluate(inputs[share], targets[share]).item()
        out[(schedule, m, optimizer, tied)] = (losses, state if layout.rank == 0 else None, owners, kept, evaluated)
    return out


def _kept_by_the_rule(pm, schedule: str, pp: int) -> int:
    """Bytes of the versions the rule still names after a flush (of calls >= 2): pipedream_2bw
    keeps W(t) for batch t+1; under pipedream stage s's next forward sees p-s-1 updates fewer than
    it has. A weight group follows its `rule_stage` (a tied copy: the first stage's); each kept
    version is a copy of the group's local shards."""
    from mesh3d.distributed.shards import local_tensor

    total = 0
    for group in pm._runtime.never_drain.versions.groups():
        kept = 1 if schedule == "pipedream_2bw" else pp - 1 - group.rule_stage
        total += kept * sum(local_tensor(p.data).nbytes for p in group.params)
    return total


@pytest.mark.parametrize("layout", list(LAYOUTS), ids=lambda layout: "x".join(map(str, layout)))
def test_never_drain_matches_its_update_rule(layout):
    pp, dp, tp = layout
    per_rank = run_on_ranks(_run, pp * dp * tp, pp, dp, tp, timeout=300)
    failures = []
    for case in cases(layout):
        schedule, m, optimizer, tied = case
        losses, state, owners, _, evaluated = per_rank[0][case]
        for rank, outcome in enumerate(per_rank):
            if outcome[case][0] != losses:
                failures.append(f"{case}: rank {rank} returned losses {outcome[case][0]}, rank 0 {losses}")
            kept, by_rule = outcome[case][3]
            if kept != by_rule:
                failures.append(f"{case}: rank {rank} keeps {kept} bytes of earlier versions, the rule names {by_rule}")
        ref_losses, ref_state = reference(
            schedule, pp, m, dp, tied, call_batches(MICROBATCH_SIZE * m * dp), optimizer, owners
        )
        error, where = worst(losses, state, ref_losses, ref_state)
        if error > TOLERANCE:
            failures.append(f"{case}: relative error {error:.2e} at {where}")
        want = reference_evaluation(tied, ref_state, *call_batches(MICROBATCH_SIZE * m * dp)[0])
        if abs(evaluated - want) > TOLERANCE * abs(want):
            failures.append(f"{case}: pm.evaluate gave {evaluated}, the final weights' loss is {want}")
    assert not failures, "\n".join(failures)


COMPOSED = [
    ("pipedream_2bw", "sgd", True, {"activation_checkpoint": "always"}),
    ("pipedream", "adamw", False, {"activation_checkpoint": "selective"}),
    ("pipedream", "sgd", True, {"activation_checkpoint": "except_last"}),
    ("pipedream_2bw", "adamw", True, {"dp_mode": "ddp"}),
    ("pipedream", "sgd", False, {"dp_mode": "ddp", "compile": "aot_eager", "activation_checkpoint": "except_last"}),
    ("pipedream_2bw", "sgd", True, {"param_dtype": torch.bfloat16}),
]


def _composed():
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=1)
    out = []
    for schedule, optimizer, tied, options in COMPOSED:
        losses, state, owners, _ = mesh3d_run(
            layout, schedule, 3, tied, call_batches(MICROBATCH_SIZE * 3 * 2), optimizer, **options
        )
        out.append((losses, state if layout.rank == 0 else None, owners))
    return out


def test_never_drain_composes():
    per_rank = run_on_ranks(_composed, 4, timeout=300)
    failures = []
    for (schedule, optimizer, tied, options), (losses, state, owners) in zip(COMPOSED, per_rank[0]):
        ref_losses, ref_state = reference(
            schedule, 2, 3, 2, tied, call_batches(MICROBATCH_SIZE * 3 * 2), optimizer, owners
        )
        if "param_dtype" in options:
            error = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
            where, limit = "the losses", 2e-2
        else:
            (error, where), limit = worst(losses, state, ref_losses, ref_state), TOLERANCE
        if error > limit:
            failures.append(f"{schedule} {optimizer} tied={tied} {options}: relative error {error:.2e} at {where}")
    assert not failures, "\n".join(failures)


def halving(call: int) -> float:
    """An LR schedule: each call's batch updates at half the rate of the one before."""
    return 0.5**call


ACROSS_CALLS = [
    ("pipedream", "sgd", {"flush_after": 3}),  # a flush changes no rule: calls 4-6 as without it
    ("pipedream", "adamw", {"lr_factor": halving}),  # each update at its batch's call's rate
    ("pipedream_2bw", "sgd", {"lr_factor": halving}),
]


def _across_calls(root):
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=1)
    data = call_batches(MICROBATCH_SIZE * 3 * 2)
    out = []
    for schedule, optimizer, options in ACROSS_CALLS:
        losses, state, owners, _ = mesh3d_run(layout, schedule, 3, True, data, optimizer, **options)
        out.append((losses, state if layout.rank == 0 else None, owners))
    # PipeDream saved after call 3, resumed at its layout by another model (other initial weights)
    share = lambda batch: tuple(t.chunk(2)[layout.dp_rank] for t in batch)  # noqa: E731
    pm = mesh3d.parallelize(
        meta_model(True, LAYERS), layout, schedule="pipedream", microbatches=3, optimizer=OPTIMIZERS["sgd"]
    )
    losses = [pm.step(*share(batch)).item() for batch in data[:3]]
    mesh3d.checkpoint.save(f"{root}/step3", pm, pm.optimizer)
    resumed = mesh3d.parallelize(
        meta_model(True, LAYERS), layout, schedule="pipedream", microbatches=3, optimizer=OPTIMIZERS["sgd"], seed=1
    )
    mesh3d.checkpoint.load(f"{root}/step3", resumed, resumed.optimizer)
    losses += [resumed.step(*share(batch)).item() for batch in data[3:]]
    resumed.flush()
    state = {k: v.numpy().copy() for k, v in resumed.full_state_dict().items()}
    out.append((losses, state if layout.rank == 0 else None, {n: resumed.state_map.owner_pp_rank(n) for n in state}))
    return out


def test_rules_hold_across_a_flush_an_lr_schedule_and_a_resume(tmp_path):
    per_rank = run_on_ranks(_across_calls, 4, str(tmp_path), timeout=300)
    cases = ACROSS_CALLS + [("pipedream", "sgd", {"resumed after call": 3})]
    failures = []
    for (schedule, optimizer, options), (losses, state, owners) in zip(cases, per_rank[0]):
        ref_losses, ref_state = reference(
            schedule,
            2,
            3,
            2,
            True,
            call_batches(MICROBATCH_SIZE * 3 * 2),
            optimizer,
            owners,
            lr_factor=options.get("lr_factor"),
        )
        error, where = worst(losses, state, ref_losses, ref_state)
        if error > TOLERANCE:
            failures.append(f"{schedule} {optimizer} {options}: relative error {error:.2e} at {where}")
    assert not failures, "\n".join(failures)


def _save_then_resume(root):
    saved_at, resumed_at = mesh3d.build_mesh(2, 2, 2), mesh3d.build_mesh(4, 1, 2)
    data = call_batches(MICROBATCH_SIZE * 2 * 2)
    losses = []
    pm = mesh3d.parallelize(
        meta_model(True, LAYERS), saved_at, schedule="pipedream_2bw", microbatches=2, optimizer=OPTIMIZERS["adamw"]
    )
    for inputs, targets in data[:3]:
        share = inputs.chunk(2)[saved_at.dp_rank], targets.chunk(2)[saved_at.dp_rank]
        losses.append(pm.step(*share).item())
    mesh3d.checkpoint.save(f"{root}/step3", pm, pm.optimizer)
    kept_after_save = pm._runtime.never_drain.versions.kept_bytes()
    resumed = mesh3d.parallelize(
        meta_model(True, LAYERS),
        resumed_at,
        schedule="pipedream_2bw",
        microbatches=4,
        optimizer=OPTIMIZERS["adamw"],
        seed=1,
    )
    mesh3d.checkpoint.load(f"{root}/step3", resumed, resumed.optimizer)
    for inputs, targets in data[3:]:
        losses.append(resumed.step(inputs, targets).item())
    resumed.flush()
    state = {k: v.numpy().copy() for k, v in resumed.full_state_dict().items()}
    owners = {name: resumed.state_map.owner_pp_rank(name) for name in state}
    return losses, state if resumed_at.rank == 0 else None, owners, kept_after_save


def test_two_bw_resumes_under_another_layout(tmp_path):
    per_rank = run_on_ranks(_save_then_resume, 8, str(tmp_path), timeout=300)
    losses, state, owners, kept = per_rank[0]
    assert kept > 0, "after a flush pipedream_2bw still keeps W(t) for the next batch"
    assert all(r[0] == losses for r in per_rank)
    ref_losses, ref_state = reference(
        "pipedream_2bw", 4, 4, 1, True, call_batches(MICROBATCH_SIZE * 2 * 2), "adamw", owners
    )
    error, where = worst(losses, state, ref_losses, ref_state)
    assert error <= TOLERANCE, f"relative error {error:.2e} at {where}"


def _fail_then_reload(root):
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1)
    data = call_batches(MICROBATCH_SIZE * 2)
    pm = mesh3d.parallelize(
        meta_model(False, LAYERS), layout, schedule="pipedream_2bw", microbatches=2, optimizer=OPTIMIZERS["sgd"]
    )
    pm.step(*data[0])
    mesh3d.checkpoint.save(f"{root}/step1", pm, pm.optimizer)

    def broken(module, inputs):
        raise RuntimeError("injected")

    hook = pm._runtime.stages[0].layers["0"].register_forward_pre_hook(broken)
    messages = []
    for attempt in (lambda: pm.step(*data[1]), lambda: pm.step(*data[1]), pm.flush):
        try:
            attempt()
        except RuntimeError as error:
            messages.append(str(error))
    hook.remove()
    mesh3d.checkpoint.load(f"{root}/step1", pm, pm.optimizer)
    losses = [pm.step(*batch).item() for batch in data[1:3]]
    return messages, losses


def test_a_failed_call_is_refused_until_a_checkpoint_is_loaded(tmp_path):
    messages, losses = run_on_ranks(_fail_then_reload, 1, str(tmp_path), timeout=120)[0]
    assert messages[0] == "injected"
    assert all(
        "call 1 raised RuntimeError half-way through the pipeline" in m and "load a checkpoint" in m
        for m in messages[1:]
    ), messages
    reference_losses, _ = reference(
        "pipedream_2bw",
        1,
        2,
        1,
        False,
        call_batches(MICROBATCH_SIZE * 2)[:3],
        "sgd",
        {n: 0 for n in meta_model(False, LAYERS).state_dict()},
    )
    assert max(abs(a - b) / b for a, b in zip(losses, reference_losses[1:])) <= TOLERANCE


def _fail_mid_batch_then_refuse(root):
    """pp=2, dp=2, pipedream_2bw, m=2: call 1 stops on rank 0 at the backward of microbatch 2 (its
    forward of 3 sent) and on rank 1 at the forward of microbatch 3 (its backward of 2 done, its
    gradients accumulated unreduced in FSDP): neither waits on the other. Every later step, and
    loading a checkpoint into this process, is refused on every rank, without a hang."""
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=1)
    data = call_batches(MICROBATCH_SIZE * 2 * 2)
    share = lambda batch: tuple(t.chunk(2)[layout.dp_rank] for t in batch)  # noqa: E731
    pm = mesh3d.parallelize(
        meta_model(True, LAYERS), layout, schedule="pipedream_2bw", microbatches=2, optimizer=OPTIMIZERS["adamw"]
    )
    pm.step(*share(data[0]))
    mesh3d.checkpoint.save(f"{root}/step1", pm, pm.optimizer)
    versions = pm._runtime.never_drain.versions
    original = versions.before_compute
    backwards = set()

    def broken(stage, microbatch):
        first_time = (stage, microbatch) not in backwards
        backwards.add((stage, microbatch))
        if (stage, microbatch) == ((0, 2) if stage == 0 else (1, 3)) and (stage == 1 or not first_time):
            raise RuntimeError("injected")
        return original(stage, microbatch)

    versions.before_compute = broken
    messages = []
    for attempt in (
        lambda: pm.step(*share(data[1])),
        lambda: pm.step(*share(data[1])),
        pm.flush,
        lambda: mesh3d.checkpoint.load(f"{root}/step1", pm, pm.optimizer),
    ):
        try:
            attempt()
        except RuntimeError as error:
            messages.append(str(error))
    return messages


def test_a_call_failed_between_pipeline_ranks_is_refused_everywhere(tmp_path):
    for messages in run_on_ranks(_fail_mid_batch_then_refuse, 4, str(tmp_path), timeout=120):
        assert messages[0] == "injected", messages
        assert all("half-way through the pipeline" in m for m in messages[1:3]), messages
        assert "restart the processes" in messages[3], messages
