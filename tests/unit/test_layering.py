"""The house's one rule, held by a test: data flows one way through mesh3d's rooms.

Each top-level room of `mesh3d/` (a folder, or one of the loose modules of the public face) has a
floor; a module may import modules of its own room or of rooms on lower floors, never higher, and
never the package's face (`import mesh3d`, whose __init__ imports the top rooms). And no two files
import each other, directly or around a circle: a file that defines a type and also picks among its
variants is split, the choice moving above the variants. Read from the source with `ast`, so a lazy
import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "mesh3d"

# Lowest first: mesh -> split -> tensor -> data parallel -> pipeline runtime -> step -> the face -> checkpoint -> train.
FLOORS = [
    ("distributed", "data", "tensor", "axes", "context_parallel"),
    ("mesh", "expert_parallel"),
    ("model", "data_parallel"),
    ("pipeline",),
    ("step",),
    ("parallel_model",),
    ("parallelize",),
    ("checkpoint",),
    ("train",),
    ("planner",),  # reads the whole stack (split, schedules, TP plans) to predict it; nothing imports it
]
FLOOR_OF = {room: floor for floor, rooms in enumerate(FLOORS) for room in rooms}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "mesh3d" else None


def _imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [
                (node.lineno, f"{node.module}.{alias.name}" if node.module == "mesh3d" else node.module)
                for alias in node.names
            ]
    return [(line, name) for line, name in found if name == "mesh3d" or name.startswith("mesh3d.")]


def _file_of(module: str) -> Path | None:
    """The file `module` (dotted, under mesh3d) is read from; None when it is not a module."""
    base = PACKAGE.parent.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imported_files(path: Path) -> set[Path]:
    """The mesh3d files `path` imports, at the top or inside a function: `from a.b import c` is
    the file a/b/c.py when there is one, else a/b.py or a/b/__init__.py."""
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {_file_of(alias.name) for alias in node.names if alias.name.startswith("mesh3d.")}
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "mesh3d"
        ):
            found |= {_file_of(f"{node.module}.{alias.name}") or _file_of(node.module) for alias in node.names}
    return found - {None, path}


def _cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """One shortest circle through each file that lies on one, each circle once."""
    cycles, seen = [], set()
    for start in sorted(graph):
        paths, frontier = {start: [start]}, [start]
        while frontier and start not in {t for f in frontier for t in graph[f]}:
            step = []
            for here in frontier:
                for there in sorted(graph[here]):
                    if there not in paths:
                        paths[there] = paths[here] + [there]
                        step.append(there)
            frontier = step
        if not frontier:
            continue
        cycle = paths[next(f for f in frontier if start in graph[f])]
        at = cycle.index(min(cycle))
        key = tuple(cycle[at:] + cycle[:at])
        if key not in seen:
            seen.add(key)
            cycles.append(list(key))
    return cycles


def test_no_import_cycle_between_files():
    """A circle of imports works only while each import on it waits inside a function; the failure
    names each circle as a chain of files, so the file to split is in plain sight."""
    files = sorted(PACKAGE.rglob("*.py"))
    graph = {path: _imported_files(path) for path in files}
    cycles = _cycles(graph)
    chains = [" -> ".join(str(p.relative_to(PACKAGE.parent)) for p in [*cycle, cycle[0]]) for cycle in cycles]
    assert not chains, "files that import each other (a function-local import counts):\n" + "\n".join(chains)


def test_every_room_has_a_floor():
    rooms = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.name != "__init__.py")
    }
    assert rooms == set(FLOOR_OF), (
        f"rooms without a floor here: {rooms - set(FLOOR_OF)}; floors without a room: {set(FLOOR_OF) - rooms}"
    )


def test_no_module_imports_upward_or_the_face():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE.parent)
        if relative == Path("mesh3d/__init__.py"):
            continue
        own = FLOOR_OF[_room(".".join(relative.with_suffix("").parts))]
        for line, name in _imports(path):
            room = _room(name)
            if room is None:
                upward.append(f"{relative}:{line} imports the package face `{name}`")
            elif FLOOR_OF[room] > own:
                upward.append(f"{relative}:{line} imports {name} (floor {FLOOR_OF[room]} > {own})")
    assert not upward, "\n".join(upward)


def test_at_most_five_loose_modules_at_the_top():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 5, loose


def test_test_file_names_are_unique_across_folders():
    """pytest imports test files by their basename (docs/testing.md): a name in both folders stops
    the whole collection."""
    tests = Path(__file__).resolve().parents[1]
    names = [p.name for folder in ("unit", "distributed", "gpu") for p in (tests / folder).glob("test_*.py")]
    twice = sorted({name for name in names if names.count(name) > 1})
    assert not twice, f"rename all but one of each: {twice}"
