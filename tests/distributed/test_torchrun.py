"""train.py under torchrun: 8 ranks at (pp, dp, tp) = (2, 2, 2) on one node, 4 at (2, 1, 2) on two nodes.

The losses must equal those of the same command in one plain process (1, 1, 1) on the same global
batches: relative error <= 1e-4 (fp32; the sums run in a different order). The two-node launch
starts two torchrun agents with c10d rendezvous on 127.0.0.1, 2 processes each (a pipeline stage
per node: the stages' messages cross nodes), and checks from each rank's own report that every
tensor-parallel group lies within one node.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from multiprocess import free_port

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ["examples/llama/train.py", "--seq-len", "64", "--global-batch", "16", "--log-every", "1"]
TOLERANCE = 1e-4
TIMEOUT_S = 300


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "GROUP_RANK"):
        env.pop(var, None)
    return env


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def _check(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


@pytest.fixture(scope="module")
def single_process_losses(tmp_path_factory) -> list[float]:
    metrics = tmp_path_factory.mktemp("one") / "metrics.jsonl"
    cmd = [sys.executable, *TRAIN, "--steps", "5", "--metrics", str(metrics)]
    _check(subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S))
    return _losses(metrics)


def _assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    errors = [abs(a - b) / abs(b) for a, b in zip(got, want)]
    assert max(errors) <= TOLERANCE, (got, want, errors)


def test_8_ranks_train_like_one_process(tmp_path, single_process_losses):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "8",
        *TRAIN,
        "--pp",
        "2",
        "--dp",
        "2",
        "--tp",
        "2",
        "--steps",
        "5",
        "--metrics",
        str(metrics),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    _check(done)
    assert "step     5  loss" in done.stdout and "tokens/s" in done.stdout
    assert done.stdout.count("step     1  loss") == 1  # rank 0 alone reports
    _assert_close(_losses(metrics), single_process_losses)


def two_agent_command(port: int, nproc_per_node: int) -> list[str]:
    """torchrun as one of two agents ("nodes") meeting through c10d rendezvous on 127.0.0.1:`port`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"mesh3d-test-{port}",
        "--local-addr",
        "127.0.0.1",
    ]


def start_agents(cmd: list[str], env: dict) -> list[subprocess.Popen]:
    return [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]


def finish_agents(agents: list[subprocess.Popen], cmd: list[str]) -> list[subprocess.CompletedProcess]:
    """Wait for both agents (killed if they outlive TIMEOUT_S); each must exit 0."""
    outputs = []
    try:
        for agent in agents:
            stdout, stderr = agent.communicate(timeout=TIMEOUT_S)
            outputs.append(subprocess.CompletedProcess(cmd, agent.returncode, stdout, stderr))
    finally:
        for agent in agents:
            agent.kill()
    for done in outputs:
        _check(done)
    return outputs


def test_two_nodes_on_loopback(tmp_path, single_process_losses):
    metrics, report = tmp_path / "metrics.jsonl", tmp_path / "placement.json"
    cmd = [
        *two_agent_command(free_port(), 2),
        *TRAIN,
        "--pp",
        "2",
        "--dp",
        "1",
        "--tp",
        "2",
        "--steps",
        "3",
        "--metrics",
        str(metrics),
        "--placement-report",
        str(report),
    ]
    finish_agents(start_agents(cmd, _env()), cmd)
    placement = json.loads(report.read_text())
    nodes = sorted(r["node"] for r in placement["ranks"])
    assert nodes == [0] * 2 + [1] * 2, placement
    assert placement["tp_groups_within_one_node"], placement
    node_of = {r["rank"]: r["node"] for r in placement["ranks"]}
    for group in placement["tp_groups"]:
        assert len({node_of[r] for r in group}) == 1, (group, node_of)
    _assert_close(_losses(metrics), single_process_losses[:3])
