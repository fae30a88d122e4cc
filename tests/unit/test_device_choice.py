"""Which device build_mesh picks (process_group.pick_device), with CUDA's presence mocked: CPU under
gloo, a GPU per process from LOCAL_RANK, and cuda:0 where a launcher shows each process its own GPU
alone."""

import pytest
import torch

from mesh3d.distributed import process_group


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `n` visible GPUs (0: none); set_device is recorded, not run."""
    chosen = []

    def machine(n: int, local_rank: int | None = None, group: str | None = None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        monkeypatch.setattr(process_group.dist, "is_initialized", lambda: group is not None)
        monkeypatch.setattr(process_group.dist, "get_backend", lambda: group)
        if local_rank is None:
            monkeypatch.delenv("LOCAL_RANK", raising=False)
        else:
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        return chosen

    return machine


def test_no_gpu_means_cpu(gpus):
    gpus(0)
    assert process_group.pick_device(None) == torch.device("cpu")


def test_one_gpu_per_local_rank(gpus):
    chosen = gpus(8, local_rank=5)
    assert process_group.pick_device(None) == torch.device("cuda", 5)
    assert chosen == [torch.device("cuda", 5)]


def test_one_visible_gpu_per_process_is_cuda_0_whatever_the_local_rank(gpus):
    gpus(1, local_rank=7)
    assert process_group.pick_device(None) == torch.device("cuda", 0)


def test_more_processes_than_visible_gpus_is_refused(gpus):
    gpus(2, local_rank=3)
    with pytest.raises(ValueError, match="LOCAL_RANK=3 but this process sees 2 GPUs"):
        process_group.pick_device(None)


@pytest.mark.parametrize("group, backend", [("gloo", None), (None, "gloo"), ("cpu:gloo,cuda:nccl", "gloo")])
def test_gloo_means_cpu_on_a_machine_with_gpus(gpus, group, backend):
    gpus(8, local_rank=0, group=group)
    assert process_group.pick_device(None, backend) == torch.device("cpu")


@pytest.mark.parametrize("group, backend", [("nccl", None), (None, "nccl"), ("cpu:gloo,cuda:nccl", None)])
def test_nccl_means_cuda(gpus, group, backend):
    gpus(8, local_rank=2, group=group)
    assert process_group.pick_device(None, backend) == torch.device("cuda", 2)


def test_an_explicit_device_wins(gpus):
    gpus(8, local_rank=1, group="gloo")
    assert process_group.pick_device("cuda:3") == torch.device("cuda", 3)
    gpus(0)
    with pytest.raises(ValueError, match="CUDA is not available"):
        process_group.pick_device("cuda")
