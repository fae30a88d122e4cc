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

Every style leaves a plain tensor, so a stage's last module hands the next stage a plain local
tensor (pipeline/boundary.py). Any other style string (packed/fused experts, expert parallel, MLA
splits, sequence parallel, ...) is refused, naming the architecture, the module pattern and the
style, when tp > 1: mesh3d does not guess at a translation it cannot make exact.
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

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
TRANSLATED_STYLES = tuple(_STYLES)  # the style strings mesh3d translates (docs/parallelize.md lists them)


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
    arch = type(model).__name__
    declared = declared_tp_plan(model)
    if not declared:
        return None, (
            f"{arch} ({model.config.model_type}): transformers declares no tensor-parallel plan for it "
            "(config.base_model_tp_plan is empty); pass tp_plan={module-name pattern: ParallelStyle} or use tp=1"
        )
    names = [name for name, _ in model.named_modules()]
    plan: dict[str, ParallelStyle] = {}
    for pattern, style_name in declared.items():
        if not any(fnmatchcase(name, pattern) for name in names):
            continue  # the architecture's plan covers variants (dense or expert blocks) this config lacks
        make = _STYLES.get(style_name)
        if make is None:
            return None, (
                f"{arch} ({model.config.model_type}): its tensor-parallel plan gives module pattern {pattern!r} the "
                f"style {style_name!r}, which mesh3d does not translate into torch DTensor styles exactly (it "
                f"translates {list(_STYLES)}); use tp=1, or pass your own tp_plan={{pattern: ParallelStyle}}"
            )
        style = make()
        if style is not None:
            plan[pattern] = style
    per_head = _whole_per_head_parameter(model, declared)
    if per_head:
        return None, (
            f"{arch} ({model.config.model_type}): its tensor-parallel plan splits the heads of {per_head[0]!r} but "
            f"leaves its parameter {per_head[1]!r} (one value per head) whole, so a tp rank's heads would meet all "
            "heads' values; use tp=1, or pass your own tp_plan={pattern: ParallelStyle}"
        )
    return plan, None


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
