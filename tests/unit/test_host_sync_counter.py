"""The host-sync counter (tests/host_syncs.py) counts each value read into Python and each copy to the
host once, and nothing else: computation, host reads through numpy and collectives are free."""

import torch
from host_syncs import HostSyncCounter, _is_copy_to_host


def test_every_kind_of_read_counts_once():
    t = torch.arange(6.0).reshape(2, 3)
    with HostSyncCounter() as syncs:
        t.sum().item()
        bool(t[0, 1])
        int(t[1, 1])
        float(t[0, 0])
        t.tolist()
        if t.any():  # an implicit bool
            pass
    assert syncs.count == 6, syncs.ops
    assert syncs.ops.count("Tensor.tolist") == 1


def test_compute_and_host_reads_are_free():
    t = torch.arange(6.0).reshape(2, 3)
    with HostSyncCounter() as syncs:
        u = (t * 2).sum(dim=0).cumsum(0)
        torch._foreach_norm([t, u])
        t.numpy().max()  # host data read on the host: no device would wait
        t.to("cpu")  # already there: no copy
        t.shape[0] + t.numel()
    assert syncs.count == 0, syncs.ops


def test_only_a_copy_from_a_device_to_the_host_counts():
    """The copy rule alone, on tensors placed on meta (a stand-in for a device) and on the CPU."""
    device, host = torch.empty(2, device="meta"), torch.empty(2)
    to_copy, copy_ = torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default
    assert _is_copy_to_host(to_copy, (device,), {"device": torch.device("cpu")})
    assert not _is_copy_to_host(to_copy, (host,), {"device": torch.device("meta")})  # host to device
    assert not _is_copy_to_host(to_copy, (device,), {"dtype": torch.float16})  # stays on the device
    assert _is_copy_to_host(copy_, (host, device), {})
    assert not _is_copy_to_host(copy_, (device, host), {})


def test_the_count_stops_at_the_exit():
    with HostSyncCounter() as syncs:
        torch.ones(()).item()
    torch.ones(()).item()
    assert syncs.count == 1


def test_an_optimizer_step_reads_only_host_counters():
    """AdamW's step counts live on the host (not capturable, not fused): their reads are not counted."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones(3)
    with HostSyncCounter() as syncs:
        optimizer.step()
        optimizer.step()
        weight.sum().item()
    assert syncs.count == 1, syncs.ops
