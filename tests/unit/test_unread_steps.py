"""UnreadSteps: every step's values back in order after one read, nothing read before it."""

import math

import torch
from host_syncs import HostSyncCounter

from mesh3d.train.unread_steps import UnreadSteps


def test_steps_come_back_in_order_from_one_read():
    unread = UnreadSteps()
    with HostSyncCounter() as holding:
        unread.add(1, loss=torch.tensor(2.5), grad_norm=torch.tensor(float("nan")), skipped=torch.tensor(True), lr=0.1)
        unread.add(2, loss=torch.tensor(1.5, dtype=torch.bfloat16), grad_norm=None, skipped=torch.tensor(False))
    assert not holding.ops, holding.ops
    with HostSyncCounter() as reading:
        rows = unread.read()
    assert reading.count == 1, reading.ops
    assert rows[0]["step"] == 1 and rows[0]["loss"] == 2.5 and math.isnan(rows[0]["grad_norm"])
    assert rows[0]["skipped"] is True and rows[0]["lr"] == 0.1
    assert rows[1] == {"step": 2, "loss": 1.5, "grad_norm": None, "skipped": False}
    assert unread.read() == [] and len(unread) == 0
