"""The code tree in docs/design.md is the tree on disk: the one tour of the code, kept true.

The tree is the fenced block of docs/design.md that starts with the line `mesh3d/`. A line whose
first word ends in `/` names a folder, one whose first word ends in `.py` a file; its indentation
says which folder it sits in (deeper than the folder's line). Other lines (none today) would be
prose and are skipped. Every name in the tree must exist, and every folder of Python files and
every `.py` file under mesh3d/ must be named in it, except the `__init__.py` of a subpackage
(its folder's line describes it).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
NAME = re.compile(r"^( *)([\w.-]+/|[\w-]+\.py)(?:\s|$)")


def tree_block() -> list[str]:
    """The lines of the fenced block in docs/design.md whose first line is `mesh3d/`."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", DESIGN.read_text(), re.S | re.M)
    trees = [b for b in blocks if b.startswith("mesh3d/\n")]
    assert len(trees) == 1, "docs/design.md should hold exactly one code tree starting with 'mesh3d/'"
    return trees[0].splitlines()


def documented_paths() -> set[str]:
    """Every path the tree names, relative to the repository root (folders end in '/')."""
    paths: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indentation, folder path) of the folders enclosing a line
    for line in tree_block():
        match = NAME.match(line)
        if not match:
            continue
        indent, name = len(match.group(1)), match.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = (stack[-1][1] if stack else "") + name
        assert path not in paths, f"docs/design.md names {path} twice"
        paths.add(path)
        if name.endswith("/"):
            stack.append((indent, path))
    return paths


def actual_paths() -> set[str]:
    """Every .py file under mesh3d/ and every folder holding one, but subpackages' __init__.py."""
    paths: set[str] = {"mesh3d/"}
    for file in (ROOT / "mesh3d").rglob("*.py"):
        relative = file.relative_to(ROOT)
        if "__pycache__" in relative.parts:
            continue
        if file.name != "__init__.py" or relative.parent == Path("mesh3d"):
            paths.add(relative.as_posix())
        for parent in relative.parents:
            if parent != Path("."):
                paths.add(parent.as_posix() + "/")
    return paths


def test_every_module_and_folder_of_mesh3d_is_in_the_tree():
    missing = actual_paths() - documented_paths()
    assert not missing, f"add these to the code tree in docs/design.md: {sorted(missing)}"


def test_every_name_in_the_tree_exists():
    stale = sorted(p for p in documented_paths() if not (ROOT / p.rstrip("/")).exists())
    assert not stale, f"docs/design.md's code tree names what is not there: {stale}"


def test_the_tree_is_read_as_a_tree():
    """A few names the parser must place: a file at the top, one two folders down, a folder outside mesh3d/."""
    paths = documented_paths()
    assert {"mesh3d/mesh.py", "mesh3d/pipeline/schedule/ir.py", "mesh3d/model/traced/", "tests/"} <= paths
