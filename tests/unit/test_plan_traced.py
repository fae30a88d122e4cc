"""mesh3d.plan of a traced model (model/traced/): captured with token ids, measured on the stages
torch's pipeline frontend cuts, its skip connections routed as the runtime routes them.

SkipModel (tests/sequential_cases.py: an embedding, 8 residual blocks in an nn.ModuleList, a head,
tanh of the embedding added after the last block) holds the same block as token_model, an
nn.Sequential the planner cuts: the probe must measure that block alike either way, and as an
independent count says (its parameters, FlopCounterMode on the block alone). Its skip goes from
the first stage to the last, past the middle one; EveryBlockToTheHead's blocks each send their
output to the head too, so the middle stage sends its output on twice.
"""

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from pipeline_cases import TOLERANCE, relative
from sequential_cases import BLOCK_TP_PLAN, DIM, VOCAB, Residual, SkipModel, token_model
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import mesh3d
from mesh3d.model.intake import anatomy_of
from mesh3d.model.meta_copy import meta_copy
from mesh3d.planner.measure.data_parallel_timing import time_data_parallel
from mesh3d.planner.measure.measured_stages import planner_anatomy, token_ids
from mesh3d.planner.measure.probe import measure_model

SEQ = 16
SIZES = dict(gpus=4, gpus_per_node=4, hardware="h100", seq_len=SEQ, global_batch=8)


class EveryBlockToTheHead(nn.Module):
    """An embedding, 6 residual blocks, a head reading the sum of every block's output: each
    block's output goes to the next block and, past the stages between, to the last."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Residual() for _ in range(6)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, total = self.emb(ids), 0
        for block in self.blocks:
            h = block(h)
            total = total + h
        return self.head(total)


class BranchesOnValues(nn.Module):
    """Branches on a value: torch.export cannot capture it as one graph."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Residual() for _ in range(4)])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
            if h.sum() > 0:
                h = -h
        return h


def measured(model: nn.Module, tp: int = 1, microbatch_size: int = 2):
    meta = meta_copy(model)
    return measure_model(
        meta,
        planner_anatomy(meta, SEQ),
        tp=tp,
        tp_plan=BLOCK_TP_PLAN,
        microbatch_size=microbatch_size,
        seq_len=SEQ,
        param_dtype=None,
    )


def test_a_traced_model_is_planned_and_its_block_measured_as_the_same_block_cut_from_a_sequential():
    plans = mesh3d.plan(meta_copy(SkipModel(tied=False)), **SIZES, tp_plan=BLOCK_TP_PLAN, tie_band=0)
    speeds = [p.tokens_per_second_per_gpu for p in plans]
    assert len(plans) > 10 and speeds == sorted(speeds, reverse=True)
    assert {p.tp for p in plans} == {1, 2, 4} and {p.pp for p in plans} == {1, 2, 4}
    for tp in (1, 2):
        traced, cut = measured(SkipModel(tied=False), tp), measured(token_model(tied=False), tp)
        assert replace(traced.block, param_names=()) == replace(cut.block, param_names=())  # their names differ
        assert traced.checkpointed_stage["middle"] == cut.checkpointed_stage["middle"]
    # independently: the block's own parameters, and FlopCounterMode on the block alone
    block, x = Residual(), torch.randn(2, SEQ, DIM, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        block(x).sum().backward()
    costs = measured(SkipModel(tied=False))
    assert sum(torch.Size(s).numel() for s in costs.block.param_shapes) == sum(p.numel() for p in block.parameters())
    assert costs.block.flops == counter.get_total_flops()
    # what the block keeps for its backward: its input (the up projection's), tanh's output (also down's input)
    assert costs.block.saved["never"] == 2 * SEQ * (DIM + 2 * DIM) * 4


def test_the_middle_stage_message_counts_every_tensor_it_sends_on():
    one_message = 2 * SEQ * DIM * 4  # a microbatch of 2, fp32
    assert measured(token_model(tied=False)).message_bytes == one_message
    assert measured(SkipModel(tied=False)).message_bytes == one_message  # the skip goes from the first stage
    assert measured(EveryBlockToTheHead()).message_bytes == 2 * one_message  # to the next stage and the head


def test_plans_carry_the_example_inputs_and_parallelize_runs_them_on_the_same_model():
    """plan, then parallelize the very model planned (on meta) with the plan's kwargs: the capture
    at the plan's microbatch size; the step's loss is the one-process model's with the same values."""
    model = meta_copy(SkipModel(tied=False))
    slow = mesh3d.Hardware(
        "slow",
        peak_flops=1e12,
        memory_bytes=2**30,
        intra_node_bandwidth=1e9,
        inter_node_bandwidth=1e8,
        memory_bandwidth=1e10,
    )
    best = mesh3d.plan(
        model, gpus=1, hardware=slow, seq_len=SEQ, global_batch=4, fix={"microbatches": 2, "param_dtype": None}
    )[0]
    kwargs = best.parallelize_kwargs()
    (ids,) = kwargs["example_inputs"]
    assert ids.is_meta and ids.dtype == torch.long and tuple(ids.shape) == (2, SEQ) and "split_points" not in kwargs
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (torch.randint(0, VOCAB, (4, SEQ), generator=generator) for _ in range(2))
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        pm = mesh3d.parallelize(model, layout, **kwargs)
        got = pm.step(inputs, targets).item()
        state = pm.full_state_dict()
    finally:
        dist.destroy_process_group()
    reference = SkipModel(tied=False)
    reference.load_state_dict(state)
    want = nn.functional.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten()).item()
    assert relative(got, want) < TOLERANCE


def test_split_points_pick_the_stages_and_are_passed_on():
    plans = mesh3d.plan(
        meta_copy(SkipModel(tied=False)), **{**SIZES, "gpus": 2, "gpus_per_node": 2}, split_points=["blocks.3"]
    )
    assert plans and all(p.pp * p.virtual_stages == 2 for p in plans)
    assert all(p.parallelize_kwargs()["split_points"] == ["blocks.3"] for p in plans)
    with pytest.raises(ValueError, match=r"layers_per_stage\) makes 2 stages, so pp \* virtual_stages must be 2"):
        mesh3d.plan(meta_copy(SkipModel(tied=False)), **SIZES, split_points=["blocks.3"], fix={"pp": 4})


def test_a_model_torch_export_cannot_capture_is_refused_with_the_anatomys_error():
    with pytest.raises(ValueError) as anatomy:
        anatomy_of(meta_copy(BranchesOnValues()), (token_ids(1, SEQ),))
    with pytest.raises(ValueError) as planned:
        mesh3d.plan(meta_copy(BranchesOnValues()), **SIZES)
    assert str(planned.value) == str(anatomy.value)
    assert "torch.export cannot capture" in str(planned.value)


def test_a_traced_model_is_timed_on_this_machine():
    """Its parts timed at the plan's microbatch size (a capture of its own: 2 rows, the probe's 1),
    and data parallelism's wrapping of its middle stage, for FSDP and DDP."""
    plans = mesh3d.plan(
        meta_copy(SkipModel(tied=False)),
        gpus=2,
        gpus_per_node=2,
        hardware="this-machine",
        seq_len=SEQ,
        global_batch=4,
        fix={"pp": 1, "microbatches": 1, "param_dtype": None, "activation_checkpoint": "never"},
    )
    assert {(p.dp, p.microbatch_size) for p in plans} == {(2, 2)} and {p.dp_mode for p in plans} == {"fsdp", "ddp"}
    assert all(p.step_seconds > 0 and p.time.exposed_dp_seconds > 0 for p in plans)
    meta = meta_copy(SkipModel(tied=False))
    overhead = time_data_parallel(
        meta,
        planner_anatomy(meta, SEQ),
        dp=2,
        dp_mode="fsdp",
        tp=1,
        tp_plan=None,
        microbatch_size=2,
        seq_len=SEQ,
        param_dtype=None,
    )
    assert overhead.elements == sum(p.numel() for p in Residual().parameters()) and overhead.regathered > 0


@pytest.mark.parametrize("tp", [1, 2])
def test_the_stages_between_are_timed_on_meta_and_hand_on_inputs_of_their_shapes(tp, monkeypatch):
    """time_model materializes first, middle and last only; the last stage's inputs (its
    predecessor's output and the skip from the first stage) are real values of the shapes the
    whole walk on meta gives."""
    from mesh3d.planner.measure import measured_stages as M
    from mesh3d.planner.measure.part_timing import time_model

    meta = meta_copy(SkipModel(tied=False))
    anatomy = planner_anatomy(meta, SEQ)
    on_meta = M.measured_stages(meta, anatomy, 2, SEQ)
    flow = M.StageFlow(on_meta, token_ids(2, SEQ))
    for kind in ("first", "middle"):
        stage, x = flow.stage_and_input(kind)
        flow.hand_on(kind, stage(x))
    want = flow.input("last").shape

    inputs = {}
    original = M.StageFlow.input

    def recorded(self, kind):
        x = original(self, kind)
        inputs[kind] = x
        if kind == "last":
            inputs["filler on meta"] = M._on_meta(self.measured.stages["filler"])
        return x

    monkeypatch.setattr(M.StageFlow, "input", recorded)
    costs = measure_model(meta, anatomy, tp=tp, tp_plan=BLOCK_TP_PLAN, microbatch_size=1, seq_len=SEQ, param_dtype=None)
    timed = time_model(meta, anatomy, costs, tp_plan=BLOCK_TP_PLAN, microbatch_size=2, param_dtype=None)
    assert inputs["filler on meta"] and not inputs["last"].is_meta
    assert inputs["last"].shape == want
    assert timed.last_end.forward_seconds >= 0 and timed.block.forward_seconds > 0
