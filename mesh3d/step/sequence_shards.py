"""The step's batch as this rank computes it: under context parallelism, each sequence cut to the
rank's tokens, with its targets, positions and every per-token input, and the attention context
of each microbatch; at cp = 1, the batch as given.

Every rank of a cp group is handed the same whole rows (as every tp rank is). Positions and
document ids are read from the whole rows before the cut (sequence_cut.py), so a chunk's tokens
keep their place in the sequence and in their document.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from mesh3d.context_parallel.call_verdicts import StepVerdicts
from mesh3d.context_parallel.model_check import POSITIONS
from mesh3d.context_parallel.sdpa_calls import ContextParallelAttention, own_tokens_mask
from mesh3d.context_parallel.sequence_cut import SequenceCut, whole_positions
from mesh3d.data.documents import documents_from_positions
from mesh3d.mesh import Layout

DOCUMENTS = "document_ids"


@dataclass(frozen=True)
class RankBatch:
    """What this rank's stages run on: its tokens, targets and per-sample inputs, and the context
    a stage's call on microbatch `mb` runs in (`around(mb)`; None: no context), with the step's
    attention verdicts those contexts note (judged with the loss; None at cp = 1)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    per_sample: dict[str, torch.Tensor]
    around: Callable[[int], AbstractContextManager] | None = None
    verdicts: StepVerdicts | None = None


class SequenceShards:
    """Cuts each step's batch over the cp ranks of `layout` (nothing to cut at cp = 1).

    Args:
        layout: this rank's Layout.
        microbatches: microbatches per step (the attention context is per microbatch).
        takes_positions: whether a stage of the model takes `position_ids` (required at cp > 1:
            parallelize refuses a model that does not).
        mask_input: the per-sample input through which a stage is handed the mask over its own
            tokens, with documents read from the whole rows' position ids (a Hugging Face model's
            `attention_mask`: hugging_face/context_parallel.py); None: the model builds its own.
    """

    def __init__(self, layout: Layout, microbatches: int, takes_positions: bool, mask_input: str | None = None):
        self.layout = layout
        self.microbatches = microbatches
        self.takes_positions = takes_positions
        self.mask_input = mask_input

    @property
    def active(self) -> bool:
        return self.layout.cp > 1

    def local_length(self, seq_len: int) -> int:
        """How many tokens of a sequence this rank's stages see."""
        return seq_len // self.layout.cp

    def cut(self, inputs: torch.Tensor, targets: torch.Tensor, per_sample: dict[str, torch.Tensor]) -> RankBatch:
        """This rank's part of the batch (checked like the whole batch before: see check_batch).
        Raises, the same on every rank, where the sequence length does not cut into 2 x cp chunks."""
        if not self.active:
            return RankBatch(inputs, targets, per_sample)
        layout = self.layout
        if inputs.dim() < 2:
            raise ValueError(
                f"context parallelism (cp={layout.cp}) cuts each sequence along dim 1, but the inputs have shape "
                f"{tuple(inputs.shape)}; pass (batch, seq) token ids"
            )
        cut = SequenceCut(layout.cp, layout.cp_rank, inputs.shape[1])
        whole = dict(per_sample)
        if self.takes_positions and POSITIONS not in whole:
            whole[POSITIONS] = whole_positions(inputs, whole, DOCUMENTS)
        local = {name: cut.cut(t) if cut.is_per_token(t) else t for name, t in whole.items()}
        documents = whole.get(DOCUMENTS)
        if self.mask_input is not None:
            if self.mask_input in per_sample:
                raise ValueError(
                    f"context parallelism (cp={layout.cp}) does not take a {self.mask_input!r} (padding) yet: the "
                    "mask of each rank's tokens is built from the position ids; pack documents with restarting "
                    f"position_ids instead of padding, or use cp=1"
                )
            documents = documents_from_positions(whole[POSITIONS])
            local[self.mask_input] = own_tokens_mask(cut, documents)
        per_microbatch = _packed_microbatches(documents, self.microbatches)
        group = layout.group("cp")
        verdicts = StepVerdicts(layout.cp)

        def around(mb: int) -> AbstractContextManager:
            docs = per_microbatch[mb] if per_microbatch is not None else None
            return ContextParallelAttention(cut, group, verdicts, docs)

        return RankBatch(cut.cut(inputs), cut.cut(targets), local, around, verdicts)


def _packed_microbatches(documents: torch.Tensor | None, microbatches: int) -> list[torch.Tensor | None] | None:
    """Each microbatch's document ids, None for one whose rows are each one document: its mask is
    the causal one, which attention.py attends without mask rows. Document ids on the host (as a
    loader gives them) are read there, through numpy; on a device, once (one host sync a step)."""
    if documents is None:
        return None
    parts = documents.chunk(microbatches)
    if documents.device.type == "cpu":
        packed = [bool((part.numpy() != part.numpy()[:, :1]).any()) for part in parts]
    else:
        packed = torch.stack([(part != part[:, :1]).any() for part in parts]).tolist()
    return [part if is_packed else None for part, is_packed in zip(parts, packed, strict=True)]
