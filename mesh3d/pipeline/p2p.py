"""Point-to-point traffic between pipeline stages: the only place that talks to peers (over the
groups pipeline/communicators.py creates: one per direction per pair of pp ranks).

One discipline on every device, NCCL's: each receive is posted where the lowering put it, into a
fresh buffer, and messages pair by their order on a channel, never by tag (none is sent). The
lowering (schedule/lower.py) proves that the lists finish when every communicator completes its
operations one after another in issue order and a send completes only once its receive is
posted; tests/nccl_rules.py holds gloo to the same rules in the suite, so the program the tests
run is the one NCCL runs. (A receive posted at the step's start, as gloo would forgive, sits at
the head of its channel and holds up every send the lowering placed behind it: a deadlock on
NCCL.)

A `Mailbox` lives for one step (under a never-drain schedule, for every call until the flush: each
call receives everything sent to it, and what a later call consumes waits in the inbox). A stage's
output (or input gradient) is handed over in memory when the consuming stage sits on this rank, and
goes out with `isend` otherwise; a receive's `irecv` goes into a buffer shaped from the meta run
and is waited on only when the compute that consumes it starts, which then holds the only
reference: the buffer is freed with its last use. On CUDA no buffer outlives the step to be
reused by the next one, so none needs an event: ProcessGroupNCCL keeps the buffer alive for its own
stream until the work is waited, and `take` waits on it (the current stream then waits for NCCL's)
before the consumer reads. Sends are waited on at the end of
the step; a completed send is dropped as soon as the next one is posted, so a step holds the
messages in flight, not all it sent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mesh3d.distributed.peer_timeout import waiting_for
from mesh3d.pipeline.schedule.communicators import RUNTIME
from mesh3d.pipeline.schedule.ir import Action, Kind, Schedule

Spec = tuple[torch.Size, torch.dtype]


@dataclass(frozen=True)
class PipelinePeers:
    """This rank's pp group: its position, every member's global rank, the group itself, and the
    groups its messages travel on."""

    pp_rank: int
    global_ranks: list[int]
    group: dist.ProcessGroup | None  # None when pp == 1 (nothing is ever sent)
    device: torch.device
    # (direction, low pp rank, high pp rank) -> that channel's group (schedule/communicators.py);
    # with none at all (peers built by hand, in one-process tests) every message goes on `group`
    channels: dict[tuple[str, int, int], dist.ProcessGroup] = field(default_factory=dict)

    def group_of(self, action: Action) -> dist.ProcessGroup | None:
        """The group a SEND / RECV action travels on: the channel the lowering proved it on."""
        if not self.channels:
            return self.group
        channel = RUNTIME.of_message(self.pp_rank, action)
        if channel not in self.channels:  # on the pp group it could wait behind another channel's message
            raise RuntimeError(
                f"pp rank {self.pp_rank}: {action} has no channel of its own ({channel}); built: "
                f"{sorted(self.channels)}"
            )
        return self.channels[channel]


def warm_up(peers: PipelinePeers) -> None:
    """One tiny message each way on every channel of this rank, at setup: NCCL connects two ranks
    at their first message, and connections made lazily inside a step have hung multi-node runs
    (torch's pipelining warms up the same way). On each channel the lower pp rank sends first and
    the higher receives first, so neither waits behind its own send in the channel's order."""
    pending = []
    for (_, low, high), group in sorted(peers.channels.items()):
        other = high if peers.pp_rank == low else low
        peer = peers.global_ranks[other]
        outgoing, incoming = torch.zeros(1, device=peers.device), torch.empty(1, device=peers.device)
        send = functools.partial(dist.isend, outgoing, dst=peer, group=group)
        receive = functools.partial(dist.irecv, incoming, src=peer, group=group)
        for post in (send, receive) if peers.pp_rank == low else (receive, send):
            pending.append((post(), outgoing, incoming, peer))
    for work, _, _, peer in pending:
        with waiting_for(f"the pipeline's warm-up exchange with global rank {peer}"):
            work.wait()


@dataclass
class Traffic:
    """What a step sent and received on this rank."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    # bytes sent, by (producer stage, consumer stage): only what left this rank; a hand-over in
    # memory between two stages of this rank sends nothing and is not counted
    bytes_by_stage_pair: dict[tuple[int, int], int] = field(default_factory=dict)

    def count_send(self, producer: int, consumer: int, nbytes: int) -> None:
        """One message of `nbytes` from stage `producer` to stage `consumer`."""
        self.bytes_sent += nbytes
        self.messages_sent += 1
        pair = (producer, consumer)
        self.bytes_by_stage_pair[pair] = self.bytes_by_stage_pair.get(pair, 0) + nbytes


class Mailbox:
    """One step's tensors between stages: in memory on this rank, isend/irecv across ranks.

    Slots are keyed (F or B, this end's stage, the other end's stage, microbatch): a stage may
    receive from several producers (the previous stage and skip connections) and send to several
    consumers, gradients likewise the other way.

    Under a never-drain schedule one mailbox serves every call until the flush: a call may receive
    what the next one consumes, which stays in the inbox.
    """

    def __init__(
        self,
        peers: PipelinePeers,
        schedule: Schedule,
        specs: dict[tuple[int, int], Spec],
        traffic: Traffic,
    ):
        self.peers = peers
        self.schedule = schedule
        # by (producer, consumer) stage: the activation message's shape and dtype as sent (its gradient's too)
        self.specs = specs
        self.traffic = traffic
        self.inbox: dict[tuple[Kind, int, int, int], object] = {}  # tensor, or (work, buffer, what) of a posted irecv
        self.outbox: dict[tuple[Kind, int, int, int], torch.Tensor] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor, str]] = []  # work, tensor, what it is (for errors)

    def put(self, kind: Kind, producer: int, consumer: int, microbatch: int, tensor: torch.Tensor) -> None:
        """A result of `producer` for `consumer` (an activation, or a gradient going back): kept here
        if `consumer` runs on this rank, else queued for its SEND."""
        if self.schedule.stage_rank(consumer) == self.peers.pp_rank:
            self.inbox[(kind, consumer, producer, microbatch)] = tensor
        else:
            self.outbox[(kind, producer, consumer, microbatch)] = tensor

    def take(self, kind: Kind, stage: int, sender: int, microbatch: int) -> torch.Tensor:
        """The activation (F) or output gradient (B) `stage` consumes from stage `sender`, waiting
        for it if still in flight."""
        item = self.inbox.pop((kind, stage, sender, microbatch))
        if isinstance(item, tuple):
            work, buffer, what = item
            with waiting_for(what):  # a peer that never sends: PeerTimeout naming this message
                work.wait()
            return buffer
        return item

    def post_recv(self, action: Action) -> None:
        """RECV_F / RECV_B: post the irecv now, where the lowering put it, into a fresh buffer shaped
        from the meta run."""
        forward = action.kind == Kind.RECV_F
        producer = action.other_stage  # of this message (for a gradient: the activation's consumer)
        shape, dtype = self.specs[(producer, action.stage) if forward else (action.stage, producer)]
        buffer = torch.empty(shape, dtype=dtype, device=self.peers.device)
        work = dist.irecv(buffer, src=self.peers.global_ranks[action.peer], group=self.peers.group_of(action))
        self.traffic.bytes_received += buffer.numel() * buffer.element_size()
        what = (
            f"P2P recv of the {'activation' if forward else 'output gradient'} of stage {action.stage}, "
            f"microbatch {action.microbatch}, from stage {producer} on global rank "
            f"{self.peers.global_ranks[action.peer]}"
        )
        self.inbox[(Kind.F if forward else Kind.B, action.stage, producer, action.microbatch)] = (work, buffer, what)

    def send(self, action: Action) -> None:
        """SEND_F / SEND_B: isend what the stage queued, after checking it has the announced shape."""
        forward = action.kind == Kind.SEND_F
        stage, microbatch, other = action.stage, action.microbatch, action.other_stage
        tensor = self.outbox.pop((Kind.F if forward else Kind.B, stage, other, microbatch)).contiguous()
        shape, dtype = self.specs[(stage, other) if forward else (other, stage)]
        if tensor.shape != shape or tensor.dtype != dtype:
            what = "output" if forward else "input gradient"
            raise RuntimeError(
                f"stage {stage} produced an {what} of {tuple(tensor.shape)} {tensor.dtype} "
                f"for microbatch {microbatch}, "
                f"but the meta run gave {tuple(shape)} {dtype}: a stage's output must depend only on its input's "
                "shape and dtype"
            )
        work = dist.isend(tensor, dst=self.peers.global_ranks[action.peer], group=self.peers.group_of(action))
        what = (
            f"P2P send of the {'output' if forward else 'input gradient'} of stage {stage}, microbatch {microbatch}, "
            f"to stage {other} on global rank {self.peers.global_ranks[action.peer]}"
        )
        self._release_completed_sends()
        self.sends.append((work, tensor, what))  # the tensor must live until the send completes
        self.traffic.count_send(stage, other, tensor.numel() * tensor.element_size())

    def _release_completed_sends(self) -> None:
        """Drop the sends that completed, and with them the last reference to what they sent (an
        input gradient nothing else holds): a step then keeps what is in flight, not every message
        it sent. The work itself keeps a tensor alive until it completes (NCCL stashes it)."""
        self.sends = [send for send in self.sends if not send[0].is_completed()]

    def close(self) -> None:
        """End of a step (or call) that finished: wait for the sends (a receive a later call of a
        never-drain schedule consumes stays in the inbox)."""
        for work, _, what in self.sends:
            with waiting_for(what):
                work.wait()
        self.sends = []
