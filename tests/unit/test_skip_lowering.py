"""Skip connections in the lowering: a message straight from producer to consumer (and its
gradient straight back), none through the ranks between, both ends in one order, every schedule
family still able to finish, every message's tag unique."""

import pytest

from mesh3d.pipeline import SCHEDULES, Kind, ScheduleError, build_schedule, lower
from mesh3d.pipeline.schedule.communicators import RUNTIME
from mesh3d.pipeline.schedule.ir import COMPUTE

FAMILIES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved_1f1b", 2),
    ("zero_bubble", 1),
    ("zero_bubble", 2),
    ("zbv", 2),
    ("dualpipev", 2),
]


def skip_messages(lowered, pair):
    """Per rank, the communication actions of the skip `pair` = (producer, consumer)."""
    producer, consumer = pair
    found = {}
    for rank, actions in enumerate(lowered.actions):
        for a in actions:
            if a.kind in COMPUTE or a.far_stage is None:
                continue
            ends = {a.stage, a.far_stage}
            if ends == {producer, consumer}:
                found.setdefault(rank, []).append(a)
    return found


@pytest.mark.parametrize("name,v", FAMILIES)
def test_a_skip_from_the_first_stage_to_the_last_is_sent_directly(name, v):
    pp = 4
    m = max(5, SCHEDULES[name].min_microbatches(pp))
    schedule = build_schedule(name, pp, m, v)
    last = schedule.n_stages - 1
    lowered = lower(schedule, skips=[(0, last)])  # check_lowered inside: it can finish, both ends agree
    plain = lower(schedule)
    found = skip_messages(lowered, (0, last))
    first_rank, last_rank = schedule.stage_rank(0), schedule.stage_rank(last)
    if first_rank == last_rank:  # a V (zbv, dualpipev) holds both ends on rank 0: handed over in memory
        assert found == {}
    else:
        assert set(found) == {first_rank, last_rank}  # the ranks between see nothing of it

        def kinds(rank):
            return sorted(str(a.kind) for a in found[rank])

        assert kinds(first_rank) == sorted(["RECV_B", "SEND_F"] * m)
        assert kinds(last_rank) == sorted(["RECV_F", "SEND_B"] * m)
    # what the skip adds is only its own messages: the rest of every list is unchanged
    for rank in range(pp):
        others = [a for a in lowered.actions[rank] if a.far_stage is None]
        assert others == list(plain.actions[rank]), rank


@pytest.mark.parametrize("name,v", FAMILIES)
def test_messages_pair_by_order_with_several_skips(name, v):
    """No tag tells messages apart (NCCL has none): on each channel, the sender's sends to a peer
    and the peer's receives from it list the same messages in the same order."""
    schedule = build_schedule(name, 4, max(4, SCHEDULES[name].min_microbatches(4)), v)
    n = schedule.n_stages
    skips = [(0, n - 1), (0, 2), (1, n - 1)] if n > 4 else [(0, 3), (0, 2), (1, 3)]
    lowered = lower(schedule, skips=skips)
    sent, received = {}, {}
    for rank, actions in enumerate(lowered.actions):
        for a in actions:
            if a.kind in (Kind.SEND_F, Kind.SEND_B):
                message = (a.kind.value, a.stage, a.other_stage, a.microbatch)
                sent.setdefault((RUNTIME.of_message(rank, a), rank, a.peer), []).append(message)
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                message = (Kind.SEND_F if a.kind == Kind.RECV_F else Kind.SEND_B).value, a.other_stage, a.stage
                received.setdefault((RUNTIME.of_message(rank, a), a.peer, rank), []).append((*message, a.microbatch))
    assert sent == received and any(len(messages) > 1 for messages in sent.values())


def test_a_skip_must_go_past_the_next_stage():
    schedule = build_schedule("1f1b", 4, 4)
    for bad in [(0, 1), (2, 1), (0, 4), (-1, 2)]:
        with pytest.raises(ScheduleError, match="skip connection"):
            lower(schedule, skips=[bad])
