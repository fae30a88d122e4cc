"""The pipeline's mailbox off the CPU, in one process with a stubbed receive: nothing posted ahead, no
buffer pooled, a received tensor dropped once its compute took it. (Receives on CPU, on 2 ranks:
tests/distributed/test_p2p.py.)"""

import torch

from mesh3d.pipeline import p2p
from mesh3d.pipeline.schedule.catalog import build_schedule
from mesh3d.pipeline.schedule.ir import Action, Kind


def test_off_cpu_receives_keep_the_lowered_order_and_are_not_held_past_their_use(monkeypatch):
    """On CUDA (here: any device but the CPU) nothing is posted ahead, no buffer is pooled, and the
    mailbox drops a received tensor once its compute took it, so it is freed with its last use."""

    class Done:
        def wait(self):
            pass

    monkeypatch.setattr(p2p.dist, "irecv", lambda *args, **kwargs: Done())
    schedule = build_schedule("1f1b", 2, 2, 1)
    peers = p2p.PipelinePeers(pp_rank=1, global_ranks=[0, 1], group=None, device=torch.device("meta"))
    spec = (torch.Size([2, 4]), torch.float32)
    mailbox = p2p.Mailbox(peers, schedule, {(0, 1): spec}, p2p.Traffic(), p2p.ReceiveBuffers())
    receive = Action(1, Kind.RECV_F, 0, 0)
    mailbox.post_receives_ahead((receive,))
    assert mailbox.inbox == {}  # not posted ahead
    mailbox.post_recv(receive)
    received = mailbox.take(Kind.F, 1, 0, 0)
    assert received.shape == spec[0]
    assert mailbox.inbox == {} and mailbox.posted == {} and mailbox.buffers is None
