"""A dry run: any rank of a job of any size set up and stepped on this CPU, before renting the GPUs.

    reports = mesh3d.dry_run(build_model, world_size=1024, pp=8, dp=16, tp=8, seq_len=2048, global_batch=256)
    for report in reports:
        print(report.text())

Each sampled rank runs in a fresh CPU process of its own under torch's fake process group
(distributed/dry_world.py): `build_mesh`, `parallelize` and `steps` steps with AdamW, exactly as
that rank runs them in the job, while every collective returns at once. What it proves and what it
cannot is in docs/plan.md, "Before you rent".
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from mesh3d.axes import resolve_sizes


@dataclass(frozen=True)
class RankReport:
    """What one rank of the job made and holds, and the planner's figures beside them.

    Attributes:
        rank, world_size: the rank played and the job's size; coordinate: its place on each mesh dim.
        setup_seconds: build_mesh and parallelize on this CPU (the model materialized as its shards).
        world_creations: group creations every rank of the world takes part in (new_group,
            split_group), torch's for a DeviceMesh included; member_creations: those made among
            their members alone; communicators: the process groups this rank is a member of.
        parameter_bytes, gradient_bytes, optimizer_bytes: this rank's local shards (exact).
        traffic: the steps' collectives and messages: group kind -> op -> (calls, bytes given).
        sent_per_step: the last step's bytes on the wire (ring algorithms), by group kind.
        predicted: the planner's bytes for this rank's pp rank (its fullest dp/tp rank):
            "parameters", "gradients", "optimizer", and "sent on <kind>" per step for each kind
            it predicts (`traffic_why_not`: what it leaves out); empty with `predicted_why_not`
            when it has none.
    """

    rank: int
    world_size: int
    coordinate: dict[str, int]
    setup_seconds: float
    world_creations: int
    member_creations: int
    communicators: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    traffic: dict[str, dict[str, tuple[int, int]]]
    sent_per_step: dict[str, int] = field(default_factory=dict)
    predicted: dict[str, int] = field(default_factory=dict)
    predicted_why_not: str = ""
    traffic_why_not: str = ""

    def mismatches(self) -> list[str]:
        """Where the planner's figures and this rank's differ: a byte count this rank holds above
        the planner's (a later dp rank may hold less: FSDP pads the first ranks' shards), or a
        group kind whose bytes per step differ (every rank of a stage sends padded shards alike)."""
        found = []
        for what in ("parameters", "gradients", "optimizer"):
            held, predicted = getattr(self, f"{what.removesuffix('s')}_bytes"), self.predicted.get(what)
            fullest = all(at == 0 for dim, at in self.coordinate.items() if dim != "pp")
            if predicted is not None and (held > predicted or (fullest and held != predicted)):
                found.append(f"rank {self.rank} {what}: holds {held:,} bytes, the planner says {predicted:,}")
        for key, predicted in self.predicted.items():
            kind = key.removeprefix("sent on ")
            if key.startswith("sent on ") and abs(self.sent_per_step.get(kind, 0) - predicted) > 1:
                sent = self.sent_per_step.get(kind, 0)
                found.append(f"rank {self.rank} sent on {kind}: {sent:,} bytes a step, the planner says {predicted:,}")
        return found

    def text(self) -> str:
        """The report as lines a person reads."""
        where = ", ".join(f"{dim} {at}" for dim, at in self.coordinate.items())
        lines = [
            f"rank {self.rank} of {self.world_size} ({where}): set up in {self.setup_seconds:.1f} s",
            f"  group creations: {self.world_creations} world-wide, {self.member_creations} among members "
            f"alone; {self.communicators} communicators on this rank",
        ]
        for what in ("parameters", "gradients", "optimizer"):
            held = getattr(self, f"{what.removesuffix('s')}_bytes")
            beside = f"planner {self.predicted[what]:,}" if what in self.predicted else "planner: -"
            lines.append(f"  {what}: {held:,} bytes ({beside})")
        if self.predicted_why_not:
            lines.append(f"  planner: no prediction ({self.predicted_why_not})")
        for kind, ops in sorted(self.traffic.items()):
            listed = ", ".join(f"{op} x{calls} {sent:,} B" for op, (calls, sent) in sorted(ops.items()))
            lines.append(f"  on {kind}: {listed}")
        for kind, sent in sorted(self.sent_per_step.items()):
            predicted = self.predicted.get(f"sent on {kind}")
            beside = f"planner {predicted:,}" if predicted is not None else "planner: -"
            lines.append(f"  sent on {kind} per step: {sent:,} bytes ({beside})")
        if self.traffic_why_not:
            lines.append(f"  planner: traffic not all predicted ({self.traffic_why_not})")
        return "\n".join(lines)


def default_ranks(world_size: int, pp: int) -> list[int]:
    """The first, a middle and the last rank of each pipeline stage (pp is the outermost dim)."""
    stage = world_size // pp
    picked = {s * stage + offset for s in range(pp) for offset in (0, stage // 2, stage - 1)}
    return sorted(picked)


def dry_run(
    build_model: Callable[[], nn.Module],
    world_size: int,
    ranks: Sequence[int] | None = None,
    *,
    pp: int = 1,
    dp: int = -1,
    tp: int = 1,
    cp: int = 1,
    ep: int = 1,
    seq_len: int,
    global_batch: int,
    steps: int = 2,
    predict: bool = True,
    processes: int | None = None,
    timeout: float = 600.0,
    **parallelize_kwargs,
) -> list[RankReport]:
    """Set up and step `ranks` of a `world_size`-rank job on this CPU, one fresh process per rank.

    Args:
        build_model: returns the whole model on the meta device; called in each rank's process, so
            it must pickle (a module-level function, or functools.partial of one).
        world_size: the job's size; pp, dp, tp, cp, ep as for `build_mesh` (dp=-1: the rest).
        ranks: the ranks to play; default `default_ranks` (first, middle, last of each stage).
        seq_len, global_batch: each step's batch: global_batch sequences of seq_len tokens, dp's
            share on each rank (random token ids: a dry run checks shapes, not values).
        steps: pm.step calls, each followed by an AdamW step (its state is counted).
        predict: put the planner's bytes for each rank's pp rank beside its own (mesh3d.plan).
        processes: how many ranks run at once; default this machine's CPU count.
        timeout: seconds for all of them; ranks still running then are killed and reported.
        parallelize_kwargs: passed to `parallelize` (schedule, microbatches, dp_mode, ...).

    Raises:
        ValueError: sizes that do not make `world_size`, a rank outside it.
        ValueError: the same ValueError on every rank that failed (a setting parallelize refuses).
        RuntimeError: a rank that raised otherwise (its traceback) or did not finish in time.
    """
    sizes = resolve_sizes(world_size, pp=pp, dp=dp, tp=tp, cp=cp, ep=ep)
    ranks = list(default_ranks(world_size, sizes["pp"]) if ranks is None else ranks)
    if not ranks or any(not 0 <= r < world_size for r in ranks):
        raise ValueError(f"dry_run: ranks must be in [0, {world_size}), got {ranks}")
    job = Job(build_model, world_size, sizes, seq_len, global_batch, steps, predict, parallelize_kwargs)
    return _run_processes(job, ranks, processes or os.cpu_count() or 1, timeout)


@dataclass(frozen=True)
class Job:
    """What every played rank of one dry run is given (dry_run's arguments, resolved)."""

    build_model: Callable[[], nn.Module]
    world_size: int
    sizes: dict[str, int]
    seq_len: int
    global_batch: int
    steps: int
    predict: bool
    parallelize_kwargs: dict


def _run_processes(job: Job, ranks: list[int], at_once: int, timeout: float) -> list[RankReport]:
    # a fresh interpreter: the fake group is the process's default group; not a daemon, since the
    # planner measures the model in processes of its own
    context = mp.get_context("spawn")
    results = context.Queue()
    waiting, running, reports, failures = list(ranks), {}, {}, {}
    deadline = time.monotonic() + timeout
    while (waiting or running) and time.monotonic() < deadline:
        while waiting and len(running) < at_once:
            rank = waiting.pop(0)
            running[rank] = context.Process(target=_rank_main, args=(job, rank, results), daemon=False)
            running[rank].start()
        try:
            rank, report, error = results.get(timeout=0.5)
        except queue.Empty:
            for rank, process in list(running.items()):
                if not process.is_alive() and process.exitcode != 0:
                    failures[rank] = f"exited with code {process.exitcode} without reporting"
                    running.pop(rank)
            continue
        running.pop(rank).join()
        if error is None:
            reports[rank] = report
        else:
            failures[rank] = error
    for rank, process in running.items():
        process.kill()
        failures[rank] = f"did not finish within {timeout:.0f} s (killed)"
    user_errors = {why.rstrip().splitlines()[-1] for why in failures.values()}
    if failures and len(user_errors) == 1 and next(iter(user_errors)).startswith("ValueError: "):
        # the same bad setting on every failed rank (a tp that does not divide the heads...): the
        # user's error as parallelize words it, once, not a traceback per rank
        raise ValueError(next(iter(user_errors)).removeprefix("ValueError: "))
    if failures:
        told = "\n".join(f"--- rank {rank}:\n{why}" for rank, why in sorted(failures.items()))
        raise RuntimeError(f"dry_run: {len(failures)} of {len(ranks)} ranks failed\n{told}")
    return [reports[rank] for rank in ranks]


def _rank_main(job: Job, rank: int, results) -> None:
    torch.set_num_threads(1)
    try:
        results.put((rank, _play(job, rank), None))
    except BaseException:  # noqa: BLE001 - the parent reports every rank's failure
        results.put((rank, None, traceback.format_exc()))


def _play(job: Job, rank: int) -> RankReport:
    """Play `rank` of the job under torch's fake process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mesh3d.distributed.creation_count import counting_group_creations

    start = time.perf_counter()
    with counting_group_creations() as creations:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=job.world_size)
        return measure_rank(job, creations, start, backend="fake", device="cpu")


def measure_rank(job: Job, creations, start: float, **mesh_options) -> RankReport:
    """build_mesh (with `mesh_options`), parallelize and the steps, on whatever process group this
    process has (the fake one, or a real one: tests/distributed/test_dry_run_inventory.py holds
    the two to the same report); `creations` counts the group creations (creation_count.py)."""
    import torch.distributed.distributed_c10d as c10d

    from mesh3d.distributed.traffic_count import TrafficCount
    from mesh3d.mesh import build_mesh
    from mesh3d.parallelize import parallelize

    layout = build_mesh(**job.sizes, **mesh_options)
    pm = parallelize(job.build_model(), layout, **job.parallelize_kwargs)
    setup_seconds = time.perf_counter() - start
    # a never-drain schedule updates inside pm.step, with the optimizer parallelize built (optimizer=)
    inside = pm.never_drains and pm.optimizer is not None
    optimizer = pm.optimizer if inside else torch.optim.AdamW(pm.parameters(), lr=1e-4)
    inputs = torch.randint(0, 2, (job.global_batch // layout.dp, job.seq_len))
    traffic = TrafficCount()
    gradient_bytes, before = 0, {}
    with traffic:
        for step in range(job.steps):
            if step == job.steps - 1:
                before = dict(traffic.sent)
            pm.step(inputs, inputs)
            gradient_bytes = _bytes(p.grad for p in pm.parameters() if p.grad is not None)
            if not inside:
                optimizer.step()
                optimizer.zero_grad()
    pm.flush()  # a never-drain schedule's last updates (outside the steps' count); nothing otherwise
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim()]
    predicted, why_not, traffic_why_not = _predicted(job, layout) if job.predict else ({}, "", "")
    last_step = {kind: round(sent - before.get(kind, 0.0)) for kind, sent in traffic.sent.items()}
    return RankReport(
        rank=layout.rank,
        world_size=job.world_size,
        coordinate=dict(zip(layout.dims, layout.coordinate)),
        setup_seconds=setup_seconds,
        world_creations=creations["world"],
        member_creations=creations["local"],
        communicators=sum(1 for g in c10d._world.pg_map if g is not c10d.GroupMember.WORLD),
        parameter_bytes=_bytes(pm.parameters()),
        gradient_bytes=gradient_bytes,
        optimizer_bytes=_bytes(state),
        traffic=traffic.as_dict(),
        sent_per_step={kind: sent for kind, sent in last_step.items() if sent},
        predicted=predicted,
        predicted_why_not=why_not,
        traffic_why_not=traffic_why_not,
    )


def _bytes(tensors) -> int:
    from mesh3d.distributed.shards import local_tensor

    return sum(local_tensor(t).numel() * local_tensor(t).element_size() for t in tensors)


def _predicted(job: Job, layout) -> tuple[dict[str, int], str, str]:
    """The planner's parameter, gradient and optimizer bytes and the step's bytes sent for this
    rank's pp rank; why it has none, and why no traffic."""
    from mesh3d.planner.run_memory import plan_for_layout

    try:
        kwargs = dict(seq_len=job.seq_len, global_batch=job.global_batch, gpus_per_node=min(8, job.world_size))
        plan = plan_for_layout(job.build_model(), layout, **kwargs, **job.parallelize_kwargs)
    except Exception as error:  # noqa: BLE001 - a prediction that cannot be made is said, never raised
        return {}, f"{type(error).__name__}: {str(error).splitlines()[0]}", ""
    memory = plan.memory_by_pp_rank[layout.pp_rank] if plan.memory_by_pp_rank else plan.memory_per_rank
    held = {"parameters": memory.parameters, "gradients": memory.gradients, "optimizer": memory.optimizer}
    sent = plan.traffic_by_pp_rank[layout.pp_rank] if plan.traffic_by_pp_rank else {}
    return {**held, **{f"sent on {kind}": round(b) for kind, b in sent.items()}}, "", plan.traffic_why_not
