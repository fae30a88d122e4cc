"""HSDP (`dp_mode="hsdp", dp_shard=K`) equals one process: losses, clipped grad norms and parameters
after 2 AdamW steps, with pp (a split-backward schedule), tp, cp and ties; each rank holds 1/K of its
stage's parameters (with cp, 1/(K x cp)); PipeDream-2BW (never draining, its weight versions swapped
through the sharded parameters) equals its update rule's one-process reference at (2,4,1), K = 2; a
checkpoint saved under HSDP resumes under FSDP with the uninterrupted run's losses. One launch of 8
ranks runs every case."""

import math

import pytest
from checkpoint_cases import build, train
from multiprocess import run_on_ranks
from never_drain_cases import MICROBATCH_SIZE, call_batches, mesh3d_run, reference, worst
from pipeline_cases import TOLERANCE, batches, fewest_layers, pipeline_run, reference_run, tp_args, worst_error
from torch.distributed.tensor import DTensor, Replicate

import mesh3d

GLOBAL_BATCH = 16
# ((pp, dp, cp, tp), dp_shard, tied, other parallelize options)
CASES = [
    ((1, 4, 1, 2), 2, True, {}),
    ((2, 4, 1, 1), 2, False, {"schedule": "zbv", "microbatches": 4}),
    ((1, 8, 1, 1), 4, True, {}),
    ((1, 2, 2, 2), 1, False, {"loss_fn": None}),  # cp: mesh3d's (sum, count) loss
]


def _layers(sizes, options) -> int:
    return fewest_layers(sizes[0], options)


def _holds_a_k_th(pm, layout, dp_shard) -> str | None:
    """None when every parameter is replicated across the groups and sharded within one; else why not."""
    group = dp_shard * layout.cp
    for name, param in pm.named_parameters():
        if not isinstance(param, DTensor):
            return f"{name} is not a DTensor"
        mesh = param.device_mesh
        if tuple(mesh.mesh_dim_names[:2]) != ("dp_replicate", "dp_shard" if layout.cp == 1 else "dp_shard_cp"):
            return f"{name} lives on {mesh.mesh_dim_names}"
        across, within = param.placements[:2]
        if tuple(mesh.shape[:2]) != (layout.dp // dp_shard, group) or across != Replicate() or within.dim != 0:
            return f"{name}: mesh {tuple(mesh.shape)}, placements {param.placements}"
        rows = param.to_local().shape[0]
        tp_rows = any(getattr(p, "dim", None) == 0 for p in param.placements[2:])  # tp splits the rows too
        whole = param.shape[0] // (layout.tp if tp_rows else 1)
        if rows > math.ceil(whole / group):
            return f"{name}: {rows} of {whole} rows on one of {group} shard ranks"
    return None


def _run(references, scratch):
    outcome = {}
    for sizes, dp_shard, tied, options in CASES:
        pp, dp, cp, tp = sizes
        layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=cp, tp=tp)
        args = tp_args(tied, _layers(sizes, options))
        result = pipeline_run(
            layout, tied, batches(GLOBAL_BATCH), args=args, dp_mode="hsdp", dp_shard=dp_shard, **options
        )
        key = f"{sizes} dp_shard={dp_shard} tied={tied} {options}"
        outcome[key] = (
            worst_error(result, references[(tied, args.n_layers)]),
            _holds_a_k_th(result[3], layout, dp_shard),
        )
    # never draining: 6 calls of PipeDream-2BW with AdamW (3 microbatches of each of 4 dp ranks a call)
    never_drain = mesh3d.build_mesh(pp=2, dp=4, tp=1)
    data = call_batches(MICROBATCH_SIZE * 3 * 4)
    losses, state, owners, pm = mesh3d_run(
        never_drain, "pipedream_2bw", 3, True, data, "adamw", dp_mode="hsdp", dp_shard=2
    )
    reference_losses, reference_state = reference("pipedream_2bw", 2, 3, 4, True, data, "adamw", owners)
    outcome["(2, 4, 1) dp_shard=2 pipedream_2bw"] = (
        worst(losses, state, reference_losses, reference_state),
        _holds_a_k_th(pm, never_drain, 2),
    )
    # saved under HSDP after 2 of 4 steps, resumed under FSDP at another layout
    hsdp = mesh3d.build_mesh(pp=2, dp=4, tp=1)
    pm, optimizer, loader = build(hsdp, True, dp_mode="hsdp", dp_shard=2, schedule="1f1b", microbatches=4)
    whole = train(pm, optimizer, loader, 2)
    mesh3d.checkpoint.save(f"{scratch}/ckpt", pm, optimizer, step=2, data_state=loader.state_dict())
    whole += train(pm, optimizer, loader, 2)
    pm, optimizer, loader = build(mesh3d.build_mesh(pp=1, dp=4, tp=2), True, init_seed=7)
    loader.load_state_dict(mesh3d.checkpoint.load(f"{scratch}/ckpt", pm, optimizer)["data_state"])
    outcome["resume"] = (whole[2:], train(pm, optimizer, loader, 2))
    return outcome


@pytest.mark.timeout(900)
def test_hsdp_matches_one_process_and_resumes_under_fsdp(tmp_path):
    references = {
        (tied, _layers(sizes, options)): reference_run(
            tied, batches(GLOBAL_BATCH), tp_args(tied, _layers(sizes, options))
        )
        for sizes, _, tied, options in CASES
    }
    per_rank = run_on_ranks(_run, 8, references, str(tmp_path), timeout=600)
    failures = []
    for rank, outcome in enumerate(per_rank):
        whole, resumed = outcome.pop("resume")
        if any(abs(a - b) > TOLERANCE * abs(b) for a, b in zip(resumed, whole)):
            failures.append(f"rank {rank}: resumed under FSDP {resumed} != uninterrupted {whole}")
        for case, ((error, where), held) in outcome.items():
            if error > TOLERANCE:
                failures.append(f"rank {rank} {case}: relative error {error:.2e} at {where}")
            if held is not None:
                failures.append(f"rank {rank} {case}: {held}")
    assert not failures, "\n".join(failures)
