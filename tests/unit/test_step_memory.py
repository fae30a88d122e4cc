"""mesh3d.train.step_memory: a step's memory peak and its rise over the rank's baseline, what the
progress line and a metrics row say of it.

On the CPU (no process group: one rank) the peak is the process's resident-set peak, which a
step that allocates more than any before raises, and the rise is that peak less the one when the
StepMemory was made; the CUDA figures' columns and wording are checked on a MemoryPeak built with
them (the gathering over ranks: test_train_checkpoint.py)."""

import inspect
import resource
import types

import pytest
import torch

import mesh3d
from mesh3d.planner import predict_memory
from mesh3d.train import MemoryPeak, StepMemory
from mesh3d.train.step_memory import GIB


def _cpu_layout():
    return types.SimpleNamespace(device=torch.device("cpu"), pp_rank=0)


def test_the_cpu_peak_is_the_resident_peak_and_rises_with_a_bigger_step():
    memory = StepMemory(_cpu_layout())
    memory.begin()
    before = memory.gather()
    assert before.rank == 0 and before.reserved_bytes is None and before.device_share is None
    assert 0 < before.peak_bytes <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert before.baselines == (memory.baseline,) and before.rises == (before.peak_bytes - memory.baseline,)
    grown = torch.ones(before.peak_bytes // 4 + 64 * 1024**2 // 4)  # more than the whole peak so far
    memory.begin()
    after = memory.gather()
    assert after.peak_bytes >= before.peak_bytes + grown.numel() * 4 // 2
    assert after.rise_bytes == after.peak_bytes - memory.baseline >= grown.numel() * 4 // 2
    record = after.as_record()
    assert set(record) == {
        "memory_rise_gib",
        "memory_peak_gib",
        "memory_peak_rank",
        "memory_rise_gib_by_rank",
        "memory_baseline_gib_by_rank",
    }
    assert record["memory_peak_gib"] == pytest.approx(after.peak_bytes / GIB) and record["memory_peak_rank"] == 0
    assert record["memory_rise_gib_by_rank"] == [pytest.approx(after.rise_bytes / GIB)]


def test_what_the_line_and_the_row_say():
    # the rank that rose most is reported (rank 1 here, though rank 0 held more before the model)
    cpu = MemoryPeak(int(1.5 * GIB), 1, rises=(GIB // 4, GIB), baselines=(GIB, GIB // 2), pp_ranks=(0, 1))
    assert cpu.describe() == "mem +1.00 GiB (rank 1)"
    assert cpu.describe(planned_bytes=GIB // 2) == "mem +1.00 GiB (rank 1, planned 0.50 GiB)"
    assert cpu.as_record()["memory_rise_gib_by_rank"] == [0.25, 1.0]
    assert cpu.as_record()["memory_baseline_gib_by_rank"] == [1.0, 0.5]
    cuda = MemoryPeak(peak_bytes=12 * GIB, rank=5, reserved_bytes=14 * GIB, device_total_bytes=80 * GIB)
    assert cuda.describe() == "mem +12.00 GiB reserved 14.00 GiB 17.5% (rank 5)"
    assert cuda.as_record() == {
        "memory_rise_gib": 12.0,
        "memory_peak_gib": 12.0,
        "memory_peak_rank": 5,
        "memory_reserved_gib": 14.0,
        "memory_device_share": 0.175,
    }


def _debug_on_meta():
    from examples.llama.config import get_config
    from examples.llama.model import Transformer

    with torch.device("meta"):
        return Transformer(get_config("debug", max_seq_len=64))


def test_the_prediction_is_the_planners_for_the_layout_and_said_beside_the_peak():
    layout = types.SimpleNamespace(device=torch.device("cpu"), world_size=1, pp=1, dp=1, cp=1, tp=1, ep=1)
    prediction = predict_memory(_debug_on_meta(), layout, seq_len=64, global_batch=4, schedule="1f1b")
    defaults = inspect.signature(mesh3d.parallelize).parameters  # what parallelize runs when not told
    fix = dict(pp=1, dp=1, tp=1, schedule="1f1b", microbatches=1, virtual_stages=1, param_dtype=None)
    fix.update({k: defaults[k].default for k in ("activation_checkpoint", "dp_mode", "compile")})
    (planned,) = mesh3d.plan(_debug_on_meta(), gpus=1, seq_len=64, global_batch=4, memory_limit=2**60, fix=fix)
    assert prediction.predicted_bytes == planned.memory_per_rank.total
    assert prediction.by_pp_rank == (planned.memory_per_rank.total,)
    assert prediction.as_record() == {"memory_predicted_gib": prediction.predicted_bytes / GIB}
    peak = MemoryPeak(GIB, 2, rises=(0, 0, GIB // 2), baselines=(0, 0, GIB // 2), pp_ranks=(0, 0, 0))
    assert prediction.planned_for(peak) == planned.memory_per_rank.total
    assert prediction.as_record(peak)["memory_predicted_gib_by_rank"] == [prediction.predicted_bytes / GIB] * 3
    line = prediction.beside(peak)
    assert line.startswith(f"memory: predicted {prediction.predicted_bytes / GIB:.2f} GiB (mesh3d.plan")
    said = "measured 0.50 GiB (rank 2): its resident peak 1.00 GiB less the 0.50 GiB it held before the model was built"
    assert line.endswith(said), line


def test_a_layout_the_planner_does_not_model_is_said_not_raised():
    layout = types.SimpleNamespace(device=torch.device("cpu"), world_size=2, pp=2, dp=1, cp=1, tp=1, ep=1)
    prediction = predict_memory(_debug_on_meta(), layout, seq_len=64, global_batch=4, schedule="pipedream")
    assert prediction.predicted_bytes is None and prediction.as_record() == {}
    assert "not modelled by the planner" in prediction.beside(MemoryPeak(peak_bytes=GIB, rank=0))


def test_the_prediction_plans_the_split_parallelize_is_given():
    """A layers_per_stage (the ends alone here) reaches the planner as parallelize takes it."""
    layout = types.SimpleNamespace(device=torch.device("cpu"), world_size=2, pp=2, dp=1, cp=1, tp=1, ep=1)
    kwargs = dict(seq_len=64, global_batch=4, schedule="interleaved_1f1b", virtual_stages=2)
    alone = predict_memory(_debug_on_meta(), layout, **kwargs, layers_per_stage=[0, 4, 4, 0])
    balanced = predict_memory(_debug_on_meta(), layout, **kwargs)
    defaults = inspect.signature(mesh3d.parallelize).parameters
    fix = dict(pp=2, dp=1, tp=1, schedule="interleaved_1f1b", microbatches=2, virtual_stages=2, param_dtype=None)
    fix.update({k: defaults[k].default for k in ("activation_checkpoint", "dp_mode", "compile")})
    (planned,) = mesh3d.plan(
        _debug_on_meta(), gpus=2, seq_len=64, global_batch=4, memory_limit=2**60, fix=fix, layers_per_stage=[0, 4, 4, 0]
    )
    assert alone.predicted_bytes == planned.memory_per_rank.total != balanced.predicted_bytes
    # each pp rank's own figure: the rank reported is held against its stage's, not the fullest
    assert alone.by_pp_rank == tuple(memory.total for memory in planned.memory_by_pp_rank)
    on_stage = {pp: MemoryPeak(GIB, pp, rises=(1, 1), baselines=(0, 0), pp_ranks=(0, 1)) for pp in (0, 1)}
    assert [alone.planned_for(on_stage[pp]) for pp in (0, 1)] == list(alone.by_pp_rank)
