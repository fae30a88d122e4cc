"""Test layout: `unit/` runs in this one process, `distributed/` launches ranks (gloo on CPU).

Every test under `distributed/` carries the `distributed` marker, so
`pytest -m "not distributed"` runs the unit tests alone. The shared harnesses (`multiprocess.py`,
`pipeline_cases.py`, `checkpoint_cases.py`, `text_corpus.py`) live beside this file and are
importable from both folders.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    distributed = TESTS / "distributed"
    for item in items:
        if distributed in Path(item.path).parents:
            item.add_marker(pytest.mark.distributed)
