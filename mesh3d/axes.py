"""The parallel axes: their names, their order, which may be left out of the mesh, and their sizes.

The one place that defines them (docs/mesh.md). Outermost first:

    pp   pipeline stages            crosses nodes
    dp   data-parallel replicas     FSDP2 shards (or DDP replicates) over dp x cp
    cp   context parallelism        each sequence cut over its ranks; optional
    tp   tensor parallelism         consecutive ranks: one node, the fastest links

Global rank r = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank. An optional axis of
size 1 is not a dim of the DeviceMesh at all, so a layout without it has exactly the mesh, the
coordinates and the rank order it had before the axis existed: ("pp", "dp", "tp").

One more axis is carved out of these rather than added to them, so it leaves the world size alone:

    ep   expert parallelism         ep consecutive ranks of a stage's dp x cp x tp hold 1/ep of
                                    every block's experts each; the stage's ranks at the same
                                    ep_rank (edp of them) hold the same experts

A stage's ranks are numbered s = (dp_rank * cp + cp_rank) * tp + tp_rank, so ep_rank = s % ep and
the expert mesh is ("pp", "edp", "ep") over the global ranks in order. With ep = 1 there is no
expert mesh at all.

Pure arithmetic, no torch, no communication: every rank reaches the same verdict before any
collective.
"""

from __future__ import annotations

import math
import operator

AXES = ("pp", "dp", "cp", "tp")
# Axes that are dims of the mesh only when larger than 1.
OPTIONAL_AXES = ("cp",)
# The axes whose ranks at one pipeline stage hold the same parameters and different data: data
# parallelism (FSDP/DDP), the gradient reduction and the loss's count run over all of them.
DATA_AXES = ("dp", "cp")
# The name of the one mesh dim spanning DATA_AXES when more than one of them is in the mesh.
DATA_DIM = "dp_cp"
# The axes whose ranks share a pipeline stage; expert parallelism splits their product.
STAGE_AXES = ("dp", "cp", "tp")
# The carved axis, and the dims of the mesh it makes when larger than 1.
EXPERT_AXIS = "ep"
EXPERT_DIMS = ("pp", "edp", "ep")
# Every size a layout has, as errors print them: the mesh's axes, then the carved one.
ALL_AXES = (*AXES, EXPERT_AXIS)


def mesh_dims(sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh's dim names for these sizes, outermost first: every axis, less optional ones of size 1."""
    return tuple(axis for axis in AXES if axis not in OPTIONAL_AXES or sizes[axis] > 1)


def data_dims(sizes: dict[str, int]) -> tuple[str, ...]:
    """The mesh dims data parallelism spans: dp, and cp where it is a dim."""
    dims = mesh_dims(sizes)
    return tuple(axis for axis in DATA_AXES if axis in dims)


def stage_size(sizes: dict[str, int]) -> int:
    """How many ranks share a pipeline stage: dp x cp x tp."""
    return math.prod(sizes[axis] for axis in STAGE_AXES)


def describe(sizes: dict[str, int], separator: str = ", ") -> str:
    """'pp=2, dp=1, tp=2' (cp and ep named only where larger than 1), as errors and reprs print sizes."""
    shown = [*mesh_dims(sizes), *([EXPERT_AXIS] if sizes.get(EXPERT_AXIS, 1) > 1 else [])]
    return separator.join(f"{axis}={sizes[axis]}" for axis in shown)


def resolve_sizes(world_size: int, **given: int) -> dict[str, int]:
    """Check the axes' sizes against the world size and resolve dp=-1 to "the rest of the world".

    `given`: a size per axis name (an axis left out is 1, dp -1). Returns {axis: size} for every
    axis in ALL_AXES. Raises ValueError naming the sizes and what to change.
    """
    unknown = sorted(set(given) - set(ALL_AXES))
    if unknown:
        raise ValueError(f"build_mesh: unknown axes {unknown}; the axes are {list(ALL_AXES)}")
    expert = given.pop(EXPERT_AXIS, 1)
    sizes = {axis: given.get(axis, -1 if axis == "dp" else 1) for axis in AXES}
    shown = [axis for axis in AXES if axis not in OPTIONAL_AXES or sizes[axis] != 1]  # cp named where it is not 1
    where = ", ".join(f"{axis}={sizes[axis]}" for axis in shown) + f", world size={world_size}"
    for axis, size in sizes.items():
        try:
            if isinstance(size, bool):
                raise TypeError
            sizes[axis] = operator.index(size)
        except TypeError:
            raise ValueError(f"build_mesh: {axis} must be an int, got {size!r} ({where})") from None
    if any(sizes[axis] < 1 for axis in shown if axis != "dp"):
        raise ValueError(f"build_mesh: {' and '.join(a for a in shown if a != 'dp')} must be >= 1 ({where})")
    others = math.prod(size for axis, size in sizes.items() if axis != "dp")
    named = "*".join(axis for axis in AXES if axis != "dp" and (axis not in OPTIONAL_AXES or sizes[axis] > 1))
    if sizes["dp"] == -1:
        if world_size % others != 0:
            raise ValueError(
                f"build_mesh: dp=-1 takes the rest of the world, but {named}={others} does not divide "
                f"the world size ({where}); choose sizes whose product divides {world_size}"
            )
        sizes["dp"] = world_size // others
    elif sizes["dp"] < 1:
        raise ValueError(f"build_mesh: dp must be >= 1, or -1 for the rest of the world ({where})")
    product = others * sizes["dp"]
    if product != world_size:
        every = "*".join(axis for axis in AXES if axis not in OPTIONAL_AXES or sizes[axis] > 1)
        raise ValueError(
            f"build_mesh: {every}={product} does not equal the world size ({where}); "
            f"choose sizes whose product is {world_size}, or pass dp=-1"
        )
    sizes[EXPERT_AXIS] = _expert_size(expert, sizes, where)
    return sizes


def _expert_size(ep, sizes: dict[str, int], where: str) -> int:
    """ep checked against the ranks that share a stage, which it must divide."""
    try:
        if isinstance(ep, bool):
            raise TypeError
        ep = operator.index(ep)
    except TypeError:
        raise ValueError(f"build_mesh: ep must be an int >= 1, got {ep!r} ({where})") from None
    if ep < 1:
        raise ValueError(f"build_mesh: ep must be an int >= 1, got {ep!r} ({where})")
    ranks = stage_size(sizes)
    if ranks % ep != 0:
        divisors = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise ValueError(
            f"build_mesh: ep={ep} must divide the ranks that share a pipeline stage, dp*cp*tp={ranks} "
            f"({where}); choose ep among {divisors}"
        )
    return ep
