"""The mesh's size arithmetic on its own: dp=-1 takes the rest of the world, a product that misses it is refused."""

import pytest

from mesh3d.mesh import resolve_sizes


def test_resolve_sizes_pure():
    assert resolve_sizes(4, -1, 2, 16) == (4, 2, 2)
    assert resolve_sizes(1, -1, 1, 1) == (1, 1, 1)
    with pytest.raises(ValueError, match="world size=16"):
        resolve_sizes(4, 2, 4, 16)
