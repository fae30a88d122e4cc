"""Whether a model can run under context parallelism, decided before any message, the same on
every rank (pure, or a run on meta tensors).

A model runs under cp unchanged when (docs/model_protocol.md#context-parallelism):
- it takes `position_ids` (a keyword-only input of a stage's forward, or its per_sample_inputs):
  a rank holding tokens from the middle of a sequence must be told where they sit;
- each of its blocks mixes the sequence through `F.scaled_dot_product_attention` only, which
  mesh3d makes context-parallel (sdpa_calls.py); a block that attends by hand, or mixes tokens
  another way (a convolution, a state-space scan), would see only its rank's tokens.
The second is seen on meta tensors: each block is run and its SDPA calls counted (a call with a
float mask, an additive bias no cut sequence can extend, is refused there too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

from mesh3d.context_parallel.sdpa_calls import AttentionCallCounter

POSITIONS = "position_ids"


def check_kind(
    cp: int, traced: bool, takes: Iterable[frozenset[str]], model: nn.Module, refusal: str | None = None
) -> None:
    """Refuse, by name, a model that cannot take cp > 1 whatever its blocks do (`refusal`: the
    model's own reason, from its anatomy)."""
    if cp == 1:
        return
    name = type(model).__name__
    if refusal is not None:
        raise ValueError(
            f"{name}: {refusal}, which context parallelism (cp={cp}) cannot extend to a sequence cut over ranks "
            "exactly; use cp=1 for it"
        )
    if traced:
        raise ValueError(
            f"{name}: context parallelism (cp={cp}) does not run a traced model: its captured graph fixes the "
            "sequence length and its attention; bring the model through the mesh3d protocol or as a Hugging Face "
            "causal LM, or use cp=1"
        )
    if not any(POSITIONS in names for names in takes):
        raise ValueError(
            f"{name}: context parallelism (cp={cp}) needs a model that takes position_ids: each rank holds tokens "
            "from the middle of the sequence and must be told their positions, but no stage takes them. Add a "
            "keyword-only `position_ids` input to its forward (docs/model_protocol.md#context-parallelism), or "
            "use cp=1"
        )


def check_blocks_attend(
    blocks: list[tuple[str, nn.Module]], run: Callable[[], object], model: nn.Module, cp: int
) -> None:
    """Run the meta model (`run`) counting each block's SDPA calls; refuse blocks that make none."""
    counter = AttentionCallCounter()
    seen: dict[str, int] = {}
    handles = []
    for name, block in blocks:
        handles.append(block.register_forward_pre_hook(lambda *_, n=name: seen.__setitem__(n, -counter.calls)))
        handles.append(block.register_forward_hook(lambda *_, n=name: seen.__setitem__(n, seen[n] + counter.calls)))
    try:
        with counter:
            run()
    finally:
        for handle in handles:
            handle.remove()
    if counter.float_masks:
        raise ValueError(
            f"{type(model).__name__}: context parallelism (cp={cp}): its attention calls "
            "scaled_dot_product_attention with a float mask (an additive bias computed from its own tokens), "
            "which mesh3d cannot extend to a sequence cut over ranks; use cp=1 for it"
        )
    if counter.dropouts:
        raise ValueError(
            f"{type(model).__name__}: context parallelism (cp={cp}): its attention drops out attention weights "
            f"(dropout_p={sorted(counter.dropouts)}), which cannot be drawn as one process draws them when the "
            "sequence is cut; set the model's attention dropout to 0, or use cp=1"
        )
    silent = [name for name, _ in blocks if seen.get(name, 0) == 0]
    if silent:
        raise ValueError(
            f"{type(model).__name__}: context parallelism (cp={cp}): block(s) {silent[:4]}"
            f"{' ...' if len(silent) > 4 else ''} never call torch.nn.functional.scaled_dot_product_attention, "
            "so under cp they would see only their rank's tokens (attention computed by hand, or another way of "
            "mixing the sequence): mesh3d makes only SDPA calls context-parallel. Use an SDPA attention (for a "
            "Hugging Face model: attn_implementation='sdpa'), or cp=1"
        )
