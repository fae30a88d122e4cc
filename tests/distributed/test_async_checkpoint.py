"""mesh3d.checkpoint.async_save: a checkpoint written in the background while training goes on.

One launch of 4 ranks:
- at (2,2,1) (pp x dp, FSDP) and (1,2,2) (dp x tp): 2 steps, async_save, 2 more steps while it is
  in flight (at (2,2,1) its write is held back until those steps are done, so it must write the
  copy taken at the call), wait(); a fresh model and optimizer load it and take the same 2 steps:
  the losses and parameters of the run that went on;
- one save at a time: a second async_save, a blocking save and a load each wait for the save in
  flight (the load reads the very checkpoint being written); the host copy is reused;
- a failure in the background thread (before_publish raising on rank 0) is raised by wait() on
  every rank, every time, and nothing is published; one nobody waited for is raised by the next
  async_save, once;
- bad arguments raise in async_save itself, on every rank, with nothing started.

The handle's own logic without a process group: tests/unit/test_async_save_handle.py; a rank killed
during the background write under torchrun: tests/distributed/test_restart.py.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch.distributed as dist
from checkpoint_cases import build, full_state, train, worst_relative_error
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE
from rank_errors import message_of

import mesh3d
from mesh3d.checkpoint import background_save, saving

LAYERS = 4  # the layouts are the point, not the depth


def _held_back() -> threading.Event:
    """Hold every background write back, before it writes anything, until the returned event is set."""
    gate = threading.Event()
    write_rng = saving._write_rng

    def wait_then_write(*args):
        gate.wait()
        write_rng(*args)

    saving._write_rng = wait_then_write
    gate.restore = lambda: setattr(saving, "_write_rng", write_rng)
    return gate


def _resumes_exactly(root: str, sizes: tuple[int, int, int], hold_back: bool) -> dict:
    pp, dp, tp = sizes
    layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    pm, optimizer, loader = build(layout, True, small=True, n_layers=LAYERS)
    train(pm, optimizer, loader, 2)
    gate = _held_back() if hold_back else None
    path = f"{root}/{pp}{dp}{tp}/step2"
    handle = mesh3d.checkpoint.async_save(path, pm, optimizer, data_state=loader.state_dict())
    out = {"in flight": not handle.done()}
    went_on = train(pm, optimizer, loader, 2)
    if gate is not None:
        out["unpublished while held"] = not handle.done() and not Path(path).exists()
        gate.set()
        gate.restore()
    out["waited"] = handle.wait() == path and handle.done()
    want = full_state(pm)

    fresh, fresh_optimizer, fresh_loader = build(layout, True, small=True, init_seed=1, n_layers=LAYERS)
    state = mesh3d.checkpoint.load(path, fresh, fresh_optimizer)
    fresh_loader.load_state_dict(state["data_state"])
    out["step"] = state["step"]
    out["losses"] = (train(fresh, fresh_optimizer, fresh_loader, 2), went_on)
    out["worst"] = worst_relative_error(full_state(fresh), want)
    return out


def _one_at_a_time(root: str) -> dict:
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=1)
    pm, optimizer, loader = build(layout, True, small=True, n_layers=LAYERS)
    train(pm, optimizer, loader, 1)
    save = mesh3d.checkpoint.async_save
    out = {}
    for label, then in (
        ("async_save", lambda: save(f"{root}/second/step2", pm, optimizer)),
        ("save", lambda: mesh3d.checkpoint.save(f"{root}/blocking/step1", pm, optimizer)),
        ("load", lambda: mesh3d.checkpoint.load(f"{root}/{label}/step1", pm, optimizer)),
    ):
        gate = _held_back()
        first = save(f"{root}/{label}/step1", pm, optimizer)
        buffers = background_save._host_copy._buffers
        threading.Timer(0.5, gate.set).start()  # until then the first save cannot finish
        then()
        gate.restore()
        out[label] = (first.done(), Path(f"{root}/{label}/step1").is_dir())
        if label == "async_save":
            out["second"] = background_save._in_flight.wait() == f"{root}/second/step2"
            out["buffers reused"] = background_save._host_copy._buffers is buffers
    return out


def _failures(root: str) -> dict:
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=1)
    pm, optimizer, loader = build(layout, True, small=True, n_layers=LAYERS)
    train(pm, optimizer, loader, 1)
    mesh3d.checkpoint.save(f"{root}/step1", pm, optimizer)

    def boom(written: Path) -> None:
        if dist.get_rank() == 0:
            raise RuntimeError(f"refusing to publish {written.name}")

    out = {}
    handle = mesh3d.checkpoint.async_save(f"{root}/step2", pm, optimizer, before_publish=boom)
    out["wait"] = [message_of(handle.wait), message_of(handle.wait)]  # every time it is asked
    out["done"] = handle.done()
    out["next starts"] = message_of(lambda: mesh3d.checkpoint.async_save(f"{root}/step3", pm, optimizer).wait())
    mesh3d.checkpoint.async_save(f"{root}/step4", pm, optimizer, before_publish=boom)  # nobody waits for it
    out["next raises"] = message_of(lambda: mesh3d.checkpoint.async_save(f"{root}/step5", pm, optimizer))
    out["then starts"] = message_of(lambda: mesh3d.checkpoint.async_save(f"{root}/step6", pm, optimizer).wait())

    # Bad arguments: raised by async_save itself, on every rank, with nothing started.
    bad = {
        "keep_last": lambda: mesh3d.checkpoint.async_save(f"{root}/bad7", pm, optimizer, step=7, keep_last=0),
        "steps differ": lambda: mesh3d.checkpoint.async_save(f"{root}/bad", pm, optimizer, step=7 + layout.rank),
        "extra": lambda: mesh3d.checkpoint.async_save(f"{root}/bad7", pm, optimizer, extra={"x": object()}),
        "before_publish": lambda: mesh3d.checkpoint.async_save(f"{root}/bad7", pm, before_publish="kill"),
    }
    out["bad"] = {label: message_of(call) for label, call in bad.items()}
    out["nothing in flight"] = background_save._in_flight is None
    out["latest"] = mesh3d.checkpoint.latest(root)
    return out


def _all_cases(root: str) -> dict:
    return {
        "pp dp": _resumes_exactly(root, (2, 2, 1), hold_back=True),
        "dp tp": _resumes_exactly(root, (1, 2, 2), hold_back=False),
        "one at a time": _one_at_a_time(root),
        "failures": _failures(root),
    }


def test_async_save_resumes_exactly_one_at_a_time_and_failures_on_every_rank(tmp_path):
    per_rank = run_on_ranks(_all_cases, 4, str(tmp_path), timeout=150)
    for rank, out in enumerate(per_rank):
        for layout in ("pp dp", "dp tp"):
            run = out[layout]
            assert run["waited"] and run["step"] == 2, (rank, layout, run)
            losses, want = run["losses"]
            assert max(abs(a - b) / abs(b) for a, b in zip(losses, want)) <= TOLERANCE, (rank, layout, losses, want)
            error, where = run["worst"]
            assert error <= TOLERANCE, f"rank {rank} {layout}: {error:.2e} at {where}"
        held = out["pp dp"]
        assert held["in flight"] and held["unpublished while held"], (rank, held)

        queued = out["one at a time"]
        for label in ("async_save", "save", "load"):
            assert queued[label] == (True, True), (rank, label, queued[label])  # the first was published first
        assert queued["second"] and queued["buffers reused"], (rank, queued)

        failed = out["failures"]
        for message in failed["wait"]:
            assert message is not None and "refusing to publish .step2.partial" in message, (rank, message)
            assert "found on rank 0" in message or rank == 0, (rank, message)
        assert failed["done"] and failed["next starts"] is None, (rank, failed)
        assert "refusing to publish .step4.partial" in (failed["next raises"] or ""), (rank, failed)
        assert failed["then starts"] is None, (rank, failed)
        bad = failed["bad"]
        assert "keep_last must be None or an int >= 1" in bad["keep_last"], (rank, bad)
        assert "ranks passed different path, step or data_state" in bad["steps differ"], (rank, bad)
        assert "extra must be JSON-serializable" in bad["extra"], (rank, bad)
        assert "before_publish must be callable or None, got 'kill'" in bad["before_publish"], (rank, bad)
        assert failed["nothing in flight"], rank
    assert sorted(p.name for p in (tmp_path).iterdir() if p.name.startswith("step")) == ["step1", "step3", "step6"]
    assert per_rank[0]["failures"]["latest"] == str(tmp_path / "step6")
    assert not (tmp_path / "bad7").exists() and not (tmp_path / "bad").exists()
