"""Each context-parallel attention call's verdict, and their judgement one call late.

A rank judges its own call (sdpa_calls.py): which whole-sequence mask its `attn_mask` is on its own
tokens, or causal (`is_causal=True`), or none it can extend. The verdict travels in the call's K/V
all-gather (attention.py), so every rank of the cp group has every rank's. A call is refused where
a rank's mask cannot be extended, or where the ranks made different kinds of call (one causal, one
with a document mask): computed on, the group would train another model than one process.

Reading the verdicts at each call would sync the host with the device once a call, and a rank that
raised there while a peer (its check skipped: a mask it had judged before) went on would leave the
peer waiting in its next collective. So the gathered verdicts stay on the device, summed over the
step (`StepVerdicts`), travel in the loss's all-reduce (step/global_loss.py) and are judged one
call late (step/late_verdicts.py: at the end of the next step or evaluate, or by pm.flush), so the
step never waits for them: every rank of the world judges the same sums at the same point and
raises alike, after the faulty call's update and before the raising call's (a never-drain
schedule refuses the next call until a checkpoint is loaded).
"""

from __future__ import annotations

import torch

from mesh3d.distributed.printed_once import agreed

# A call's verdict, one number each, shared by the ranks of a cp group.
DOCUMENTS, CAUSAL, NO_MASK, NOT_EXTENSIBLE, NOT_BOOLEAN = 1, 2, 3, 8, 9
KINDS = (DOCUMENTS, CAUSAL, NO_MASK, NOT_EXTENSIBLE, NOT_BOOLEAN)
TAKEN = {DOCUMENTS: "block-causal over document_ids", CAUSAL: "causal", NO_MASK: "no mask"}
_NAMES = {
    **TAKEN,
    NO_MASK: "no mask (or an all-True one)",
    NOT_EXTENSIBLE: "a boolean mask that is none of them",
    NOT_BOOLEAN: "a float (additive) mask",
}


class StepVerdicts:
    """The refused calls of one step, counted on the device: [refused calls, then for each cp rank
    and each kind of KINDS, the refused calls where that rank's call was of that kind].

    Args:
        cp: the cp group's size (every rank of the world has the same).
    """

    def __init__(self, cp: int):
        self.cp = cp
        self._sums: torch.Tensor | None = None

    def note(self, verdicts: torch.Tensor) -> None:
        """One call's verdicts, every cp rank's ((cp,) on the device, as gathered): added, unread
        (compared with Python numbers: a tensor of the codes made here would be a copy to the device,
        which waits for it on CUDA)."""
        refused = (verdicts != verdicts[0]).any() | (verdicts >= NOT_EXTENSIBLE).any()
        kinds = torch.stack([verdicts == code for code in KINDS], dim=1) & refused  # (cp, kinds)
        row = torch.cat([refused.reshape(1), kinds.flatten()]).float()
        self._sums = row if self._sums is None else self._sums + row

    def sums(self, device: torch.device) -> torch.Tensor:
        """What `judge` reads, once summed over every rank (zeros where no call was made here)."""
        if self._sums is None:
            return torch.zeros(1 + self.cp * len(KINDS), device=device)
        return self._sums.to(device)

    def judge(self, sums: list[float]) -> None:
        """Raise, on every rank alike, where any rank's step made a refused call (`sums`: `sums()`
        summed over every rank, read from host memory one call late)."""
        if not sums[0]:
            return
        flags = [sums[1 + r * len(KINDS) : 1 + (r + 1) * len(KINDS)] for r in range(self.cp)]
        made = "; ".join(
            f"cp rank {r}: " + " or ".join(_NAMES[kind] for kind, n in zip(KINDS, row, strict=True) if n)
            for r, row in enumerate(flags)
        )
        raise agreed(
            ValueError(
                "context parallelism: the model called scaled_dot_product_attention in a way mesh3d cannot extend "
                f"to the whole sequence ({made}). Under cp every rank of "
                "a group must make the same kind of call, and a mask must be boolean and, on a rank's own "
                f"tokens, one of: {', '.join(TAKEN.values())} (built from the per-sample inputs mesh3d hands the "
                "stage); call SDPA with is_causal=True, or build the mask from document_ids, or use cp=1 "
                "(docs/model_protocol.md#context-parallelism)"
            )
        )
