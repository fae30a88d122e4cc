"""The space `plan()` searches and the checks of its arguments: which (pp, dp, cp, tp) layouts and
fixed choices are candidates, the hardware and memory limit a plan is made for, and what a user
is told when nothing fits. Pure arithmetic (the hardware and the model's own context-parallel
check aside), so every caller gets the same errors before anything is measured."""

from __future__ import annotations

import math
import re

import torch

from mesh3d.context_parallel.model_check import check_kind
from mesh3d.expert_parallel.apply import splits_the_sequence
from mesh3d.expert_parallel.plan import check_expert_parallel
from mesh3d.model.stage_inputs import stage_input_names
from mesh3d.pipeline.config import ACTIVATION_CHECKPOINT_MODES
from mesh3d.pipeline.schedule.catalog import SCHEDULES, check_schedule_config
from mesh3d.planner import constants as C
from mesh3d.planner.hardware import HARDWARE, Hardware
from mesh3d.planner.measure.costs import ModelCosts
from mesh3d.planner.measure.experts import TOP_K_ATTRIBUTES, routing_sizes
from mesh3d.planner.measure.machine_bench import measure_this_machine
from mesh3d.planner.measure.measured_stages import measured_stages
from mesh3d.tensor.plan import TensorParallelConfig

# The never-drain schedules (pipedream, pipedream_2bw) hold stashed weight versions and overlap
# calls; the planner's memory walk and step timeline model one flushing step, so it leaves them out.
PLANNED_SCHEDULES = [name for name, spec in SCHEDULES.items() if not spec.never_drains]

# A plan's layout, as the CLI's table lists it and tells two plans apart.
LAYOUT = ("pp", "dp", "cp", "tp", "ep", "schedule", "virtual_stages", "microbatches")
LAYOUT += ("activation_checkpoint", "dp_mode")
FIXABLE = (*LAYOUT, "dp_shard", "reshard_after_forward", "param_dtype", "compile", "fused_loss")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(
    gpus,
    gpus_per_node,
    global_batch,
    n_blocks,
    tp_sizes,
    fix,
    tensor_parallel=True,
    seq_len=None,
    cp_choices=(1,),
    ep_choices=(1,),
    n_stages=None,
):
    """Every layout mesh3d accepts for these sizes, with `fix` applied; tp = 1 only, unless fixed,
    for a model without a tensor-parallel plan. `cp_choices`: the context-parallel degrees the
    model can take (context_parallel_degrees), each kept where it cuts `seq_len` into 2 x cp
    chunks and, unless pinned, where its cp x tp ranks fit in a node (each layer's K/V all-gather
    wants NVLink); the global batch divides over dp alone (a cp group's ranks share their rows).
    `ep_choices` (expert_parallel_degrees): each kept where it divides the stage's dp x cp x tp
    ranks and, unless pinned, fits in a node (its all-to-alls every block want NVLink). `n_stages`:
    the stages a given split makes (split_points, layers_per_stage): pp divides it, v is the rest."""

    def allowed(name, values):
        return [fix[name]] if name in fix else values

    tp_choices = [t for t in divisors(gpus) if t <= gpus_per_node and all(s % t == 0 for s in tp_sizes.values())]
    tp_choices = tp_choices if tensor_parallel else [1]
    pairs = [
        (tp, cp)
        for tp in allowed("tp", tp_choices)
        for cp in cp_choices
        if gpus % (tp * cp) == 0
        and (seq_len is None or seq_len % (2 * cp) == 0)
        and (cp * tp <= gpus_per_node or "cp" in fix)
    ]
    for tp, cp in pairs:
        pp_choices = [
            p for p in divisors(gpus // (tp * cp)) if (p <= n_blocks if n_stages is None else n_stages % p == 0)
        ]
        for pp in allowed("pp", pp_choices):
            if gpus % (tp * cp * pp):
                continue
            dp = gpus // (tp * cp * pp)
            if "dp" in fix and fix["dp"] != dp or global_batch % dp:
                continue
            local = global_batch // dp
            for ep in [e for e in ep_choices if (dp * cp * tp) % e == 0 and (e <= gpus_per_node or "ep" in fix)]:
                yield from _schedules(allowed, fix, n_blocks, pp, dp, cp, tp, ep, local, gpus_per_node, n_stages)


def _schedules(allowed, fix, n_blocks, pp, dp, cp, tp, ep, local, gpus_per_node, n_stages=None):
    """The schedule, microbatch, checkpointing and data-parallel choices of one (pp, dp, cp, tp, ep)."""
    for schedule in allowed("schedule", ["1f1b"] if pp == 1 else list(PLANNED_SCHEDULES)):
        spec = SCHEDULES[schedule]
        v_choices = (
            [spec.fixed_virtual_stages] if spec.fixed_virtual_stages else ([1, 2, 4] if spec.multi_stage else [1])
        )
        if n_stages is not None:  # the split decides v
            v_choices = [v for v in [n_stages // pp] if pp * v == n_stages and (v == 1 or spec.multi_stage)]
            v_choices = [v for v in v_choices if not spec.fixed_virtual_stages or v == spec.fixed_virtual_stages]
        for v in allowed("virtual_stages", [v for v in v_choices if n_stages is not None or pp * v <= n_blocks]):
            for m in allowed("microbatches", [m for m in divisors(local) if m <= 4 * pp * v or m == pp]):
                if local % m:
                    continue
                try:  # each schedule's own minimum (dualpipev: m >= 2*pp; memory and time walk its lists)
                    check_schedule_config(schedule, pp, m, v)
                except ValueError:
                    continue
                for ac in allowed("activation_checkpoint", list(ACTIVATION_CHECKPOINT_MODES)):
                    # FSDP/DDP span dp x cp: the ranks of a cp group hold the same parameters
                    choices = _data_parallel_choices(allowed, dp, cp, tp, pp, gpus_per_node)
                    for mode, reshard, dp_shard in choices:
                        yield dict(
                            pp=pp,
                            dp=dp,
                            cp=cp,
                            tp=tp,
                            ep=ep,
                            schedule=schedule,
                            virtual_stages=v,
                            microbatches=m,
                            activation_checkpoint=ac,
                            dp_mode=mode,
                            reshard_after_forward=reshard,
                            dp_shard=dp_shard,
                            param_dtype=fix.get("param_dtype", torch.bfloat16),
                            compile=fix.get("compile", False),
                            local_batch=local,
                            microbatch_size=local // m,
                        )


def context_parallel_degrees(model, anatomy, gpus, gpus_per_node, fix, hardware: Hardware, seq_len: int) -> list[int]:
    """The cp degrees to plan: `fix`'s, refused by name (as parallelize would) where the model or the
    hardware cannot take it; else, for sequences of C.CP_SEARCHED_FROM_SEQ_LEN tokens or more,
    every divisor of the GPUs up to a node (candidate_layouts keeps those whose cp x tp group fits
    in one; a larger cp can be pinned); 1 alone for shorter sequences, for a model mesh3d cannot cut
    along the sequence and on a measured machine."""

    def refused(cp: int) -> None:
        if anatomy.traced is None:
            takes = [stage_input_names(stage) for stage in measured_stages(model, anatomy, 1, 2 * cp).stages.values()]
        else:
            takes = []
        check_kind(cp, anatomy.traced is not None, takes, model, anatomy.cp_refusal)
        if hardware.times_the_model:
            raise ValueError(
                f"plan: cp={cp} on {hardware.name!r}: a measured machine times its model's parts on whole "
                "sequences, not a cp rank's; plan context parallelism for a GPU preset or a Hardware, or fix cp=1"
            )

    if "cp" not in fix and seq_len < C.CP_SEARCHED_FROM_SEQ_LEN:
        return [1]
    return _pinned_or_searched("cp", fix, refused, lambda: [c for c in divisors(gpus) if c <= gpus_per_node])


def expert_parallel_degrees(model, anatomy, gpus, gpus_per_node, fix, hardware: Hardware, tp_plan) -> list[int]:
    """The ep degrees to plan: `fix`'s, refused by name (as parallelize would) where the model, its
    tp plan or the hardware cannot take it; else, for a mixture of experts whose config declares
    its experts (base_model_ep_plan), every divisor of its expert count up to a node; 1 alone for
    any other model and on a measured machine."""
    plan = anatomy.expert_plan

    def refused(ep: int) -> None:
        check_expert_parallel(
            plan, anatomy.expert_plan_refusal, ep, splits_the_sequence(TensorParallelConfig(plan=dict(tp_plan or {})))
        )
        if ep > 1 and routing_sizes(model) is None:
            raise ValueError(
                f"plan: ep={ep}, but the config of {anatomy.name} names neither how many experts a token is routed "
                f"to ({', '.join(TOP_K_ATTRIBUTES)}) nor its hidden_size, which size the all-to-alls; use ep=1"
            )
        if ep > 1 and hardware.times_the_model:
            raise ValueError(
                f"plan: ep={ep} on {hardware.name!r}: a measured machine times the experts as one rank runs "
                "them all, not their all-to-alls; plan expert parallelism for a GPU preset or a Hardware, or fix ep=1"
            )

    return _pinned_or_searched(
        "ep", fix, refused, lambda: [e for e in divisors(plan.num_experts) if e <= gpus_per_node and gpus % e == 0]
    )


def _pinned_or_searched(axis: str, fix: dict, refused, searched) -> list[int]:
    """A carved axis's degrees: the pinned one, or `refused` raises its reason (as parallelize
    would); unpinned, `searched()` where the model takes the axis at all (degree 2), else 1 alone."""
    if axis in fix:
        refused(fix[axis])
        return [fix[axis]]
    try:
        refused(2)
    except ValueError:
        return [1]
    return searched()


def _data_parallel_choices(allowed, dp: int, cp: int, tp: int, pp: int, gpus_per_node: int):
    """(dp_mode, reshard_after_forward, dp_shard) of the ranks holding the same parameters (dp x cp):
    FSDP over them reshards after each forward or keeps the stage gathered (parallelize's default:
    reshard at pp = 1, keep at pp > 1, where the other choice trades memory for a gather per
    microbatch and is searched too); HSDP too where dp spans nodes, sharded over a node's dp ranks
    (dp_shard, or the pinned one) and replicated across nodes; reshard None where there is nothing
    to reshard (DDP, dp x cp = 1)."""
    per_node = gpus_per_node // (cp * tp)  # dp ranks in a node (ranks are tp fastest, then cp, then dp)
    hybrid = per_node >= 1 and dp > per_node and dp % per_node == 0
    [pinned] = allowed("dp_shard", [None])
    if pinned is not None:  # a run's own sharding groups (check_fix: with dp_mode="hsdp"), whatever the node
        per_node, hybrid = pinned, dp % pinned == 0
    sharded = dp * cp > 1
    for mode in allowed("dp_mode", ["fsdp", "ddp", *(["hsdp"] if hybrid else [])] if sharded else ["fsdp"]):
        if mode == "hsdp" and not hybrid:
            continue
        dp_shard = per_node if mode == "hsdp" else None
        if mode in ("fsdp", "hsdp") and sharded:
            keep = [True] if pp == 1 else [False, True]
            yield from ((mode, r, dp_shard) for r in allowed("reshard_after_forward", keep))
        elif allowed("reshard_after_forward", [None]) == [None]:
            yield mode, None, None


def context_parallel_refusal(costs: ModelCosts, name: str) -> str | None:
    """Why the measured block cannot run under the cp it was measured at, as parallelize's check
    would refuse it (context_parallel/model_check.py); None where it can (and at cp = 1)."""
    if costs.cp == 1:
        return None
    if not costs.block.cp.calls:
        return (
            f"plan: cp={costs.cp}, but the blocks of {name} never call "
            "torch.nn.functional.scaled_dot_product_attention, the attention mesh3d makes context-parallel; use "
            "cp=1 (or an SDPA attention)"
        )
    if costs.block.cp.float_masks:
        return (
            f"plan: cp={costs.cp}, but the attention of {name} calls scaled_dot_product_attention with a float mask, "
            "which mesh3d cannot extend to a sequence cut over ranks; use cp=1"
        )
    return None


def check_fix(fix: dict | None) -> dict:
    fix = dict(fix or {})
    unknown = sorted(set(fix) - set(FIXABLE))
    if unknown:
        raise ValueError(f"plan: fix has unknown keys {unknown}; pin any of {list(FIXABLE)}")
    if "schedule" in fix and fix["schedule"] not in SCHEDULES:
        raise ValueError(f"plan: fix schedule={fix['schedule']!r}; choose one of {sorted(SCHEDULES)}")
    if "schedule" in fix and fix["schedule"] not in PLANNED_SCHEDULES:
        raise ValueError(
            f"plan: fix schedule={fix['schedule']!r} is not modelled by the planner yet (its weight "
            f"versions and cross-call timeline); choose one of {sorted(PLANNED_SCHEDULES)}"
        )
    if "activation_checkpoint" in fix and fix["activation_checkpoint"] not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(
            f"plan: fix activation_checkpoint={fix['activation_checkpoint']!r}; "
            f"choose one of {list(ACTIVATION_CHECKPOINT_MODES)}"
        )
    if "dp_mode" in fix and fix["dp_mode"] not in ("fsdp", "hsdp", "ddp"):
        raise ValueError(
            f"plan: fix dp_mode={fix['dp_mode']!r}; choose 'fsdp', 'hsdp' (planned where dp spans nodes) or 'ddp'"
        )
    shard = fix.get("dp_shard")
    if "dp_shard" in fix and (
        fix.get("dp_mode") != "hsdp" or isinstance(shard, bool) or not isinstance(shard, int) or shard < 1
    ):
        raise ValueError(
            f"plan: fix dp_shard={fix['dp_shard']!r} with dp_mode={fix.get('dp_mode')!r}; dp_shard sizes HSDP's "
            "sharding groups: pin it with dp_mode='hsdp', a positive integer dividing dp"
        )
    if "param_dtype" in fix and fix["param_dtype"] is not None and not isinstance(fix["param_dtype"], torch.dtype):
        raise ValueError(f"plan: fix param_dtype={fix['param_dtype']!r}; give a torch dtype (torch.bfloat16) or None")
    if "reshard_after_forward" in fix and not isinstance(fix["reshard_after_forward"], bool):
        raise ValueError(
            f"plan: fix reshard_after_forward={fix['reshard_after_forward']!r}; give True or False (FSDP over dp > 1)"
        )
    if "compile" in fix and not isinstance(fix["compile"], bool):
        raise ValueError(f"plan: fix compile={fix['compile']!r}; give True or False")
    if "fused_loss" in fix and not isinstance(fix["fused_loss"], bool):
        raise ValueError(f"plan: fix fused_loss={fix['fused_loss']!r}; give True or False")
    for name in ("pp", "dp", "cp", "tp", "ep", "virtual_stages", "microbatches"):
        if name in fix and (isinstance(fix[name], bool) or not isinstance(fix[name], int) or fix[name] < 1):
            raise ValueError(f"plan: fix {name}={fix[name]!r}; give a positive integer")
    return fix


def check_sizes(gpus, gpus_per_node, seq_len, global_batch) -> None:
    for name, value in (
        ("gpus", gpus),
        ("gpus_per_node", gpus_per_node),
        ("seq_len", seq_len),
        ("global_batch", global_batch),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan: {name} must be a positive integer, got {value!r}")
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(
            f"plan: gpus={gpus} is not a whole number of nodes of {gpus_per_node}; use a multiple of "
            f"{gpus_per_node} (e.g. {gpus // gpus_per_node * gpus_per_node} or "
            f"{(gpus // gpus_per_node + 1) * gpus_per_node})"
        )


def resolve_hardware(hardware: str | Hardware) -> Hardware:
    """A preset by name, "this-machine" (measured now), or a Hardware as given."""
    if isinstance(hardware, Hardware):
        return hardware
    if hardware == "this-machine":
        return measure_this_machine()
    if hardware not in HARDWARE:
        raise ValueError(
            f"plan: unknown hardware {hardware!r}; choose one of {sorted(HARDWARE)}, "
            "'this-machine', or pass mesh3d.planner.Hardware(...)"
        )
    return HARDWARE[hardware]


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def memory_limit_bytes(limit: int | str | None, hardware: Hardware) -> int:
    if limit is None:
        return int(hardware.memory_bytes * (1 - C.MEMORY_MARGIN_FRACTION))
    if isinstance(limit, str):
        match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", limit)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"plan: memory_limit={limit!r}; write bytes or a size such as '80GiB' or '75GB'")
        return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0:
        raise ValueError(f"plan: memory_limit must be positive bytes or a size such as '80GiB', got {limit!r}")
    return int(limit)


def nothing_fits(gpus, limit, smallest_need, fix, global_batch, split_counts=None) -> str:
    gib = 2**30
    if smallest_need is None:
        stages = (
            ""
            if split_counts is None
            else f", and the split (split_points or layers_per_stage) makes {len(split_counts)} stages, "
            f"so pp * virtual_stages must be {len(split_counts)}"
        )
        return (
            f"plan: no layout of {gpus} GPUs matches these sizes (global_batch={global_batch}, fix={fix}); "
            "global_batch must divide over dp, microbatches over each dp rank's batch, tp the model's head "
            f"counts, seq_len into 2 x cp chunks{', dp_shard into dp' if 'dp_shard' in fix else ''}{stages}"
        )
    need = math.ceil(smallest_need / limit)
    return (
        f"plan: no layout fits in {limit / gib:.1f} GiB per GPU on {gpus} GPUs (fix={fix}); the leanest "
        f"needs {smallest_need / gib:.1f} GiB. Try about {need}x the GPUs ({gpus * need}), a smaller "
        f"global_batch or seq_len, or a larger memory_limit"
    )
