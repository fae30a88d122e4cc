"""Run examples/llama/train.py on ranks forked from the tests' fork server, as torchrun would start it.

`run_train(argv, nproc=N)` calls the script's `main(argv)` in N processes with torchrun's
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), or, with nproc=0, in one process
without it, as `python train.py` runs; each process's stdout and stderr (file descriptors 1 and
2, so C++ output too) go to files, joined rank by rank as torchrun's would be. It returns a
`subprocess.CompletedProcess` like `subprocess.run` of the same command, exit status included
(argparse's and a configuration error's 2: the first rank's nonzero one), and each rank's in
`rank_returncodes`.

Why not torchrun: each of its ranks is a fresh interpreter that imports torch, mesh3d and
transformers (5-8 s of CPU each, and the launcher's own torch import) before one tiny step; a rank
forked here starts from a server that imported them once (multiprocess.PRELOADED). The launcher
itself (torchrun's agent, restarts, two nodes, signals, a hang's exit) is what test_torchrun.py,
test_restart.py, test_hang.py and test_config_errors.py run for real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from multiprocess import RankFailure, run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = "examples/llama/train.py"
# What `python train.py` sees without torchrun: none of the rendezvous variables.
_NO_LAUNCHER = {
    var: None for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
}


def _train_rank(argv: list[str], out_dir: str) -> int:
    """One rank: train.py's main with its output in out_dir; its exit status (an error raises)."""
    rank = os.environ.get("RANK", "0")
    os.chdir(ROOT)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, stream in ((1, "out"), (2, "err")):
        with open(os.path.join(out_dir, f"{rank}.{stream}"), "w") as file:
            os.dup2(file.fileno(), fd)
    import warnings

    warnings.simplefilter("ignore")  # the tests' torchrun runs set PYTHONWARNINGS=ignore
    sys.argv = [SCRIPT, *argv]
    from examples.llama import train

    try:
        train.main(list(argv))
        return 0
    except SystemExit as done:  # argparse's exit, a configuration error's (config_errors.py)
        if isinstance(done.code, str):
            print(done.code, file=sys.stderr)
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:
        traceback.print_exc()
        raise  # run_on_ranks fails the launch (and stops peers waiting on this rank)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_train(
    argv: list[str],
    nproc: int = 0,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """train.py with `argv` on `nproc` ranks (0: one process, no torchrun environment); `env` is
    added to each rank's. With check, a nonzero exit fails with the output's tail."""
    with tempfile.TemporaryDirectory(prefix="train-launch-") as out_dir:
        rank_env = {**(_NO_LAUNCHER if nproc == 0 else {}), **(env or {})}
        try:
            codes = run_on_ranks(_train_rank, max(nproc, 1), list(argv), out_dir, timeout=timeout, env=rank_env)
            failure = ""
        except RankFailure as error:
            codes, failure = [1], str(error)
        stdout, stderr = (
            "".join(
                Path(out_dir, f"{rank}.{stream}").read_text()
                for rank in range(max(nproc, 1))
                if Path(out_dir, f"{rank}.{stream}").exists()
            )
            for stream in ("out", "err")
        )
    returncode = next((code for code in codes if code), 0)
    done = subprocess.CompletedProcess([SCRIPT, *argv], returncode, stdout, stderr + failure)
    done.rank_returncodes = codes
    if check:
        assert returncode == 0, f"exit {returncode}\n{stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done
