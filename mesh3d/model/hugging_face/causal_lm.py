"""A Hugging Face causal LM's anatomy, read from what transformers declares for its architecture.

The config's `base_model_pp_plan` names the base model's children in order: those before the
repeated blocks take `input_ids` (the embedding: first stage), the one ModuleList is the blocks,
those after it (the final norm) belong to the last stage, with the output head
(`get_output_embeddings()`). Every other child (the rotary table) holds no state and stays on
every stage.

A stage runs the architecture's own forward, not a rewrite of it: the first stage calls the base
model with `input_ids`, the others with `inputs_embeds` (the hidden states received); stages
before the last return the base model's `last_hidden_state` (the final norm stands down as an
nn.Identity there, as what follows the embedding, a dropout, does on stages after the first),
the last stage runs the causal LM's forward whole (norm, head, logit scaling or softcapping) and
returns its `logits`. Every stage hands the base model the step's `position_ids` and
`attention_mask` (per-sample inputs, model/stage_inputs.py) as transformers' own forward receives
them, where the architecture's forward takes them: each stage then builds the same rotary angles
and the same mask (packed sequences from restarting position ids, padding from the mask) as the
whole model would. Each stage's config lists only its own blocks'
`layer_types`, for forwards that pick a block's mask by its position in the loop. Whether this
composition equals the architecture's forward is not assumed: it is checked on a small instance
of the architecture (exactness.py, run by model/intake.py after this anatomy) and an architecture
that fails is refused by name.
"""

from __future__ import annotations

import copy
import functools
import inspect

from torch import nn

from mesh3d.expert_parallel.plan import translate_ep_plan
from mesh3d.model.anatomy import Anatomy
from mesh3d.model.hugging_face.context_parallel import MASK_INPUT, context_parallel_problem
from mesh3d.model.hugging_face.router_loss import record_router_logits, recorded_router_logits, router_aux_of
from mesh3d.model.hugging_face.seeded_init import init_stage_weights
from mesh3d.model.hugging_face.tp_plan import tensor_parallel_sizes, translate_tp_plan
from mesh3d.model.router_aux import RouterAux, from_wire, to_wire

# The per-sample inputs a Hugging Face stage hands its base model, where that model's forward takes them.
PER_SAMPLE_INPUTS = ("position_ids", "attention_mask")


def hugging_face_anatomy(model: nn.Module) -> Anatomy:
    """The anatomy of a transformers `*ForCausalLM`; a ValueError naming the architecture and
    what is missing when mesh3d cannot split it exactly."""
    arch = type(model).__name__
    config = model.config
    prefix = model.base_model_prefix
    base = getattr(model, prefix, None) if prefix else None
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if base is None or base is model or head is None:
        raise ValueError(
            f"{arch}: mesh3d takes a Hugging Face causal LM (a *ForCausalLM with a base model and an output head, "
            "as AutoModelForCausalLM builds it); pass that model, not the bare base model or another head"
        )
    pp_plan = getattr(config, "base_model_pp_plan", None)
    if not pp_plan:
        raise ValueError(_no_plan_refusal(arch, config.model_type, prefix, base))
    names = list(pp_plan)
    blocks = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(blocks) != 1:
        raise ValueError(
            f"{arch}: its base_model_pp_plan {names} must name exactly one nn.ModuleList of blocks, found {blocks}"
        )
    at = names.index(blocks[0])
    before, after = names[:at], names[at + 1 :]
    problem = _plan_problem(pp_plan, before, blocks[0], after) or _stateful_extra(model, base, prefix, head, names)
    router_aux, router_problem = router_aux_of(model)
    problem = problem or router_problem
    if problem:
        raise ValueError(f"{arch} ({config.model_type}): {problem}; mesh3d cannot split it exactly")
    head_path = next(name for name, module in model.named_modules() if module is head)
    tp_plan, tp_plan_refusal = translate_tp_plan(model)
    expert_plan, expert_plan_refusal = translate_ep_plan(model)
    return Anatomy(
        name=f"{arch} (Hugging Face)",
        layers=f"{prefix}.{blocks[0]}",
        first=tuple(f"{prefix}.{n}" for n in before),
        last=(*(f"{prefix}.{n}" for n in after), head_path),
        # The base forward applies what follows the embedding (GPT-NeoX's, Phi's, GPT-J's dropout) to
        # inputs_embeds and the final norm to the blocks' output on every stage: identity where dropped.
        identity_when_dropped=tuple(f"{prefix}.{n}" for n in (*before[1:], *after)),
        make_stage=functools.partial(_make_stage, prefix, copy.deepcopy(config), router_aux),
        tp_plan=tp_plan,
        tp_plan_refusal=tp_plan_refusal,
        tensor_parallel_sizes=tensor_parallel_sizes(config),
        vocab_size=config.vocab_size,
        init_stage=init_stage_weights,
        fake_shape_run=True,  # transformers' mask code reads the position ids' values
        cp_mask_input=MASK_INPUT if MASK_INPUT in inspect.signature(base.forward).parameters else None,
        cp_refusal=context_parallel_problem(config),
        router_aux=router_aux,
        expert_plan=expert_plan,
        expert_plan_refusal=expert_plan_refusal or "",
    )


def _no_plan_refusal(arch: str, model_type: str, prefix: str, base: nn.Module) -> str:
    """Why an architecture without a `base_model_pp_plan` (GPT-2's) is refused, by either of the
    two paths that could take it: stage by stage on its own forward, or traced."""
    lists = [(name, len(m)) for name, m in base.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    blocks = f"{prefix}.{max(lists, key=lambda entry: entry[1])[0]}" if lists else f"a module inside {prefix!r}"
    return (
        f"{arch} ({model_type}): its config declares no base_model_pp_plan, so mesh3d cannot tell which modules "
        "take and give what between stages of its own forward. Nor can it trace the model instead "
        f"(example_inputs=): its blocks ({blocks}) run inside {prefix!r}, which the causal LM's forward calls as one "
        "module, and a traced stage runs whole modules, so every split point would fall inside it. Use an "
        "architecture that declares a base_model_pp_plan (docs/model_protocol.md lists them), or write the model "
        "to the mesh3d protocol (docs/model_protocol.md has a complete example)"
    )


def _plan_problem(pp_plan: dict, before: list[str], blocks: str, after: list[str]) -> str | None:
    """The pipeline plan's shape must be: input_ids -> ... -> hidden_states through the blocks -> ..."""
    if not before or "input_ids" not in pp_plan[before[0]][0]:
        return f"its base_model_pp_plan does not begin with a module taking input_ids (got {dict(pp_plan)})"
    if list(pp_plan[blocks][1]) != ["hidden_states"]:
        return f"its blocks give {list(pp_plan[blocks][1])} between stages, not hidden_states alone"
    for name in after:
        if list(pp_plan[name][0]) != ["hidden_states"] or list(pp_plan[name][1]) != ["hidden_states"]:
            return f"its base_model_pp_plan's {name!r} after the blocks does not map hidden_states to hidden_states"
    return None


def _stateful_extra(model: nn.Module, base: nn.Module, prefix: str, head: nn.Module, planned: list[str]) -> str | None:
    """A module outside the plan runs on every stage, so it must hold no state a stage would duplicate."""
    extras = [(f"{prefix}.{n}", m) for n, m in base.named_children() if n not in planned]
    extras += [(n, m) for n, m in model.named_children() if m is not base and m is not head]
    for path, module in extras:
        if any(True for _ in module.parameters()) or any(True for _ in module.state_dict()):
            return f"module {path!r} holds state but is not in its base_model_pp_plan (stages would each hold a copy)"
    return None


def _make_stage(
    prefix: str,
    config,
    router_aux: RouterAux | None,
    stage: nn.Module,
    is_first: bool,
    is_last: bool,
    layer_range: range,
) -> nn.Module:
    """Turn a cut copy into a stage that runs the architecture's own forward (module docstring)."""
    layer_types = list(getattr(config, "layer_types", None) or [])
    if layer_types:
        stage.config.layer_types = [layer_types[i] for i in layer_range]
    original = type(stage)
    stage.__class__ = _stage_class(original)
    stage._mesh3d_role = (original, prefix, is_first, is_last)
    stage._mesh3d_unsplit_config = config  # the stage's own config lists only its blocks' layer_types
    # Every stage builds the rotary angles and the mask itself, so each takes what the base model takes.
    taken = inspect.signature(getattr(stage, prefix).forward).parameters
    stage.per_sample_inputs = tuple(name for name in PER_SAMPLE_INPUTS if name in taken)
    stage.router_aux = router_aux
    if router_aux is not None:
        record_router_logits(stage, stage)
    return stage


def unsplit_config(stage: nn.Module):
    """The config of the whole model a Hugging Face stage was cut from (its `layer_types` all of the
    model's, where the stage's own lists its blocks'); None for a stage of any other kind of model."""
    return getattr(stage, "_mesh3d_unsplit_config", None)


def architecture_of(stage: nn.Module) -> type | None:
    """The transformers class of the model a Hugging Face stage was cut from; None for any other stage."""
    role = getattr(stage, "_mesh3d_role", None)
    return role[0] if role is not None else None


@functools.cache
def _stage_class(original: type) -> type:
    # A subclass, so the stage is still the architecture's class for everything but its forward.
    return type(
        original.__name__,
        (original,),
        {
            "forward": _stage_forward,
            "init_weights": _stage_init_weights,
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
        },
    )


def _stage_init_weights(self) -> None:
    """The architecture's own initialization of what this stage holds (a model given on meta).

    transformers' `init_weights` also ties the output head to the embedding, which a stage that
    holds one end without the other cannot do; mesh3d ties across stages itself (pipeline/tied.py).
    """
    self.initialize_weights()


def _stage_forward(self, x, *router_sums, **per_sample):
    original, prefix, is_first, is_last = self._mesh3d_role
    given = {"input_ids": x} if is_first else {"inputs_embeds": x}
    given.update(per_sample)  # position_ids, attention_mask: the microbatch's, as transformers' forward takes them
    aux = self.router_aux
    if aux is None:
        if is_last:
            return original.forward(self, **given, use_cache=False).logits
        return getattr(self, prefix)(**given, use_cache=False).last_hidden_state
    # The router loss: this stage's layers added to the sums received (router_loss.py); transformers'
    # own loss stands down (output_router_logits=False), the hooks record the logits.
    with recorded_router_logits() as records:
        if is_last:
            out = original.forward(self, **given, use_cache=False, output_router_logits=False).logits
        else:
            out = getattr(self, prefix)(**given, use_cache=False, output_router_logits=False).last_hidden_state
    # A stage called on its own (the planner's probe) starts from no sums; the runtime always hands them on.
    sums = from_wire(router_sums[0]) if router_sums and not is_first else aux.start(out.device)
    mask = per_sample.get("attention_mask")
    if mask is not None and mask.dim() != 2:
        mask = None  # only a 2-d padding mask weighs the sums (cp's prepared 4-d masks pad nothing)
    for logits in records:
        sums = aux.add_layer(sums, logits, mask)
    return (out, sums) if is_last else (out, to_wire(sums, out.dtype))
