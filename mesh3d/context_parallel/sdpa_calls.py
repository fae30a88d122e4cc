"""The model's own attention calls made context-parallel: `F.scaled_dot_product_attention`
intercepted while a stage runs a microbatch (a TorchFunctionMode), and answered over the whole
sequence (attention.py).

A model written for one process calls SDPA on its chunk's queries, keys and values with
`is_causal=True`, or with a boolean mask it built from its (chunk of the) per-sample inputs. The
first becomes causal attention over every gathered key by global position. A mask is taken only
where it is one mesh3d can extend to the whole sequence: the call's mask must equal, on this
rank's own tokens, one of the masks the whole rows define -- block-causal over the step's
`document_ids`, causal, or none -- and that mask's rows over every key are used. Anything else is
refused by name on every rank together one call late (the verdicts travel in the K/V gather:
call_verdicts.py), never trained on silently.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from mesh3d.context_parallel.attention import CausalQueries, GatheredAttention, attend
from mesh3d.context_parallel.call_verdicts import CAUSAL, DOCUMENTS, NO_MASK, NOT_BOOLEAN, NOT_EXTENSIBLE, StepVerdicts
from mesh3d.context_parallel.sequence_cut import SequenceCut


class ContextParallelAttention(TorchFunctionMode):
    """While active, every `F.scaled_dot_product_attention` call attends over the whole sequence.

    Args:
        cut: this rank's tokens of each sequence (sequence_cut.py).
        group: the cp process group.
        verdicts: where the step's calls note their verdicts (judged with the step's loss).
        document_ids: the microbatch's whole-row document ids (batch, seq), or None.
    """

    # Re-entered where a block checkpointed on its own recomputes its forward inside the backward
    # (pipeline/activation_checkpoint.py): its SDPA calls must span the whole sequence there too.
    reenter_on_recompute = True

    def __init__(
        self,
        cut: SequenceCut,
        group: dist.ProcessGroup,
        verdicts: StepVerdicts,
        document_ids: torch.Tensor | None = None,
    ):
        super().__init__()
        self.cut, self.group, self.verdicts, self.document_ids = cut, group, verdicts, document_ids
        self.calls = 0
        self._positions: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._causal: dict[torch.device, CausalQueries] = {}
        # A mask judged once is the same mask at every later call that passes it (the layers of a
        # stage, the recompute): no second comparison. Each is held here, so no other tensor can take
        # its memory (and its key) while the context lives.
        self._agreed: dict[tuple, tuple[int, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self._attend(*args, **kwargs)
        return func(*args, **kwargs)

    def _attend(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ) -> torch.Tensor:
        cut = self.cut
        local = 2 * cut.chunk
        if query.shape[-2] != local or key.shape[-2] != local or value.shape[-2] != local:
            raise ValueError(
                f"context parallelism: an attention call over {query.shape[-2]} queries and {key.shape[-2]} keys, "
                f"but this rank holds {local} tokens of each sequence (cp={cut.cp}, sequence length {cut.seq_len}); "
                "under cp a model's attention must run on its own tokens' queries, keys and values "
                "(docs/model_protocol.md#context-parallelism)"
            )
        if dropout_p:
            raise ValueError(
                f"context parallelism: an attention call with dropout_p={dropout_p}; attention dropout cannot "
                "be drawn as one process draws it when the sequence is cut: set the model's attention "
                "dropout to 0, or use cp=1"
            )
        q_pos, k_pos = self._positions_on(query.device)
        kind = CAUSAL if is_causal else NO_MASK
        if attn_mask is not None:
            # _version: a mask buffer refilled in place between layers is a new mask
            mask_id = (attn_mask.data_ptr(), attn_mask._version, tuple(attn_mask.shape), attn_mask.stride())
            seen = (*mask_id, attn_mask.dtype, is_causal)
            kind = self._agreed.get(seen, (None,))[0]
            if kind is None:
                kind = self._match(attn_mask, q_pos, k_pos, is_causal)
                self._agreed[seen] = (kind, attn_mask)
        call = GatheredAttention(
            group=self.group,
            cp=cut.cp,
            mask=lambda device: self._rows(kind, *self._positions_on(device)),
            scale=scale,
            enable_gqa=enable_gqa,
            verdict=kind,
            note=self.verdicts.note,
            causal=self._causal_queries(query.device) if kind == CAUSAL else None,
        )
        return attend(query, key, value, call)

    def _causal_queries(self, device: torch.device) -> CausalQueries:
        """This rank's queries as runs of positions, and the keys' order, for causal calls (made once)."""
        if device not in self._causal:
            self._causal[device] = CausalQueries.of(self.cut.positions, self._positions_on(device)[1])
        return self._causal[device]

    def _positions_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's tokens' positions, every gathered key's position) on `device`, made once."""
        if device not in self._positions:
            self._positions[device] = (self.cut.positions.to(device), self.cut.gathered_positions.to(device))
        return self._positions[device]

    def _rows(self, kind: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor | None:
        """This rank's queries' mask over every gathered key: (1 or batch, 1, queries, keys) bool, or None."""
        if kind in (NO_MASK, NOT_EXTENSIBLE, NOT_BOOLEAN):
            return None
        return mask_rows(q_pos, k_pos, self.document_ids if kind == DOCUMENTS else None)

    def _match(self, attn_mask: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, is_causal: bool) -> int:
        """Which whole-sequence mask `attn_mask` (over this rank's own tokens) is."""
        if attn_mask.dtype != torch.bool or is_causal:
            return NOT_BOOLEAN
        local = slice(self.cut.cp_rank * len(q_pos), (self.cut.cp_rank + 1) * len(q_pos))
        kinds = ([DOCUMENTS] if self.document_ids is not None else []) + [CAUSAL, NO_MASK]
        for kind in kinds:
            rows = self._rows(kind, q_pos, k_pos)
            own = torch.ones_like(attn_mask) if rows is None else rows[..., local]
            try:
                shape = torch.broadcast_shapes(attn_mask.shape, own.shape)
            except RuntimeError:
                continue
            if torch.equal(attn_mask.expand(shape), own.expand(shape)):
                return kind
        return NOT_EXTENSIBLE


def mask_rows(q_pos: torch.Tensor, k_pos: torch.Tensor, document_ids: torch.Tensor | None) -> torch.Tensor:
    """Which keys (at global positions k_pos) each query (at q_pos) sees: causal, and within its
    document where whole-row `document_ids` (batch, seq) are given; (1 or batch, 1, queries, keys) bool."""
    causal = (q_pos[:, None] >= k_pos[None, :])[None, None]
    if document_ids is None:
        return causal
    docs = document_ids.to(q_pos.device)
    return (docs[:, q_pos, None] == docs[:, None, k_pos])[:, None] & causal


def own_tokens_mask(cut: SequenceCut, document_ids: torch.Tensor | None) -> torch.Tensor:
    """The mask over this rank's own tokens (batch or 1, 1, chunk, chunk): what a model that builds
    its mask from the rank's tokens alone would build; mesh3d hands it to a Hugging Face stage, whose
    SDPA calls are then extended to the whole sequence by it (`ContextParallelAttention`)."""
    positions = cut.positions
    return mask_rows(positions, positions, document_ids)


class AttentionCallCounter(TorchFunctionMode):
    """Counts `F.scaled_dot_product_attention` calls and lets them through (a meta run's probe),
    noting those whose mask no cut sequence can take: a float mask (an additive bias)."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.float_masks = 0
        self.dropouts: set[float] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            self.float_masks += int(mask is not None and mask.dtype != torch.bool)
            dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
            if dropout:
                self.dropouts.add(float(dropout))
        return func(*args, **kwargs)
