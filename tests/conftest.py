"""Test layout: `unit/` runs in this one process, `distributed/` launches processes (gloo on CPU).

`unit/` holds what runs inside the pytest process (a worker pool of the code under test included);
`distributed/` holds what starts other processes: ranks through `multiprocess.run_on_ranks`, torchrun,
or train.py and probes in a fresh interpreter. Every test under `distributed/` carries the
`distributed` marker, so `pytest -m "not distributed"` runs the unit tests alone. `gpu/` holds
what needs a CUDA GPU: its tests launch ranks too (`distributed`), and each file marks itself
`cuda` and skips without a GPU (`gpu_cases.needs_gpu`). The shared
harnesses (`multiprocess.py`, `rank_errors.py`, `pipeline_cases.py`, `checkpoint_cases.py`,
`text_corpus.py`) live beside this file and are importable from both folders; test file names are
unique across the two folders (pytest imports them by basename).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from multiprocess import hide_gpus  # noqa: E402

hide_gpus()  # before anything initializes CUDA: the CPU suite stays on the CPU on a GPU machine


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    launching = (TESTS / "distributed", TESTS / "gpu")  # both start rank processes
    for item in items:
        if any(folder in Path(item.path).parents for folder in launching):
            item.add_marker(pytest.mark.distributed)
    # The files that launch ranks first, the unit tests' many short files after: the two pytest-xdist
    # workers (pyproject.toml) then end together, the short files filling in, rather than one worker
    # finishing a long launch alone. Stable, so each file keeps its own order.
    items.sort(key=lambda item: item.get_closest_marker("distributed") is None)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind():
    """A unit test module that starts a process group in this process (build_mesh's world of one)
    leaves none to the next module: the two pytest workers run the files in an order of their own,
    and the planner's probe needs a process without one (planner/measure/probe.py)."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# MESH3D_TEST_CPU_LOG=FILE: each test's CPU seconds, its rank processes and subprocesses included,
# appended to FILE as "cpu wall nodeid" (docs/testing.md). Each pytest worker moves itself into a
# cgroup v1 cpuacct group of its own (root, Linux), which every process it starts inherits; a
# test's CPU is the group's usage after it less before. pytest's timing cannot see this: ranks
# that share two cores with the other worker's ranks take their time longer, not their CPU.
_cpu_group: Path | None = None


def pytest_sessionstart(session: pytest.Session) -> None:
    import os

    global _cpu_group
    if not os.environ.get("MESH3D_TEST_CPU_LOG"):
        return
    group = Path(f"/sys/fs/cgroup/cpuacct/mesh3d_tests_{os.getpid()}")
    group.mkdir()
    (group / "cgroup.procs").write_text(str(os.getpid()))
    _cpu_group = group


def pytest_sessionfinish(session: pytest.Session) -> None:
    import os

    if _cpu_group is None:
        return
    (_cpu_group.parent / "cgroup.procs").write_text(str(os.getpid()))
    try:
        _cpu_group.rmdir()
    except OSError:  # a process this worker started still runs there (a fork server): it stays
        pass


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    import os
    import time

    if _cpu_group is None:
        yield
        return
    usage = _cpu_group / "cpuacct.usage"
    cpu, wall = int(usage.read_text()), time.monotonic()
    yield
    cpu, wall = (int(usage.read_text()) - cpu) / 1e9, time.monotonic() - wall
    with open(os.environ["MESH3D_TEST_CPU_LOG"], "a") as log:
        log.write(f"{cpu:.1f} {wall:.1f} {item.nodeid}\n")
