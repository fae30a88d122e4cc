"""Checksums of checkpoints (issue 25), in this one process: block digests read in chunks against
one-shot XXH3 and the legacy CRC-32 against a bitwise reference,
the files dealt out among ranks, and a real checkpoint (a tiny LLaMA at pp = dp = tp = 1, a
private world of one) damaged in place with its sizes kept: `load` and the verify command name the
damaged file; a checkpoint without checksums still loads, with one notice; a damaged safetensors
export is refused by the import.
"""

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import xxhash

import mesh3d
from examples.llama.config import ModelArgs
from examples.llama.model import Transformer, loss_fn
from mesh3d.checkpoint import DamagedCheckpoint, checksums, integrity
from mesh3d.checkpoint.verify import main as verify_main

ROOT = Path(__file__).resolve().parents[2]
ARGS = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)


def _table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
        table.append(crc)
    return table


TABLE = _table()


def reference_crc32(data: bytes) -> int:
    """CRC-32 (IEEE 802.3: reflected, polynomial 0xEDB88320), a byte table in Python: independent of zlib."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = (crc >> 8) ^ TABLE[(crc ^ byte) & 0xFF]
    return crc ^ 0xFFFFFFFF


def test_every_block_of_a_file_read_in_chunks_has_the_one_shot_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "_CHUNK", 1000)  # several chunks per block, the last one partial
    monkeypatch.setattr(checksums, "BLOCK_BYTES", 2500)
    data = random.Random(0).randbytes(6321)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    sums = checksums.sums_of(tmp_path, ["f", "empty"], threads=3)
    blocks = [data[:2500], data[2500:5000], data[5000:]]
    assert sums == {
        "f": {"size": 6321, "xxh3_64": [xxhash.xxh3_64_hexdigest(b) for b in blocks]},
        "empty": {"size": 0, "xxh3_64": [xxhash.xxh3_64_hexdigest(b"")]},
    }
    assert checksums.first_mismatch(tmp_path, sums, sums) is None
    # a manifest written with CRC-32 (mesh3d before XXH3) still verifies, against a bitwise CRC-32
    legacy = {"f": {"size": 6321, "crc32": [f"{reference_crc32(b):08x}" for b in blocks], "algorithm": "crc32"}}
    assert [checksums.hash_of(tmp_path / "f", i * 2500, 2500, "crc32") for i in range(3)] == legacy["f"]["crc32"]
    assert checksums.first_mismatch(tmp_path, legacy, legacy) is None
    with open(tmp_path / "f", "r+b") as f:  # one bit of the second block
        f.seek(4000)
        f.write(bytes([data[4000] ^ 1]))
    for recorded in (sums, legacy):
        problem = checksums.first_mismatch(tmp_path, recorded, recorded)
        assert problem.startswith(f"{tmp_path / 'f'} has another checksum than when it was written (bytes 2500-5000:")


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_every_file_is_verified_by_exactly_one_rank(world_size):
    sums = {f"__{i}_0.distcp": {"size": (i * 37) % 11, "xxh3_64": "0"} for i in range(7)}
    shares = [checksums.share(sums, rank, world_size) for rank in range(world_size)]
    assert sorted(name for names in shares for name in names) == sorted(sums)


def _damage(file: Path) -> None:
    """Overwrite 64 bytes in the middle of `file` (fewer for a small file), keeping its size."""
    size = file.stat().st_size
    n = min(64, size // 2)
    with open(file, "r+b") as f:
        f.seek(size // 2 - n // 2)
        old = f.read(n)
        f.seek(size // 2 - n // 2)
        f.write(bytes(b ^ 0xFF for b in old))
    assert file.stat().st_size == size


@pytest.fixture
def pm():
    torch.manual_seed(0)
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        yield mesh3d.parallelize(Transformer(ARGS), layout, loss_fn=loss_fn, schedule="gpipe", dp_mode="ddp")
    finally:
        dist.destroy_process_group()


def _saved(pm, tmp_path) -> Path:
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    pm.step(tokens[:, :-1], tokens[:, 1:])
    optimizer.step()
    return Path(mesh3d.checkpoint.save(tmp_path / "ckpt" / "step1", pm, optimizer))


def _verify(path: Path, capsys) -> tuple[int, str]:
    status = verify_main([str(path)])
    return status, capsys.readouterr().out


def test_save_records_a_checksum_of_every_file_it_publishes(pm, tmp_path):
    path = _saved(pm, tmp_path)
    sums = checksums.read_manifest(path)
    on_disk = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()}
    assert set(sums) == on_disk - {checksums.CHECKSUM_FILE}
    for name, entry in sums.items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_64": [xxhash.xxh3_64_hexdigest(data)], "algorithm": "xxh3_64"}, name


@pytest.mark.parametrize("which", ["data", ".metadata", "train_state.json"])
def test_a_file_changed_in_place_is_named_by_load_and_by_verify(pm, tmp_path, capsys, which):
    path = _saved(pm, tmp_path)
    assert _verify(path, capsys) == (0, f"whole: {path}\n")
    if which == "data":
        file = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    else:
        file = path / which
    _damage(file)
    with pytest.raises(DamagedCheckpoint, match=f"{file}.*checksum"):
        mesh3d.checkpoint.load(path, pm)
    status, out = _verify(path, capsys)
    assert status == 1 and out.startswith("damaged:") and str(file) in out


def test_a_checkpoint_with_an_unreadable_train_state_is_still_listed_by_its_step(pm, tmp_path):
    path = _saved(pm, tmp_path)
    shutil.copytree(path, path.parent / "step12")
    (path.parent / "step12" / "train_state.json").write_text("{")
    assert mesh3d.checkpoint.complete_checkpoints(path.parent) == [path, path.parent / "step12"]


def test_verify_as_a_command_exits_0_for_whole_and_1_for_damaged(pm, tmp_path):
    path = _saved(pm, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "mesh3d.checkpoint.verify", str(path)]
    whole = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert (whole.returncode, whole.stdout) == (0, f"whole: {path}\n"), whole.stderr
    _damage(path / "rng" / "rank-00000.json")
    damaged = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert damaged.returncode == 1 and str(path / "rng" / "rank-00000.json") in damaged.stdout
    elsewhere = subprocess.run([*command[:-1], str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert elsewhere.returncode == 1 and elsewhere.stdout.startswith(
        f"cannot verify: {tmp_path} is not a mesh3d checkpoint"
    )


def test_a_checkpoint_without_checksums_loads_with_one_notice(pm, tmp_path, capsys):
    path = _saved(pm, tmp_path)
    want = {n: t.detach().clone() for n, t in pm.state_map.local().items()}
    (path / checksums.CHECKSUM_FILE).unlink()
    integrity._NOTICED.clear()
    with torch.no_grad():
        for t in pm.parameters():
            t.zero_()
    mesh3d.checkpoint.load(path, pm)
    mesh3d.checkpoint.load(path, pm)
    notices = [line for line in capsys.readouterr().err.splitlines() if "checksums.json" in line]
    assert len(notices) == 1 and str(path) in notices[0], notices
    for name, tensor in pm.state_map.local().items():
        assert torch.equal(tensor, want[name]), name
    assert _verify(path, capsys)[0] == 0


def test_an_edited_manifest_is_damage(pm, tmp_path):
    path = _saved(pm, tmp_path)
    (path / checksums.CHECKSUM_FILE).write_text("{not json")
    with pytest.raises(DamagedCheckpoint, match="checksums.json is unreadable"):
        mesh3d.checkpoint.load(path, pm)


def test_a_safetensors_export_carries_checksums_and_its_import_verifies_them(pm, tmp_path, capsys):
    out = Path(mesh3d.checkpoint.export_safetensors(pm, tmp_path / "hf"))
    assert set(checksums.read_manifest(out)) == {"model.safetensors"}  # the weights; config.json is the user's to edit
    mesh3d.checkpoint.import_safetensors(pm, out)
    assert _verify(out, capsys)[0] == 0
    _damage(out / "model.safetensors")
    with pytest.raises(ValueError, match=f"{out / 'model.safetensors'}.*checksum"):
        mesh3d.checkpoint.import_safetensors(pm, out)
    status, printed = _verify(out, capsys)
    assert status == 1 and str(out / "model.safetensors") in printed


def test_a_checkpoint_with_a_crc32_manifest_still_verifies_and_loads(pm, tmp_path, capsys):
    """Checkpoints written before the switch to XXH3 recorded CRC-32s; they stay loadable."""
    path = _saved(pm, tmp_path)
    files = {
        name: {"size": entry["size"], "crc32": [f"{reference_crc32((path / name).read_bytes()):08x}"]}
        for name, entry in checksums.read_manifest(path).items()
    }
    manifest = {"algorithm": "crc32", "block_bytes": checksums.BLOCK_BYTES, "files": files}  # as mesh3d wrote it then
    (path / checksums.CHECKSUM_FILE).write_text(json.dumps(manifest))
    assert _verify(path, capsys) == (0, f"whole: {path}\n")
    mesh3d.checkpoint.load(path, pm)
    _damage(max(path.glob("*.distcp"), key=lambda p: p.stat().st_size))
    with pytest.raises(DamagedCheckpoint, match="crc32"):
        mesh3d.checkpoint.load(path, pm)
