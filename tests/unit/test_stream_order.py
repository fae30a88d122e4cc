"""Stream order at a weight-version swap, in one process without a GPU: FSDP2's all-gather streams
stand in as recording fakes. The swap's and the update's writes to the shards sit between the
current stream waiting for FSDP's gathers and FSDP's gathers waiting for the current stream; on CPU
nothing is ordered. (The same on a GPU with a delayed stream: tests/gpu.)"""

from types import SimpleNamespace

import torch
from torch import nn

from mesh3d.pipeline.stream_order import gather_streams, shard_writes
from mesh3d.pipeline.weight_versions import StageWeights


class RecordingStream:
    def __init__(self, name: str, log: list, watched: nn.Parameter):
        self.name, self.log, self.watched = name, log, watched

    def wait_stream(self, other: "RecordingStream") -> None:
        # what the shards hold when the wait is queued: the write it orders must already be queued
        self.log.append((self.name, "waits for", other.name, self.watched.detach().clone()))


class FakeUnit:
    """An FSDP module as stream_order.py sees it: its state, the root's communication context."""

    def __init__(self, device: str, log: list, watched: nn.Parameter, context=None):
        current = RecordingStream("current", log, watched)
        self.context = context or SimpleNamespace(
            device_handle=SimpleNamespace(current_stream=lambda: current),
            all_gather_copy_in_stream=RecordingStream("copy-in", log, watched),
            all_gather_stream=RecordingStream("all-gather", log, watched),
        )
        self.device = torch.device(device)
        self.log = log

    def _get_fsdp_state(self):
        return SimpleNamespace(_device=self.device, _comm_ctx=self.context)

    def reshard(self) -> None:
        self.log.append(("reshard",))


def _stage(log: list, device: str = "cuda") -> tuple[StageWeights, nn.Parameter]:
    layer = nn.Linear(2, 2, bias=False)
    nn.init.zeros_(layer.weight)
    weights = StageWeights(layer, [layer.weight], rule_stage=0)
    root = FakeUnit(device, log, layer.weight)
    weights.units = [root, FakeUnit(device, log, layer.weight, context=root.context)]  # one root, two units
    return weights, layer.weight


def _waits(log: list) -> list[tuple]:
    return [entry for entry in log if entry[0] != "reshard"]


def test_a_swap_writes_the_shards_between_the_two_waits_on_fsdps_gather_streams():
    log = []
    weights, weight = _stage(log)
    weights.kept[1] = [torch.ones(2, 2)]
    weights.use(1, oldest_needed=0)
    assert log[:2] == [("reshard",), ("reshard",)]  # resharded before anything is written
    order = [entry[:3] for entry in log[2:]]
    assert order == [  # once per root, not per unit
        ("current", "waits for", "copy-in"),
        ("current", "waits for", "all-gather"),
        ("copy-in", "waits for", "current"),
        ("all-gather", "waits for", "current"),
    ]
    before, after = [entry[3] for entry in log[2:4]], [entry[3] for entry in log[4:]]
    assert all(torch.equal(t, torch.zeros(2, 2)) for t in before)  # version 0 still there
    assert all(torch.equal(t, torch.ones(2, 2)) for t in after)  # version 1 written
    assert torch.equal(weight, torch.ones(2, 2)) and set(weights.kept) == {0}


def test_an_update_writes_the_shards_between_the_two_waits():
    log = []
    weights, weight = _stage(log)

    def step():
        with torch.no_grad():
            weight.add_(2.0)

    weights.update(step, oldest_needed=0)
    values = {entry[:3]: entry[3] for entry in _waits(log)}
    assert torch.equal(values[("current", "waits for", "all-gather")], torch.zeros(2, 2))
    assert torch.equal(values[("all-gather", "waits for", "current")], torch.full((2, 2), 2.0))
    assert len(_waits(log)) == 4


def test_on_cpu_and_before_fsdps_first_forward_nothing_is_ordered():
    log = []
    weights, _ = _stage(log, device="cpu")
    assert gather_streams(weights.units) == []
    weights.kept[1] = [torch.ones(2, 2)]
    weights.use(1, oldest_needed=0)
    assert _waits(log) == []
    lazy = FakeUnit("cuda", log, nn.Parameter(torch.zeros(1)), context=SimpleNamespace())  # streams not made yet
    with shard_writes([lazy]):
        pass
    assert _waits(log) == [] and gather_streams([lazy]) == []


def test_gather_streams_are_each_roots_two_streams_once():
    log = []
    weights, _ = _stage(log)
    names = [stream.name for stream in gather_streams(weights.units)]
    assert names == ["copy-in", "all-gather"]


def test_a_sent_tensor_lives_until_its_send_completes_and_a_receive_is_waited_on_before_it_is_read(monkeypatch):
    """The mailbox's hand-overs to and from NCCL's stream: what a send reads stays referenced until
    the send's work completes (NCCL reads it on its own stream), and a received tensor is handed to
    its consumer only after its work was waited on (which makes the current stream wait)."""
    import gc
    import weakref

    from mesh3d.pipeline import p2p
    from mesh3d.pipeline.schedule.catalog import build_schedule
    from mesh3d.pipeline.schedule.ir import Action, Kind

    class Work:
        def __init__(self):
            self.done = False
            self.waited = False

        def is_completed(self):
            return self.done

        def wait(self):
            self.waited = True

    works = []

    def queue(*args, **kwargs):
        works.append(Work())
        return works[-1]

    monkeypatch.setattr(p2p.dist, "isend", queue)
    monkeypatch.setattr(p2p.dist, "irecv", queue)
    schedule = build_schedule("1f1b", 2, 2, 1)
    peers = p2p.PipelinePeers(pp_rank=0, global_ranks=[0, 1], group=None, device=torch.device("meta"))
    spec = (torch.Size([2, 4]), torch.float32)
    mailbox = p2p.Mailbox(peers, schedule, {(0, 1): spec}, p2p.Traffic())
    sent = []
    for microbatch in (0, 1):
        tensor = torch.empty(spec[0], device="meta")
        sent.append(weakref.ref(tensor))
        mailbox.put(Kind.F, 0, 1, microbatch, tensor)
        mailbox.send(Action(0, Kind.SEND_F, microbatch, 1))
        del tensor
    gc.collect()
    assert sent[0]() is not None and sent[1]() is not None  # neither send completed: both kept
    works[0].done = True
    mailbox.put(Kind.F, 0, 1, 2, torch.empty(spec[0], device="meta"))
    mailbox.send(Action(0, Kind.SEND_F, 2, 1))
    gc.collect()
    assert sent[0]() is None and sent[1]() is not None  # the completed one is let go, not the other

    mailbox.post_recv(Action(0, Kind.RECV_B, 0, 1))
    receive = works[-1]
    assert not receive.waited
    mailbox.take(Kind.B, 0, 1, 0)
    assert receive.waited
