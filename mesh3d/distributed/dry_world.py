"""A dry run: one rank of a large world, alone on a CPU, under torch's fake process group.

`dist.init_process_group("fake", store=FakeStore(), rank=r, world_size=N)` gives a process the
rank and world size of a real job while every collective returns at once and carries nothing.
The setup and the step then run exactly as that rank would run them (the same groups, the same
shards, the same collectives issued), which is what mesh3d.dry_run measures. What no rank can learn
there is another rank's answer: an exchange of Python objects brings back nothing (or this rank's
own object), and a value "computed on rank 0 and handed to the others" never arrives. So every
agreement (agree.py) asks `answers_alone()` first: in a dry run each rank answers from its own
view, as if every rank had said what this one says. That is exact for the agreements mesh3d makes
(every rank computes them from the same arguments and the same meta model); what it cannot show is
a rank that disagrees, which needs a real run. It says so once, on stderr.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

FAKE_BACKEND = "fake"  # the name torch's fake process group registers

_told = False  # whether this process has said that it answers alone


def is_dry_run() -> bool:
    """Whether the default process group is torch's fake one (no peer ever answers)."""
    world = dist.distributed_c10d.GroupMember.WORLD  # None before init_process_group
    return world is not None and FAKE_BACKEND in str(dist.get_backend(world))


def answers_alone() -> bool:
    """Whether cross-rank agreements must be answered from this rank's own view (a dry run); the
    first time it is, says so in one line."""
    global _told
    if not is_dry_run():
        return False
    if not _told:
        _told = True
        print(
            f"mesh3d: dry run under torch's fake process group (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}): every cross-rank agreement is answered from this rank's own view",
            file=sys.stderr,
            flush=True,
        )
    return True
