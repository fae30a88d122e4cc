"""The pipeline's process groups, created at setup: one per direction per pair of pp ranks.

On NCCL the operations on one communicator run in issue order on one stream
(schedule/communicators.py), so what shares a communicator waits on each other: the lowering
proves its lists finish with exactly these groups (`RUNTIME`), and activations and gradients,
or the messages to two neighbours, overlap instead of queueing behind each other. Each channel is
one kind of group (its two pp positions in every pp group of the mesh), made with one call for the
whole world (Layout.own_groups, distributed/group_kinds.py); then each rank exchanges one tiny
message on each of its own (p2p.py's `warm_up`), so NCCL makes its connections at setup rather than
inside a step. A tie's collective has groups of its own too
(tied.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from mesh3d.mesh import Layout
from mesh3d.pipeline.p2p import PipelinePeers, warm_up
from mesh3d.pipeline.schedule.communicators import message_channels
from mesh3d.pipeline.schedule.ir import Action

Lists = Sequence[Sequence[Action]]  # per pp rank, its lowered actions


def pipeline_peers(layout: Layout, *lowered: Lists) -> PipelinePeers:
    """This rank's PipelinePeers, with a group for every channel `lowered` (per-rank lists: the
    training and evaluation schedules, a never-drain schedule's calls) uses, each warmed up."""
    ranks = layout.group_ranks("pp")
    if layout.pp == 1:
        return PipelinePeers(layout.pp_rank, ranks, None, layout.device)
    pp_groups = layout.axis_groups("pp")
    # one kind per channel: its two pp positions in every pp group of the mesh
    kinds = {key: [[members[key[1]], members[key[2]]] for members in pp_groups] for key in message_channels(*lowered)}
    channels = {key: group for key, group in layout.own_groups("pipeline", kinds).items() if group is not None}
    peers = PipelinePeers(layout.pp_rank, ranks, layout.group("pp"), layout.device, channels)
    warm_up(peers)
    return peers
