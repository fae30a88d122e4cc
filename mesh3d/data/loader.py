"""Deterministic, resumable, data-parallel batches.

The loader's whole state is the global sample position: how many samples all data-parallel
ranks together have consumed. Step k's global batch is the samples at positions
[k*B, (k+1)*B) of a seeded permutation (a fresh one per epoch), and dp rank r takes the r-th
contiguous slice of it. So the sequence of global batches is the same for any dp degree, and a
checkpoint taken at dp=2 resumes at the exact next sample under dp=4.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from mesh3d.data.dataset import TokenDataset


class DistributedLoader:
    """Yields (inputs, targets) of shape (global_batch_size // dp_size, seq_len) for this dp rank.

    Ranks with the same dp coordinate (the tp and pp ranks of one data-parallel replica) get
    identical batches; together the dp ranks cover the global batch exactly once.
    """

    def __init__(
        self,
        dataset: TokenDataset,
        global_batch_size: int,
        *,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
    ):
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"DistributedLoader: need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}"
            )
        if global_batch_size < 1 or global_batch_size % dp_size != 0:
            raise ValueError(
                f"DistributedLoader: global_batch_size={global_batch_size} must be a positive multiple of "
                f"dp_size={dp_size}; choose a global batch divisible by the data-parallel degree"
            )
        if len(dataset) < global_batch_size:
            raise ValueError(
                f"DistributedLoader: the dataset has {len(dataset)} samples of seq_len={dataset.seq_len}, "
                f"fewer than one global batch of {global_batch_size}"
            )
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.local_batch_size = global_batch_size // dp_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._epoch_order: tuple[int, np.ndarray] | None = None

    @classmethod
    def for_layout(cls, dataset: TokenDataset, global_batch_size: int, layout, **kwargs) -> "DistributedLoader":
        """A loader for this rank's data-parallel coordinate in a mesh3d Layout."""
        return cls(dataset, global_batch_size, dp_rank=layout.dp_rank, dp_size=layout.dp, **kwargs)

    @property
    def epoch(self) -> int:
        return self.position // len(self.dataset)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.position + self.dp_rank * self.local_batch_size
        indices = [self._sample_at(p) for p in range(first, first + self.local_batch_size)]
        self.position += self.global_batch_size
        return self.dataset.batch(indices)

    def _sample_at(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.dataset))
        if not self.shuffle:
            return offset
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.dataset))
            self._epoch_order = (epoch, order)
        return int(self._epoch_order[1][offset])

    def state_dict(self) -> dict:
        """Plain ints and bools (no tensors, no pickle needed): the global position and what it means."""
        return {
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.dataset),
            "seq_len": self.dataset.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state["position"]`; the dp degree and global batch size may differ from the saver's."""
        expected = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": len(self.dataset),
            "seq_len": self.dataset.seq_len,
        }
        mismatched = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if mismatched:
            detail = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in mismatched.items())
            raise ValueError(f"DistributedLoader: the saved data state is for different data ({detail})")
        self.position = int(state["position"])
