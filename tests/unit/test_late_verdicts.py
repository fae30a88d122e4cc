"""A call's device verdict is judged by the next call, never by its own: held in host memory,
read through numpy (no torch read the counter would see), and by `judge_now` at once."""

import pytest
import torch
from host_syncs import HostSyncCounter

from mesh3d.step.late_verdicts import LateVerdicts


def _refuse(flags: list[float]) -> None:
    if flags[0]:
        raise ValueError(f"faulty call: {flags}")


def test_a_faulty_call_is_raised_by_the_next_and_nothing_is_read_through_torch():
    late = LateVerdicts()
    faulty = torch.tensor([1.0, 2.0])
    with HostSyncCounter() as syncs:
        late.hold_and_judge_previous(faulty, _refuse)  # its own call: held, not judged
        faulty.zero_()  # the held copy is the value at the call's end, not the tensor's later one
    assert not syncs.ops, syncs.ops
    with pytest.raises(ValueError, match=r"faulty call: \[1.0, 2.0\]"):
        late.hold_and_judge_previous(torch.zeros(2), _refuse)
    late.judge_now()  # the clean call held by the raising one: nothing to raise
    late.judge_now()  # nothing held


def test_judge_now_reads_the_last_call_at_once():
    late = LateVerdicts()
    late.hold_and_judge_previous(torch.ones(1), _refuse)
    with pytest.raises(ValueError, match="faulty call"):
        late.judge_now()
    late.judge_now()  # judged once: a second flush raises nothing


def test_a_verdict_discarded_before_a_load_is_never_raised():
    """`pm.discard_in_flight` (checkpoint loads call it) forgets the held verdict: the weights it
    was about are replaced, and the first call after the load judges only itself."""
    late = LateVerdicts()
    late.hold_and_judge_previous(torch.ones(1), _refuse)
    late.discard()
    late.hold_and_judge_previous(torch.zeros(1), _refuse)  # the previous (faulty) call is gone
    late.judge_now()
