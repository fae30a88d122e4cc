"""A rank that stops answering becomes an error on every other rank (issue 16).

- In-process, 4 ranks at (pp, dp, tp) = (2, 2, 1), `build_mesh(timeout=10)`: rank 1 SIGSTOPs itself
  inside its stage's forward in the second pipelined step (a helper process wakes it 16 s later,
  so the harness can collect it). Every other rank raises mesh3d.PeerTimeout within 30 s of the
  step's start, saying a peer did not answer within the 10 s timeout, what was waiting (a P2P
  message or a collective) and its own mesh coordinates.
- train.py under torchrun with `--timeout 30` and rank 1 in an endless loop inside step 2: the job
  exits non-zero (instead of waiting 30 minutes), with the error in its log.
"""

import os
import signal
import subprocess
import sys
import time

from multiprocess import run_on_ranks
from pipeline_cases import batches, meta_model
from test_torchrun import ROOT, _env

import mesh3d
from examples.llama.model import loss_fn

TIMEOUT_S = 10
# train.py's timeout bounds the process group's start too, and four fresh interpreters under torchrun
# may start more than 10 s apart while the suite's other worker runs its own ranks
TRAIN_TIMEOUT_S = 30
STOPPED_RANK = 1


def _stopped_in_step_two() -> tuple[str, float] | str:
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=1, timeout=TIMEOUT_S)
    pm = mesh3d.parallelize(meta_model(False, n_layers=4), layout, loss_fn=loss_fn, microbatches=2)
    (first, second) = batches(8)
    pm.step(*first)
    if layout.rank == STOPPED_RANK:

        def stop(module, args):
            subprocess.Popen(["sh", "-c", f"sleep 16; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)

        pm.stages[min(pm.stages)].register_forward_pre_hook(stop)
    began = time.monotonic()
    try:
        pm.step(*second)
    except mesh3d.PeerTimeout as error:
        return str(error), time.monotonic() - began
    except RuntimeError:
        if layout.rank == STOPPED_RANK:
            return "woken"  # its peers are gone by now
        raise
    return "no error"


def test_a_stopped_rank_is_an_error_on_every_other_rank():
    results = run_on_ranks(_stopped_in_step_two, 4, timeout=90)
    coordinates = {0: (0, 0, 0), 2: (1, 0, 0), 3: (1, 1, 0)}
    for rank, (pp, dp, tp) in coordinates.items():
        message, elapsed = results[rank]
        assert elapsed < 30, (rank, elapsed, message)
        assert (
            f"rank {rank} (mesh coordinate pp {pp}, dp {dp}, tp {tp}): a peer did not answer within the "
            f"process-group timeout of {TIMEOUT_S} s while this rank waited for " in message
        ), message
        assert "P2P recv" in message or "P2P send" in message or "collective" in message, message


def test_train_py_exits_instead_of_waiting(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        "--monitor-interval",
        "0.1",
        "examples/llama/train.py",
        "--pp",
        "2",
        "--dp",
        "2",
        "--seq-len",
        "32",
        "--global-batch",
        "8",
        "--steps",
        "4",
        "--timeout",
        str(TRAIN_TIMEOUT_S),
        "--metrics",
        str(tmp_path / "m.jsonl"),
    ]
    began = time.monotonic()
    done = subprocess.run(
        cmd, cwd=ROOT, env={**_env(), "MESH3D_FAULT": "hang@1:step:2"}, capture_output=True, text=True, timeout=180
    )
    assert done.returncode != 0
    said = f"did not answer within the process-group timeout of {TRAIN_TIMEOUT_S} s"
    assert "PeerTimeout" in done.stderr and said in done.stderr, done.stderr[-4000:]
    assert time.monotonic() - began < 120
