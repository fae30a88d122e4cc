"""Peak bytes of the tensors alive during one training step at pp = 1, per activation-checkpoint mode (CPU).

    python bench/activation_peak.py --seq-len 512 --batch 2 --modes never always selective

Counts every storage an op creates during the step (forward, backward, and the recomputes torch's
checkpoint runs inside the backward), from its creation until it is freed, so the peak is the most
that was alive at once: what the forward keeps for its backward plus the transient peak of the
backward and its recomputes, gradients included. autograd's saved-tensor hooks
(mesh3d.planner.measure.meters.SavedBytesMeter) cannot see that: a checkpoint's own hooks take every save
inside the checkpointed region, and its recompute holds tensors outside any hook. The LLaMA debug
config (dim 128, 8 blocks unless --layers) on one rank, gpipe with one microbatch.
"""

from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
from multiprocess import run_on_ranks  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import mesh3d  # noqa: E402
from examples.llama.config import get_config  # noqa: E402
from examples.llama.model import Transformer, loss_fn  # noqa: E402

MIB = 2**20


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages ops created under this mode that are alive now, and their peak."""

    def __init__(self):
        super().__init__()
        self.now = self.peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t.untyped_storage())
        return out

    def _track(self, storage) -> None:
        key = storage._cdata
        if key in self._alive:
            return
        self._alive.add(key)
        nbytes = storage.nbytes()
        self.now += nbytes
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key, nbytes)  # the storage's Python object lives as long as it

    def _free(self, key: int, nbytes: int) -> None:
        self._alive.discard(key)
        self.now -= nbytes


def peaks(modes: list[str], batch: int, seq_len: int, n_layers: int = 8) -> dict[str, int]:
    """On one rank: the peak live bytes of one step (after a warm-up step) under each mode."""
    torch.set_num_threads(1)
    results = {}
    for mode in modes:
        with torch.device("meta"):
            model = Transformer(get_config("debug", max_seq_len=seq_len, n_layers=n_layers))
        pm = mesh3d.parallelize(
            model,
            mesh3d.build_mesh(pp=1, dp=1, tp=1),
            schedule="gpipe",
            microbatches=1,
            loss_fn=loss_fn,
            activation_checkpoint=mode,
        )
        tokens = torch.randint(0, 256, (batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        pm.step(inputs, targets)  # warm-up: gradients allocated, as in every later step
        live = LiveBytes()
        with live:
            pm.step(inputs, targets)
        results[mode] = live.peak
        del pm
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["never", "always", "selective"])
    args = parser.parse_args()
    result = run_on_ranks(peaks, 1, args.modes, args.batch, args.seq_len, args.layers, timeout=600)[0]
    for mode, peak in result.items():
        print(f"{mode:<12} peak live bytes in a step: {peak / MIB:8.2f} MiB")


if __name__ == "__main__":
    main()
