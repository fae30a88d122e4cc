"""The train state beside the tensors: step, data position, extra, and each rank's RNG states, as JSON.

JSON, not pickle: reading a train state runs no code. The step, data state and `extra` are the
job's (one file, written by rank 0, `train_state.json`); RNG states are per rank
(`rng/rank-00003.json`), the torch generator's bytes in base64.
"""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

FORMAT = "mesh3d.checkpoint"
VERSION = 1
TRAIN_STATE_FILE = "train_state.json"
RNG_DIR = "rng"


def check_json(value: Any, what: str) -> str:
    """`value` as JSON text, or a ValueError that says what to change (raised before any collective)."""
    try:
        return json.dumps(value, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"checkpoint.save: {what} must be JSON-serializable (dicts, lists, str, int, float, bool, None), "
            f"got {type(value).__name__}: {error}; convert tensors with .tolist() or .item()"
        ) from None


def write_json(path: Path, value: Any) -> None:
    """Write and fsync, so that a published checkpoint never holds a half-written file."""
    with open(path, "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_train_state(path: Path) -> dict:
    file = path / TRAIN_STATE_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} is not a mesh3d checkpoint (no {TRAIN_STATE_FILE}); pass a directory written by "
            "mesh3d.checkpoint.save, or use mesh3d.checkpoint.latest(root) to find one"
        )
    state = json.loads(file.read_text())
    if state.get("format") != FORMAT or state.get("version", 0) > VERSION:
        raise ValueError(
            f"{file} is format {state.get('format')!r} version {state.get('version')!r}; this mesh3d reads "
            f"{FORMAT!r} up to version {VERSION}"
        )
    return state


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _from_b64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def rng_state(device: torch.device) -> dict:
    """This process's RNG states: torch (CPU, and the CUDA device in use), Python's random, NumPy's global."""
    np_state = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {
        "torch": _b64(torch.get_rng_state()),
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }
    if device.type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(_from_b64(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(_from_b64(state["cuda"]), device)


def rng_file(path: Path, rank: int) -> Path:
    return path / RNG_DIR / f"rank-{rank:05d}.json"


def read_rng_state(path: Path, rank: int) -> dict | None:
    file = rng_file(path, rank)
    return json.loads(file.read_text()) if file.is_file() else None
