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

All of it comes from and goes to the runtime's never-drain state (pipeline/never_drain_calls.py)
through its `state_dict` and `load_state_dict`; here its entries get the checkpoint's names.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import Metadata

from mesh3d.parallel_model import ParallelModel
from mesh3d.pipeline.never_drain_calls import NeverDrainCalls

VERSIONS = "versions."


def _never_drain(pm: ParallelModel) -> NeverDrainCalls | None:
    return pm.never_drain_state


def _stored_keys(pm: ParallelModel, names: list[str]) -> dict[str, str]:
    """The state's "<v>.<name>" entries -> the checkpoint's "versions.<v>.<stored name>" (a tied
    weight goes by its first name, as in the model's entries)."""
    stored = pm.state_map.stored_names()
    keys = {}
    for entry in names:
        version, name = entry.split(".", 1)
        keys[entry] = f"{VERSIONS}{version}.{stored[name]}"
    return keys


def rule_state(pm: ParallelModel) -> dict | None:
    """Where the update rule stands after a flush (None for a schedule that drains)."""
    never_drain = _never_drain(pm)
    return never_drain.state_dict()["rule"] if never_drain is not None else None


def kept_entries(pm: ParallelModel) -> dict[str, torch.Tensor]:
    """This rank's kept versions as checkpoint entries (after a flush)."""
    never_drain = _never_drain(pm)
    if never_drain is None:
        return {}
    versions = never_drain.state_dict()["versions"]
    out: dict[str, torch.Tensor] = {}
    for entry, key in _stored_keys(pm, list(versions)).items():
        out.setdefault(key, versions[entry])
    return out


def resume_problem(pm: ParallelModel, saved: dict | None, metadata: Metadata, path: str) -> str | None:
    """Why this checkpoint's kept versions cannot continue this model's rule (None if they can)."""
    never_drain = _never_drain(pm)
    if never_drain is None or saved is None:
        return None
    rule = never_drain.rule
    if saved["schedule"] != rule.schedule:
        return (
            f"checkpoint {path} was saved with schedule {saved['schedule']!r}, this model runs {rule.schedule!r}: "
            "their update rules differ; resume with the schedule it was saved with"
        )
    if rule.schedule == "pipedream" and (saved["pp"], saved["microbatches"]) != (rule.pp, rule.microbatches):
        return (
            f"checkpoint {path} was saved by pipedream at pp={saved['pp']} with microbatches={saved['microbatches']}; "
            f"its weight versions differ per stage, so it resumes only there (this model: pp={rule.pp}, "
            f"microbatches={rule.microbatches}); pipedream_2bw resumes under any layout"
        )
    for key in _stored_keys(pm, never_drain.kept_names(saved)).values():
        if key not in metadata.state_dict_metadata:
            version, stored = key[len(VERSIONS) :].split(".", 1)
            return f"checkpoint {path} lacks weight version {version} of {stored!r} the update rule needs"
    return None


def kept_targets(pm: ParallelModel, saved: dict | None) -> dict[str, torch.Tensor]:
    """Empty tensors, shaped and placed as this rank's parameters, for DCP to fill with the kept versions."""
    never_drain = _never_drain(pm)
    if never_drain is None or saved is None:
        return {}
    empty = never_drain.empty_versions(saved)
    out = {}
    for entry, key in _stored_keys(pm, list(empty)).items():
        out.setdefault(key, empty[entry])
    return out


def restore_kept(pm: ParallelModel, saved: dict | None, loaded: dict[str, torch.Tensor]) -> None:
    """Hand the loaded versions to the runtime and set where the rule stands (a checkpoint saved
    by a schedule that drains starts the rule afresh from its weights)."""
    never_drain = _never_drain(pm)
    if never_drain is None:
        return
    if saved is None:
        never_drain.load_state_dict({"rule": None})
        return
    keys = _stored_keys(pm, never_drain.kept_names(saved))
    never_drain.load_state_dict({"rule": saved, "versions": {entry: loaded[key] for entry, key in keys.items()}})
