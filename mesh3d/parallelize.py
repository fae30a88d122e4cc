"""parallelize(): the whole model in, this rank's part of it out, wired into a pipeline schedule.

A short composition of named steps, the same on every rank, each a small function in the room of
its axis (torchtitan's parallelize_llama has the same shape):

1. check every argument (pipeline/config.py, tensor/plan.py, data_parallel/wrap.py): pure
   arithmetic on sizes and the meta model, so each rank raises the same error before any
   collective; then one small all-gather that every rank asked for the same configuration;
2. split (pipeline/split.py): every stage on meta (boundary shapes, the state map's owners),
   this rank's stages for real; tied weights shared across this rank's stages;
3. a model given with values: replicas made equal along tp and dp (initialize.py), one tensor at
   a time; a model given on meta stays on meta through steps 4-6;
4. with float8=, the blocks' linears become torchao's Float8Linear (model/float8.py), on the meta
   stages too; then tensor parallelism per stage (tensor/apply.py), on the meta stages too, so
   boundary shapes are the local shards' shapes;
5. torch.compile per block (compiled_blocks.py), when asked;
6. data parallelism per stage (data_parallel/), each stage its own FSDP/DDP root, carrying the
   mixed-precision policy (with dp = 1 too, when a compute dtype is asked for); then, for a model
   given on meta, each rank allocates its shards and fills them with the one-process values
   (initialize.py, full_view.py), and tied copies take their primary's values;
7. the pipeline runtime (pipeline/runtime.py), running the two lowered schedules the pipeline
   config made (training, evaluation), with the once-per-step gradient sync as its hook; and the
   step's loss (step/global_loss.py), the one holder of the loss function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from mesh3d.context_parallel.model_check import POSITIONS
from mesh3d.data_parallel.mixed_precision import MixedPrecision
from mesh3d.data_parallel.wrap import SHARDING_MODES, DataParallelConfig, apply_data_parallel
from mesh3d.distributed.agree import check_same_everywhere
from mesh3d.distributed.printed_once import raised_alike
from mesh3d.expert_parallel.apply import apply_expert_parallel, resolve_expert_parallel
from mesh3d.mesh import Layout, layout_or_mesh
from mesh3d.model.compiled_blocks import compile_blocks, resolve_compile
from mesh3d.model.float8 import Float8Config, precompute_scales
from mesh3d.model.fused_head_loss import check_fused_loss, fuse_head, fused_cross_entropy
from mesh3d.model.initialize import make_replicas_identical, to_device
from mesh3d.model.intake import anatomy_of
from mesh3d.model.loss import LossFn, cross_entropy_loss
from mesh3d.model.reset_parameters_warning import warn_if_reset_parameters
from mesh3d.model.stage_inputs import stage_input_names
from mesh3d.model.state_map import StateMap
from mesh3d.parallel_model import ParallelModel
from mesh3d.pipeline.communicators import pipeline_peers
from mesh3d.pipeline.config import PipelineConfig
from mesh3d.pipeline.owned_optimizer import build_optimizer, check_optimizer
from mesh3d.pipeline.runtime import PipelineRuntime
from mesh3d.pipeline.split import split_model
from mesh3d.pipeline.stage_setup import check_context_parallel, expert_load_of, initialize_shards, shard_stages
from mesh3d.pipeline.tied import TiedWeights, find_ties, tied_copies
from mesh3d.pipeline.weight_versions import WeightVersions
from mesh3d.step.batch_check import declared_vocab_size
from mesh3d.step.global_loss import GlobalLoss
from mesh3d.step.sequence_shards import SequenceShards
from mesh3d.tensor.apply import loss_context
from mesh3d.tensor.plan import TensorParallelConfig

__all__ = ["parallelize"]


def parallelize(
    model: nn.Module,
    layout: Layout | None = None,
    *,
    pp: int | None = None,
    dp: int | None = None,
    tp: int | None = None,
    cp: int | None = None,
    ep: int | None = None,
    schedule: str = "interleaved_1f1b",
    microbatches: int | None = None,
    virtual_stages: int | None = None,
    loss_fn: LossFn | None = None,
    activation_checkpoint: str = "never",
    layers_per_stage: Sequence[int] | None = None,
    stage_balance: str = "layers",
    end_weight: float = 0.0,
    dp_mode: str = "fsdp",
    dp_shard: int | None = None,
    tp_plan: dict[str, ParallelStyle] | None = None,
    reshard_after_forward: bool | None = None,
    loss_parallel: bool = False,
    fused_loss: bool = False,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    compile: bool | str = False,
    seed: int | None = None,
    split_points: Sequence[str] | None = None,
    example_inputs: tuple | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    float8: str | None = None,
) -> ParallelModel:
    """Split `model` into pipeline stages, keep this rank's, and return a ParallelModel.

    Args:
        model: the whole model, on the meta device (materialized here, then `init_weights()`
            if the model has it; a Hugging Face model: its own `_init_weights` per module, seeded
            by the module's name) or on CPU (its values are kept). One of three kinds
            (docs/model_protocol.md): the mesh3d protocol (repeated blocks in an nn.ModuleDict
            `layers`), a Hugging Face causal LM as transformers builds it (split as its config's
            `base_model_pp_plan` says, tensor-parallel by its `base_model_tp_plan`), an
            nn.Sequential (its children are the blocks), or any other module torch.export
            captures, given `example_inputs` (traced: torch's pipeline frontend cuts it, stage
            boundaries may carry several tensors, skip connections go straight to their stage).
        layout: from `build_mesh`; or give pp=/dp=/tp=/cp=/ep= and the mesh is built here. With
            cp > 1 each sequence is cut over the cp ranks (docs/parallelize.md#context-parallelism):
            the model must take `position_ids` and attend through F.scaled_dot_product_attention.
            With ep > 1 each block's experts are split over ep ranks and tokens dispatched to them
            all-to-all (docs/parallelize.md#expert-parallelism): a Hugging Face mixture of experts
            whose config declares its experts (base_model_ep_plan).
        schedule: the pipeline schedule (docs/pipeline.md#schedules), with its default
            virtual_stages and the microbatch counts it runs:
            "gpipe": virtual_stages 1; microbatches any count.
            "1f1b": virtual_stages 1; microbatches at least pp.
            "interleaved_1f1b" (default): virtual_stages 2 when pp > 1 and the model has at
                least 2*pp layers, else 1; microbatches at least pp.
            "zero_bubble" (ZB-H1; interleaved zero bubble with virtual_stages > 1):
                virtual_stages 1; microbatches at least pp.
            "zbv": virtual_stages 2 (the only value it takes); microbatches at least pp.
            "dualpipev" (DeepSeek's DualPipeV, torch's ScheduleDualPipeV order): virtual_stages 2
                (the only value it takes); microbatches at least 2*pp.
            "pipedream" (never drains; each microbatch an update of its own, weight stashing):
                virtual_stages 1; microbatches at least pp.
            "pipedream_2bw" (never drains; one update per batch, two weight versions):
                virtual_stages 1; microbatches at least pp.
            The never-drain schedules need `optimizer=` (docs/pipeline.md#never-drain-schedules).
        microbatches: microbatches per step; default pp. A schedule may need more (dualpipev: 2*pp).
        virtual_stages: stages per pp rank; default per schedule, as listed under `schedule`.
        loss_fn: loss_fn(output, target) -> a microbatch's 0-dim mean loss (the step averages the
            microbatch means), or a pair (loss_sum, count) (the step's loss is the sum of every
            loss_sum over the sum of every count, all microbatches and dp ranks: exact with masked
            targets; the count must depend on the target only). Default: next-token cross-entropy
            as such a pair, positions whose target is -100 not counted (docs/numerics.md).
        fused_loss: run the output head and that default loss together, a chunk of rows at a
            time, so a microbatch's logits never exist whole (model/fused_head_loss.py): the
            same loss and gradients, less memory. Needs the default loss, tp = 1, and a head
            named `output` (the mesh3d protocol) or `lm_head` (transformers' Llama, Mistral,
            Mixtral, Qwen2/3 and Qwen3-MoE); refused otherwise.
        activation_checkpoint: "never" (default), "always", "except_last" (the last microbatch of
            each step keeps its activations instead of recomputing them), or "selective" (every
            microbatch keeps its matmul and attention outputs and recomputes the cheap ops between
            them: pipeline/activation_checkpoint.py). Each block is checkpointed on its own (the
            ends are not), or, under a split-backward schedule, each stage whole (docs/pipeline.md).
        layers_per_stage: explicit layer counts, one per stage (pp * virtual_stages, in stage order);
            the first and the last may be 0, a stage of the embedding, or of the output layer and
            loss, alone (a traced model's stages each need a block).
        stage_balance: "layers" (each layer costs 1) or "params" (each layer costs its parameter
            count), used when layers_per_stage is not given.
        end_weight: with stage_balance="layers", the embedding and the output head each count as
            this many layers (so the first and last stages may get fewer blocks).
        dp_mode: "fsdp" (default: FSDP2 `fully_shard` per block and per stage over the dp axis),
            "hsdp" (FSDP2 within groups of `dp_shard` consecutive dp ranks, replicas across the
            groups: one node's ranks shard, the nodes replicate) or "ddp" (full replicas, one
            gradient all-reduce per stage per step). Unused when dp == 1.
        dp_shard: with dp_mode="hsdp", the dp ranks of a sharding group (dividing dp; with cp > 1
            each group's cp ranks shard with it). Only with "hsdp".
        tp_plan: {module-name pattern (fnmatch over the unsplit model's names): ParallelStyle};
            default the model's `tp_plan` attribute. Unused when tp == 1.
        reshard_after_forward: FSDP and HSDP only: free gathered parameters after each forward (and gather
            again for backward). Default False when pp > 1 (microbatches reuse them), else True.
        loss_parallel: keep the logits vocab-sharded and compute the loss under torch's
            loss_parallel(); the tp plan must leave the output head's result a DTensor sharded on
            its last dim. Unused when tp == 1.
        param_dtype: the compute dtype (e.g. torch.bfloat16); None computes in the model's dtype.
            Parameters, what the optimizer updates and checkpoints hold, stay fp32; the loss is
            computed in fp32; stage-boundary activations and their gradients travel in param_dtype.
            Every layout, dp = 1 and DDP included, uses torch's FSDP2 MixedPrecisionPolicy.
        reduce_dtype: the dtype gradients are accumulated and reduced over dp in (default fp32).
        compile: torch.compile each block of `layers` (True: inductor; or a backend name such as
            "aot_eager"); composes with tensor and data parallelism, activation checkpointing and
            tied weights, and keeps parameter names.
        split_points: the names of the blocks where stages 1, 2, ... begin (PiPPy's
            SplitPoint.BEGINNING), e.g. ["model.layers.4"]; instead of layers_per_stage.
        example_inputs: `(one_microbatch,)`, what a traced model is captured with (on meta); the
            shape `step` will see, as the graph may bake shapes in. A model whose forward takes
            per-sample inputs by keyword names them: `(tokens, {"mask": mask})`, each then passed
            to `step` by that name. Unused for the other kinds.
            Without `split_points`, a traced model's stages begin between the children of its
            longest nn.Sequential / nn.ModuleList / nn.ModuleDict.
        optimizer: a callable taking this rank's parameters and returning a torch optimizer, e.g.
            functools.partial(torch.optim.AdamW, lr=3e-4); the result is `pm.optimizer`.
            Required by the never-drain schedules, whose updates happen inside the pipeline;
            with any other schedule `pm.step` then also steps and zeroes it (so there is no
            moment to clip the gradients: to clip, leave it out and step your own optimizer).
        seed: seeds the initialization of a model given on meta: `init_weights(seed=seed)` when
            the model's init_weights takes a seed (a model that seeds by parameter name then gets
            the same weights under every layout), and the global RNG per stage; a Hugging Face
            model's modules are each seeded by (seed, module name), so every layout gets the same
            weights. None: the model's default (Hugging Face: torch.initial_seed()). Unused for a
            model given with values.
        float8: train the blocks' linear layers in float8 through torchao (`pip install
            "mesh3d[float8]"`; docs/parallelize.md#float8): None (default, off), "tensorwise" (one
            scale per tensor; FSDP then gathers the weights in float8, and tp uses torchao's float8
            styles) or "rowwise" (one scale per row; tp = 1 only). Converted: each nn.Linear inside
            the repeated blocks whose in and out features are multiples of 16 (under tp, those the
            plan shards with a plain ColwiseParallel or RowwiseParallel); never the embedding or the
            output head. Refused by name with a traced model or ep > 1.
    """
    with raised_alike():
        anatomy = anatomy_of(model, example_inputs, split_points)  # which way the model came in, before any collective
    layout = layout_or_mesh(layout, pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
    with raised_alike():  # arithmetic on the keywords, alike on every rank: printed once
        precision = MixedPrecision.resolve(model, param_dtype, reduce_dtype)
        replicas = layout.data_parallel_size  # dp x cp: context-parallel ranks hold the same parameters
        data = DataParallelConfig.resolve(
            dp_mode, reshard_after_forward, layout.pp, replicas, precision, dp_shard, layout.dp
        )
        compile_backend = resolve_compile(compile)
        tensor = TensorParallelConfig.resolve(
            model,
            layout.tp,
            tp_plan if tp_plan is not None else anatomy.tp_plan,
            loss_parallel,
            anatomy.tensor_parallel_sizes,
            refusal=anatomy.tp_plan_refusal,
        )
        experts, tensor = resolve_expert_parallel(anatomy.expert_plan, anatomy.expert_plan_refusal, layout, tensor)
        pipe = PipelineConfig.resolve(
            model,
            anatomy,
            layout.pp,
            schedule=schedule,
            microbatches=microbatches,
            virtual_stages=virtual_stages,
            activation_checkpoint=activation_checkpoint,
            layers_per_stage=layers_per_stage,
            stage_balance=stage_balance,
            end_weight=end_weight,
            split_points=split_points,
        )
        check_optimizer(pipe, optimizer)
        check_fused_loss(fused_loss, model, loss_fn, layout.tp, pipe.traced is not None)
        low_precision = Float8Config.resolve(
            float8,
            model,
            anatomy,
            tensor.plan,
            tp=layout.tp,
            ep=layout.ep,
            shards_weights=data.mode in SHARDING_MODES and (data.wraps(replicas) or pipe.never_drains),
            never_drains=pipe.never_drains,
            traced=pipe.traced is not None,
        )
        tensor = dataclasses.replace(tensor, plan=low_precision.tp_plan)  # converted linears: float8 styles
    _check_same_config_everywhere(
        f"{pipe} {data} {tensor} ep={layout.ep} compile={compile_backend} fused_loss={fused_loss} {low_precision}"
    )

    split = split_model(model, anatomy, pipe.stage_layers, pipe.schedule.local_stages(layout.pp_rank), pipe.traced)
    takes = [stage_input_names(stage) for stage in split.meta_stages]
    check_context_parallel(model, layout.cp, anatomy, pipe, split, takes)
    stages = split.stages if split.from_meta else to_device(split.stages, layout.device)
    ties = find_ties(model)
    tie_holders = pipe.tie_holders(ties, split.meta_stages)
    state = StateMap.from_stages(layout, split.meta_model, split.meta_stages, pipe.schedule.stage_rank, ties, stages)
    tied = TiedWeights(ties, split.meta_stages, pipe.schedule.stage_rank, layout, stages)
    tied.tie_locally()
    if fused_loss and pipe.schedule.n_stages - 1 in stages:
        fuse_head(stages[pipe.schedule.n_stages - 1])
    low_precision.convert([*split.meta_stages, *stages.values()])  # before tp, compile and FSDP wrap them
    if not split.from_meta:
        make_replicas_identical(stages, layout)  # values given: sharding starts from the first rank's
    if experts is not None:
        apply_expert_parallel(stages, experts, layout)
    if tensor.plan:
        shard_stages(split, stages, tied, tensor, layout, anatomy, pipe, takes, example_inputs)
    if compile_backend is not None:
        compile_blocks(stages.values(), anatomy, compile_backend, split_backward=pipe.schedule.splits_backward)
    grad_sync = None
    # never-drain: versions are swapped through FSDP (weight_versions.py); split experts: FSDP over their replicas
    if data.wraps(replicas) or pipe.never_drains or experts is not None:
        tied.separate_stages()  # each stage is its own FSDP/DDP root: no Parameter shared by two
        grad_sync = apply_data_parallel(stages, layout, data, anatomy.blocks)
    if split.from_meta:
        initialize_shards(stages, layout, seed, anatomy)
        warn_if_reset_parameters(anatomy.name, split.meta_stages, anatomy.init_stage is not None)
    tied.sync_values()
    built_optimizer = build_optimizer(optimizer, stages) if optimizer is not None else None
    stream = pipe.never_drain_stream(tie_holders)
    versions = None
    if stream is not None:
        versions = WeightVersions(stages, stream.rule, built_optimizer, tied_copies(tied, stages, tie_holders))

    lists = [pipe.training.actions, pipe.evaluation.actions]  # every message's channel, each one made here
    if stream is not None:
        lists += [[sum(calls, ()) for calls in lowering.segments] for lowering in (stream.alone, stream.pair)]
    peers = pipeline_peers(layout, *lists)
    runtime = PipelineRuntime(
        stages,
        precision.computed(split.meta_stages),
        pipe.training,
        pipe.evaluation,
        peers,
        pipe.activation_checkpoint,
        before_backward=grad_sync.before_backward if grad_sync is not None else None,
        after_weight_backward=grad_sync.after_weight_backward if grad_sync is not None else None,
        fake_shape_run=anatomy.fake_shape_run,
        routes=pipe.routes,
        blocks=anatomy.blocks,
        stream=stream,
        versions=versions,
    )
    has_last_stage = pipe.schedule.n_stages - 1 in stages
    loss = GlobalLoss(
        layout,
        fused_cross_entropy if fused_loss else loss_fn or cross_entropy_loss,
        loss_context(tensor.loss_parallel),
        pipe.schedule.microbatches,
        has_last_stage,
        per_microbatch=pipe.loss_per_microbatch,
        router_aux=anatomy.router_aux,
    )
    return ParallelModel(
        layout,
        runtime,
        loss,
        tied,
        state,
        pipe.stage_layers,
        tensor,
        grad_sync,
        declared_vocab_size(anatomy.vocab_size),
        built_optimizer,
        anatomy.input_index_bounds,
        SequenceShards(
            layout,
            pipe.schedule.microbatches,
            any(POSITIONS in names for names in takes),
            anatomy.cp_mask_input if any(anatomy.cp_mask_input in names for names in takes) else None,
        ),
        expert_load_of(anatomy, split, stages, layout),
        before_step=(lambda: precompute_scales(stages.values())) if low_precision.precompute else None,
    )


def _check_same_config_everywhere(config: str) -> None:
    """Ranks with different schedules or splits would send mismatched messages and hang."""
    check_same_everywhere(
        config,
        lambda everyone: (
            f"parallelize: ranks were given different pipeline configurations (this rank: {config}); "
            "pass the same schedule, microbatches, virtual_stages, activation_checkpoint and split on every rank"
        ),
    )
