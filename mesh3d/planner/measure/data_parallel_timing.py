"""What FSDP2 (or DDP, its `replicate`) adds to a block's compute on this machine, timed.

On a measured machine (`Hardware.times_the_model`, "this-machine") the planner times the model's
parts (part_timing.py); data parallelism then adds more than its bytes on the wire: FSDP2's hooks
around every wrapped module, the copies into and out of its flat buffers at each gather and
reduce-scatter, the gradient accumulation of unreduced backwards. A memory-bound estimate of the
copies missed most of it on a CPU (docs/performance.md). So the block is wrapped as mesh3d wraps it
(data_parallel/wrap.py), over torch's fake process group of dp ranks (whose collectives move
nothing: the planner adds their bytes and latency itself), and timed against the plain block.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from mesh3d.model.anatomy import Anatomy
from mesh3d.planner import constants as C
from mesh3d.planner.measure.measured_stages import MeasuredStages, StageFlow, measured_stages, token_ids
from mesh3d.planner.measure.probe import _computed


@dataclass(frozen=True)
class DataParallelOverhead:
    """Seconds data parallelism adds to one block's microbatch (forward and backward), on top of
    its compute, for `elements` unsharded parameter elements (the planner scales by a rank's)."""

    elements: int
    regathered: float  # a microbatch whose forward and backward each gather again (reshard after forward)
    gathered: float  # a microbatch with the parameters kept gathered (pp > 1), gradients unreduced
    reduced: float  # what the backward that reduces the gradients adds


@contextlib.contextmanager
def fake_mesh(dp: int, tp: int) -> Iterator[object]:
    """A (dp, tp) DeviceMesh over torch's fake process group (this process is rank 0, no message
    moves); it needs a process without a process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp * tp)
    try:
        yield init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    finally:
        dist.destroy_process_group()


def time_data_parallel(
    model: nn.Module,
    anatomy: Anatomy,
    *,
    dp: int,
    dp_mode: str,
    tp: int,
    tp_plan: dict | None,
    microbatch_size: int,
    seq_len: int,
    param_dtype: torch.dtype | None,
) -> DataParallelOverhead | None:
    """The overhead of wrapping a block for `dp` ranks in `dp_mode`; None where it cannot be timed
    here (this process already has a process group: the planner then estimates the copies)."""
    if dp == 1 or tp > 1 or dist.is_initialized():  # with tp, sequence parallel shards the block's input
        return None
    from mesh3d.data_parallel.mixed_precision import MixedPrecision
    from mesh3d.model.initialize import initialize
    from mesh3d.tensor.apply import apply_tensor_parallel

    on_meta = measured_stages(model, anatomy, microbatch_size, seq_len)
    flow = _flow_to_the_middle(on_meta, microbatch_size, seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with fake_mesh(dp, tp) as mesh:

            def block_stage() -> nn.Module:
                stage = copy.deepcopy(on_meta.stages["middle"])
                stage.to_empty(device="cpu")
                initialize(stage, 1, torch.device("cpu"), 0, anatomy.init_stage)
                if tp > 1:
                    apply_tensor_parallel([stage], tp_plan, mesh["tp"])
                return stage

            plain = block_stage()
            elements = sum(p.numel() for p in plain.parameters()) * tp
            precision = MixedPrecision(param_dtype, torch.float32)
            x = torch.randn(flow.input("middle").shape)
            base = _timed(plain, flow.called("middle", plain), x, param_dtype)
            runs = {}
            for reshard in (True, False):
                wrapped = block_stage()
                _wrap(wrapped, anatomy, mesh["dp"], dp_mode, reshard, precision)
                runs[reshard] = _timed(wrapped, flow.called("middle", wrapped), x, None, wrapped=True)
    finally:
        torch.set_num_threads(threads)
    regathered = max(0.0, runs[True]["unreduced"] - base["unreduced"])
    gathered = max(0.0, runs[False]["unreduced"] - base["unreduced"])
    reduced = max(0.0, runs[True]["reduced"] - runs[True]["unreduced"])
    return DataParallelOverhead(elements, regathered, gathered, reduced)


def _flow_to_the_middle(measured: MeasuredStages, batch: int, seq_len: int) -> StageFlow:
    """The walk of the stages on meta up to the middle one, whose input is then known: what the
    first stage hands a block for `batch` x `seq_len` token ids (its shape, how it divides)."""
    flow = StageFlow(measured, token_ids(batch, seq_len))
    first, tokens = flow.stage_and_input("first")
    flow.hand_on("first", first(tokens))
    flow.input("middle")
    return flow


def _wrap(stage: nn.Module, anatomy: Anatomy, mesh, dp_mode: str, reshard: bool, precision) -> None:
    from torch.distributed.fsdp import fully_shard

    if dp_mode == "fsdp":
        wrap = functools.partial(fully_shard, mesh=mesh, reshard_after_forward=reshard)
    else:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        wrap = functools.partial(replicate, mesh=mesh)
    for block in anatomy.blocks(stage):
        wrap(block, mp_policy=precision.policy(root=False))
    wrap(stage, mp_policy=precision.policy(root=True))


def _timed(stage: nn.Module, call: nn.Module, x: torch.Tensor, param_dtype, wrapped: bool = False) -> dict[str, float]:
    """Best seconds of a forward and backward with gradients left unreduced, and with them reduced;
    `call`: the stage as the runtime calls it (measured_stages.py)."""
    if not wrapped:
        stage = _computed(stage, param_dtype)
    flush = torch.empty(C.CACHE_FLUSH_BYTES // 4)
    best = {"unreduced": float("inf"), "reduced": float("inf")}
    for repeat in range(C.TIMING_REPEATS + 1):
        for kind in ("unreduced", "reduced"):
            if wrapped:
                stage.set_requires_gradient_sync(kind == "reduced")
                stage.set_is_last_backward(kind == "reduced")
            flush.zero_()
            inp = x.detach().requires_grad_(True)
            start = time.perf_counter()
            out = call(inp)
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.backward(out, torch.ones_like(out))
            seconds = time.perf_counter() - start
            stage.zero_grad(set_to_none=True)
            if repeat:
                best[kind] = min(best[kind], seconds)
    return best
