"""`mesh3d.plan`: every layout of a model on a cluster, the ones that fit, ranked by tokens/s per GPU.

For each candidate (pp, dp, cp, tp, ep, schedule, virtual_stages, microbatches, activation_checkpoint,
dp_mode) the planner builds the schedule mesh3d would run, predicts the fullest rank's memory
(predict/memory.py) and the step's time (predict/step_time.py) from costs measured on the model itself
(measure/probe.py, once per tp and cp degree; under ep, measure/experts.py), drops what does not fit and ranks the rest.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

from mesh3d.model.fused_head_loss import check_fused_loss
from mesh3d.pipeline.schedule.catalog import build_schedule
from mesh3d.pipeline.split import split_point_counts, stage_layer_ranges
from mesh3d.pipeline.tied import find_ties
from mesh3d.planner.band import check_band, rank_within_band
from mesh3d.planner.hardware import Hardware
from mesh3d.planner.measure.costs import ModelCosts
from mesh3d.planner.measure.data_parallel_timing import time_data_parallel
from mesh3d.planner.measure.experts import at_expert_parallel, routing_sizes, without_experts
from mesh3d.planner.measure.measured_stages import planner_anatomy, token_ids
from mesh3d.planner.measure.part_timing import time_model
from mesh3d.planner.measure.probe import measure_model_anywhere
from mesh3d.planner.model_source import max_sequence_length, meta_model
from mesh3d.planner.planned_layout import Plan
from mesh3d.planner.predict.links import Links
from mesh3d.planner.predict.memory import StagePlacement, rank_activations, rank_memory
from mesh3d.planner.predict.step_time import step_time
from mesh3d.planner.predict.traffic import rank_traffic, traffic_unpredicted
from mesh3d.planner.search_space import (
    candidate_layouts,
    check_fix,
    check_sizes,
    context_parallel_degrees,
    context_parallel_refusal,
    expert_parallel_degrees,
    memory_limit_bytes,
    nothing_fits,
    resolve_hardware,
)


def plan(
    model: nn.Module | str | object,
    gpus: int,
    gpus_per_node: int = 8,
    hardware: str | Hardware = "h100",
    seq_len: int = 8192,
    global_batch: int = 256,
    memory_limit: int | str | None = None,
    fix: dict | None = None,
    tp_plan: dict | None = None,
    split_points: Sequence[str] | None = None,
    tie_band: float | None = None,
    layers_per_stage: Sequence[int] | None = None,
) -> list[Plan]:
    """Rank the layouts of `model` on `gpus` devices of `hardware`: the fastest first, only those
    that fit; within the planner's error band of each other, those near the memory limit last (band.py).

    Args:
        model: a model on the meta device (mesh3d protocol, Hugging Face, nn.Sequential, or any
            other module torch.export captures: traced, as `parallelize` takes it given
            `example_inputs`), a Hugging Face config, or a preset name ("llama3-8b",
            "llama3-70b", "llama3-405b"). The model is a language model: its input is token ids of
            (microbatch, seq_len); a traced model is captured with such ids on meta, once per
            microbatch size the planner measures, and its plans' `parallelize_kwargs()` carry
            `example_inputs` of the plan's microbatch size (docs/plan.md).
        gpus, gpus_per_node: the cluster (tensor parallelism stays within a node, and so does
            context parallelism with it unless `fix` pins cp).
        hardware: a preset ("h100", "h100-96gb", "h200", "a100-80gb", "b200"), a `Hardware`, or
            "this-machine".
        seq_len, global_batch: tokens per sequence and sequences per step.
        memory_limit: bytes (or "80GiB") a rank may hold; default the hardware's memory less
            constants.MEMORY_MARGIN_FRACTION.
        fix: pin choices by the plan's attribute names, e.g. {"pp": 8, "schedule": "1f1b"} or
            {"cp": 4} (context parallelism: searched unpinned from constants.CP_SEARCHED_FROM_SEQ_LEN
            tokens on, where the model takes it and seq_len cuts into 2 x cp chunks; a pinned cp a
            model cannot run is refused by name as parallelize would), or {"ep": 2} (expert
            parallelism: searched unpinned for a mixture of experts that declares its experts).
        tp_plan: a tensor-parallel plan, when the model's own declaration is not the one to use.
        split_points: the blocks where stages 1, 2, ... begin, as `parallelize` takes them (a
            traced model's blocks are then that container's children): only layouts of
            len(split_points) + 1 stages are planned, split there, and the plans pass them on.
        layers_per_stage: blocks per stage, as `parallelize` takes them (the first and the last
            stage may hold 0: an end alone); only layouts of that many stages are planned.
        tie_band: among plans whose tokens/s lie within this fraction of the fastest of their
            tier, those predicted within constants.MEMORY_PREDICTION_BAND of the memory limit
            rank last (band.py); default the hardware's error band (`Hardware.band`: how far its
            predictions stood from published runs); 0 ranks by speed alone.

    Raises ValueError naming what would fit when nothing does; a traced model that torch.export
    cannot capture raises the anatomy's ValueError (torch's reason) as `parallelize` would.
    """
    check_band(tie_band)
    hw = resolve_hardware(hardware)
    fix = check_fix(fix)
    check_sizes(gpus, gpus_per_node, seq_len, global_batch)
    model = meta_model(model)
    longest = max_sequence_length(model)
    if longest is not None and seq_len > longest:
        raise ValueError(
            f"plan: seq_len={seq_len} is longer than the model takes ({longest}); use seq_len <= {longest}"
        )
    limit = memory_limit_bytes(memory_limit, hw)
    anatomy = planner_anatomy(model, seq_len, split_points)
    fused_loss = fix.get("fused_loss", False)  # refused as parallelize refuses it; planned at tp = 1 only
    check_fused_loss(fused_loss, model, None, fix.get("tp", 1), anatomy.traced is not None)
    n_blocks = len(anatomy.block_names(model))
    if split_points is not None and layers_per_stage is not None:
        raise ValueError("plan: give split_points or layers_per_stage, not both")
    split_counts = None
    if split_points is not None:
        split_counts = split_point_counts(anatomy, anatomy.block_names(model), split_points)
    elif layers_per_stage is not None:  # bad counts refused before the search, as parallelize refuses them
        split_counts = list(layers_per_stage)
        stage_layer_ranges(model, anatomy, len(split_counts), "layers", 0.0, split_counts)
    plan_tp = tp_plan if tp_plan is not None else anatomy.tp_plan
    tied = any(len(group) > 1 for group in find_ties(model))
    param_bytes = next(model.parameters()).element_size()
    measure = functools.cache(
        lambda tp, dtype, cp=1: measure_model_anywhere(
            model,
            anatomy,
            split_points,
            tp=tp,
            tp_plan=plan_tp,
            microbatch_size=1,
            seq_len=seq_len,
            param_dtype=dtype,
            cp=cp,
            fused_loss=fused_loss,
        )
    )
    cp_choices = context_parallel_degrees(model, anatomy, gpus, gpus_per_node, fix, hw, seq_len)
    ep_choices = expert_parallel_degrees(model, anatomy, gpus, gpus_per_node, fix, hw, plan_tp)

    measure_whole_experts = functools.cache(
        lambda tp, dtype, cp: measure_model_anywhere(
            model,
            anatomy,
            split_points,
            tp=tp,
            tp_plan=without_experts(plan_tp, anatomy.expert_plan),
            microbatch_size=1,
            seq_len=seq_len,
            param_dtype=dtype,
            cp=cp,
            fused_loss=fused_loss,
        )
    )

    @functools.cache
    def costs_at(tp, dtype, cp, ep):
        if ep == 1:
            return measure(tp, dtype, cp)
        # the same probe without the experts' tp entries: their whole weights, the tp traffic left
        whole = measure(1, dtype, cp) if tp == 1 else measure_whole_experts(tp, dtype, cp)
        return at_expert_parallel(measure(tp, dtype, cp), whole, anatomy.expert_plan, ep, *routing_sizes(model))

    # A measured machine times the model's parts at each microbatch size it plans (predict/step_time.py).
    timed = functools.cache(
        lambda tp, dtype, mbs: time_model(
            model, anatomy, measure(tp, dtype), tp_plan=plan_tp, microbatch_size=mbs, param_dtype=dtype
        )
    )
    # ... and what data parallelism's wrapping adds to a block there, per dp degree and mode.
    dp_timed = functools.cache(
        lambda dp, mode, tp, dtype, mbs: time_data_parallel(
            model,
            anatomy,
            dp=dp,
            dp_mode=mode,
            tp=tp,
            tp_plan=plan_tp,
            microbatch_size=mbs,
            seq_len=seq_len,
            param_dtype=dtype,
        )
    )
    # Many candidates share a schedule, a split and a walk of the action lists: each is built once.
    schedule_of = functools.cache(build_schedule)
    layers_of = functools.cache(
        lambda n_stages: stage_layer_ranges(model, anatomy, n_stages, "layers", 0.0, split_counts)
    )
    walks: dict[tuple, tuple[tuple[int, int], ...]] = {}
    plans, smallest_need = [], None
    for cand in candidate_layouts(
        gpus,
        gpus_per_node,
        global_batch,
        n_blocks,
        anatomy.tensor_parallel_sizes,
        fix,
        tensor_parallel=bool(plan_tp) and not fused_loss,
        seq_len=seq_len,
        cp_choices=cp_choices,
        ep_choices=ep_choices,
        n_stages=None if split_counts is None else len(split_counts),
    ):
        if split_counts is not None and cand["pp"] * cand["virtual_stages"] != len(split_counts):
            continue  # the split names the stages
        costs = costs_at(cand["tp"], cand["param_dtype"], cand["cp"], cand["ep"])
        refusal = context_parallel_refusal(costs, anatomy.name)
        if refusal is not None:
            if "cp" in fix:
                raise ValueError(refusal)
            continue
        built = schedule_of(cand["schedule"], cand["pp"], cand["microbatches"], cand["virtual_stages"])
        layers = layers_of(cand["pp"] * cand["virtual_stages"])
        compute_bytes = (
            param_bytes if cand["param_dtype"] is None else torch.empty((), dtype=cand["param_dtype"]).element_size()
        )
        data_ranks = cand["dp"] * cand["cp"]  # FSDP/DDP span dp x cp
        hybrid = cand["dp_mode"] == "hsdp"  # FSDP over a node's dp ranks (and their cp), replicas across nodes
        place = StagePlacement(
            built,
            layers,
            cand["dp_shard"] * cand["cp"] if hybrid else data_ranks,
            "fsdp" if hybrid else cand["dp_mode"],
            cand["microbatch_size"],
            cand["activation_checkpoint"],
            param_bytes,
            compute_bytes,
            wraps=data_ranks > 1 or cand["ep"] > 1 or cand["param_dtype"] is not None,
            tied_end=tied,
            reshard_after_forward=cand["reshard_after_forward"],
            expert_dp=data_ranks * cand["tp"] // cand["ep"] if cand["ep"] > 1 else 1,
            replicas=cand["dp"] // cand["dp_shard"] if hybrid else 1,
            hybrid=hybrid,
        )
        walk = (
            cand["tp"],
            cand["cp"],
            cand["ep"],
            cand["param_dtype"],
            cand["schedule"],
            cand["pp"],
            cand["microbatches"],
            cand["virtual_stages"],
            cand["activation_checkpoint"],
            cand["microbatch_size"],
        )
        if walk not in walks:
            walks[walk] = tuple(rank_activations(costs, r, place) for r in range(cand["pp"]))
        by_rank = tuple(rank_memory(costs, r, place, walks[walk][r]) for r in range(cand["pp"]))
        memory = max(by_rank, key=lambda m: m.total)
        if memory.total > limit:
            smallest_need = memory.total if smallest_need is None else min(smallest_need, memory.total)
            continue
        links = Links.of(
            hw, cand["pp"], cand["dp"], cand["tp"], gpus_per_node, cand["cp"], cand["ep"], cand["dp_shard"]
        )
        fp32 = cand["param_dtype"] is None or cand["param_dtype"] == torch.float32
        step_costs = timed(cand["tp"], cand["param_dtype"], cand["microbatch_size"]) if hw.times_the_model else costs
        overhead = (
            dp_timed(cand["dp"], cand["dp_mode"], cand["tp"], cand["param_dtype"], cand["microbatch_size"])
            if hw.times_the_model and cand["dp"] > 1
            else None
        )
        time = step_time(step_costs, place, hw, links, compile=cand["compile"], fp32_compute=fp32, dp_overhead=overhead)
        tokens = global_batch * seq_len / time.seconds / gpus
        model_flops = _model_flops_per_token(costs, n_blocks)
        mfu = model_flops * tokens / hw.peak_for(fp32)
        traffic_why_not = traffic_unpredicted(cand["ep"])
        traffic = tuple(rank_traffic(costs, r, place) for r in range(cand["pp"]))
        plans.append(
            Plan(
                cand["pp"],
                cand["dp"],
                cand["tp"],
                cand["schedule"],
                cand["virtual_stages"],
                cand["microbatches"],
                cand["activation_checkpoint"],
                cand["dp_mode"],
                cand["param_dtype"],
                cand["compile"],
                cand["local_batch"],
                cand["microbatch_size"],
                memory,
                time.seconds,
                tokens,
                mfu,
                time.bubble_fraction,
                time,
                by_rank,
                (token_ids(cand["microbatch_size"], seq_len),) if anatomy.traced is not None else None,
                None if split_points is None else tuple(split_points),
                cand["reshard_after_forward"],
                cand["cp"],
                cand["ep"],
                cand["dp_shard"],
                fused_loss=fused_loss,
                layers_per_stage=None if layers_per_stage is None else tuple(layers_per_stage),
                traffic_by_pp_rank=traffic,
                traffic_why_not=traffic_why_not,
            )
        )
    if not plans:
        raise ValueError(nothing_fits(gpus, limit, smallest_need, fix, global_batch, split_counts))
    return rank_within_band(plans, hw.band if tie_band is None else tie_band, limit)


def _model_flops_per_token(costs: ModelCosts, n_blocks: int) -> float:
    """The whole model's FLOPs per token (forward and backward, no recomputation): MFU's numerator.
    A cp rank's tokens attend over the whole sequence, so its FLOPs per token are the whole model's,
    its attention counted as at cp = 1 (the whole score matrix, once forward) for what it runs."""
    block = costs.block.flops - costs.block.cp.run_flops + costs.block.cp.model_flops
    per_rank = n_blocks * block + costs.first_end.flops + costs.last_end.flops - costs.recomputed_flops
    return per_rank * costs.tp / (costs.microbatch_size * costs.seq_len)
