"""Damaged checkpoints, a full disk and non-finite weights (issue 16), at pp=2 on 2 ranks.

- The newest checkpoint with a shard file cut short, a shard file removed, its metadata
  overwritten, or 64 bytes in the middle of a shard file changed (its size kept: caught by its
  checksum, issue 25): `load` raises DamagedCheckpoint on every rank naming the checkpoint and the file,
  and mesh3d.train's resume (`resume_latest`) says so and loads the newest checkpoint that loads,
  whose weights equal those saved there.
- A save whose first write (the RNG state) or shard write fails with ENOSPC raises that OSError on
  every rank and leaves the previous checkpoint the newest.
- A save of a NaN weight (on one rank) is refused on every rank, naming the parameter.
A barrier after each error proves that no rank hangs.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoint_cases import build, full_state, train, worst_relative_error
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE
from rank_errors import raised

import mesh3d
from mesh3d.distributed.shards import local_tensor
from mesh3d.train import resume_latest

DAMAGES = ("cut short", "removed", "metadata", "changed")
REFUSED = (ValueError, OSError)  # what a load or save says about a damaged checkpoint, a full disk or a NaN weight


def _damage(root: Path, how: str) -> str:
    """Copy root's step2 and step4 to a new root and damage its step4; the file damaged."""
    copy = root / f"damaged {how}"
    for name in ("step2", "step4"):
        shutil.copytree(root / name, copy / name)
    newest = copy / "step4"
    if how == "metadata":
        victim = newest / ".metadata"
        victim.write_bytes(b"not a pickle")
    else:
        victim = sorted(newest.glob("*.distcp"))[-1]
        if how == "changed":
            with open(victim, "r+b") as f:  # every bit of 64 bytes flipped, the size kept
                f.seek(victim.stat().st_size // 2)
                flipped = bytes(b ^ 0xFF for b in f.read(64))
                f.seek(victim.stat().st_size // 2)
                f.write(flipped)
        elif how == "cut short":
            victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        else:
            victim.unlink()
    return str(victim)


def _faults(root: str) -> dict:
    root = Path(root)
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    pm, optimizer, loader = build(layout, True, small=True)
    train(pm, optimizer, loader, 1)
    mesh3d.checkpoint.save(root / "step2", pm, optimizer, step=2, data_state=loader.state_dict())
    saved_at_2 = full_state(pm)
    train(pm, optimizer, loader, 1)
    mesh3d.checkpoint.save(root / "step4", pm, optimizer, step=4, data_state=loader.state_dict())
    victims = [None] * len(DAMAGES)
    if layout.rank == 0:
        victims = [_damage(root, how) for how in DAMAGES]
    dist.broadcast_object_list(victims, src=0)

    result = {"victims": victims, "load_errors": [], "resumed": [], "said": [], "errors_vs_step2": []}
    for how in DAMAGES:
        damaged = root / f"damaged {how}"
        error = raised(lambda: mesh3d.checkpoint.load(damaged / "step4", pm, optimizer), REFUSED)
        result["load_errors"].append((type(error).__name__, str(error)))
        said = []
        path, _ = resume_latest(str(damaged), pm, optimizer, say=said.append)
        result["resumed"].append(path)
        result["said"].append(said)
        result["errors_vs_step2"].append(worst_relative_error(full_state(pm), saved_at_2)[0])

    # A full disk: rank 1's first write (its RNG state), then its shard write, fails with ENOSPC.
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    result["enospc"] = []
    from torch.distributed.checkpoint import filesystem

    from mesh3d.checkpoint import saving

    for module, name in ((saving, "_write_rng"), (filesystem, "_write_item")):
        original = getattr(module, name)
        if layout.rank == 1:
            setattr(module, name, no_space)
        error = raised(lambda: mesh3d.checkpoint.save(root / "step6", pm, optimizer, step=6), REFUSED)
        setattr(module, name, original)
        result["enospc"].append((type(error).__name__, getattr(error, "errno", None), str(error)))
    result["latest_after_enospc"] = mesh3d.checkpoint.latest(root)

    # A NaN weight on rank 1 only.
    if layout.rank == 1:
        with torch.no_grad():
            local_tensor(dict(pm.named_parameters())["norm.weight"])[0] = float("nan")
    error = raised(lambda: mesh3d.checkpoint.save(root / "step8", pm, optimizer, step=8), REFUSED)
    result["nan"] = (type(error).__name__, str(error))
    result["latest_after_nan"] = mesh3d.checkpoint.latest(root)
    return result


def test_damaged_checkpoints_full_disk_and_nan_weights(tmp_path):
    results = run_on_ranks(_faults, 2, str(tmp_path), timeout=120)
    for rank, result in enumerate(results):
        for how, victim, (kind, message) in zip(DAMAGES, result["victims"], result["load_errors"]):
            assert kind == "DamagedCheckpoint", (rank, how, kind, message)
            assert str(tmp_path / f"damaged {how}" / "step4") in message and victim in message, (rank, message)
        assert "cut short" in result["load_errors"][0][1] and "missing" in result["load_errors"][1][1]
        # The metadata's checksum is checked before it is parsed: a shorter file is cut short.
        assert ".metadata is cut short" in result["load_errors"][2][1], result["load_errors"][2][1]
        assert "another checksum than when it was written" in result["load_errors"][3][1]
        for how, path, said in zip(DAMAGES, result["resumed"], result["said"]):
            assert path == str(tmp_path / f"damaged {how}" / "step2"), (rank, how, path)
            assert len(said) == 1 and said[0].startswith(f"cannot resume from {tmp_path / f'damaged {how}' / 'step4'}")
        assert max(result["errors_vs_step2"]) <= TOLERANCE, result["errors_vs_step2"]

        for kind, code, message in result["enospc"]:
            assert (kind, code) == ("OSError", errno.ENOSPC), (rank, result["enospc"])
            assert "No space left on device" in message, (rank, message)
        assert "failed on rank 1" in result["enospc"][1][2] and "previous checkpoint stays the newest" in message
        assert result["latest_after_enospc"] == str(tmp_path / "step4")

        kind, message = result["nan"]
        assert kind == "ValueError" and "parameter norm.weight holds NaN or Inf" in message, (rank, message)
        assert result["latest_after_nan"] == str(tmp_path / "step4")
    assert not (tmp_path / "step6").exists() and not (tmp_path / "step8").exists()
