"""The store a torchrun worker starts its process group on: one key space per attempt.

Why this file exists. torchrun (torch >= 2.4) hands its workers the agent's own TCPStore
(TORCHELASTIC_USE_AGENT_STORE=True, MASTER_PORT = the agent's store port) and keeps that store
alive across restarts. torch's env:// rendezvous then connects to it without any per-attempt key
prefix (its comment still says each retry gets a new store, which has not been true since the
store became shared). After torchrun starts new workers, they find the dead attempt's keys under
the same names: gloo reads a peer's listening address before the new peer has overwritten it and
fails with "connectFullMesh failed ... Connection refused" (the old port), and counters the
group's barriers add to already hold the old attempt's counts, so ranks wait on each other forever.

Why the attempt is numbered through the store. torchrun's TORCHELASTIC_RESTART_COUNT is each
agent's own count: an agent that joins later (a replaced or added node) starts at 0 while the
others are at 1, and a restart for a change of membership does not count at all. Workers that
prefix by it read different key spaces (and hang) or the dead attempt's (and hang). So rank 0
numbers the attempt with an atomic `store.add` and tells every other rank, through keys only this
attempt can know: each rank posts a fresh random nonce, rank 0 answers every nonce it sees under
that rank's name until the rank acknowledges the answer. torchrun stops every worker of an
attempt before any of the next starts (its agents meet in a new rendezvous round in between), so
a nonce that is not answered is a dead worker's and costs nothing.
"""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch.distributed as dist

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
_JOIN = "mesh3d/join"  # the keys of the numbering itself, outside every attempt's key space
_POLL_S = 0.01


def restart_count() -> int:
    """This agent's torchrun attempt: 0 for the first, 0 outside torchrun. Per agent, so a label
    for logs only; the store's key space is numbered by `agreed_attempt`."""
    return int(os.environ.get(RESTART_COUNT_ENV) or 0)


def uses_agent_store() -> bool:
    """Whether torchrun told its workers to connect to the agent's (restart-surviving) store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def agreed_attempt(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> int:
    """The number of this attempt, the same on every rank of it and new on `store` (1, 2, ...).

    Every rank of the attempt must call it; rank 0 waits until each other rank has its answer.
    Raises TimeoutError on rank 0, naming the ranks that never asked, after `timeout`; another
    rank's wait for its answer ends with the store's own timeout error.
    """
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"{_JOIN}/ask/{rank}", nonce)
        attempt = int(store.get(f"{_JOIN}/answer/{nonce}"))
        store.set(f"{_JOIN}/ack/{nonce}/{attempt}", "")
        return attempt
    attempt = store.add(f"{_JOIN}/attempts", 1)
    answered: dict[int, str] = {}  # rank -> the nonce last answered
    waiting = set(range(1, world_size))
    deadline = time.monotonic() + timeout.total_seconds()
    while waiting:
        for asker in sorted(waiting):
            if not store.check([f"{_JOIN}/ask/{asker}"]):
                continue
            nonce = store.get(f"{_JOIN}/ask/{asker}").decode()
            if answered.get(asker) != nonce:  # a new asker, or a dead attempt's nonce answered before
                store.set(f"{_JOIN}/answer/{nonce}", str(attempt))
                answered[asker] = nonce
            if store.check([f"{_JOIN}/ack/{nonce}/{attempt}"]):
                waiting.discard(asker)
        if waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank 0 numbered attempt {attempt} on torchrun's store, but ranks {sorted(waiting)} of "
                    f"{world_size} did not ask for it within {timeout}; they did not start or cannot reach "
                    f"MASTER_ADDR:MASTER_PORT"
                )
            time.sleep(_POLL_S)
    return attempt


def attempt_store(timeout: timedelta) -> dist.Store:
    """A client of torchrun's agent store whose keys are private to this attempt (agreed_attempt)."""
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=world_size,
        is_master=False,  # the agent hosts the store; workers only connect
        timeout=timeout,
    )
    attempt = agreed_attempt(store, rank, world_size, timeout)
    return dist.PrefixStore(f"mesh3d/attempt_{attempt}", store)
