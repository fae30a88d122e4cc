"""The bad-data check's local verdict in one process: what is refused, what passes. (The verdict shared by
every rank before any message: tests/distributed/test_bad_data.py.)"""

import torch
from pipeline_cases import VOCAB


def test_batch_problem_in_one_process():
    """The local verdict alone: what is refused, what passes (no vocabulary declared: shapes only)."""
    from mesh3d.step.batch_check import batch_problem

    ids = torch.tensor([[1, 2], [3, 63]])
    assert batch_problem(ids, ids, VOCAB) is None
    assert batch_problem(ids, torch.tensor([[1, -100], [3, 4]]), VOCAB) is None
    assert "outside [0, 64) or -100" in batch_problem(ids, torch.tensor([[1, -1], [3, 4]]), VOCAB)
    assert "input token id 64 at position (1, 1)" in batch_problem(ids + 1, ids, VOCAB)
    assert batch_problem(ids.float(), ids, None) is None  # no vocabulary: any inputs
    assert "differ in batch or sequence size" in batch_problem(ids, ids[:, :1], None)
    assert "differ in batch size" in batch_problem(ids, torch.tensor([1, 2, 3]), None)
    assert batch_problem(ids, torch.tensor([5, 6]), None) is None  # one label per sample
