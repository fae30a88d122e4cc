"""NCCL's watchdog and the gloo side group, in one process without a GPU: the environment defaults
set before an NCCL process group starts (never over the user's), the side group build_mesh creates
on NCCL, and agree's exchange running on it."""

from datetime import timedelta

import pytest
import torch

from mesh3d.distributed import agree, host_group, process_group
from mesh3d.distributed.nccl_watchdog import WATCHDOG_DEFAULTS, set_watchdog_defaults

NAMES = [name for name, (_, aliases) in WATCHDOG_DEFAULTS.items() for name in (name, *aliases)]


@pytest.fixture
def clean_environment(monkeypatch):
    """No watchdog variable set; whatever the test writes is undone after it."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_defaults_fill_what_the_user_left_unset_and_keep_what_they_set():
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}  # the older name
    chosen = set_watchdog_defaults(environ)
    assert chosen == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "50", **chosen}
    fresh = {}
    assert (
        set_watchdog_defaults(fresh)
        == fresh
        == {
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_FR_BUFFER_SIZE": "2000",
        }
    )


def test_the_nccl_group_starts_with_the_defaults_in_its_environment(clean_environment):
    import os

    clean_environment.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")  # the user's choice stands
    seen = {}

    def init_process_group(backend, **kwargs):
        seen[backend] = {name: os.environ.get(name) for name in NAMES}

    clean_environment.setattr(process_group.dist, "init_process_group", init_process_group)
    clean_environment.setattr(process_group, "launched_by_torchrun", lambda: False)
    process_group.init_default_group("gloo", torch.device("cpu"), None)
    assert {name for name, value in seen["gloo"].items() if value} == {"TORCH_NCCL_DUMP_ON_TIMEOUT"}  # gloo: none set
    process_group.init_default_group("nccl", torch.device("cpu"), timedelta(seconds=10))
    assert seen["nccl"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert seen["nccl"]["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert seen["nccl"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"


def test_on_nccl_build_mesh_makes_a_gloo_world_group_and_agree_exchanges_on_it(monkeypatch):
    world = object()  # stands for the default process group
    monkeypatch.setattr(host_group, "_default_group", lambda: world)
    created = []

    def new_group(ranks=None, timeout=None, backend=None):
        created.append({"ranks": ranks, "timeout": timeout, "backend": backend})
        return f"gloo side group {len(created)}"

    monkeypatch.setattr(process_group.dist, "new_group", new_group)
    process_group.start_host_group("nccl", timedelta(seconds=10))
    assert created == [{"ranks": None, "timeout": timedelta(seconds=10), "backend": "gloo"}]  # the whole world
    assert host_group.host_group() == "gloo side group 1"

    exchanged = []

    def all_gather_object(output, value, group=None):
        exchanged.append(group)
        output[:] = [value, value]

    monkeypatch.setattr(agree.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(agree.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(agree.dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(agree.dist, "all_gather_object", all_gather_object)
    agree.check_same_everywhere((2, 1, 1), str)
    assert exchanged == ["gloo side group 1"]

    process_group.start_host_group("gloo", timedelta(seconds=10))  # on gloo: the default group itself
    agree.check_same_everywhere((2, 1, 1), str)
    assert exchanged[-1] is None and len(created) == 1

    process_group.start_host_group("nccl", timedelta(seconds=10))
    monkeypatch.setattr(host_group, "_default_group", object)  # a new default group: the side group is gone
    assert host_group.host_group() is None
    host_group.use_host_group(None)
