"""The pipeline's messages on CPU are NCCL's program: each channel's operations run in the order of
the lowered lists, under NCCL's rules (tests/nccl_rules.py), and a list that breaks those rules is
caught by name, never as a hang.

The lowered lists are the reference for the order (schedule/lower.py proves they finish under
NCCL's rules); the rules themselves are enforced independently of the lowering, by the wrapper
over gloo that every rank of the suite runs under. (The mailbox in one process: tests/unit/test_p2p_mailbox.py.)
"""

import dataclasses

import nccl_rules
import pytest
from multiprocess import RankFailure, run_on_ranks
from pipeline_cases import batches, meta_model

import mesh3d
from mesh3d.pipeline.schedule.communicators import RUNTIME
from mesh3d.pipeline.schedule.ir import Kind

SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2), ("zero_bubble", 1), ("zbv", 2), ("dualpipev", 2))
_OPS = {Kind.SEND_F: "send", Kind.SEND_B: "send", Kind.RECV_F: "recv", Kind.RECV_B: "recv"}


def _channel_orders(schedule: str, virtual_stages: int) -> dict:
    """Per channel of this rank: the (op, peer) order a step issued, and the lowered list's."""
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    m = 4
    pm = mesh3d.parallelize(meta_model(False), layout, schedule=schedule, microbatches=m, virtual_stages=virtual_stages)
    runtime = pm._runtime
    peers = runtime.peers
    before = {key: len(nccl_rules.issued_on(group)) for key, group in peers.channels.items()}  # the warm-up
    inputs, targets = batches(2 * m)[0]
    pm.step(inputs, targets)
    expected = {key: [] for key in peers.channels}
    for action in runtime.train_actions:
        if action.kind in _OPS:
            expected[RUNTIME.of_message(peers.pp_rank, action)].append(
                (_OPS[action.kind], peers.global_ranks[action.peer])
            )
    issued = {
        key: [(op.op, op.peer) for op in nccl_rules.issued_on(group)[before[key] :]]
        for key, group in peers.channels.items()
    }
    return {"expected": expected, "issued": issued}


def _orders() -> dict:
    return {case: _channel_orders(*case) for case in SCHEDULES}


def test_each_channel_runs_the_lowered_order_on_cpu():
    """With the one discipline, the CPU run posts every receive where the lowering put it: each
    channel's operations, as issued, equal the lowered list filtered to that channel."""
    per_rank = run_on_ranks(_orders, 2, timeout=180)
    for rank, cases in enumerate(per_rank):
        for case, orders in cases.items():
            assert any(orders["expected"].values()), (rank, case)
            assert orders["issued"] == orders["expected"], (rank, case)


def _receives_first(actions):
    """The old CPU program: every receive of the step posted at its start, the rest in order."""
    receives = [a for a in actions if a.kind in (Kind.RECV_F, Kind.RECV_B)]
    return tuple(receives + [a for a in actions if a.kind not in (Kind.RECV_F, Kind.RECV_B)])


def _hoisted_step() -> float:
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    pm = mesh3d.parallelize(meta_model(False), layout, schedule="interleaved_1f1b", microbatches=4)
    runtime = pm._runtime
    runtime.train_actions = _receives_first(runtime.train_actions)  # past the lowering's check
    inputs, targets = batches(8)[0]
    return pm.step(inputs, targets).item()


def _lowered_step() -> float:
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    pm = mesh3d.parallelize(meta_model(False), layout, schedule="interleaved_1f1b", microbatches=4)
    inputs, targets = batches(8)[0]
    return pm.step(inputs, targets).item()


def test_a_list_that_breaks_nccls_order_is_caught_by_name():
    """Receives posted at the step's start, as the CPU path once did, pass on plain gloo (matched
    loosely, they still give the lowered lists' loss) but hold up the sends behind them on NCCL:
    under the rules the step stops with an error naming the communicator and the operation at its
    head, within the rules' timeout."""
    lowered = run_on_ranks(_lowered_step, 2, timeout=120)
    loose = run_on_ranks(_hoisted_step, 2, timeout=120, env={nccl_rules.ENV: "0"})
    assert loose == pytest.approx(lowered, rel=1e-6)
    with pytest.raises(RankFailure) as caught:
        run_on_ranks(_hoisted_step, 2, timeout=120, env={nccl_rules.TIMEOUT_ENV: "8"})
    text = str(caught.value)
    assert "NCCLOrderDeadlock" in text, text
    assert "on communicator 'mesh3d pipeline' (global ranks [0, 1])" in text, text
    assert "the operation at the head is #" in text and "recv of" in text, text


def test_the_rules_pair_messages_by_order_not_by_tag():
    """Two messages sent with their tags swapped land in issue order under the rules (as NCCL,
    which has no tags, delivers them), where plain gloo would pair them by tag."""
    per_rank = run_on_ranks(_swapped_tags, 2, timeout=60)
    assert per_rank[1] == [1.0, 2.0]
    rules_log = per_rank[0]
    assert rules_log == [dataclasses.astuple(nccl_rules.Issued("send", 1, 4, t)) for t in (7, 3)]


def _swapped_tags():
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    if dist.get_rank() == 0:
        works = [dist.isend(torch.tensor([1.0]), dst=1, group=group, tag=7)]
        works.append(dist.isend(torch.tensor([2.0]), dst=1, group=group, tag=3))
        for work in works:
            work.wait()
        return [dataclasses.astuple(op) for op in nccl_rules.issued_on(group)]
    first, second = torch.zeros(1), torch.zeros(1)
    works = [dist.irecv(first, src=0, group=group, tag=3), dist.irecv(second, src=0, group=group, tag=7)]
    for work in works:
        work.wait()
    return [first.item(), second.item()]


def _collective_behind_a_receive() -> str:
    """Rank 0 posts a receive, then joins an all-reduce on the same communicator; rank 1 joins the
    all-reduce, then sends. gloo alone finishes; on NCCL the all-reduce waits behind the receive."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.new_group([0, 1], group_desc="channel and collective")
    value, message = torch.ones(1), torch.zeros(1)
    if dist.get_rank() == 0:
        receive = dist.irecv(message, src=1, group=group)
        dist.all_reduce(value, group=group)
        receive.wait()
    else:
        dist.all_reduce(value, group=group)
        dist.send(message, dst=0, group=group)
    return "finished"


def test_a_collective_on_a_channel_keeps_its_place_in_the_order():
    """A collective on a communicator that carries messages queues behind them as on NCCL: plain
    gloo finishes the lists, the rules stop them by name."""
    assert run_on_ranks(_collective_behind_a_receive, 2, timeout=60, env={nccl_rules.ENV: "0"}) == ["finished"] * 2
    with pytest.raises(RankFailure) as caught:
        run_on_ranks(_collective_behind_a_receive, 2, timeout=60, env={nccl_rules.TIMEOUT_ENV: "5"})
    text = str(caught.value)
    assert "NCCLOrderDeadlock" in text and "'channel and collective'" in text, text
