"""async_save's parts that need no second process: the handle (done, wait, a failure raised on
every wait), the one-save-in-flight rule (a failure nobody waited for raised once, by the next
save), the host copy (refilled in place for the same shapes, made anew for others), and a whole
async_save in a private world of one: what is saved is the state at the call, not after the
steps taken meanwhile. Several ranks: tests/distributed/test_async_checkpoint.py."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import mesh3d
from examples.llama.config import ModelArgs
from examples.llama.model import Transformer, loss_fn
from mesh3d.checkpoint import background_save
from mesh3d.checkpoint.background_save import AsyncSave, finish_previous
from mesh3d.checkpoint.staging import HostCopy

ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


def test_the_handle_is_done_when_the_write_ends_and_wait_returns_the_path():
    release = threading.Event()
    handle = AsyncSave("ckpt/step1", lambda: release.wait(timeout=30))
    assert not handle.done() and "writing" in repr(handle)
    release.set()
    assert handle.wait() == "ckpt/step1"
    assert handle.done() and "published" in repr(handle)


def test_a_failure_is_raised_by_every_wait_and_by_the_next_save_only_if_nobody_waited():
    def fail():
        raise ValueError("disk gone")

    told = AsyncSave("ckpt/step1", fail)
    for _ in range(2):
        with pytest.raises(ValueError, match="disk gone"):
            told.wait()
    background_save._in_flight = told
    finish_previous()  # the caller saw it already: the next save goes ahead
    assert background_save._in_flight is None

    background_save._in_flight = AsyncSave("ckpt/step2", fail)  # nobody waits for this one
    with pytest.raises(ValueError, match="disk gone"):
        finish_previous()
    finish_previous()  # raised once, then forgotten
    assert background_save._in_flight is None


def test_the_host_copy_is_refilled_in_place_for_the_same_shapes():
    copy = HostCopy()
    weight = torch.arange(6.0).reshape(2, 3)
    entries = {"model.w": weight, "optim.state.w.step": torch.tensor(3.0), "optim.param_groups.w.betas": (0.9, 0.95)}
    staged = copy.stage(entries, torch.device("cpu"))
    weight += 1  # a step after the call
    assert torch.equal(staged["model.w"], torch.arange(6.0).reshape(2, 3)) and staged["model.w"] is not weight
    assert staged["optim.param_groups.w.betas"] == (0.9, 0.95)
    again = copy.stage({**entries, "optim.state.w.step": torch.tensor(4.0)}, torch.device("cpu"))
    assert again["model.w"] is staged["model.w"] and torch.equal(again["model.w"], weight)  # the same buffer
    assert again["optim.state.w.step"].item() == 4.0
    wider = copy.stage({**entries, "model.w": torch.ones(2, 4)}, torch.device("cpu"))
    assert wider["model.w"].shape == (2, 4) and wider["model.w"] is not staged["model.w"]


@pytest.fixture
def pm():
    torch.manual_seed(0)
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        yield mesh3d.parallelize(Transformer(ARGS), layout, loss_fn=loss_fn, schedule="gpipe", dp_mode="ddp")
    finally:
        finish_previous()
        dist.destroy_process_group()


def _step(pm, optimizer) -> None:
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    pm.step(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    optimizer.zero_grad()


def test_async_save_in_one_process_writes_the_state_at_the_call(pm, tmp_path):
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    _step(pm, optimizer)
    at_call = {k: v.clone() for k, v in pm.full_state_dict().items()}
    handle = mesh3d.checkpoint.async_save(tmp_path / "step1", pm, optimizer, extra={"note": "at the call"})
    _step(pm, optimizer)  # while the write may still run
    assert handle.wait() == str(tmp_path / "step1") and handle.done()
    assert mesh3d.checkpoint.load(tmp_path / "step1", pm, optimizer)["extra"] == {"note": "at the call"}
    loaded = pm.full_state_dict()
    assert all(torch.equal(loaded[k], at_call[k]) for k in at_call)
    with pytest.raises(ValueError, match="step must be a non-negative int"):  # raised at the call, nothing started
        mesh3d.checkpoint.async_save(tmp_path / "bad", pm, step=-1)
    assert background_save._in_flight is None
