"""What one stage of a model costs, measured on fake tensors: parameters, saved activations, FLOPs,
tensor-parallel traffic and the message it sends on, per microbatch, as one tp rank holds them.

Nothing is estimated from a formula per architecture: the planner cuts three small stages from the
model on meta as mesh3d would (measured_stages.py; first: the first end and one block; middle: one
block; last: one block, the last end and the loss), applies the model's own tensor-parallel plan
with torch's DTensor styles over a fake process group of tp ranks (torch's "fake" backend:
collectives that move nothing), and runs each forward and backward under FakeTensorMode on
CPU-device fake tensors, so attention takes the fused path that saves its output and
log-sum-exp, as on a GPU. What runs is counted with torch's own meters (meters.py):

- saved activations: autograd's saved-tensor hooks (the bytes a rank keeps for the backward), with
  the stage run plain and under a whole-stage checkpoint (what the runtime does for "always");
- what "selective" caches: the results of the policy's ops (pipeline/activation_checkpoint.py),
  counted by a dispatch mode as they are computed;
- FLOPs: FlopCounterMode (the local shards' matmuls, recomputation not counted);
- tensor-parallel traffic: the bytes of every functional collective DTensor issues;
- under context parallelism (cp > 1): the stages run on one cp rank's seq_len / cp tokens, each
  attention call answered over the whole sequence as mesh3d answers it (context_parallel.py), which
  also records the K/V exchange.

The middle stage is a block; first minus middle and last minus middle are the two ends. A model's
blocks must be alike (they are in every decoder the planner knows: checked by shape).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from mesh3d.model.anatomy import Anatomy
from mesh3d.model.fused_head_loss import fuse_head, head_targets
from mesh3d.model.loss import cross_entropy_loss
from mesh3d.pipeline.activation_checkpoint import SAVED_OPS
from mesh3d.pipeline.shape_ops import ShapeRunOps
from mesh3d.planner.measure.context_parallel import GatheredAttentionShapes
from mesh3d.planner.measure.costs import AttentionExchange, ModelCosts, PartCosts
from mesh3d.planner.measure.measured_stages import KINDS, MeasuredStages, StageFlow, measured_stages, planner_anatomy
from mesh3d.planner.measure.meters import (
    CPU_ATTENTION_FLOPS,
    CollectiveBytes,
    KernelsAsOnAGPU,
    ResultsOf,
    SavedBytesMeter,
    ScoreMatrixBytes,
    local_shard,
)


@contextlib.contextmanager
def fake_tp_mesh(tp: int) -> Iterator[object]:
    """A one-dimensional DeviceMesh of `tp` ranks over torch's fake process group (this process is
    rank 0 and no message moves); None for tp = 1. Needs no process group to exist already."""
    if tp == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError(
            f"plan: measuring tp={tp} runs tensor parallelism over a fake process group, which needs a process "
            "without one; call mesh3d.plan before build_mesh (or in a process of its own), or fix tp=1"
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def measure_model_anywhere(
    model: nn.Module, anatomy: Anatomy, split_points: Sequence[str] | None = None, **sizes
) -> ModelCosts:
    """`measure_model`, in a process of its own when this one already has a process group: the
    fake group of tp > 1 ranks cannot be made beside it (under torchrun after build_mesh, or in a
    test process that built a mesh). The model goes there on meta, pickled, with the `split_points`
    its anatomy was found with; a few seconds more."""
    if sizes["tp"] == 1 or not dist.is_initialized():
        return measure_model(model, anatomy, **sizes)
    import concurrent.futures
    import multiprocessing

    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_measure_in_a_process, model, split_points, sizes).result()


def _measure_in_a_process(model: nn.Module, split_points: Sequence[str] | None, sizes: dict) -> ModelCosts:
    return measure_model(model, planner_anatomy(model, sizes["seq_len"], split_points), **sizes)


def measure_model(
    model: nn.Module,
    anatomy: Anatomy,
    *,
    tp: int,
    tp_plan: dict | None,
    microbatch_size: int,
    seq_len: int,
    param_dtype: torch.dtype | None,
    cp: int = 1,
    fused_loss: bool = False,
) -> ModelCosts:
    """Measure a block and the two ends of `model` (on meta) at `tp` and `cp`; see the module docstring.
    `seq_len` is the whole sequence's: a cp rank runs seq_len // cp of its tokens. `fused_loss`: the
    last stage's head computes the loss as parallelize(fused_loss=True) makes it (no whole logits
    kept; its backward runs the head's forward again, which the costs' `recomputed_flops` holds)."""
    from mesh3d.tensor.apply import apply_tensor_parallel

    n_blocks = len(anatomy.block_names(model))
    if n_blocks < 3:
        raise ValueError(f"plan: {anatomy.name} has {n_blocks} blocks; the planner measures a model with at least 3")
    seq_len //= cp  # the rank's tokens of each sequence
    measured = measured_stages(model, anatomy, microbatch_size, seq_len)
    stages = measured.stages
    if fused_loss:
        fuse_head(stages["last"])
    with fake_tp_mesh(tp) as mesh:
        if mesh is not None:
            if not tp_plan:
                raise ValueError(f"plan: tp={tp} needs a tensor-parallel plan, and {anatomy.name} declares none")
            apply_tensor_parallel(stages.values(), tp_plan, mesh)
        attention = GatheredAttentionShapes(cp) if cp > 1 else None
        # ShapeRunOps: grouped-mm experts, expert loops; KernelsAsOnAGPU: a GPU's attention and dropout
        with (
            FakeTensorMode(allow_non_fake_inputs=True),
            ShapeRunOps(),
            KernelsAsOnAGPU(),
            attention or contextlib.nullcontext(),
        ):
            results, message, checkpointed = _run_chain(measured, tp, microbatch_size, seq_len, param_dtype, attention)
    block = results["middle"]
    first = results["first"].minus(block, *_end_params(stages["first"], stages["middle"]))
    last = results["last"].minus(block, *_end_params(stages["last"], stages["middle"]))
    dtype = param_dtype or torch.float32
    # fused: the end's forward FLOPs are its head's (a norm and the loss count none), run again in backward
    recomputed = last.forward_flops if fused_loss else 0.0
    return ModelCosts(
        tp, microbatch_size, seq_len, dtype, block, first, last, message, checkpointed, cp, recomputed_flops=recomputed
    )


def _end_params(stage: nn.Module, middle: nn.Module) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """A stage's parameters that are not its block's (matched by shape, the block being alike)."""
    block = sorted(tuple(local_shard(p).shape) for p in middle.parameters())
    names, shapes = [], []
    remaining = list(block)
    for name, param in stage.named_parameters():
        shape = tuple(local_shard(param).shape)
        if shape in remaining:
            remaining.remove(shape)
        else:
            names.append(name)
            shapes.append(shape)
    return tuple(names), tuple(shapes)


def _run_chain(
    measured: MeasuredStages,
    tp: int,
    batch: int,
    seq_len: int,
    param_dtype: torch.dtype | None,
    attention: GatheredAttentionShapes | None,
) -> tuple[dict[str, PartCosts], int, dict[str, int]]:
    """Each measured stage's costs, its input the stages before it handed on; and the middle
    stage's message (everything it sends on). `attention`: under cp, the active mode answering
    the attention calls; what it records of one forward is the stage's exchange."""
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    targets = torch.zeros(batch, seq_len, dtype=torch.long)
    for stage in measured.stages.values():
        _computed(stage.to_empty(device="cpu"), param_dtype)
    flow = StageFlow(measured, tokens)
    results: dict[str, PartCosts] = {}
    checkpointed = {}
    for kind in KINDS:
        stage, x = flow.stage_and_input(kind)
        is_last = kind == "last"
        saved = {
            "never": _saved_bytes(stage, x, targets if is_last else None, "never"),
            "selective": _selective_cache_bytes(stage, x),
        }
        checkpointed[kind] = _saved_bytes(stage, x, targets if is_last else None, "always")
        if attention is not None:
            attention.calls.clear()  # the calls of the one forward below
        # under cp the attention is mesh3d's gathered one (SDPA's kernels): no score matrix written out
        scores = ScoreMatrixBytes(batch, seq_len, seq_len) if attention is None else None
        flops, forward_flops, traffic, out = _flops_and_traffic(stage, x, targets if is_last else None, tp, scores)
        exchange = attention.exchange() if attention is not None else AttentionExchange()
        own = measured.stages[kind]
        params = tuple(local_shard(p).shape for p in own.parameters())
        names = tuple(n for n, _ in own.named_parameters())
        results[kind] = PartCosts(
            params,
            names,
            saved,
            flops,
            forward_flops,
            traffic.bytes,
            traffic.count,
            dict(traffic.by_kind),
            cp=exchange,
            score_bytes=scores.total if scores else 0,
            forward_score_bytes=scores.forward if scores else 0,
            tp_replicated_elements=sum(local_shard(p).numel() for p in own.parameters() if _tp_replicated(p)),
        )
        if not is_last:
            flow.hand_on(kind, out)
    return results, flow.sent_bytes("middle"), checkpointed


def _tp_replicated(param: torch.Tensor) -> bool:
    """A trainable parameter the tp plan made a DTensor without sharding it."""
    placements = getattr(param, "placements", None)
    return param.requires_grad and placements is not None and all(p.is_replicate() for p in placements)


def _computed(stage: nn.Module, param_dtype: torch.dtype | None) -> nn.Module:
    """The stage's parameters in the compute dtype, as FSDP's mixed-precision policy gathers them
    (in place: the stage is the probe's own copy)."""
    if param_dtype is None:
        return stage
    for module in stage.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point():
                module._parameters[name] = nn.Parameter(
                    param.detach().to(param_dtype), requires_grad=param.requires_grad
                )
    return stage


def _forward(stage: nn.Module, x: torch.Tensor, targets: torch.Tensor | None, mode: str) -> torch.Tensor:
    """The stage as the runtime runs it (pipeline/runtime.py): the loss outside the checkpoint."""

    def call(inp):
        with head_targets(targets):  # a fused head computes the loss (a checkpoint's rerun included)
            out = stage(inp)
        if isinstance(out, tuple) and getattr(stage, "router_aux", None) is not None:
            out = out[0]  # a router loss's few sums beside the activation (model/router_aux.py): not counted
        return getattr(out, "logits", out)

    if mode == "always":
        out = checkpoint(call, x, use_reentrant=False)
    else:
        out = call(x)
    return _forward_loss(out, targets)


def _input(x: torch.Tensor) -> torch.Tensor:
    return x.detach().requires_grad_(True) if x.is_floating_point() else x


def _selective_cache_bytes(stage, x) -> int:
    """What "selective" keeps of a stage's forward besides its input: the results of its matmuls
    and attention (the loss's graph is not kept; the forward is recomputed before the backward)."""
    counter = ResultsOf(SAVED_OPS)
    with torch.enable_grad(), counter:
        _forward(stage, _input(x), None, "never")
    return counter.total


def _saved_bytes(stage, x, targets, mode) -> int:
    meter = SavedBytesMeter()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
        _forward(stage, _input(x), targets, mode)
    return meter.peak


def _flops_and_traffic(
    stage, x, targets, tp: int, scores: ScoreMatrixBytes | None
) -> tuple[float, float, CollectiveBytes, torch.Tensor]:
    """FLOPs per tp rank: FlopCounterMode counts a DTensor op at its global shape, and every op it
    counts (matmuls, attention) is one the tensor-parallel plan shards over all tp ranks. `scores`,
    when given, counts the bytes through written-out score matrices (forward and backward)."""
    traffic = CollectiveBytes(tp)
    counter = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)
    inp = _input(x)
    with counter, traffic, scores or contextlib.nullcontext():
        out = loss = _forward(stage, inp, targets, "never")  # the last stage's loss included
        forward = counter.get_total_flops()
        if scores is not None:
            scores.forward = scores.total
        grad_out = None if targets is not None else torch.ones_like(loss)
        torch.autograd.backward(loss, grad_out)  # .grad of fake parameters: no memory
    return counter.get_total_flops() / tp, forward / tp, traffic, out


def _forward_loss(out: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """The last stage's loss (mesh3d's default), as a tensor to backpropagate; `out` unchanged elsewhere."""
    if targets is None or out.dim() == 0:  # no loss here, or a fused head's (fused_head_loss.py)
        return out
    value = cross_entropy_loss(local_shard(out), targets)
    return value[0] if isinstance(value, tuple) else value
