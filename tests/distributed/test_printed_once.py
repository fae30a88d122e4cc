"""An error the ranks agreed on is printed once: rank 0's traceback, one line from each other rank
(mesh3d/distributed/printed_once.py). Under torchrun, two ranks of a user's script that ask
build_mesh for different layouts; the hook's choice itself in this process."""

import subprocess
import sys

import pytest
from pipeline_cases import tiny_args
from test_torchrun import ROOT, TIMEOUT_S, _env

import mesh3d
from examples.llama.model import Transformer
from mesh3d.distributed.agree import raise_if_any
from mesh3d.distributed.printed_once import AGREED, FOUND_ON, _hook, agreed

SCRIPT = """
import os, mesh3d
mesh3d.build_mesh(pp=1, dp=-1, tp=1 + int(os.environ["RANK"]))  # rank 1 asks for another layout
"""


def test_the_rank_that_found_it_says_so(capsys):
    """One rank's failure raised everywhere (agree.py): the finder does not say rank 0 found it."""
    with pytest.raises(ValueError) as raised:
        raise_if_any("ValueError: pm.step: bad batch: input token id 64")  # one process: found here, on rank 0
    assert getattr(raised.value, FOUND_ON) == 0
    found_on_1 = agreed(ValueError("pm.step: bad batch: input token id 64"), found_on=1)
    _hook(None, 1)(ValueError, found_on_1, None)
    _hook(None, 2)(ValueError, found_on_1, None)
    assert capsys.readouterr().err.splitlines() == [
        "[rank 1] stopped on the ValueError it found, which rank 0 printed",
        "[rank 2] stopped on the ValueError that rank 0 printed",
    ]


def test_each_rank_prints_what_it_should():
    printed = []

    def previous(kind, error, traceback):
        printed.append(str(error))

    error = agreed(ValueError("the batch is bad"))
    _hook(previous, 0)(ValueError, error, None)
    assert printed == ["the batch is bad"]  # rank 0: in full, as Python would
    _hook(previous, 3)(ValueError, error, None)
    assert printed == ["the batch is bad"]  # rank 3: one line of its own, not the traceback
    _hook(previous, 3)(ValueError, ValueError("only here"), None)
    assert printed == ["the batch is bad", "only here"]  # an error not agreed on: every rank prints it


def test_an_agreed_error_is_printed_by_rank_zero_only(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", tmp_path / "s.py"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode != 0
    # the workers' lines, as torchrun prefixes them ("[rank0]: ..."); its own summary comes after
    assert done.stderr.count("]: Traceback (most recent call last)") == 1, done.stderr[-4000:]
    assert "[rank0]: ValueError: build_mesh: ranks asked for different layouts" in done.stderr
    assert "ranks asked for different layouts" in done.stderr
    assert "[rank 1] stopped on the ValueError that rank 0 printed" in done.stderr, done.stderr[-4000:]


def test_parallelize_marks_its_arithmetic_errors_as_agreed():
    """A keyword every rank checks alike, before any collective (here the schedule), is printed once too."""
    with pytest.raises(ValueError, match="no_such_schedule") as raised:
        mesh3d.parallelize(Transformer(tiny_args(False, 2)), schedule="no_such_schedule")
    assert getattr(raised.value, AGREED, False)
