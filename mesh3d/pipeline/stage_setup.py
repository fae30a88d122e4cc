"""What parallelize does to the stages once the model is split (split.py): every stage on meta and
this rank's for real. Context parallelism's check runs the meta stages; tensor parallelism shards
the meta stages and this rank's alike, so boundary shapes are the local shards'; a model given on
meta gets its shards filled with the one-process values; the experts' load is counted per stage.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mesh3d.context_parallel.model_check import POSITIONS, check_blocks_attend, check_kind
from mesh3d.expert_parallel.expert_load import ExpertLoad
from mesh3d.mesh import Layout
from mesh3d.model.anatomy import Anatomy
from mesh3d.model.initialize import agree_on_seed, allocate, initialize
from mesh3d.pipeline.boundary import BoundaryShapes
from mesh3d.pipeline.config import PipelineConfig
from mesh3d.pipeline.split import Split
from mesh3d.pipeline.tied import TiedWeights
from mesh3d.tensor.apply import apply_tensor_parallel
from mesh3d.tensor.partial_gradients import modules_seeing_shards, replicate_on_shards
from mesh3d.tensor.plan import TensorParallelConfig


def check_context_parallel(
    model: nn.Module, cp: int, anatomy: Anatomy, pipe: PipelineConfig, split: Split, takes: list[frozenset[str]]
) -> None:
    """At cp > 1, a model that cannot be cut along the sequence is refused by name, on every rank
    alike (the meta stages run here, counting each block's attention calls; no message)."""
    check_kind(cp, pipe.traced, takes, model, anatomy.cp_refusal)
    if cp == 1:
        return
    names = {id(module): name for stage in split.meta_stages for name, module in stage.named_modules()}
    blocks = [(names[id(block)], block) for stage in split.meta_stages for block in anatomy.blocks(stage)]
    length = 2 * cp
    sample = torch.zeros(1, length, dtype=torch.long)
    positions = {POSITIONS: torch.arange(length).unsqueeze(0)}
    shapes = BoundaryShapes(split.meta_stages, anatomy.fake_shape_run, pipe.routes, takes)
    check_blocks_attend(blocks, lambda: shapes.of(sample, positions), model, cp)


def shard_stages(
    split: Split,
    stages: dict[int, nn.Module],
    tied: TiedWeights,
    tensor: TensorParallelConfig,
    layout: Layout,
    anatomy: Anatomy,
    pipe: PipelineConfig,
    takes: list[frozenset[str]],
    example_inputs: tuple | None,
) -> None:
    """The same plan on the meta stages (boundary shapes become local shapes) and on this rank's;
    then the modules the plan leaves replicated but feeds a slice (tensor/partial_gradients.py),
    found by running the meta stages on a microbatch (when its shape is known) before and after."""
    # a microbatch: the traced model's own, token ids for a model that declares a vocabulary (tp of
    # them: sequence parallelism splits the sequence over tp, and a model's max length is at least that)
    ids = torch.zeros(1, layout.tp, dtype=torch.long) if anatomy.vocab_size is not None else None
    sample = example_inputs[0] if pipe.traced else ids
    named = anatomy.traced.per_sample if pipe.traced else {}  # a traced model's other inputs, by keyword
    fresh = functools.partial(BoundaryShapes, split.meta_stages, anatomy.fake_shape_run, pipe.routes, takes)
    run = None if sample is None else lambda: fresh().of(sample, named)  # noqa: E731  (uncached)
    tp_mesh = layout.mesh["tp"]
    shard = functools.partial(apply_tensor_parallel, split.meta_stages, tensor.plan, tp_mesh)
    seeing = modules_seeing_shards(split.meta_stages, shard, run) if run is not None else shard() or []
    replicate_on_shards(split.meta_stages, seeing, tp_mesh)
    tied.check_sharded_alike(split.meta_stages)
    apply_tensor_parallel(stages.values(), tensor.plan, tp_mesh)
    replicate_on_shards(stages.values(), seeing, tp_mesh)


def initialize_shards(stages: dict[int, nn.Module], layout: Layout, seed: int | None, anatomy: Anatomy) -> None:
    """A model given on meta, sharded on meta: each rank allocates its shards only and fills them
    with the values one process would initialize (model/full_view.py)."""
    base_seed = agree_on_seed(seed, layout.device)
    allocate(stages, layout.device)
    for index, stage in stages.items():
        initialize(stage, index, layout.device, seed, anatomy.init_stage, base_seed=base_seed)


def expert_load_of(anatomy: Anatomy, split: Split, stages: dict[int, nn.Module], layout: Layout) -> ExpertLoad | None:
    """Per-expert token counts for a model whose experts modules are declared (at any ep)."""
    if anatomy.expert_plan is None:
        return None
    return ExpertLoad(anatomy.expert_plan, [name for name, _ in split.meta_model.named_modules()], stages, layout)
