"""What data parallelism's wrapping adds to a block, timed for the planner on this machine:
positive for FSDP and DDP over a fake 2-rank group, absent where it is not timed."""

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
        assert overhead.regathered > 0 and overhead.gathered > 0 and overhead.reduced >= 0
    assert time_data_parallel(model, anatomy, dp=1, dp_mode="fsdp", tp=1, **sizes) is None
    assert time_data_parallel(model, anatomy, dp=2, dp_mode="fsdp", tp=2, **sizes) is None
