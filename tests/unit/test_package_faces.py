"""One rule for what a package's `__init__` exports (docs/design.md, "Package faces"): the names a
user of mesh3d imports from that package, listed in `__all__` and named in its docstring, and
nothing else (a package only mesh3d itself uses exports nothing); code inside mesh3d imports each
name from the module that defines it, never through a package's `__init__`."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "mesh3d"
INITS = sorted(ROOT.rglob("__init__.py"))


def _package(path: Path) -> str:
    return ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])


def _exports(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_each_face_exports_what_it_imports_and_names_it_in_its_docstring():
    for init in INITS:
        tree = ast.parse(init.read_text())
        exported = _exports(tree)
        imported = {
            a.asname or a.name
            for n in tree.body
            if isinstance(n, ast.ImportFrom) and n.module != "__future__"
            for a in n.names
        }
        if init.parent != ROOT:  # the top face also names its subpackages
            assert imported == set(exported), f"{init}: imports {sorted(imported)}, exports {sorted(exported)}"
        doc = ast.get_docstring(tree) or ""
        unnamed = [name for name in exported if not re.search(rf"\b{re.escape(name)}\b", doc)]
        assert not unnamed, f"{init}: exports {unnamed} without naming them in its docstring"


def test_no_module_of_mesh3d_imports_through_a_package_face():
    packages = {_package(init) for init in INITS}
    submodules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts) for p in ROOT.rglob("*.py")} | packages
    for path in ROOT.rglob("*.py"):
        if path == ROOT / "__init__.py":
            continue  # the face of mesh3d composes the others'
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in packages:
                through = [a.name for a in node.names if f"{node.module}.{a.name}" not in submodules]
                assert not through, f"{path}: imports {through} from {node.module}'s face, not from their modules"
