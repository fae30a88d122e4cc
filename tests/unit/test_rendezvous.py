"""The attempt number every worker of one torchrun attempt agrees on (mesh3d/distributed/rendezvous.py).

Ranks are threads on one real TCPStore (the role torchrun's agent store plays). Attempts run one
after another, as torchrun runs them (every worker of an attempt is stopped before the next
starts): each attempt's ranks get one number, new on the store, whatever order they arrive in and
whatever a dead attempt left behind; nothing read from the environment, so agents that count
restarts differently (a fresh one and a restarted one) cannot disagree.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from mesh3d.distributed.rendezvous import agreed_attempt

TIMEOUT = timedelta(seconds=20)
WORLD = 4


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    yield store


def _client(server) -> dist.Store:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)


def _attempt(server, world: int = WORLD, seed: int = 0) -> list[int]:
    """One attempt: every rank on its own client, started in a shuffled order with small delays."""
    delays = random.Random(seed).sample([0.0, 0.02, 0.05, 0.1, 0.15, 0.2][:world], world)

    def rank_main(rank: int) -> int:
        time.sleep(delays[rank])
        return agreed_attempt(_client(server), rank, world, TIMEOUT)

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(rank_main, range(world)))


def test_each_attempt_agrees_on_a_new_number(server):
    seen = []
    for seed in range(3):  # rank 0 first in some attempts, last in others
        numbers = _attempt(server, seed=seed)
        assert len(set(numbers)) == 1, numbers
        seen.append(numbers[0])
    assert seen == [1, 2, 3]


def test_what_a_dead_attempt_left_does_not_mislead_the_next(server):
    first = _attempt(server)[0]
    # A dead attempt: rank 2 asked and was never answered; rank 0 numbered it and died; rank 3
    # was answered under a nonce of its own. None of them acknowledged anything.
    dead = _client(server)
    dead.set("mesh3d/join/ask/2", "nonce-of-a-dead-worker")
    dead.add("mesh3d/join/attempts", 1)
    dead.set("mesh3d/join/ask/3", "answered-dead-nonce")
    dead.set("mesh3d/join/answer/answered-dead-nonce", str(first + 1))
    numbers = _attempt(server, seed=1)
    assert len(set(numbers)) == 1 and numbers[0] not in (first, first + 1), (first, numbers)


def test_a_world_of_one_needs_no_answer(server):
    assert agreed_attempt(_client(server), 0, 1, TIMEOUT) == 1


def test_rank_0_names_the_ranks_that_never_asked(server):
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] of 3 did not ask"):
        agreed_attempt(_client(server), 0, 3, timedelta(seconds=0.3))
