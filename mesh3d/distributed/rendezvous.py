"""The store a torchrun worker starts its process group on: one key space per restart attempt.

Why this file exists. torchrun (torch >= 2.4) hands its workers the agent's own TCPStore
(TORCHELASTIC_USE_AGENT_STORE=True, MASTER_PORT = the agent's store port) and keeps that store
alive across restarts. torch's env:// rendezvous then connects to it without any per-attempt key
prefix (its comment still says each retry gets a new store, which has not been true since the
store became shared). After `--max-restarts` starts new workers, they find the dead attempt's
keys under the same names: gloo reads a peer's listening address before the new peer has
overwritten it and fails with "connectFullMesh failed ... Connection refused" (the old port), and
counters the group's barriers add to already hold the old attempt's counts, so ranks wait on
each other forever. Prefixing every key with the attempt number (TORCHELASTIC_RESTART_COUNT,
which torchrun sets for each attempt) gives each attempt a clean key space on the same store.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """Which torchrun attempt this process belongs to: 0 for the first, 0 outside torchrun."""
    return int(os.environ.get(RESTART_COUNT_ENV) or 0)


def uses_agent_store() -> bool:
    """Whether torchrun told its workers to connect to the agent's (restart-surviving) store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def attempt_store(timeout: timedelta) -> dist.Store:
    """A client of torchrun's agent store whose keys are private to this restart attempt."""
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,  # the agent hosts the store; workers only connect
        timeout=timeout,
    )
    return dist.PrefixStore(f"mesh3d/attempt_{restart_count()}", store)
