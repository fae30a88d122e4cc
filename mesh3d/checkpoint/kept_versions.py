"""The weight versions a never-drain schedule keeps (pipeline/weight_versions.py), in a checkpoint.

After a flush every update in flight is applied and the parameters hold the newest weights; the
update rule may still name earlier versions for the next microbatches (PipeDream-2BW: batch t+1
is computed with W(t) while W(t+1) is the newest). They are saved next to the model, keyed like it
by the unsplit model's names and the version's update count:

    versions.<v>.<fqn>      parameter <fqn> after <v> updates (this rank's shard, as the parameter is)

and the train state records where the rule stands ({"schedule", "calls", "updates", ...}),
so a resume continues with exactly the losses of an uninterrupted run. PipeDream-2BW's rule does not
depend on the layout: it resumes under any (pp, dp, tp) and microbatch count. PipeDream's versions
differ per stage (stage s keeps p-s): it resumes with the pp and microbatches it was saved with.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from mesh3d.distributed.shards import local_tensor
from mesh3d.parallel_model import ParallelModel

VERSIONS = "versions."


def _names(pm: ParallelModel) -> dict[int, str]:
    stored = pm.state.stored_names()
    return {id(p): stored[n] for n, p in pm.named_parameters()}


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` (a shard) as the parameter holds its own: a DTensor with its mesh and placements."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return local


def rule_state(pm: ParallelModel) -> dict | None:
    """Where the update rule stands after a flush (None for a schedule that drains)."""
    never_drain = pm.runtime.never_drain
    versions = never_drain.versions if never_drain is not None else None
    if versions is None:
        return None
    rule = versions.rule
    return {"schedule": rule.schedule, "pp": rule.pp, "microbatches": rule.microbatches,
            "calls": never_drain.calls,
            "updates": versions.updates()}


def kept_entries(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """This rank's kept versions as checkpoint entries (after a flush)."""
    never_drain = pm.runtime.never_drain
    versions = never_drain.versions if never_drain is not None else None
    if versions is None:
        return {}
    names = _names(pm)
    out: dict[str, torch.Tensor] = {}
    for weights in versions.groups():
        for version, copies in weights.kept.items():
            for param, local in zip(weights.params, copies):
                out.setdefault(f"{VERSIONS}{version}.{names[id(param)]}", _like(param, local))
    return out


def resume_problem(pm: ParallelModel, saved: dict | None, metadata: Metadata, path: str) -> str | None:
    """Why this checkpoint's kept versions cannot continue this model's rule (None if they can)."""
    never_drain = pm.runtime.never_drain
    versions = never_drain.versions if never_drain is not None else None
    if versions is None or saved is None:
        return None
    rule = versions.rule
    if saved["schedule"] != rule.schedule:
        return (f"checkpoint {path} was saved with schedule {saved['schedule']!r}, this model runs {rule.schedule!r}: "
                "their update rules differ; resume with the schedule it was saved with")
    if rule.schedule == "pipedream" and (saved["pp"], saved["microbatches"]) != (rule.pp, rule.microbatches):
        return (f"checkpoint {path} was saved by pipedream at pp={saved['pp']} with microbatches={saved['microbatches']}; "
                f"its weight versions differ per stage, so it resumes only there (this model: pp={rule.pp}, "
                f"microbatches={rule.microbatches}); pipedream_2bw resumes under any layout")
    names = _names(pm)
    next_microbatch = _next_microbatch(saved, rule.microbatches)
    for weights, needed in versions.needed_versions(next_microbatch, saved["updates"]):
        for version in needed:
            for param in weights.params:
                key = f"{VERSIONS}{version}.{names[id(param)]}"
                if key not in metadata.state_dict_metadata:
                    return f"checkpoint {path} lacks weight version {version} of {names[id(param)]!r} the update rule needs"
    return None


def _next_microbatch(saved: dict, microbatches: int) -> int:
    """Microbatches are numbered across calls; a batch-level rule (2BW) renumbers by the calls made."""
    return saved["calls"] * microbatches


def kept_targets(pm: ParallelModel, saved: dict | None) -> dict[str, torch.Tensor]:
    """Empty tensors, shaped and placed as this rank's parameters, for DCP to fill with the kept versions."""
    never_drain = pm.runtime.never_drain
    versions = never_drain.versions if never_drain is not None else None
    if versions is None or saved is None:
        return {}
    names = _names(pm)
    out = {}
    for weights, needed in versions.needed_versions(_next_microbatch(saved, versions.rule.microbatches), saved["updates"]):
        for version in needed:
            for param in weights.params:
                out.setdefault(f"{VERSIONS}{version}.{names[id(param)]}", torch.empty_like(param.detach()))
    return out


def restore_kept(pm: ParallelModel, saved: dict | None, loaded: dict[str, torch.Tensor]) -> None:
    """Hand the loaded versions to the runtime and set where the rule stands (a checkpoint saved
    by a schedule that drains starts the rule afresh from its weights)."""
    never_drain = pm.runtime.never_drain
    versions = never_drain.versions if never_drain is not None else None
    if versions is None:
        return
    if saved is None:
        never_drain.restart_rule()
        return
    names = _names(pm)
    next_microbatch = _next_microbatch(saved, versions.rule.microbatches)
    kept: dict[int, dict[int, list[torch.Tensor]]] = {}
    for position, (weights, needed) in enumerate(versions.needed_versions(next_microbatch, saved["updates"])):
        kept[position] = {
            version: [local_tensor(loaded[f"{VERSIONS}{version}.{names[id(p)]}"]).clone() for p in weights.params]
            for version in needed
        }
    never_drain.calls = saved["calls"]
    versions.restore(next_microbatch, saved["updates"], kept)
