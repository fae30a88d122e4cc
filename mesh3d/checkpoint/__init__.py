"""Checkpoints: save and resume under any (pp, dp, tp); safetensors export and import with Hugging Face names.

    mesh3d.checkpoint.save(path, pm, optimizer=None, *, step, data_state=None, extra=None,
                           before_publish=None, checksums=True)
    handle = mesh3d.checkpoint.async_save(path, pm, optimizer=None, ...)  # save's arguments; written
    handle.wait()                                   # in the background: an AsyncSave (wait() / done())
    state = mesh3d.checkpoint.load(path, pm, optimizer=None)    # {"step", "data_state", "extra"}
    mesh3d.checkpoint.latest(root) -> path | None   # this process's listing; jobs resume with mesh3d.train
    mesh3d.checkpoint.complete_checkpoints(root) -> [path, ...]   # oldest first
    mesh3d.checkpoint.export_safetensors(pm, out_dir, config=None)
    mesh3d.checkpoint.import_safetensors(pm, in_dir)
    class MyAdapter(mesh3d.checkpoint.HFAdapter): ...              # a model's names <-> Hugging Face's
    python -m mesh3d.checkpoint.verify ckpt/step100                 # every file against its checksum; exit 0/1

A damaged checkpoint raises DamagedCheckpoint (a ValueError).
"""

from mesh3d.checkpoint.background_save import AsyncSave, async_save
from mesh3d.checkpoint.directories import complete_checkpoints, latest
from mesh3d.checkpoint.hf_adapter import HFAdapter
from mesh3d.checkpoint.integrity import DamagedCheckpoint
from mesh3d.checkpoint.safetensors_io import export_safetensors, import_safetensors
from mesh3d.checkpoint.save_load import load, save

__all__ = [
    "AsyncSave",
    "DamagedCheckpoint",
    "HFAdapter",
    "async_save",
    "complete_checkpoints",
    "export_safetensors",
    "import_safetensors",
    "latest",
    "load",
    "save",
]
