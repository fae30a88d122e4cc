"""The checkpoint directory protocol on its own, in one process: which directory is the latest, what
keep_last removes, and the leftovers of a replacement that crashed between its two renames."""

import json
from pathlib import Path

import mesh3d
from mesh3d.checkpoint import directories


def _fake_checkpoint(path: Path, step: int) -> None:
    path.mkdir(parents=True)
    (path / ".metadata").write_text("")
    (path / "train_state.json").write_text(json.dumps({"step": step}))


def test_latest_orders_by_step_and_ignores_partial_and_foreign_directories(tmp_path):
    assert mesh3d.checkpoint.latest(tmp_path / "absent") is None
    assert mesh3d.checkpoint.latest(tmp_path) is None
    _fake_checkpoint(tmp_path / "step900", 900)
    _fake_checkpoint(tmp_path / "step1000", 1000)  # name order would pick step900
    _fake_checkpoint(tmp_path / ".step2000.partial", 2000)
    (tmp_path / "notes").mkdir()
    assert mesh3d.checkpoint.latest(tmp_path) == str(tmp_path / "step1000")


def test_keep_last_never_removes_the_checkpoint_just_written(tmp_path):
    _fake_checkpoint(tmp_path / "step5", 5)
    _fake_checkpoint(tmp_path / "step9", 9)
    _fake_checkpoint(tmp_path / "branch", 7)  # written now, after a rollback to an older step
    removed = directories.prune(tmp_path, 2, keep=tmp_path / "branch")
    assert [p.name for p in removed] == ["step5"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["branch", "step9"]


def test_a_crash_between_the_two_renames_of_a_replacement_is_undone(tmp_path):
    _fake_checkpoint(tmp_path / ".step5.replaced", 5)  # the old step5, moved aside; the new one never arrived
    (tmp_path / ".step6.partial").mkdir()
    partial = directories.prepare(tmp_path / "step7")
    assert partial == tmp_path / ".step7.partial" and partial.is_dir()
    assert mesh3d.checkpoint.latest(tmp_path) == str(tmp_path / "step5")
    assert not (tmp_path / ".step6.partial").exists()
