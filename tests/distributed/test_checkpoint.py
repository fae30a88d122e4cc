"""Checkpoint behaviour beyond resharding (test_checkpoint_resharding.py).

- a save is atomic: a process SIGKILLed while writing its shards, or after every file was written
  but before the checkpoint was published, leaves `latest()` on the previous checkpoint, which
  loads and resumes exactly; the next save clears the leftovers;
- `latest`, `keep_last`, replacing a checkpoint of the same name, the train state round trip
  (step, data_state, extra), RNG states restored;
- a checkpoint that does not fit the model or the optimizer is refused on every rank, naming the
  first mismatching parameter, before any tensor is read (a barrier after each proves no hang);
- bad arguments to save raise on every rank before any collective.

The directory protocol alone (latest, keep_last, a crashed replacement): tests/unit/test_checkpoint_directories.py.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from checkpoint_cases import build, full_state, train, worst_relative_error
from multiprocess import RankFailure, run_on_ranks
from pipeline_cases import TOLERANCE, tiny_args
from rank_errors import message_of

import mesh3d
from examples.llama.model import Transformer, loss_fn

# -- a save killed midway ------------------------------------------------------------------------


def _kill_during_save(root: str, where: str) -> None:
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    pm, optimizer, loader = build(layout, True, small=True)
    train(pm, optimizer, loader, 2)
    mesh3d.checkpoint.save(f"{root}/step2", pm, optimizer, step=2, data_state=loader.state_dict())
    losses = train(pm, optimizer, loader, 2)
    state = full_state(pm)
    if layout.rank == 0:
        np.savez(f"{root}/uninterrupted.npz", **state)
        Path(f"{root}/uninterrupted_losses.json").write_text(json.dumps(losses))
    dist.barrier()
    if where == "writing shards" and layout.rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    die = (lambda written: os.kill(os.getpid(), signal.SIGKILL)) if where == "before publishing" else None
    mesh3d.checkpoint.save(f"{root}/step4", pm, optimizer, step=4, data_state=loader.state_dict(), before_publish=die)
    raise AssertionError("the save was supposed to be killed")


def _resume_latest(root: str):
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    pm, optimizer, loader = build(layout, True, small=True, init_seed=1)
    path = mesh3d.checkpoint.latest(root)
    state = mesh3d.checkpoint.load(path, pm, optimizer)
    loader.load_state_dict(state["data_state"])
    losses = train(pm, optimizer, loader, 2)
    result = (path, state["step"], losses, full_state(pm))
    mesh3d.checkpoint.save(f"{root}/step4", pm, optimizer, step=4, data_state=loader.state_dict())
    return result


@pytest.mark.parametrize("where", ["writing shards", "before publishing"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, where):
    root = str(tmp_path)
    with pytest.raises(RankFailure, match="exited with code -9"):
        run_on_ranks(_kill_during_save, 2, root, where, timeout=120)
    assert mesh3d.checkpoint.latest(root) == str(tmp_path / "step2")
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("."))
    assert leftovers == [".step4.partial"]
    if where == "before publishing":  # every file was written: only the name was missing
        assert (tmp_path / ".step4.partial" / ".metadata").is_file()

    path, step, losses, state = run_on_ranks(_resume_latest, 2, root, timeout=120)[0]
    assert path == str(tmp_path / "step2") and step == 2
    want_losses = json.loads((tmp_path / "uninterrupted_losses.json").read_text())
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) <= TOLERANCE, (losses, want_losses)
    with np.load(tmp_path / "uninterrupted.npz") as want:
        error, at = worst_relative_error(state, dict(want))
    assert error <= TOLERANCE, f"{error:.2e} at {at}"
    # The resumed run's own save cleared what the killed one left.
    assert mesh3d.checkpoint.latest(root) == str(tmp_path / "step4")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# -- latest, keep_last, train state, RNG, errors ---------------------------------------------------


def _error_message(fn) -> str:
    # After the barrier in `raised`: a rank that hung in a collective would never get there, and the
    # harness fails the test.
    return message_of(fn, (ValueError, FileNotFoundError)) or "no error"


def _model(tied: bool, **changes):
    with torch.device("meta"):
        return Transformer(tiny_args(tied).with_(**changes))


def _behaviour(root: str) -> dict:
    out = {}
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    pm, optimizer, loader = build(layout, False, small=True)
    listings = []
    for step in (1, 2, 3):
        train(pm, optimizer, loader, 1)
        scheduler = {"last_epoch": step, "base_lrs": [1e-4]}
        mesh3d.checkpoint.save(
            f"{root}/step{step}",
            pm,
            optimizer,
            step=step,
            data_state=loader.state_dict(),
            extra={"scheduler": scheduler, "note": "ok"},
            keep_last=2,
        )
        listings.append(sorted(os.listdir(root)))
    out["listings"] = listings
    out["latest"] = mesh3d.checkpoint.latest(root)
    # Replacing a checkpoint of the same name.
    mesh3d.checkpoint.save(
        f"{root}/step3", pm, optimizer, step=3, data_state=loader.state_dict(), extra={"note": "again"}
    )
    # RNG: what is drawn after a load equals what was drawn right after the save.
    drawn_after_save = (torch.rand(3).tolist(), random.random(), float(np.random.rand()))
    state = mesh3d.checkpoint.load(f"{root}/step3", pm, optimizer)
    out["rng_restored"] = (torch.rand(3).tolist(), random.random(), float(np.random.rand())) == drawn_after_save
    out["state"] = state
    out["files"] = sorted(os.listdir(f"{root}/step3"))

    # Checkpoints that do not fit: every rank raises, before any collective of the load.
    mesh3d.checkpoint.save(f"{root}/model_only", pm, step=3)
    errors = {}
    for label, model in {
        "wider": _model(False, dim=64),
        "shallower": _model(False, n_layers=4),
        "tied": _model(True),
    }.items():
        other = mesh3d.parallelize(model, layout, loss_fn=loss_fn)
        errors[label] = _error_message(functools.partial(mesh3d.checkpoint.load, f"{root}/step3", other))
    sgd = torch.optim.SGD(pm.parameters(), lr=0.1, momentum=0.9)
    errors["sgd"] = _error_message(lambda: mesh3d.checkpoint.load(f"{root}/step3", pm, sgd))
    errors["no optimizer saved"] = _error_message(lambda: mesh3d.checkpoint.load(f"{root}/model_only", pm, optimizer))
    errors["missing"] = _error_message(lambda: mesh3d.checkpoint.load(f"{root}/nothing", pm))
    # Bad arguments to save.
    errors["tensor extra"] = _error_message(
        lambda: mesh3d.checkpoint.save(f"{root}/bad", pm, step=4, extra={"x": torch.ones(1)})
    )
    errors["steps differ"] = _error_message(lambda: mesh3d.checkpoint.save(f"{root}/bad", pm, step=4 + layout.rank))
    errors["keep_last"] = _error_message(lambda: mesh3d.checkpoint.save(f"{root}/bad", pm, step=4, keep_last=0))
    errors["no step"] = _error_message(lambda: mesh3d.checkpoint.save(f"{root}/bad", pm))
    rank0_extra = {"x": torch.ones(1)} if layout.rank == 0 else {}  # only rank 0's extra is saved, and checked
    errors["rank 0 extra"] = _error_message(
        lambda: mesh3d.checkpoint.save(f"{root}/bad", pm, step=4, extra=rank0_extra)
    )
    os.makedirs(f"{root}/notes", exist_ok=True)
    if layout.rank == 0:
        Path(f"{root}/notes/todo.txt").write_text("mine")
    dist.barrier()
    errors["not a checkpoint"] = _error_message(lambda: mesh3d.checkpoint.save(f"{root}/notes", pm, step=4))
    out["errors"] = errors
    out["notes kept"] = sorted(os.listdir(f"{root}/notes"))
    out["model only loads"] = _error_message(lambda: mesh3d.checkpoint.load(f"{root}/model_only", pm))
    return out


def test_latest_keep_last_train_state_rng_and_errors(tmp_path):
    per_rank = run_on_ranks(_behaviour, 2, str(tmp_path), timeout=120)
    out = per_rank[0]
    assert out["listings"] == [["step1"], ["step1", "step2"], ["step2", "step3"]]
    assert out["latest"] == str(tmp_path / "step3")
    assert out["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "checksums.json", "rng", "train_state.json"]
    assert out["state"]["step"] == 3 and out["state"]["extra"] == {"note": "again"}
    assert out["state"]["data_state"]["position"] == 3 * 16
    assert all(r["rng_restored"] for r in per_rank)
    for rank, result in enumerate(per_rank):
        errors = result["errors"]
        assert (
            "'tok_embeddings.weight' has shape (64, 32) in the checkpoint, the model expects (64, 64)"
            in errors["wider"]
        )
        assert (
            "holds 36 tensors the model does not have, the first 'layers.4.attention_norm.weight'"
            in errors["shallower"]
        )
        assert "the first 'output.weight'" in errors["tied"]
        assert "holds AdamW optimizer state, not SGD" in errors["sgd"]
        assert "holds no optimizer state" in errors["no optimizer saved"]
        assert "is not a mesh3d checkpoint" in errors["missing"]
        assert "extra must be JSON-serializable" in errors["tensor extra"]
        assert "ranks passed different path, step or data_state" in errors["steps differ"]
        assert "keep_last must be None or an int >= 1" in errors["keep_last"]
        assert "pass step= (the name 'bad' ends in no step number" in errors["no step"]
        assert "extra must be JSON-serializable" in errors["rank 0 extra"]
        assert "exists and is not a mesh3d checkpoint" in errors["not a checkpoint"]
        assert result["model only loads"] == "no error", rank
    assert not (tmp_path / "bad").exists()
    assert out["notes kept"] == ["todo.txt"]


# -- optimizers: state saved before the first step, settings that shape the state ---------------


def _optimizer_cases(root: str) -> dict:
    out = {}
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    # Saved before any step: the optimizer has no state yet. Loading must give a run identical to
    # one that never saved.
    pm, optimizer, loader = build(layout, True, small=True)
    mesh3d.checkpoint.save(f"{root}/step0", pm, optimizer, data_state=loader.state_dict())
    reference_losses = train(pm, optimizer, loader, 2)
    reference = full_state(pm)
    pm, optimizer, loader = build(layout, True, small=True, init_seed=1)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=optimizer.param_groups[0]["lr"], foreach=True)
    state = mesh3d.checkpoint.load(f"{root}/step0", pm, optimizer)
    loader.load_state_dict(state["data_state"])
    out["step0"] = (train(pm, optimizer, loader, 2), reference_losses, worst_relative_error(full_state(pm), reference))

    # Settings that change what state an optimizer keeps must match; implementation flags need not.
    def refused(saved_optimizer, loading_optimizer, name) -> tuple[str, bool]:
        train_model, _, train_loader = build(layout, False, small=True)
        first = saved_optimizer(train_model.parameters())
        inputs, targets = next(train_loader)
        train_model.step(inputs, targets)
        first.step()
        mesh3d.checkpoint.save(f"{root}/{name}", train_model, first, step=1)
        fresh, _, _ = build(layout, False, small=True)
        second = loading_optimizer(fresh.parameters())
        message = _error_message(lambda: mesh3d.checkpoint.load(f"{root}/{name}", fresh, second))
        return message, not second.state  # a refused load leaves the optimizer as it was

    out["amsgrad"] = refused(lambda p: torch.optim.AdamW(p, amsgrad=True), torch.optim.AdamW, "amsgrad")
    out["momentum"] = refused(
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.1), "momentum"
    )
    out["foreach"] = refused(
        lambda p: torch.optim.AdamW(p, foreach=False), lambda p: torch.optim.AdamW(p, foreach=True), "foreach"
    )
    fresh, _, _ = build(layout, False, small=True)
    kept = torch.optim.AdamW(fresh.parameters(), foreach=True)
    mesh3d.checkpoint.load(f"{root}/foreach", fresh, kept)
    out["foreach kept"] = kept.param_groups[0]["foreach"]
    return out


def test_optimizer_state_saved_before_the_first_step_and_mismatched_settings(tmp_path):
    out = run_on_ranks(_optimizer_cases, 2, str(tmp_path), timeout=120)[0]
    losses, reference_losses, (error, where) = out["step0"]
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference_losses)) <= TOLERANCE
    assert error <= TOLERANCE, f"{error:.2e} at {where}"
    message, untouched = out["amsgrad"]
    assert "optimizer state tok_embeddings.weight.'max_exp_avg_sq' that this optimizer does not keep" in message
    assert untouched
    message, untouched = out["momentum"]
    assert "optimizer state tok_embeddings.weight.'momentum_buffer' that this optimizer does not keep" in message
    assert untouched
    assert out["foreach"][0] == "no error" and out["foreach kept"] is True
