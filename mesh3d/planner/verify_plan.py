"""A plan held to the real code before the GPUs are rented: its layout dry-run (fake_cluster.py)
and the planner's bytes for each played rank set beside what that rank holds and sends.

`mesh3d-plan --verify` runs it on the plan it ranks first; examples/llama/train.py --dry-run on
the run its flags describe. The sequence can be played shorter than the plan's (`seq_len`): a
CPU runs every played rank's share of the step for real, and at a plan's 8192 tokens a large
model's share takes hours there. The parameters, gradients and optimizer state do not depend on
it; the traffic is predicted at the length played, so the check is as strict.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from mesh3d.planner.fake_cluster import RankReport, dry_run
from mesh3d.planner.model_source import meta_model
from mesh3d.planner.planned_layout import Plan

_SIZES = ("pp", "dp", "cp", "tp", "ep")
_HELD = ("parameter", "gradient", "optimizer")


def verify_plan(
    model: object,
    best: Plan,
    gpus: int,
    global_batch: int,
    seq_len: int,
    ranks: Sequence[int] | None = None,
    timeout: float = 3600.0,
) -> list[RankReport]:
    """Dry-run `best` (a Plan of `model`, as `mesh3d.plan` was given it: a preset name, a Hugging
    Face config or a picklable builder's result) on `ranks` of `gpus` (default: the first, a middle
    and the last of each stage), at `seq_len` tokens a sequence."""
    kwargs = best.parallelize_kwargs()
    sizes = {name: kwargs.pop(name, 1) for name in _SIZES}
    kwargs.pop("example_inputs", None)  # a traced model is captured again at the played length
    return dry_run(
        functools.partial(meta_model, model),
        gpus,
        ranks,
        **sizes,
        seq_len=seq_len,
        global_batch=global_batch,
        timeout=timeout,
        **kwargs,
    )


def verdict(reports: Sequence[RankReport]) -> tuple[bool, str]:
    """Whether every played rank holds and sends what the planner says, and the line saying so."""
    played = ", ".join(str(r.rank) for r in reports)
    none = sorted({r.predicted_why_not for r in reports} - {""})
    if none:
        return False, f"verify: the planner has no figures for ranks {played} ({'; '.join(none)})"
    found = [line for report in reports for line in report.mismatches()]
    unpredicted = sorted({r.traffic_why_not for r in reports} - {""})
    if found:
        return False, f"verify: the planner and the code differ on ranks {played}:\n  " + "\n  ".join(found)
    kinds = sorted({key.removeprefix("sent on ") for r in reports for key in r.predicted if key.startswith("sent on ")})
    checked = "parameter, gradient and optimizer bytes"
    if kinds:  # every kind a rank sends on, or where some go unpredicted, the kinds checked by name
        checked += f" and the bytes sent on {', '.join(kinds)}" if unpredicted else " and the bytes each group sends"
    line = f"verify: the planner's {checked} equal what ranks {played} hold and send"
    if any(getattr(r, f"{w}_bytes") < r.predicted[f"{w}s" if w != "optimizer" else w] for r in reports for w in _HELD):
        line += " (a later dp rank holds less: FSDP pads the first ranks' shards, the planner's figure)"
    if unpredicted:
        line += f" (not checked: {'; '.join(unpredicted)})"
    return True, line
