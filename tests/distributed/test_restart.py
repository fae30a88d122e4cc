"""Restart under torchrun (issue 16): a worker SIGKILLed, torchrun starts new ones, nothing is lost.

train.py at (pp, dp, tp) = (2, 1, 1) on 2 ranks (each a fresh interpreter per attempt: the fewest
that hold a peer waiting on the killed one), `--max-restarts 1 --checkpoint-every 2 --resume`, 5
steps. The fault comes from the MESH3D_FAULT test hook (examples/llama/fault_injection.py), which
fires in torchrun's first attempt only:
- rank 1 killed inside step 4 (in its stage's forward), after the step-2 checkpoint;
- rank 0 killed inside the save of the step-4 checkpoint (files written, not yet published), and
  inside its background write under --async-checkpoint (the loop having gone on to step 5).
(`--resume` with no checkpoint yet trains from the start: test_train_checkpoint.py.)
Then the way a cluster takes a lost node: two torchrun agents (a process each, c10d rendezvous
on 127.0.0.1), every process of both SIGKILLed while the workers are inside step 4 (rank 0 hangs
there through the hook), and the same command started again with fresh agents, as a requeued
SLURM job is (examples/slurm/train.sbatch).
Each run must end with the losses of every step (the later JSONL line for a step logged twice)
and the final weights (exported as safetensors) of the same command run without a fault:
relative error <= 1e-5 (fp32; the same layout sums in the same order). Every JSONL line names the
torchrun attempt that wrote it.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multiprocess import free_port
from safetensors.torch import load_file
from test_torchrun import ROOT, _env, finish_agents, start_agents, two_agent_command

TRAIN = [
    "examples/llama/train.py",
    "--pp",
    "2",
    "--dp",
    "1",
    "--seq-len",
    "32",
    "--global-batch",
    "8",
    "--steps",
    "5",
    "--warmup",
    "2",
    "--log-every",
    "1",
    "--checkpoint-every",
    "2",
    "--resume",
]
TOLERANCE = 1e-5
TIMEOUT_S = 480


def _train(tmp, fault: str | None = None) -> tuple[subprocess.CompletedProcess, list[dict]]:
    env, flags = _env(), []
    if fault:
        fault, *flags = fault.split()  # "kill@0:save:4 --async-checkpoint": the fault, then train.py flags
        env["MESH3D_FAULT"] = fault
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.1",
        *TRAIN,
        *flags,
        "--checkpoint-dir",
        str(tmp / "ckpt"),
        "--metrics",
        str(tmp / "metrics.jsonl"),
        "--export-hf",
        str(tmp / "final"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done, [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(export_dir, want_weights: dict) -> None:
    """The safetensors export in `export_dir` holds `want_weights`, each within TOLERANCE (relative)."""
    weights = load_file(export_dir / "model.safetensors")
    assert sorted(weights) == sorted(want_weights)
    for name, want in want_weights.items():
        error = ((weights[name] - want).norm() / want.norm()).item()
        assert error <= TOLERANCE, (name, error)


def _losses_by_step(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}  # a step logged twice: the later line wins


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fault_free")
    _, records = _train(tmp)
    assert [r["restart"] for r in records] == [0] * 5
    return _losses_by_step(records), load_file(tmp / "final" / "model.safetensors")


@pytest.mark.parametrize(
    "fault, resumed_from",
    [
        ("kill@1:step:4", "step2"),  # mid-step, after the first checkpoint
        ("kill@0:save:4", "step2"),  # rank 0 during a save: step4 never published
        ("kill@0:save:4 --async-checkpoint", "step2"),  # in the background write, training gone on: the same
    ],
)
def test_a_killed_worker_is_restarted_and_nothing_is_lost(tmp_path, fault_free, fault, resumed_from):
    want_losses, want_weights = fault_free
    done, records = _train(tmp_path, fault)
    restarts = [r["restart"] for r in records]
    assert restarts[0] == 0 and restarts[-1] == 1, restarts  # the first attempt logged, the second finished
    assert f"resumed from {tmp_path / 'ckpt' / resumed_from}" in done.stdout
    first_of_restart = restarts.index(1)
    assert records[first_of_restart]["step"] == int(resumed_from[4:]) + 1

    got = _losses_by_step(records)
    assert sorted(got) == sorted(want_losses) == [1, 2, 3, 4, 5]
    errors = {s: abs(got[s] - want_losses[s]) / abs(want_losses[s]) for s in want_losses}
    assert max(errors.values()) <= TOLERANCE, (got, want_losses)

    assert_same_weights(tmp_path / "final", want_weights)


def test_the_fault_hook_is_off_unless_asked_and_only_in_the_first_attempt(monkeypatch):
    from examples.llama.fault_injection import FaultInjection

    monkeypatch.delenv("MESH3D_FAULT", raising=False)
    assert FaultInjection.from_env(1) is None
    monkeypatch.setenv("MESH3D_FAULT", "kill@1:save:4")
    fault = FaultInjection.from_env(1)
    assert (fault.phase, fault.step) == ("save", 4) and FaultInjection.from_env(0) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert FaultInjection.from_env(1) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("MESH3D_FAULT", "explode@1:step:2")
    with pytest.raises(SystemExit, match="ACTION@RANK:PHASE:STEP"):
        FaultInjection.from_env(1)


def _all_below(pids: list[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while we looked
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], list(pids)
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _wait_for_step(metrics: Path, step: int, agents: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if metrics.exists() and any(json.loads(line)["step"] == step for line in metrics.read_text().splitlines()):
            return
        assert all(agent.poll() is None for agent in agents), [agent.communicate() for agent in agents]
        time.sleep(0.2)
    raise AssertionError(f"step {step} was not logged within {TIMEOUT_S} s")


def test_every_process_of_two_agents_killed_mid_step_then_started_again(tmp_path, fault_free):
    want_losses, want_weights = fault_free
    cmd_tail = [
        *TRAIN,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--metrics",
        str(tmp_path / "metrics.jsonl"),
        "--export-hf",
        str(tmp_path / "final"),
    ]
    first = [*two_agent_command(free_port(), 1), *cmd_tail]
    agents = start_agents(first, {**_env(), "MESH3D_FAULT": "hang@0:step:4"})
    try:
        _wait_for_step(tmp_path / "metrics.jsonl", 3, agents)  # step 2's checkpoint is published
        time.sleep(1.0)  # every rank is inside step 4 now: rank 0 hangs there, the others wait for it
        everything = [agent.pid for agent in agents]
        everything += _all_below(everything)
        for pid in everything:  # all at once, as a node or a job ends
            os.kill(pid, signal.SIGKILL)
    finally:
        for agent in agents:
            agent.kill()
            agent.communicate()
    assert not (tmp_path / "ckpt" / "step4").exists()

    again = [*two_agent_command(free_port(), 1), *cmd_tail]
    outputs = finish_agents(start_agents(again, _env()), again)
    assert any(f"resumed from {tmp_path / 'ckpt' / 'step2'}" in done.stdout for done in outputs)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 3, 4, 5], records  # step 3 logged before the kill and after

    got = _losses_by_step(records)
    errors = {s: abs(got[s] - want_losses[s]) / abs(want_losses[s]) for s in want_losses}
    assert max(errors.values()) <= TOLERANCE, (got, want_losses)
    assert_same_weights(tmp_path / "final", want_weights)
