"""The pipeline's mailbox in one process with a stubbed receive: one path on every device (nothing
posted ahead, no buffer kept between steps, a received tensor dropped once its compute took it).
(The CPU run's order on 2 ranks, under NCCL's rules: tests/distributed/test_p2p.py.)"""

import pytest
import torch

from mesh3d.pipeline import p2p
from mesh3d.pipeline.schedule.catalog import build_schedule
from mesh3d.pipeline.schedule.ir import Action, Kind


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_receive_is_posted_when_its_action_runs_and_not_held_past_its_use(monkeypatch, device):
    """On every device (here CPU, and meta standing for CUDA) the irecv is posted by its RECV
    action, untagged, into a fresh buffer, and the mailbox drops the received tensor once its
    compute took it, so it is freed with its last use."""
    posted = []

    class Done:
        def wait(self):
            pass

    def irecv(buffer, **kwargs):
        posted.append(kwargs)
        return Done()

    monkeypatch.setattr(p2p.dist, "irecv", irecv)
    schedule = build_schedule("1f1b", 2, 2, 1)
    peers = p2p.PipelinePeers(pp_rank=1, global_ranks=[0, 1], group=None, device=torch.device(device))
    spec = (torch.Size([2, 4]), torch.float32)
    mailbox = p2p.Mailbox(peers, schedule, {(0, 1): spec}, p2p.Traffic())
    assert not hasattr(mailbox, "post_receives_ahead")
    receive = Action(1, Kind.RECV_F, 0, 0)
    assert mailbox.inbox == {} and posted == []
    mailbox.post_recv(receive)
    assert posted == [{"src": 0, "group": None}]  # no tag: messages pair by their order on the channel
    received = mailbox.take(Kind.F, 1, 0, 0)
    assert received.shape == spec[0] and received.device.type == device
    assert mailbox.inbox == {}
