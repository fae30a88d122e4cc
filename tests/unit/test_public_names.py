"""ParallelModel's public names are exactly those docs/parallelize.md lists (its "What
`ParallelModel` offers" table): a name added or removed is documented, or the test fails."""

import re
from pathlib import Path

from mesh3d import ParallelModel

DOC = Path(__file__).resolve().parents[2] / "docs" / "parallelize.md"


def documented_names() -> set[str]:
    section = DOC.read_text().split("## What `ParallelModel` offers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    return {name for row in rows for name in re.findall(r"`(\w+)", row)}


def test_parallel_model_public_names_are_the_documented_ones():
    public = {name for name in dir(ParallelModel) if not name.startswith("_")}
    assert public == documented_names()


def test_parallel_model_sets_no_public_attribute():
    import inspect

    assigned = set(re.findall(r"self\.(\w+)\s*=", inspect.getsource(ParallelModel)))
    assert {name for name in assigned if not name.startswith("_")} == set()
