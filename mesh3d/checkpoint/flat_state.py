"""The model and optimizer state of one rank as one flat dict keyed by the unsplit model's names.

This is what torch.distributed.checkpoint (DCP) writes and reads. Keys:

    model.<fqn>                         a parameter or persistent buffer (this rank's shard)
    optim.state.<fqn>.<key>             one optimizer state entry of a parameter (exp_avg, step, ...)
    optim.param_groups.<fqn>.<key>      a hyperparameter of the parameter's group (lr, betas, ...)

Keys never depend on the layout: a tensor is named after the parameter, never after a stage, a
rank or an optimizer index (docs/design.md's pitfall: index-keyed optimizer state collides across pp
ranks). DCP records each shard's offset in the global tensor, so a key saved by 8 ranks in
(pp, dp, tp) = (2, 2, 2) loads into any other layout.

A tied weight is one tensor of the unsplit model: it is stored once, under its first name (the
embedding), whichever copy a rank holds. Copies on several ranks are equal, and DCP writes a
chunk offered by several ranks once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mesh3d.distributed.shards import local_tensor
from mesh3d.parallel_model import ParallelModel

MODEL = "model."
OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups."


# Group settings that choose how an optimizer computes, not what: the loading optimizer keeps its own
# (a checkpoint written with fused=True on a GPU must load into a CPU run).
IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable"})


@dataclass
class FlatState:
    """This rank's flat state (see the module docstring) and what loading must fill in afterwards."""

    entries: dict[str, object] = field(default_factory=dict)
    # Optimizer state of a second local copy of a tied weight: (copy's state, the stored copy's state).
    tied_optimizer_copies: list[tuple[dict, dict]] = field(default_factory=list)
    # Param groups and the keys their hyperparameters are read from: (group, {hyperparameter: key}).
    group_keys: list[tuple[dict, dict[str, str]]] = field(default_factory=list)
    # optim.state key -> (the parameter's optimizer state dict, its entry name).
    optimizer_slots: dict[str, tuple[dict, str]] = field(default_factory=dict)
    # Stored name of every parameter the optimizer holds -> its state's entry names (empty: no state yet).
    optimizer_entries: dict[str, set[str]] = field(default_factory=dict)
    # Stored name -> the local parameters under it (two for local copies of a tied weight).
    optimizer_params: dict[str, list[torch.Tensor]] = field(default_factory=dict)


def _named_optimizer_params(pm: ParallelModel, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(param) -> stored name for every parameter the optimizer holds; an error for a stranger."""
    names = pm.state_map.stored_names()
    by_id = {id(p): names[n] for n, p in pm.named_parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise ValueError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not one of this model's "
                    "parameters; build the optimizer over pm.parameters() (after parallelize)"
                )
    return by_id


def flat_state(pm: ParallelModel, optimizer: torch.optim.Optimizer | None) -> FlatState:
    """This rank's model (and optimizer) state, keyed as in the module docstring; tensors share storage."""
    out = FlatState()
    names = pm.state_map.stored_names()
    for name, tensor in pm.state_map.local().items():
        out.entries.setdefault(MODEL + names[name], tensor.detach())
    if optimizer is None:
        return out
    param_names = _named_optimizer_params(pm, optimizer)
    stored_state: dict[str, dict] = {}
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        keys: dict[str, str] = {}
        for param in group["params"]:
            name = param_names[id(param)]
            for k, v in hyper.items():
                out.entries.setdefault(f"{OPTIM_GROUPS}{name}.{k}", v)
                keys.setdefault(k, f"{OPTIM_GROUPS}{name}.{k}")
            out.optimizer_params.setdefault(name, []).append(param)
            out.optimizer_entries.setdefault(name, set())
            state = optimizer.state.get(param)
            if not state:
                continue
            if name in stored_state:  # a second local copy of a tied weight
                out.tied_optimizer_copies.append((state, stored_state[name]))
                continue
            stored_state[name] = state
            out.optimizer_entries[name] = set(state)
            for k, v in state.items():
                key = f"{OPTIM_STATE}{name}.{k}"
                out.entries[key] = v.detach() if isinstance(v, torch.Tensor) else v
                out.optimizer_slots[key] = (state, k)
        out.group_keys.append((group, keys))
    return out


def saved_optimizer_entries(metadata: Metadata) -> dict[str, set[str]]:
    """Parameter name -> the optimizer state entries the checkpoint holds for it."""
    entries: dict[str, set[str]] = {}
    for key in metadata.state_dict_metadata:
        if key.startswith(OPTIM_STATE):
            # Entry names (exp_avg, step, ...) hold no dot: the last one separates them from the name.
            name, _, entry = key[len(OPTIM_STATE) :].rpartition(".")
            entries.setdefault(name, set()).add(entry)
    return entries


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Give every trainable parameter its optimizer state, so that loading has tensors to fill;
    returns the parameters that got new state (`drop_state` takes it back).

    A step with zero gradients and lr 0 creates the state (torch optimizers create it lazily);
    the parameters' values do not matter, loading overwrites them afterwards. Gradients the
    caller had are put back.
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    created = [p for p in params if not optimizer.state.get(p)]
    if not created:
        return []
    saved_grads = [p.grad for p in params]
    saved_lrs = [g.get("lr") for g in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optimizer.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for p, grad in zip(params, saved_grads):
            p.grad = grad
        for g, lr in zip(optimizer.param_groups, saved_lrs):
            if lr is not None:
                g["lr"] = lr
    return created


def drop_state(optimizer: torch.optim.Optimizer, params) -> None:
    for param in params:
        optimizer.state.pop(param, None)


def unsaved_optimizer_params(state: FlatState, metadata: Metadata) -> list[torch.Tensor]:
    """Parameters the checkpoint holds no optimizer state for (saved before their first step, or
    frozen then): they start with fresh state, as in the run that saved."""
    saved = saved_optimizer_entries(metadata)
    return [param for name, params in state.optimizer_params.items() if name not in saved for param in params]


def check_against_checkpoint(
    pm: ParallelModel,
    state: FlatState,
    metadata: Metadata,
    path: str,
    saved_optimizer: str | None,
    optimizer_type: str | None,
) -> str | None:
    """What makes this checkpoint unfit for this model (or None): the first mismatching parameter.

    The model check looks at every name of the whole model (the same answer on every rank); the
    optimizer check at this rank's parameters.
    """
    saved = metadata.state_dict_metadata
    names = pm.state_map.stored_names()
    wanted = {}
    for name, (shape, _) in pm.state_map.specs.items():
        wanted.setdefault(names[name], tuple(shape))
    for name, shape in wanted.items():
        meta = saved.get(MODEL + name)
        if meta is None:
            return (
                f"checkpoint {path} does not fit this model: it has no {name!r} (shape {shape}); it was saved from a "
                "different model (another depth, tied vs untied embeddings, other module names)"
            )
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != shape:
            got = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else "a non-tensor"
            return (
                f"checkpoint {path} does not fit this model: {name!r} has shape {got} in the checkpoint, the model "
                f"expects {shape}; build the model with the configuration the checkpoint was saved from"
            )
    extra = [k[len(MODEL) :] for k in saved if k.startswith(MODEL) and k[len(MODEL) :] not in wanted]
    if extra:
        return (
            f"checkpoint {path} does not fit this model: it holds {len(extra)} tensors the model does not have, the "
            f"first {extra[0]!r}; it was saved from a different model (another depth, tied vs untied embeddings)"
        )
    has_optimizer = any(k.startswith(OPTIM_STATE) or k.startswith(OPTIM_GROUPS) for k in saved)
    if optimizer_type is not None and not has_optimizer:
        return (
            f"checkpoint {path} holds no optimizer state (it was saved without an optimizer); "
            "pass optimizer=None to load"
        )
    if optimizer_type is not None and saved_optimizer not in (None, optimizer_type):
        return (
            f"checkpoint {path} holds {saved_optimizer} optimizer state, not {optimizer_type}; "
            f"build a {saved_optimizer} "
            "(with the settings it was saved with), or pass optimizer=None to load the model only"
        )
    for key, value in state.entries.items():
        if not key.startswith(OPTIM_STATE):
            continue
        meta = saved.get(key)
        if meta is None:
            return (
                f"checkpoint {path} has no optimizer state {key[len(OPTIM_STATE) :]!r}: it was saved with a different "
                "optimizer (or other settings, e.g. amsgrad); build the optimizer the checkpoint was saved with"
            )
        if isinstance(value, torch.Tensor) and (
            not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.shape)
        ):
            return f"checkpoint {path}: optimizer state {key[len(OPTIM_STATE) :]!r} does not match this optimizer's"
    saved_entries_of = saved_optimizer_entries(metadata)
    for name, entries in state.optimizer_entries.items():
        saved_entries = saved_entries_of.get(name, set())
        if saved_entries - entries:
            extra_entry = sorted(saved_entries - entries)[0]
            return (
                f"checkpoint {path} has optimizer state {name}.{extra_entry!r} that this optimizer does not keep: "
                "it was "
                "saved with other optimizer settings (e.g. amsgrad=True, momentum); build the optimizer the checkpoint "
                "was saved with"
            )
    return None


def targets(state: FlatState, metadata: Metadata) -> dict[str, object]:
    """The entries DCP should fill: every tensor, and the hyperparameters the checkpoint has."""
    saved = metadata.state_dict_metadata
    return {k: v for k, v in state.entries.items() if not k.startswith(OPTIM_GROUPS) or k in saved}


@torch.no_grad()
def apply_loaded(state: FlatState, loaded: dict[str, object]) -> None:
    """Put in place what DCP does not fill in place: hyperparameters, non-tensor optimizer state
    (DCP replaces those values in `loaded`), and the optimizer state of second local copies of a
    tied weight."""
    for group, keys in state.group_keys:
        for hyper, key in keys.items():
            if key in loaded and hyper not in IMPLEMENTATION_FLAGS:
                group[hyper] = loaded[key]
    for key, (param_state, name) in state.optimizer_slots.items():
        if not isinstance(param_state[name], torch.Tensor):
            param_state[name] = loaded[key]
    for copy, source in state.tied_optimizer_copies:
        for k, v in source.items():
            if isinstance(v, torch.Tensor) and isinstance(copy.get(k), torch.Tensor):
                local_tensor(copy[k]).copy_(local_tensor(v))
            else:
                copy[k] = v
