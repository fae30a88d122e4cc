"""Which transformers architectures run under context parallelism, and how they take their mask.

A stage cut from a transformers causal LM builds its attention mask from its own inputs
(`create_causal_mask`), and reads packed documents from position ids that do not rise by one. On a
cp rank's tokens (a head and a tail chunk of each sequence) that reading is wrong: the jump between
the two chunks would look like a new document. So at cp > 1 mesh3d hands each stage the mask over
its own tokens as a prepared 4-d mask (transformers takes one as it is), with documents read from
the whole rows' position ids; its SDPA calls are then extended to the whole sequence
(mesh3d/context_parallel/sdpa_calls.py).

A prepared mask replaces every mask the architecture would build, so an architecture whose
attention is not causal over the whole sequence -- sliding windows, chunked attention, layers of
other kinds -- is refused by name at cp > 1 rather than trained with another mask; so is a rotary
embedding whose frequencies follow the largest position a stage sees (dynamic, longrope), which
under cp is the rank's own. Attention that
does not go through SDPA (eager, sinks, softcapping) is refused by the block probe of
context_parallel/model_check.py.
"""

from __future__ import annotations

MASK_INPUT = "attention_mask"


def context_parallel_problem(config) -> str | None:
    """Why a config's attention cannot run under cp > 1 (None: it can)."""
    kinds = sorted(set(getattr(config, "layer_types", None) or []) - {"full_attention"})
    if kinds:
        return f"its layers include {kinds} attention, not causal over the whole sequence"
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True):
        return f"its attention is a sliding window of {window} tokens"
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None:
        return f"its attention is chunked ({chunk} tokens)"
    rope = _rope_types(config) & LENGTH_DEPENDENT_ROPE
    if rope:
        return (
            f"its rotary embedding ({sorted(rope)}) picks its frequencies from the largest position a stage is "
            "handed, which is the rank's own tokens' under cp, not the sequence's"
        )
    return None


# transformers' rope types whose frequencies depend on the largest position in the batch
# (modeling_rope_utils.dynamic_rope_update): "dynamic" scaling and Phi-3's "longrope".
LENGTH_DEPENDENT_ROPE = {"dynamic", "longrope"}


def _rope_types(config) -> set[str]:
    """Every rope type the config names (one, or one per layer type)."""
    found = set()
    for source in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if not isinstance(source, dict):
            continue
        entries = source.values() if all(isinstance(v, dict) for v in source.values()) and source else [source]
        for entry in entries:
            kind = entry.get("rope_type", entry.get("type")) if isinstance(entry, dict) else None
            if isinstance(kind, str):
                found.add(kind)
    return found
