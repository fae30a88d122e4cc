"""parallelize(): the whole model in, this rank's part of it out, wired into a pipeline schedule.

Order of work, the same on every rank:
1. check every argument (pure arithmetic on sizes and the meta model: each rank raises the same
   error before any collective);
2. one small all-gather that every rank asked for the same configuration;
3. split: stages on the meta device for all stages (to learn boundary shapes and who owns
   which name; they carry the tp plan too, so the shapes are local ones), real stages for this
   rank's own;
4. materialization, initialization, tied copies made equal along pp, replicas along tp and dp;
5. tensor parallelism per stage (then ties re-made: parallelize_module replaces parameters);
6. data parallelism per stage (FSDP2 or DDP over dp), after giving each local stage its own copy
   of a tied weight (each stage is its own FSDP/DDP root);
7. the pipeline runtime, with the once-per-step gradient sync as its backward hook.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from mesh3d.data.parallel import (
    GradientSync,
    apply_data_parallel,
    check_data_parallel_config,
    make_replicas_identical,
)
from mesh3d.mesh import Layout, build_mesh
from mesh3d.parallel_model import ParallelModel
from mesh3d.pipeline.lower import lower
from mesh3d.pipeline.runtime import ACTIVATION_CHECKPOINT_MODES, PipelineRuntime
from mesh3d.pipeline.schedules import SCHEDULES, build_schedule, check_schedule_config
from mesh3d.pipeline.split import (
    assign_layers,
    build_stage,
    find_layers,
    layer_parameter_counts,
    meta_copy,
)
from mesh3d.pipeline.tied import TiedWeights, find_ties, get_parameter
from mesh3d.tensor import apply_tensor_parallel, check_plan, loss_context, model_plan, uses_sequence_parallel

STAGE_BALANCE = ("layers", "params")


def cross_entropy_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Default loss: mean cross-entropy over every position, logits (..., vocab) in fp32."""
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten())


def parallelize(
    model: nn.Module,
    layout: Layout | None = None,
    *,
    pp: int | None = None,
    dp: int | None = None,
    tp: int | None = None,
    schedule: str = "interleaved_1f1b",
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    activation_checkpoint: str = "never",
    layers_per_stage: Sequence[int] | None = None,
    stage_balance: str = "layers",
    end_weight: float = 0.0,
    dp_mode: str = "fsdp",
    tp_plan: dict[str, ParallelStyle] | None = None,
    reshard_after_forward: bool | None = None,
    loss_parallel: bool = False,
) -> ParallelModel:
    """Split `model` into pipeline stages, keep this rank's, and return a ParallelModel.

    Args:
        model: the whole model, on the meta device (materialized here, then `init_weights()`
            if the model has it) or on CPU (its values are kept). It must follow the model
            protocol: repeated blocks in an nn.ModuleDict `layers` (docs/model_protocol.md).
        layout: from `build_mesh`; or give pp=/dp=/tp= and the mesh is built here.
        schedule: "gpipe", "1f1b" or "interleaved_1f1b".
        microbatches: microbatches per step; default pp. 1F1B-type schedules need >= pp.
        virtual_stages: stages per pp rank; default 2 for interleaved_1f1b when the model has
            at least 2*pp layers (else 1), and 1 for the other schedules.
        loss_fn: loss_fn(output, target) -> mean loss of one microbatch; default cross-entropy.
        activation_checkpoint: "never", "always", or "except_last" (the last microbatch of each
            step keeps its activations instead of recomputing them).
        layers_per_stage: explicit layer counts, one per stage (pp * virtual_stages, in stage order).
        stage_balance: "layers" (each layer costs 1) or "params" (each layer costs its parameter
            count), used when layers_per_stage is not given.
        end_weight: with stage_balance="layers", the embedding and the output head each count as
            this many layers (so the first and last stages may get fewer blocks).
        dp_mode: "fsdp" (FSDP2 `fully_shard` per block and per stage over the dp axis) or "ddp"
            (full replicas, one gradient all-reduce per stage per step). Unused when dp == 1.
        tp_plan: {module-name pattern (fnmatch over the unsplit model's names): ParallelStyle};
            default the model's `tp_plan` attribute. Unused when tp == 1.
        reshard_after_forward: FSDP only: free gathered parameters after each forward (and gather
            again for backward). Default False when pp > 1 (microbatches reuse them), else True.
        loss_parallel: keep the logits vocab-sharded and compute the loss under torch's
            loss_parallel(); the tp plan must leave the output head's result a DTensor sharded on
            its last dim. Unused when tp == 1.
    """
    layers = find_layers(model)
    layout = _resolve_layout(layout, pp, dp, tp)
    check_data_parallel_config(dp_mode, reshard_after_forward)
    if reshard_after_forward is None:
        reshard_after_forward = layout.pp == 1
    plan = check_plan(model, model_plan(model, tp_plan), layout.tp) if layout.tp > 1 else {}
    loss_parallel = loss_parallel and layout.tp > 1
    if microbatches is None:
        microbatches = layout.pp
    if virtual_stages is None:
        multi = schedule in SCHEDULES and SCHEDULES[schedule].multi_stage
        virtual_stages = 2 if multi and len(layers) >= 2 * layout.pp else 1
    check_schedule_config(schedule, layout.pp, microbatches, virtual_stages)
    if activation_checkpoint not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(f"activation_checkpoint={activation_checkpoint!r}; choose one of {list(ACTIVATION_CHECKPOINT_MODES)}")
    if stage_balance not in STAGE_BALANCE:
        raise ValueError(f"stage_balance={stage_balance!r}; choose one of {list(STAGE_BALANCE)}")
    n_stages = layout.pp * virtual_stages
    if stage_balance == "params":
        per_layer, first, last = layer_parameter_counts(model)
        ranges = assign_layers(len(layers), n_stages, layer_costs=per_layer, first_cost=first, last_cost=last, layers_per_stage=layers_per_stage)
    else:
        ranges = assign_layers(len(layers), n_stages, first_cost=end_weight, last_cost=end_weight, layers_per_stage=layers_per_stage)
    steps = build_schedule(schedule, layout.pp, microbatches, virtual_stages)
    lowered = lower(steps)

    # Split. Meta copies of every stage tell each rank the boundary shapes and who owns what.
    materialize = _on_meta(model)
    meta_model = model if materialize else meta_copy(model)
    meta_stages = [build_stage(meta_model, s, n_stages, ranges[s]) for s in range(n_stages)]
    plan_summary = sorted((pattern, _describe(style)) for pattern, style in plan.items())
    _check_same_config_everywhere(
        layout,
        f"{schedule} m={microbatches} v={virtual_stages} ac={activation_checkpoint} stages={ranges} "
        f"dp_mode={dp_mode} reshard={reshard_after_forward} plan={plan_summary} loss_parallel={loss_parallel}",
    )
    state_owner, state_specs = {}, {}
    for s, stage in enumerate(meta_stages):
        for name, tensor in stage.state_dict(keep_vars=True).items():
            if name not in state_owner:
                state_owner[name], state_specs[name] = s, (tensor.shape, tensor.dtype)
    ordered = [k for k in meta_model.state_dict(keep_vars=True) if k in state_owner]
    state_owner = {k: state_owner[k] for k in ordered}
    ties = find_ties(model)
    if plan:
        for stage in meta_stages:  # the same plan on meta: boundary shapes become local shapes
            apply_tensor_parallel(stage, plan, layout.mesh["tp"])
        _check_ties_sharded_alike(ties, meta_stages)
    stages = {}
    for s in steps.local_stages(layout.pp_rank):
        stage = build_stage(model, s, n_stages, ranges[s])
        stages[s] = stage.to_empty(device=layout.device) if materialize else stage.to(layout.device)

    stage_names = {s: {n for n, _ in st.named_parameters(remove_duplicate=False)} for s, st in enumerate(meta_stages)}
    tied = TiedWeights(ties, stage_names, steps.stage_rank, layout)
    tied.tie_locally(stages)
    if materialize:
        for index, stage in stages.items():
            _initialize(stage, index, layout.device)
    tied.sync_values()
    make_replicas_identical(stages, layout)

    if plan:
        for stage in stages.values():
            apply_tensor_parallel(stage, plan, layout.mesh["tp"])
        tied.tie_locally(stages)  # parallelize_module gave each end of a local tie its own parameter
    grad_sync = None
    if layout.dp > 1:
        tied.separate_stages(stages)  # each stage is its own FSDP/DDP root: no Parameter shared by two
        for stage in stages.values():
            apply_data_parallel(stage, stage.layers, layout, dp_mode, reshard_after_forward)
        tied.refresh(stages)  # now the sharded parameters
        grad_sync = GradientSync(stages, reshard_between_backwards=dp_mode == "fsdp" and reshard_after_forward)

    runtime = PipelineRuntime(
        stages,
        meta_stages,
        lowered,
        layout.pp_rank,
        layout.group_ranks("pp"),
        layout.group("pp") if layout.pp > 1 else None,
        loss_fn or cross_entropy_loss,
        layout.device,
        activation_checkpoint,
        before_backward=grad_sync.before_backward if grad_sync is not None else None,
        loss_context=loss_context(loss_parallel),
    )
    return ParallelModel(
        layout, stages, ranges, steps, runtime, tied, state_owner, state_specs,
        grad_sync=grad_sync, sequence_parallel=uses_sequence_parallel(plan), loss_parallel=loss_parallel,
    )


def _resolve_layout(layout: Layout | None, pp: int | None, dp: int | None, tp: int | None) -> Layout:
    if layout is None:
        return build_mesh(pp=1 if pp is None else pp, dp=-1 if dp is None else dp, tp=1 if tp is None else tp)
    given = {"pp": pp, "dp": dp, "tp": tp}
    clash = {k: v for k, v in given.items() if v is not None and v != getattr(layout, k)}
    if clash:
        raise ValueError(f"parallelize: got a layout {layout!r} and different sizes {clash}; pass one or the other")
    return layout


def _check_ties_sharded_alike(ties: list[list[str]], meta_stages: list[nn.Module]) -> None:
    """The tie all-reduce adds local shards: every copy must be split the same way by the tp plan."""
    for names in ties:
        layouts = {}
        for stage in meta_stages:
            for name in names:
                param = get_parameter(stage, name)
                if param is not None:
                    layouts[name] = tuple(getattr(param, "placements", ()))
        if len(set(layouts.values())) > 1:
            raise ValueError(
                f"tied weights are sharded differently by the tp plan ({layouts}); give both modules styles that "
                "split the shared weight along the same dim (e.g. RowwiseParallel embedding and ColwiseParallel head "
                "both split the vocabulary)"
            )


def _describe(style: ParallelStyle) -> str:
    """A style's arguments where its repr shows them; its class otherwise (a default repr has an address)."""
    text = repr(style)
    return type(style).__name__ if " object at 0x" in text else text


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


@torch.no_grad()
def _initialize(stage: nn.Module, index: int, device: torch.device) -> None:
    """Fresh values for a stage materialized from meta: the model's own init_weights() if it has one.

    Each stage draws from the global RNG reseeded with (initial seed + stage index), so stages
    on different ranks, which start from the same RNG state, do not get identical layers.
    """
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(torch.initial_seed() + index)
        if callable(getattr(stage, "init_weights", None)):
            stage.init_weights()
            return
        for module in stage.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()


def _check_same_config_everywhere(layout: Layout, config: str) -> None:
    """Ranks with different schedules or splits would send mismatched messages and hang."""
    if layout.world_size == 1:
        return
    mine = torch.tensor([zlib.crc32(config.encode())], dtype=torch.int64, device=layout.device)
    everyone = [torch.empty_like(mine) for _ in range(layout.world_size)]
    dist.all_gather(everyone, mine)
    if any(int(t) != int(mine) for t in everyone):
        raise ValueError(
            f"parallelize: ranks were given different pipeline configurations (this rank: {config}); "
            "pass the same schedule, microbatches, virtual_stages, activation_checkpoint and split on every rank"
        )
