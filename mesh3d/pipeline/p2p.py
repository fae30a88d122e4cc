"""Point-to-point traffic between pipeline stages: the only place that talks to peers (over the
groups pipeline/communicators.py creates: one per direction per pair of pp ranks).

A `Mailbox` lives for one step (under a never-drain schedule, for every call until the flush: each
call receives everything sent to it, and what a later call consumes waits in the inbox). A stage's
output (or input gradient) is handed over in memory when the consuming stage sits on this rank, and
goes out with `isend` otherwise; a receive is posted early (`irecv` into a buffer shaped from the
meta run) and waited on only when the compute that consumes it starts. Every message has a tag
unique within the step, so gloo (which matches by tag) and NCCL (which matches by order; the
lowering fixed one order on both ends) both pair them correctly. Sends are waited on at the end of
the step; a completed send is dropped as soon as the next one is posted, so a step holds the
messages in flight, not all it sent.

On CPU (gloo) two things go further, because there a receive posted late is paid on the critical
path (posting an `irecv` for a message the peer already sent took 2-6 ms of the receiving rank's
time per 512 KB message, 3 % of a pp=2 ZBV step) and a fresh buffer costs page faults:

- every receive of the step is posted at its start: gloo matches by tag, so the order of
  posting does not matter there (NCCL keeps the lowered order: a channel's operations run in
  issue order on its stream, and a receive posted early would hold up the sends behind it);
- receive buffers are kept between steps (`ReceiveBuffers`, one per message slot, as torch's
  PipelineStage keeps its own): a step hands them back only once it finished, so a step that
  failed half-way leaves its buffers to the messages that may still land in them.
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
    # with none at all (peers built by hand, in tests) every message goes on `group`
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


def message_tag(
    schedule: Schedule, kind: Kind, producer_stage: int, consumer_stage: int, microbatch: int, window: int | None = None
) -> int:
    """A tag unique to one message within a step (gloo matches on it; NCCL ignores it): a stage
    with a skip connection sends to two consumers, so the consumer is part of it. With a `window`
    (never-drain schedules number microbatches across calls), microbatches are told apart modulo
    it: the messages in flight at once span fewer microbatches than that."""
    n = schedule.n_stages
    direction = 0 if kind in (Kind.SEND_F, Kind.RECV_F) else 1
    span = schedule.microbatches if window is None else window
    return ((direction * n + producer_stage) * n + consumer_stage) * span + microbatch % span


class ReceiveBuffers:
    """Receive buffers kept between steps, one per message slot (CPU only: on CUDA a buffer reused
    by the next step's receive could still be read by this step's kernels)."""

    def __init__(self):
        self._free: dict[tuple, torch.Tensor] = {}

    def get(self, slot: tuple, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = self._free.pop(slot, None)
        if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
            buffer = torch.empty(shape, dtype=dtype, device=device)
        return buffer

    def give_back(self, slot: tuple, buffer: torch.Tensor) -> None:
        self._free[slot] = buffer


class Mailbox:
    """One step's tensors between stages: in memory on this rank, isend/irecv across ranks.

    Slots are keyed (F or B, this end's stage, the other end's stage, microbatch): a stage may
    receive from several producers (the previous stage and skip connections) and send to several
    consumers, gradients likewise the other way.

    Under a never-drain schedule one mailbox serves every call until the flush (`window`: see
    `message_tag`): a call may receive what the next one consumes, which stays in the inbox.
    """

    def __init__(
        self,
        peers: PipelinePeers,
        schedule: Schedule,
        specs: dict[tuple[int, int], Spec],
        traffic: Traffic,
        buffers: ReceiveBuffers | None = None,
        window: int | None = None,
    ):
        self.peers = peers
        self.schedule = schedule
        self.window = window
        # by (producer, consumer) stage: the activation message's shape and dtype as sent (its gradient's too)
        self.specs = specs
        self.traffic = traffic
        self.inbox: dict[tuple[Kind, int, int, int], object] = {}  # tensor, or (work, buffer, what) of a posted irecv
        self.outbox: dict[tuple[Kind, int, int, int], torch.Tensor] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor, str]] = []  # work, tensor, what it is (for errors)
        # CPU (gloo, matched by tag): every receive posted at the start, into buffers kept between
        # steps; None elsewhere (a received tensor is then freed with its last use).
        self.buffers: ReceiveBuffers | None = None
        if peers.device.type == "cpu":
            self.buffers = buffers if buffers is not None else ReceiveBuffers()
        self.posted: dict[Action, torch.Tensor] = {}  # CPU: this step's receives, handed back at close()

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

    def post_receives_ahead(self, actions: tuple[Action, ...]) -> None:
        """On CPU: post every receive among `actions` now (their RECV actions then do nothing)."""
        if self.buffers is not None:
            for action in actions:
                if action.kind in (Kind.RECV_F, Kind.RECV_B):
                    self.post_recv(action)

    def post_recv(self, action: Action) -> None:
        """RECV_F / RECV_B: post the irecv now (unless already posted), into a buffer shaped from
        the meta run."""
        if action in self.posted:
            return
        forward = action.kind == Kind.RECV_F
        producer = action.other_stage  # of this message (for a gradient: the activation's consumer)
        shape, dtype = self.specs[(producer, action.stage) if forward else (action.stage, producer)]
        if self.buffers is not None:
            buffer = self.posted[action] = self.buffers.get(self._slot(action), shape, dtype, self.peers.device)
        else:
            buffer = torch.empty(shape, dtype=dtype, device=self.peers.device)
        work = dist.irecv(
            buffer,
            src=self.peers.global_ranks[action.peer],
            group=self.peers.group_of(action),
            tag=message_tag(self.schedule, action.kind, producer, action.stage, action.microbatch, self.window),
        )
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
        work = dist.isend(
            tensor,
            dst=self.peers.global_ranks[action.peer],
            group=self.peers.group_of(action),
            tag=message_tag(self.schedule, action.kind, stage, other, microbatch, self.window),
        )
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

    def _slot(self, action: Action) -> Action:
        """The receive buffer a message lands in: one per message of a step (modulo the window)."""
        if self.window is None:
            return action
        return Action(action.stage, action.kind, action.microbatch % self.window, action.peer, action.far_stage)

    def close(self) -> None:
        """End of a step (or call) that finished: wait for the sends; the buffers of the receives
        consumed go back for the next step (under a never-drain schedule a receive the next call
        consumes keeps its buffer)."""
        for work, _, what in self.sends:
            with waiting_for(what):
                work.wait()
        self.sends = []
        if self.buffers is not None:
            kept = {}
            for action, buffer in self.posted.items():
                forward = action.kind == Kind.RECV_F
                if (Kind.F if forward else Kind.B, action.stage, action.other_stage, action.microbatch) in self.inbox:
                    kept[action] = buffer
                else:
                    self.buffers.give_back(self._slot(action), buffer)
            self.posted = kept
