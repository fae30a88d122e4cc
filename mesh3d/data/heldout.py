"""A held-out split: samples set aside by the seed for evaluation, never trained on.

The split is a function of (number of samples, number held out, seed) alone, so every rank of
every layout, and a run resumed under another layout, holds out exactly the same samples.
"""

from __future__ import annotations

import numpy as np
import torch

from mesh3d.data.dataset import TokenDataset

# Mixed into the seed so that the held-out draw is not the training order's first epoch.
_HELDOUT_STREAM = 0x4E1D


class SampleSubset:
    """Some samples of a TokenDataset, in a fixed order; a dataset to the loader (len, batch, seq_len).

    `ids[i]` is the sample index, in the whole dataset, of this subset's i-th sample.
    """

    def __init__(self, dataset: TokenDataset, ids: np.ndarray):
        self.dataset = dataset
        self.ids = np.asarray(ids, dtype=np.int64)
        self.seq_len = dataset.seq_len
        self.tokens = dataset.tokens

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dataset.batch(self.ids[np.asarray(indices, dtype=np.int64)])


def split_heldout(dataset: TokenDataset, num_heldout: int, seed: int) -> tuple[SampleSubset, SampleSubset]:
    """(training samples, held-out samples): `num_heldout` samples drawn by `seed`, the rest to train on."""
    if not 0 < num_heldout < len(dataset):
        raise ValueError(
            f"cannot hold out {num_heldout} of {len(dataset)} samples for evaluation; "
            f"use fewer eval batches or more data"
        )
    order = np.random.default_rng([seed, _HELDOUT_STREAM]).permutation(len(dataset))
    heldout = order[:num_heldout]
    training = np.sort(order[num_heldout:])  # the loader shuffles it by the seed, as it does a whole dataset
    return SampleSubset(dataset, training), SampleSubset(dataset, heldout)
