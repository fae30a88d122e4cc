"""Which communicator each operation of the lowered lists runs on, as `check_lists` replays them.

On NCCL every operation a rank issues on one communicator runs on that communicator's stream, in
issue order: a send or receive completes only once every earlier operation there has, and so does
a collective, which also waits for every member to reach it. Two assignments:

- `SHARED`, mesh3d before issue 37: every pipeline message on the pp group's communicator, and a
  tied weight's collective (TIE) on `Layout.subgroup` of its holders, which is the pp group itself
  when the holders are every pp rank (pp = 2 with the first and last stage tied). Replayed, the
  never-drain schedules with a tie stop there (tests/unit/test_nccl_rule.py).
- `SEPARATE`, what the runtime creates (pipeline/communicators.py): pipeline messages on one
  communicator per direction (activations forward, gradients backward) per pair of pp ranks, and
  every tie's collective on a group of its own: activations never queue behind gradients, nor a
  message to one neighbour behind one to the other.

A finer assignment only removes waits: lists that finish under one finish under any split of its
communicators, gloo (matched by tag, no stream order) included.
"""

from __future__ import annotations

from dataclasses import dataclass

from mesh3d.pipeline.schedule.ir import Action, Kind

PP_GROUP = ("pp",)  # the pp group's own communicator


@dataclass(frozen=True)
class Communicators:
    """An assignment of the lowered lists' operations to communicators (keys compared for equality)."""

    name: str
    per_direction: bool  # messages: one communicator per (direction, pair of ranks), else the pp group's
    ties_apart: bool  # a TIE on a group of its own, else on the pp group when its holders are all pp ranks

    def of_message(self, rank: int, action: Action) -> tuple:
        """The communicator of a SEND / RECV action on `rank` (both ends get the same key)."""
        if not self.per_direction:
            return PP_GROUP
        return (direction(action.kind), min(rank, action.peer), max(rank, action.peer))

    def of_tie(self, holders: frozenset[int], pp: int) -> tuple:
        """The communicator of the TIE joining the pp ranks `holders`."""
        if not self.ties_apart and holders == frozenset(range(pp)):
            return PP_GROUP  # Layout.subgroup hands back the pp group for its own member list
        return ("tie", *sorted(holders))

    def __str__(self) -> str:
        return self.name


def direction(kind: Kind) -> str:
    """ "forward" for an activation's SEND_F / RECV_F, "backward" for a gradient's SEND_B / RECV_B."""
    return "forward" if kind in (Kind.SEND_F, Kind.RECV_F) else "backward"


def message_channels(*actions_per_rank) -> list[tuple[str, int, int]]:
    """The (direction, low rank, high rank) communicators the given lowered lists use, sorted: the
    process groups every rank creates, in this order, at setup."""
    found = set()
    for lists in actions_per_rank:
        for rank, actions in enumerate(lists):
            for action in actions:
                if action.kind in (Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B):
                    found.add(SEPARATE.of_message(rank, action))
    return sorted(found)


SHARED = Communicators("one communicator per pp group, TIE on Layout.subgroup", per_direction=False, ties_apart=False)
SEPARATE = Communicators("one per direction per rank pair, one per tie", per_direction=True, ties_apart=True)
RUNTIME = SEPARATE  # what pipeline/communicators.py creates and the lowering proves

__all__ = ["PP_GROUP", "RUNTIME", "SEPARATE", "SHARED", "Communicators", "direction", "message_channels"]
