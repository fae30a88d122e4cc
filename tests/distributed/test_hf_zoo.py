"""Every causal LM of the installed transformers that declares a `base_model_pp_plan` (zoo_cases),
tiny, through mesh3d with pipeline parallelism, at (pp, dp, tp) = (2,1,2) and, where that is not
exact (the tensor-parallel plan refused), at (2,1,1); and with context parallelism at
(pp, dp, cp, tp) = (1,1,2,1); 1F1B, 2 microbatches, one SGD step
with masked targets (mixtures of experts whose configs name a router_aux_loss_coef with their
router loss on, the reference accumulating the 2 microbatches): each is exact against
transformers' own model in one process (loss and every parameter after the step, rel 1e-5) or
refused with a ValueError naming its class, on every rank, in parallelize (before any step
message). Anything else fails the test unless KNOWN_FAILING lists
it (a row of issue 38); a listed architecture that now passes fails it too, so the list shrinks.

The (2,1,1) column counts an architecture exact at (2,1,2) as exact without running it again
(FOLDED): the same two stages, cut at the same blocks, exact with tensor parallelism on top; the
tp = 1 path itself is exact for transformers' models in test_hf_parity.py and
test_hf_latent_attention.py (at (2,1,1), under every schedule family). So the pipeline claim holds
for every architecture with one pp run each, and the architectures whose tp plan is refused still
get theirs at (2,1,1).

One launch per layout and part of the population (PARTS) runs its architectures in a loop on one
mesh, a fresh one after a crash (new groups: a failed step may leave messages pending on its own).
A rank that crashes mid-step leaves its peers waiting: the mesh's group timeout (PEER_TIMEOUT_S)
turns their wait into an error, and the ranks agree on the verdict over a group of their own with a
longer timeout, then go on. A launch that dies (a rank killed, a segfault) costs the architecture
in flight, recorded from the harness' failure, and the rest run in a fresh launch. Known failures
run last.

The table in docs/model_protocol.md between the zoo markers is this run's: the test fails if it
differs; MESH3D_UPDATE_ZOO_TABLE=1 rewrites it.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import zoo_cases
from multiprocess import RankFailure, run_on_ranks

pytest.importorskip("transformers")

# (pp, dp, tp), or (pp, dp, cp, tp) where context parallelism is on
LAYOUTS = [(2, 1, 1), (2, 1, 2), (1, 1, 2, 1)]
# A layout whose architectures exact at another layout count as exact here, not run again:
# pipeline parallelism alone, proven with tensor parallelism on top (the module docstring).
FOLDED = {(2, 1, 1): (2, 1, 2)}
BATCH = 8
MICROBATCHES = 2  # the fewest that still shows the router loss accumulated over microbatches
PEER_TIMEOUT_S = 30.0
PARTS = 2  # the population in parts, a test (and a launch) each: each well within pytest's per-test timeout
DOC = Path(__file__).resolve().parents[2] / "docs" / "model_protocol.md"
BEGIN, END = "<!-- zoo:begin -->", "<!-- zoo:end -->"

# Architectures that fail today, per layout, with the row of issue 38 that tracks each (none since
# the mixture-of-experts shape runs: pipeline/shape_ops.py). The loop stays for the next one.
KNOWN_FAILING: dict[tuple[int, ...], dict[str, str]] = {(2, 1, 1): {}, (2, 1, 2): {}, (1, 1, 2, 1): {}}


def _sizes(layout: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(("pp", "dp", "tp") if len(layout) == 3 else ("pp", "dp", "cp", "tp"), layout))


def _on_rank(sizes: dict[str, int], model_types: list[str], out_dir: str) -> None:
    import torch.distributed as dist

    import mesh3d

    verdict_group = layout = None
    batch = zoo_cases.masked_batch(BATCH)
    for model_type in model_types:
        # Fresh groups after a crash (a step that failed may leave messages pending on its groups),
        # the same mesh otherwise: a mesh per architecture, 92 of them, slows every later one.
        layout = layout or mesh3d.build_mesh(**sizes, timeout=PEER_TIMEOUT_S)
        verdict_group = verdict_group or dist.new_group(backend="gloo", timeout=timedelta(seconds=4 * PEER_TIMEOUT_S))
        mine, state = _one_architecture(model_type, layout, batch)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine, group=verdict_group)
        verdict = _agreed(everyone)
        if verdict["kind"] == "crash":
            layout = None
        if dist.get_rank() == 0:
            if state is not None and verdict["kind"] == "ran":
                torch.save(state, Path(out_dir) / f"{model_type}.pt")
            with open(Path(out_dir) / "verdicts.jsonl", "a") as file:
                file.write(json.dumps({"model_type": model_type, **verdict}) + "\n")


def _one_architecture(model_type: str, layout, batch) -> tuple[dict, dict | None]:
    """This rank's outcome: ran (with the loss), refused (the ValueError) or crash, and the state."""
    import mesh3d

    phase = "build"
    try:
        model = zoo_cases.tiny_model(model_type)
        arch = type(model).__name__
        phase = "parallelize"
        pm = mesh3d.parallelize(model, layout, schedule="1f1b", microbatches=MICROBATCHES)
        phase = "step"
        optimizer = torch.optim.SGD(pm.parameters(), lr=zoo_cases.LR)
        loss = pm.step(*batch).item()
        optimizer.step()
        state = pm.full_state_dict()
        return {"kind": "ran", "phase": phase, "loss": loss}, state
    except ValueError as error:
        if phase == "parallelize" and str(error).startswith(arch):
            return {"kind": "refused", "phase": phase, "message": str(error)}, None
        return {"kind": "crash", "phase": phase, "message": f"ValueError: {error}"}, None
    except Exception as error:  # noqa: BLE001 - any other failure is this architecture's verdict
        return {"kind": "crash", "phase": phase, "message": f"{type(error).__name__}: {error}"}, None


def _agreed(everyone: list[dict]) -> dict:
    """One verdict from every rank's: the same kind everywhere, or a crash naming who did what."""
    kinds = {rank["kind"] for rank in everyone}
    if kinds == {"ran"}:
        return everyone[0]
    if kinds == {"refused"} and len({rank["message"] for rank in everyone}) == 1:
        return everyone[0]
    crashed = [rank for rank in everyone if rank["kind"] == "crash"]
    first = (crashed or everyone)[0]
    ranks = [f"rank {r}: {rank['kind']} in {rank['phase']}" for r, rank in enumerate(everyone)]
    return {"kind": "crash", "phase": first["phase"], "message": f"{first.get('message')} ({'; '.join(ranks)})"}


@functools.cache
def _references() -> dict[str, object]:
    """transformers' own one-step run per architecture, or why transformers cannot build it tiny."""
    out = {}
    for model_type in zoo_cases.population():
        try:
            out[model_type] = zoo_cases.reference_step(model_type, zoo_cases.masked_batch(BATCH), MICROBATCHES)
        except Exception as error:  # noqa: BLE001 - transformers' own failure: not mesh3d's to take
            out[model_type] = f"{type(error).__name__}: {error}"
    return out


def _verdicts(layout: tuple[int, int, int]) -> dict[str, tuple[str, str]]:
    """{model type: (verdict, detail)}: exact, refused, unbuildable, or failing, over the whole population."""
    return {mt: verdict for part in range(PARTS) for mt, verdict in _part_verdicts(layout, part).items()}


@functools.cache
def _part_verdicts(layout: tuple[int, int, int], part: int) -> dict[str, tuple[str, str]]:
    """The verdicts of every PARTS-th architecture of the population, from the part-th."""
    references = {mt: ref for mt, ref in sorted(_references().items())[part::PARTS]}
    verdicts = {mt: ("unbuildable", ref) for mt, ref in references.items() if isinstance(ref, str)}
    if layout in FOLDED:  # exact there: exact here, not run again
        there = FOLDED[layout]
        for mt, (kind, _) in _part_verdicts(there, part).items():
            if kind == "exact":
                verdicts[mt] = ("exact", "at " + str(there).replace(" ", ""))
    known = KNOWN_FAILING[layout]
    remaining = sorted((mt for mt in references if mt not in verdicts), key=lambda mt: (mt in known, mt))
    with tempfile.TemporaryDirectory() as out_dir:
        while remaining:
            died = None
            try:
                run_on_ranks(_on_rank, math.prod(layout), _sizes(layout), remaining, out_dir, timeout=1200)
            except RankFailure as failure:
                died = str(failure)
            written = Path(out_dir) / "verdicts.jsonl"
            lines = written.read_text().splitlines() if written.exists() else []
            recorded = {v["model_type"]: v for v in map(json.loads, lines)}
            for mt in remaining:
                if mt not in recorded:
                    if died is not None:  # the launch died with this architecture in flight
                        verdicts[mt] = ("failing", f"the launch died: {died[-600:]}")
                    break
                verdicts[mt] = _judge(mt, recorded[mt], references[mt], out_dir)
            remaining = [mt for mt in remaining if mt not in verdicts]
    return verdicts


def _judge(model_type: str, verdict: dict, reference, out_dir: str) -> tuple[str, str]:
    if verdict["kind"] == "refused":
        return "refused", verdict["message"]
    if verdict["kind"] == "crash":
        return "failing", f"crash in {verdict['phase']}: {verdict['message'][:600]}"
    state = torch.load(Path(out_dir) / f"{model_type}.pt")
    error, where = zoo_cases.worst_difference(verdict["loss"], state, reference)
    if error <= zoo_cases.TOLERANCE:
        return "exact", ""
    return "failing", f"differs from transformers by {error:.3g} (relative) at {where}"


def _failures(layout, part: int) -> tuple[dict[str, str], list[str]]:
    """(unexpected failures, listed ones that now pass) in one part of the population."""
    verdicts = _part_verdicts(layout, part)
    known = {mt: why for mt, why in KNOWN_FAILING[layout].items() if mt in verdicts}
    unexpected = {mt: detail for mt, (kind, detail) in verdicts.items() if kind == "failing" and mt not in known}
    fixed = [mt for mt in known if verdicts.get(mt, ("exact",))[0] != "failing"]
    return unexpected, fixed


@pytest.mark.parametrize("part", range(PARTS), ids=lambda part: f"part{part}")
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "".join(f"{k}{v}" for k, v in _sizes(layout).items()))
def test_every_architecture_is_exact_or_refused_by_name(layout, part):
    unexpected, fixed = _failures(layout, part)
    counts = _counts(_part_verdicts(layout, part))
    assert not unexpected, (counts, "\n".join(f"{mt}: {detail}" for mt, detail in unexpected.items()))
    assert not fixed, f"now exact or refused, remove from KNOWN_FAILING[{layout}]: {fixed}"


def test_the_documented_table_is_this_run():
    table = zoo_table({layout: _verdicts(layout) for layout in LAYOUTS})
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    documented, tail = rest.split(END)
    if os.environ.get("MESH3D_UPDATE_ZOO_TABLE") == "1":
        DOC.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")
        return
    assert documented.strip() == table.strip(), "run with MESH3D_UPDATE_ZOO_TABLE=1 to rewrite the table"


def _counts(verdicts: dict[str, tuple[str, str]]) -> dict[str, int]:
    kinds = [kind for kind, _ in verdicts.values()]
    return {kind: kinds.count(kind) for kind in ("exact", "refused", "failing", "unbuildable")}


def zoo_table(by_layout: dict[tuple, dict[str, tuple[str, str]]]) -> str:
    """The markdown table of the population: a row per architecture, a column per layout."""
    names = [f"({', '.join(_sizes(layout))}) = " + str(layout).replace(" ", "") for layout in by_layout]
    lines = [f"| architecture | {' | '.join(names)} |", "|---" * (len(names) + 1) + "|"]
    for mt in sorted(next(iter(by_layout.values()))):
        cells = [_cell(layout, mt, *verdicts[mt]) for layout, verdicts in by_layout.items()]
        lines.append(f"| {mt} | {' | '.join(cells)} |")
    summary = [f"{name}: {_counts(v)}" for name, v in zip(names, by_layout.values())]
    lines += ["", "Counts: " + "; ".join(summary).replace("'", "") + "."]
    return "\n".join(lines) + "\n"


def _cell(layout, model_type: str, kind: str, detail: str) -> str:
    if kind == "refused":  # the reason, after "Class (type): "
        reason = detail.split("): ", 1)[-1]
        return "refused: " + reason.split(";")[0][:110].replace("|", "/").replace("\n", " ")
    if kind == "failing":
        return "**fails**: " + KNOWN_FAILING[layout].get(model_type, "not yet known")
    if kind == "exact" and detail:  # folded: exact at another layout (FOLDED)
        return f"exact {detail}"
    return kind
