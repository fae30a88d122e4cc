"""Packed documents: where each document sits in a row of tokens packed with separators between
them, for attention that stays inside a document and positions that restart with each one.

A row is a window of the token stream (dataset.py), documents joined by a separator (the
tokenizer's end-of-document id, ByteTokenizer's 0). The separator belongs to the document it ends:
the document id rises at the token after it. Ids count from 0 in each row (a row that starts
mid-document numbers that part 0), so they lie in [0, sequence length).
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """(batch, seq) token ids -> (batch, seq) long: which document of its row each token is in."""
    ends = (tokens == separator).long()
    return ends.cumsum(dim=-1) - ends  # the separators before this token, not counting itself


def positions_in_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) document ids -> (batch, seq) long: each token's position in its document
    (0 at each document's first token in the row)."""
    seq = document_ids.shape[-1]
    index = torch.arange(seq, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def documents_from_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) position ids -> (batch, seq) long document ids: a new document wherever a
    position is not its predecessor's plus one (transformers' reading of packed sequences)."""
    before = torch.cat([position_ids[..., :1] - 1, position_ids[..., :-1]], dim=-1)
    return (position_ids != before + 1).long().cumsum(dim=-1)
