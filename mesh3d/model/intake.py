"""How a model comes in: which of the three ways (docs/model_protocol.md), and its Anatomy.

- the mesh3d protocol: blocks in an nn.ModuleDict `layers`, ends by registration order, one
  forward that tolerates missing parts;
- a Hugging Face causal LM, described by its config's `base_model_pp_plan`
  (model/hugging_face/causal_lm.py);
- an nn.Sequential: its children are the blocks, each stage runs the ones it keeps;
- any other model torch.export can capture, from `example_inputs`: traced and split by torch's
  pipeline frontend (model/traced/), its stages handing on several tensors and skipping stages.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch import nn

from mesh3d.model.anatomy import Anatomy
from mesh3d.model.hugging_face.causal_lm import hugging_face_anatomy
from mesh3d.model.hugging_face.exactness import check_stages_exact
from mesh3d.model.stage_inputs import declared_index_bounds
from mesh3d.model.traced.anatomy import traced_anatomy


def anatomy_of(
    model: nn.Module, example_inputs: tuple | None = None, split_points: Sequence[str] | None = None
) -> Anatomy:
    """The anatomy of `model`, whichever way it came in; a ValueError listing the ways otherwise.

    A model that is none of the protocol, a Hugging Face causal LM or an nn.Sequential is traced
    when `example_inputs` (one microbatch) are given; `split_points` then also picks its blocks'
    container."""
    if _is_hugging_face(model):
        anatomy = hugging_face_anatomy(model)
        check_stages_exact(model)  # after the anatomy's own refusals, which name what is missing
        return anatomy
    if isinstance(getattr(model, "layers", None), nn.ModuleDict):
        return protocol_anatomy(model)
    if isinstance(model, nn.Sequential):
        return sequential_anatomy(model)
    if example_inputs is not None:
        return traced_anatomy(model, example_inputs, split_points)
    found = type(getattr(model, "layers", None)).__name__ if getattr(model, "layers", None) is not None else "nothing"
    raise ValueError(
        f"{type(model).__name__} has no nn.ModuleDict attribute 'layers' (found {found}), is not an nn.Sequential "
        "and is not a Hugging Face PreTrainedModel; mesh3d splits a model by the repeated blocks it keeps in "
        "`self.layers = nn.ModuleDict({'0': block, '1': block, ...})`, or traces one torch.export can capture when "
        "given example_inputs=(one_microbatch,) (see docs/model_protocol.md for the ways to bring a model)"
    )


def protocol_anatomy(model: nn.Module, attr: str = "layers") -> Anatomy:
    """The mesh3d protocol: an nn.ModuleDict `layers` keyed "0".."L-1"; the children registered
    before it belong to the first stage, those after it to the last."""
    layers = getattr(model, attr, None)
    if not isinstance(layers, nn.ModuleDict):
        found = type(layers).__name__ if layers is not None else "nothing"
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleDict attribute {attr!r} (found {found}); mesh3d splits a model "
            f"by the repeated blocks it keeps in `self.{attr} = nn.ModuleDict({{'0': block, '1': block, ...}})` "
            "(see docs/model_protocol.md)"
        )
    _check_keys(type(model).__name__ + f".{attr}", list(layers.keys()))
    names = list(model._modules)
    at = names.index(attr)
    return Anatomy(
        name=type(model).__name__,
        layers=attr,
        first=tuple(names[:at]),
        last=tuple(names[at + 1 :]),
        tp_plan=getattr(model, "tp_plan", None),
        tensor_parallel_sizes=model.tensor_parallel_sizes()
        if callable(getattr(model, "tensor_parallel_sizes", None))
        else {},
        vocab_size=getattr(model, "vocab_size", None),
        input_index_bounds=declared_index_bounds(model),
    )


def sequential_anatomy(model: nn.Sequential) -> Anatomy:
    """An nn.Sequential: every child is a block; a stage is the Sequential of the children it keeps."""
    _check_keys(f"{type(model).__name__} (nn.Sequential)", list(model._modules))
    return Anatomy(
        name=f"{type(model).__name__} (nn.Sequential)",
        layers="",
        tp_plan=getattr(model, "tp_plan", None),
        vocab_size=getattr(model, "vocab_size", None),
        input_index_bounds=declared_index_bounds(model),
    )


def _check_keys(what: str, keys: list[str]) -> None:
    if not keys:
        raise ValueError(f"{what} has no blocks; a pipeline needs at least one block per stage")
    expected = [str(i) for i in range(len(keys))]
    if keys != expected:
        raise ValueError(f"{what} must be keyed '0'..'{len(keys) - 1}' in order, got {keys}")


def _is_hugging_face(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # a model of transformers' means it is imported
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)
