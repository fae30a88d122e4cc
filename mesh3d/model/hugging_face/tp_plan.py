"""A Hugging Face causal LM's tensor-parallel plan: transformers' declaration, as torch DTensor styles.

transformers declares, per architecture, how each module shards: the config's `base_model_tp_plan`
(patterns relative to the base model, e.g. "layers.*.self_attn.q_proj": "colwise") and the causal
LM class's own `_tp_plan` ({"lm_head": "colwise_gather_output"}); the model's `tp_plan` property
joins them under the base model's prefix and adds "embedding_rowwise" for a plain nn.Embedding.
mesh3d reads that joined plan and maps each style string to the torch ParallelStyle that computes
the same thing:

- "colwise": ColwiseParallel() (weight and bias split by output rows; the output stays this rank's
  slice, a plain tensor: its heads, reshaped by the attention with -1 heads of head_dim);
- "rowwise": RowwiseParallel() (weight split by input columns, the partial sums all-reduced, the
  bias added once);
- "colwise_gather_output" / "colwise_rep": ColwiseParallel(output_layouts=Replicate()) (the full
  output gathered: the output head's logits);
- "rowwise_split_input" / "rowwise_rep": RowwiseParallel(input_layouts=Replicate()) (takes a full
  input, uses its own slice);
- "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()) on an nn.Embedding (the
  vocabulary split, each rank looks up its rows, the lookups summed); with the head's
  "colwise_gather_output" both split the vocabulary, so a tied weight's two copies have aligned
  shards (pipeline/tied.py checks it);
- "replicated_with_grad_allreduce" (Qwen3's per-head q/k norms, fed this rank's heads):
  SequenceParallel over dim 0 with a local output: the weight a replicated DTensor, the input
  this rank's part along a dim the norm does not reduce, so the weight's gradient comes out
  Partial and is summed over tp once per step (tensor/gradients.py), never per microbatch;
- "replicate": nothing (the module stays a plain replicated module, as every unplanned one;
  one fed a slice, such as Apertus' xIELU `act_fn`, has its gradient summed over tp:
  tensor/partial_gradients.py).

Modules that run on plain tensors take styles of mesh3d's own (tensor/local_styles.py), each with
the parameter entries of the plan under it ("<module pattern>.<parameter>": style):

- "moe_tp_experts": ExpertsParallel (each expert split along its intermediate features, the
  parts of the output summed over tp, its inputs' gradients summed backward), its parameters
  "packed_colwise" (a 3-d (experts, 2 x intermediate, hidden) gate_up: _StridedShard(1, 2), the
  gate and up halves each split), "rowwise" (down, (experts, hidden, intermediate): Shard(2)),
  "packed_rowwise" / "colwise" for the transposed layout (Aria: _StridedShard(2, 2) and Shard(1));
- "moe_identity_expert": ScaledInput (an identity expert's input divided by tp, so the experts'
  sum over tp counts it once);
- "local_params": LocalParameters, its parameters "colwise" (a per-head attention sink: Shard(0),
  split with the heads);
- "mla_kv_a_proj": LatentKvProjection(config.qk_rope_head_dim) (the rotary part of latent
  attention's shared key, fed to every head, has its gradient summed over tp).

Every style leaves a plain tensor, so a stage's last module hands the next stage a plain local
tensor (pipeline/boundary.py). Any other style string (expert parallel, sequence parallel,
"all_reduce" over split parameters, a split bias inside summed experts, ...) is refused, naming
the architecture, the pattern and the style, when tp > 1: mesh3d does not guess at a translation it
cannot make exact.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor import Placement, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import _StridedShard

from mesh3d.tensor.local_styles import ExpertsParallel, LatentKvProjection, LocalParameters, ScaledInput

_STYLES: dict[str, Callable[[], ParallelStyle | None]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=0, use_local_output=True),
    "replicate": lambda: None,
}
# The style strings mesh3d translates (docs/parallelize.md lists them): the module styles above, and
# those that run on local shards (tensor/local_styles.py) with the parameter styles they take.
LOCAL_SHARD_STYLES = ("local_params", "moe_tp_experts")
PACKED_STYLES = ("packed_colwise", "packed_rowwise")  # for parameters only, as "colwise" and "rowwise" also are
TRANSLATED_STYLES = (*_STYLES, *LOCAL_SHARD_STYLES, "moe_identity_expert", "mla_kv_a_proj", *PACKED_STYLES)


def declared_tp_plan(model: nn.Module) -> dict[str, str]:
    """transformers' plan for the whole causal LM: {module pattern from the model's root: style string}."""
    joined = getattr(model, "tp_plan", None)
    if isinstance(joined, dict) and joined:
        return dict(joined)
    # Without the joined property: the class's own plan and the config's, under the base model's prefix.
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    plan.update({f"{model.base_model_prefix}.{pattern}": style for pattern, style in base.items()})
    return plan


def translate_tp_plan(model: nn.Module) -> tuple[dict[str, ParallelStyle] | None, str | None]:
    """(the plan as torch styles, None), or (None, why not) for a plan mesh3d cannot translate exactly.

    Pure: the refusal is raised by parallelize only when tp > 1, on every rank before any collective.
    """
    arch = f"{type(model).__name__} ({model.config.model_type})"
    declared = declared_tp_plan(model)
    if not declared:
        return None, (
            f"{arch}: transformers declares no tensor-parallel plan for it "
            "(config.base_model_tp_plan is empty); pass tp_plan={module-name pattern: ParallelStyle} or use tp=1"
        )
    modules = dict(model.named_modules())
    module_entries = {p: s for p, s in declared.items() if any(fnmatchcase(name, p) for name in modules)}
    parameter_entries = _parameter_entries(model, declared, module_entries)
    plan: dict[str, ParallelStyle] = {}
    for pattern, style_name in module_entries.items():
        owned = parameter_entries.pop(pattern, {})
        style, why = _module_style(model, pattern, style_name, owned)
        if why:
            return None, f"{arch}: {why}; use tp=1, or pass your own tp_plan={{pattern: ParallelStyle}}"
        if style is not None:
            plan[pattern] = style
    for owner, owned in parameter_entries.items():
        (name, style_name), *_ = owned.items()
        return None, (
            f"{arch}: its tensor-parallel plan gives parameter pattern {owner + '.' + name!r} the style "
            f"{style_name!r}, but gives its module {owner!r} no style that runs on local shards ('local_params' or "
            "'moe_tp_experts'); use tp=1, or pass your own tp_plan={pattern: ParallelStyle}"
        )
    per_head = _whole_per_head_parameter(model, declared)
    if per_head:
        return None, (
            f"{arch}: its tensor-parallel plan splits the heads of {per_head[0]!r} but "
            f"leaves its parameter {per_head[1]!r} (one value per head) whole, so a tp rank's heads would meet all "
            "heads' values; use tp=1, or pass your own tp_plan={pattern: ParallelStyle}"
        )
    return plan, None


def _parameter_entries(model: nn.Module, declared: dict[str, str], module_entries: dict[str, str]):
    """{owner module pattern: {parameter name: (style, ndim)}} for the plan's entries naming parameters."""
    params = dict(model.named_parameters())
    entries: dict[str, dict[str, tuple[str, int]]] = {}
    for pattern, style_name in declared.items():
        if pattern in module_entries or style_name == "replicate":
            continue
        matched = [name for name in params if fnmatchcase(name, pattern)]
        if matched:
            owner, _, name = pattern.rpartition(".")
            entries.setdefault(owner, {})[name] = (style_name, params[matched[0]].dim())
    return entries


def _module_style(model: nn.Module, pattern: str, style_name: str, owned: dict[str, tuple[str, int]]):
    """(the torch style for a module pattern, None), or (None, why it cannot be exact)."""
    if style_name in LOCAL_SHARD_STYLES:
        placements = {}
        for name, (param_style, ndim) in owned.items():
            placement = _parameter_placement(param_style, ndim)
            if placement is None:
                return None, (
                    f"its tensor-parallel plan gives the {ndim}-d parameter {pattern + '.' + name!r} the style "
                    f"{param_style!r}, which mesh3d does not translate for parameters"
                )
            placements[name] = placement
        if style_name == "local_params":
            return LocalParameters(placements), None
        whole = _whole_expert_parameter(model, pattern, placements)
        if whole:
            return None, (
                f"its experts module {pattern!r} holds the parameter {whole!r}, which its tensor-parallel plan leaves "
                "whole: every tp rank would add all of it to the experts' summed output"
            )
        return ExpertsParallel(placements), None
    if owned:
        return None, (
            f"its tensor-parallel plan shards parameters of {pattern!r} but gives the module the style "
            f"{style_name!r}, not one that runs on local shards {LOCAL_SHARD_STYLES}"
        )
    if style_name == "mla_kv_a_proj":
        rope_dim = getattr(model.config.get_text_config(), "qk_rope_head_dim", None)
        if not isinstance(rope_dim, int):
            return None, f"its plan gives {pattern!r} the style 'mla_kv_a_proj' but its config has no qk_rope_head_dim"
        return LatentKvProjection(rope_dim), None
    if style_name == "moe_identity_expert":
        return ScaledInput(), None
    make = _STYLES.get(style_name)
    if make is None:
        return None, (
            f"its tensor-parallel plan gives module pattern {pattern!r} the style {style_name!r}, which mesh3d does "
            f"not translate into torch DTensor styles exactly (it translates {list(TRANSLATED_STYLES)})"
        )
    return make(), None


def _parameter_placement(style_name: str, ndim: int) -> Placement | None:
    """transformers' placement of a parameter its plan names (the expert weights are (experts, out, in)
    or, for "packed_rowwise", (experts, in, out)); None where a sum of the ranks' parts would not be exact."""
    if style_name == "colwise":
        return Shard(max(ndim - 2, 0))
    if ndim < 2:
        return None  # a bias split or replicated inside a summed module: no exact equivalent
    if style_name == "rowwise":
        return Shard(ndim - 1)
    if ndim != 3:
        return None  # a packed 2-d weight: its strided split would nest with FSDP's on the same dim
    if style_name == "packed_colwise":
        return _StridedShard(1, split_factor=2)
    if style_name == "packed_rowwise":
        return _StridedShard(2, split_factor=2)
    return None


def _whole_expert_parameter(model: nn.Module, pattern: str, placements: dict[str, Placement]) -> str | None:
    """A parameter of an experts module (or its children) that the plan does not shard."""
    for name, module in model.named_modules():
        if fnmatchcase(name, pattern):
            for param_name, _ in module.named_parameters():
                if param_name not in placements:
                    return f"{name}.{param_name}"
    return None


def _whole_per_head_parameter(model: nn.Module, declared: dict[str, str]) -> tuple[str, str] | None:
    """(module, parameter) where a module whose children the plan splits by heads ("colwise") holds a
    parameter of its own the plan does not name, sized by the head count (Doge's dynamic-mask `A`)."""
    heads = {getattr(model.config, n, None) for n in ("num_attention_heads", "num_key_value_heads")} - {None}
    for name, module in model.named_modules():
        if not any(fnmatchcase(name, pattern) for pattern in declared):
            split = [
                child
                for child, _ in module.named_children()
                if declared.get(next((p for p in declared if fnmatchcase(f"{name}.{child}", p)), "")) == "colwise"
            ]
            for param_name, param in module.named_parameters(recurse=False):
                if split and param.dim() >= 1 and param.shape[0] in heads:
                    return name, f"{name}.{param_name}"
    return None


def tensor_parallel_sizes(config) -> dict[str, int]:
    """The sizes the plan splits over tp, as the config names them: tp must divide each."""
    names = ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")
    return {name: int(getattr(config, name)) for name in names if isinstance(getattr(config, name, None), int)}
