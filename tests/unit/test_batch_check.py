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


def test_the_verdict_reads_host_ids_through_numpy_and_leaves_device_ids_unread():
    """A batch on the host is judged there with no torch read (no device would wait); ids already on a
    device (meta stands in for one) give a flag tensor there, read later with the other ranks' flags."""
    from host_syncs import HostSyncCounter

    from mesh3d.step.batch_check import batch_verdict

    ids = torch.tensor([[1, 2], [3, 64]])
    with HostSyncCounter() as syncs:
        assert "input token id 64 at position (1, 1)" in batch_verdict(ids, ids - 1, VOCAB)
        assert batch_verdict(ids - 1, ids - 1, VOCAB) is None
        flag = batch_verdict(ids.to("meta"), ids.to("meta"), VOCAB)
    assert syncs.count == 0, syncs.ops
    assert isinstance(flag, torch.Tensor) and flag.device.type == "meta" and flag.dtype == torch.bool
