"""What data parallelism's wrapping adds to a block, timed for the planner on this machine: timed
for FSDP and DDP over a fake 2-rank group (each term a difference of two timings, never below 0),
absent where it is not timed. That a term is above 0 is not held here: on this tiny block the
difference is within the noise of a loaded machine (a clean-clone CI run beside other work measured
0.0), and timings belong to bench/, not to tests."""

import torch

from examples.llama.config import ModelArgs
from examples.llama.model import Transformer
from mesh3d.model.intake import anatomy_of
from mesh3d.planner.measure.data_parallel_timing import time_data_parallel


def tiny():
    with torch.device("meta"):
        return Transformer(
            ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
        )


def test_wrapping_adds_time_and_is_timed_only_where_it_can_be():
    model = tiny()
    anatomy = anatomy_of(model)
    sizes = dict(tp_plan=None, microbatch_size=2, seq_len=16, param_dtype=None)
    for mode in ("fsdp", "ddp"):
        overhead = time_data_parallel(model, anatomy, dp=2, dp_mode=mode, tp=1, **sizes)
        block = sum(p.numel() for p in model.layers["1"].parameters())
        assert overhead.elements == block
        terms = (overhead.regathered, overhead.gathered, overhead.reduced)
        assert all(isinstance(t, float) and 0.0 <= t < 10.0 for t in terms), terms  # seconds, clamped at 0
    assert time_data_parallel(model, anatomy, dp=1, dp_mode="fsdp", tp=1, **sizes) is None
    assert time_data_parallel(model, anatomy, dp=2, dp_mode="fsdp", tp=2, **sizes) is None
