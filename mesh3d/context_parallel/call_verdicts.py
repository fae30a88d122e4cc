"""Each context-parallel attention call's verdict, and their judgement at the step's end.

A rank judges its own call (sdpa_calls.py): which whole-sequence mask its `attn_mask` is on its own
tokens, or causal (`is_causal=True`), or none it can extend. The verdict travels in the call's K/V
all-gather (attention.py), so every rank of the cp group has every rank's. A call is refused where
a rank's mask cannot be extended, or where the ranks made different kinds of call (one causal, one
with a document mask): computed on, the group would train another model than one process.

Reading the verdicts at each call would sync the host with the device once a call, and a rank that
raised there while a peer (its check skipped: a mask it had judged before) went on would leave the
peer waiting in its next collective. So the gathered verdicts stay on the device, summed over the
step (`StepVerdicts`), and are read with the loss in the step's one read (step/global_loss.py):
every rank of the world judges the same sums at the same point and raises alike, before the
optimizer steps.
"""

from __future__ import annotations

import torch

from mesh3d.distributed.printed_once import agreed

# A call's verdict, one number each, shared by the ranks of a cp group.
DOCUMENTS, CAUSAL, NO_MASK, NOT_EXTENSIBLE, NOT_BOOLEAN = 1, 2, 3, 8, 9
KINDS = (DOCUMENTS, CAUSAL, NO_MASK, NOT_EXTENSIBLE, NOT_BOOLEAN)
TAKEN = {DOCUMENTS: "block-causal over document_ids", CAUSAL: "causal", NO_MASK: "no mask"}
_NAMES = {**TAKEN, NOT_EXTENSIBLE: "a boolean mask that is none of them", NOT_BOOLEAN: "a float (additive) mask"}


class StepVerdicts:
    """The refused calls of one step, counted on the device: [refused calls, then per kind of
    KINDS whether a refused call had a rank of that kind]."""

    def __init__(self):
        self._sums: torch.Tensor | None = None

    def note(self, verdicts: torch.Tensor) -> None:
        """One call's verdicts, every cp rank's ((cp,) on the device, as gathered): added, unread."""
        codes = torch.tensor(KINDS, dtype=verdicts.dtype, device=verdicts.device)
        refused = (verdicts != verdicts[0]).any() | (verdicts >= NOT_EXTENSIBLE).any()
        kinds = (verdicts[:, None] == codes[None, :]).any(dim=0) & refused
        row = torch.cat([refused.reshape(1), kinds]).float()
        self._sums = row if self._sums is None else self._sums + row

    def sums(self, device: torch.device) -> torch.Tensor:
        """What `judge` reads, once summed over every rank (zeros where no call was made here)."""
        if self._sums is None:
            return torch.zeros(1 + len(KINDS), device=device)
        return self._sums.to(device)

    @staticmethod
    def judge(sums: list[float]) -> None:
        """Raise, on every rank alike, where any rank's step made a refused call (`sums`: `sums()`
        summed over every rank, read on the host)."""
        if not sums[0]:
            return
        seen = [_NAMES[kind] for kind, flag in zip(KINDS, sums[1:], strict=True) if flag]
        raise agreed(
            ValueError(
                "context parallelism: the model called scaled_dot_product_attention in a way mesh3d cannot extend "
                f"to the whole sequence (the ranks of a cp group made: {', '.join(seen)}). Under cp every rank of "
                "a group must make the same kind of call, and a mask must be boolean and, on a rank's own "
                f"tokens, one of: {', '.join(TAKEN.values())} (built from the per-sample inputs mesh3d hands the "
                "stage); call SDPA with is_causal=True, or build the mask from document_ids, or use cp=1 "
                "(docs/model_protocol.md#context-parallelism)"
            )
        )
