"""The multi-process harness itself (tests/multiprocess.py): a failing, silent or hung rank is
reported, not waited on."""

import os
import time

import pytest
from multiprocess import RankFailure, run_on_ranks


def _raise_on_rank_one():
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("boom on rank one")
    return "fine"


def _hang_on_rank_two():
    if int(os.environ["RANK"]) == 2:
        time.sleep(3600)
    return "fine"


def _exit_silently_on_rank_one(code):
    if int(os.environ["RANK"]) == 1:
        os._exit(code)
    return "fine"


@pytest.mark.parametrize("code", [0, 3])
def test_harness_reports_a_rank_that_dies_without_reporting(code):
    start = time.monotonic()
    with pytest.raises(RankFailure, match=f"rank 1 raised:\nprocess exited with code {code} without reporting"):
        run_on_ranks(_exit_silently_on_rank_one, 2, code, timeout=30)
    assert time.monotonic() - start < 10


def test_harness_reports_traceback_of_failing_rank():
    with pytest.raises(RankFailure, match="(?s)rank 1 raised.*boom on rank one"):
        run_on_ranks(_raise_on_rank_one, 2, timeout=30)


def test_harness_kills_a_hang_and_names_the_rank():
    start = time.monotonic()
    # The timeout leaves the healthy ranks time to start on a loaded machine (CI once took over 3 s
    # to start them, before the fork server preloaded mesh3d).
    with pytest.raises(RankFailure, match=r"ranks \[2\] of 3 did not finish within the 10 s timeout"):
        run_on_ranks(_hang_on_rank_two, 3, timeout=10)
    assert time.monotonic() - start < 40
