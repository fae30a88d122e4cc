"""Which tokens of a sequence each context-parallel rank holds, and the step's inputs cut so.

Causal attention costs a query in proportion to its position, so a rank holding one contiguous
stretch of the sequence would do cp times the work of the first rank at the end. Each sequence is
cut into 2 x cp equal chunks instead, and cp rank r holds chunk r from the head and chunk
2 x cp - 1 - r from the tail: every rank then attends over the same number of (query, key)
pairs, whatever cp. Its tokens stay in sequence order (the head chunk first), which the attention
masks rely on (sdpa_calls.py).

Everything here is computed from the whole sequence, which every rank of a cp group is given:
positions and document ids are those of the whole row, never recomputed from a chunk.
"""

from __future__ import annotations

import torch

from mesh3d.data.documents import positions_in_documents


class SequenceCut:
    """The head-and-tail cut of sequences of `seq_len` tokens over `cp` ranks."""

    def __init__(self, cp: int, cp_rank: int, seq_len: int):
        if seq_len % (2 * cp) != 0:
            raise ValueError(
                f"sequence length {seq_len} does not cut into 2*cp={2 * cp} equal chunks: context parallelism "
                f"gives each of the cp={cp} ranks one chunk from the head of every sequence and one from its "
                f"tail (balanced causal attention); use a sequence length that is a multiple of {2 * cp}, or "
                "another cp"
            )
        self.cp, self.cp_rank, self.seq_len = cp, cp_rank, seq_len
        self.chunk = seq_len // (2 * cp)

    def positions_of(self, cp_rank: int) -> torch.Tensor:
        """The sequence positions cp rank `cp_rank` holds, in the order it holds them (long, 1-d)."""
        c, last = self.chunk, 2 * self.cp - 1 - cp_rank
        return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c), torch.arange(last * c, (last + 1) * c)])

    @property
    def positions(self) -> torch.Tensor:
        """This rank's positions (`positions_of(cp_rank)`)."""
        return self.positions_of(self.cp_rank)

    @property
    def gathered_positions(self) -> torch.Tensor:
        """The positions of every rank's tokens, rank after rank: the order of keys gathered from the cp group."""
        return torch.cat([self.positions_of(r) for r in range(self.cp)])

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (batch, seq, ...) tensor (a copy: dim 1 indexed)."""
        return tensor.index_select(1, self.positions.to(tensor.device))

    def is_per_token(self, tensor: torch.Tensor) -> bool:
        """Whether a per-sample input runs along the sequence (its dim 1 is the sequence length)."""
        return tensor.dim() >= 2 and tensor.shape[1] == self.seq_len


def whole_positions(
    inputs: torch.Tensor, per_sample: dict[str, torch.Tensor], documents: str = "document_ids"
) -> torch.Tensor:
    """The positions a model takes when it is given none, of the whole rows: 0..seq-1 per row, or,
    where the step has packed documents (`document_ids`), each token's position in its document
    (mesh3d.data.documents' convention)."""
    if documents in per_sample:
        return positions_in_documents(per_sample[documents])
    batch, seq = inputs.shape[0], inputs.shape[1]
    return torch.arange(seq, device=inputs.device).expand(batch, seq).contiguous()
