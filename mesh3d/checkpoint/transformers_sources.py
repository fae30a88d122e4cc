"""Where a transformers model's tensor lies in a checkpoint of the Hub's layout: renamed, or split by expert.

transformers 5 loads checkpoints through weight conversions (`transformers.conversion_mapping`):
renamings (Mixtral's `block_sparse_moe` is now `mlp`) and fusions. A mixture-of-experts model
holds each layer's experts as one 3-d tensor
(`mlp.experts.gate_up_proj`, experts x 2·intermediate x hidden), but the checkpoints on the Hub,
and those `save_pretrained` writes, hold them one by one (`mlp.experts.0.gate_proj.weight`, ...):
transformers' weight conversions (`transformers.conversion_mapping`) stack them on load. The import
reads the same declaration instead of a table of its own: a converter whose operations are
"stack the experts" (MergeModulelist on dim 0), optionally followed by "concatenate the parts"
(Concatenate on dim 1), and the renamings before it. Each rank still reads only its window: per
expert, the rows of each part that fall in it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

_LITERAL = re.compile(r"^(?:[^\\^$*+?()\[\]{}|]|\\.)*$")  # a regex of escaped or plain characters only


@dataclass(frozen=True)
class ExpertStack:
    """A fused expert tensor: `parts[j][e]` is the checkpoint tensor of part j (gate, up) of expert e,
    each of `rows[j]` rows; the fused tensor stacks the experts (dim 0) of the parts concatenated (dim 1)."""

    parts: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]

    def names(self) -> list[str]:
        return [name for part in self.parts for name in part]

    def count(self) -> int:
        return len(self.parts[0])

    def fused_shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...] | None:
        """The fused tensor's shape from the checkpoint tensors' (None where the experts' shapes differ)."""
        rest = {shapes[name][1:] for name in self.names()}
        whole_parts = all(shapes[name][0] == rows for part, rows in zip(self.parts, self.rows) for name in part)
        if len(rest) != 1 or not whole_parts:
            return None
        return (self.count(), sum(self.rows), *rest.pop())

    def read(self, read_one: Callable[[str, tuple[slice, ...]], torch.Tensor], window: tuple[slice, ...]):
        """The window of the fused tensor, read part by part and expert by expert."""
        experts, rows, rest = window[0], window[1], window[2:]
        out = []
        for expert in range(experts.start, experts.stop):
            pieces, start = [], 0
            for part, count in zip(self.parts, self.rows):
                low, high = max(rows.start, start), min(rows.stop, start + count)
                if low < high:
                    pieces.append(read_one(part[expert], (slice(low - start, high - start), *rest)))
                start += count
            out.append(torch.cat(pieces, dim=0))
        return torch.stack(out)


def checkpoint_source(
    name: str, model_type: str, available: set[str], shape: tuple[int, ...], part_rows: Callable[[str], int]
) -> str | ExpertStack | None:
    """The checkpoint tensor(s) transformers builds the model's tensor `name` (of `shape`) from, among
    `available`: a renamed one, or the experts one by one; None where its conversions say nothing."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return None
    conversions = get_checkpoint_conversion_mapping(model_type) or []
    renamings = [c for c in conversions if type(c).__name__ == "WeightRenaming"]
    renamed = _checkpoint_name(name, renamings, available)
    if renamed is not None or len(shape) != 3:
        return renamed
    experts = shape[0]
    for converter in conversions:
        if type(converter).__name__ != "WeightConverter" or not _stacks_then_concatenates(converter):
            continue
        (target,) = converter.target_patterns
        if not name.endswith(target.lstrip(".")):
            continue
        prefix = name[: len(name) - len(target.lstrip("."))]
        parts = []
        for pattern in converter.source_patterns:
            names = tuple(
                _checkpoint_name(prefix + pattern.lstrip(".").replace("*", str(e)), renamings, available)
                for e in range(experts)
            )
            if None in names:
                return None
            parts.append(names)
        return ExpertStack(tuple(parts), tuple(part_rows(part[0]) for part in parts))
    return None


def _stacks_then_concatenates(converter) -> bool:
    """Operations that stack the experts on dim 0, then join the parts on dim 1 (or a single part)."""
    kinds = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    if len(converter.target_patterns) != 1:
        return False
    if len(converter.source_patterns) == 1:
        return kinds == [("MergeModulelist", 0)]
    return kinds == [("MergeModulelist", 0), ("Concatenate", 1)]


def _checkpoint_name(model_name: str, renamings, available: set[str]) -> str | None:
    """The checkpoint's name of a tensor the model names `model_name`: as it is, or with one of the
    architecture's literal renamings undone (Mixtral's `.block_sparse_moe.` became `.mlp.`)."""
    if model_name in available:
        return model_name
    for renaming in renamings:
        for source, target in zip(renaming.source_patterns, renaming.target_patterns):
            if not _LITERAL.match(source) or target not in model_name:
                continue
            original = model_name.replace(target, re.sub(r"\\(.)", r"\1", source), 1)
            if original in available:
                return original
    return None
