"""The mesh's size arithmetic on its own: dp=-1 takes the rest of the world, a product that misses it is refused."""

import pytest

from mesh3d.mesh import resolve_sizes


def test_resolve_sizes_pure():
    assert resolve_sizes(4, -1, 2, 16) == (4, 2, 2)
    assert resolve_sizes(1, -1, 1, 1) == (1, 1, 1)
    with pytest.raises(ValueError, match="world size=16"):
        resolve_sizes(4, 2, 4, 16)


def test_cp_sizes_sit_between_dp_and_tp():
    from mesh3d.axes import mesh_dims
    from mesh3d.axes import resolve_sizes as axis_sizes

    assert resolve_sizes(2, -1, 2, 16, cp=2) == (2, 2, 2, 2)  # (pp, dp, cp, tp)
    assert resolve_sizes(1, 1, 2, 8, cp=4) == (1, 1, 4, 2)
    assert mesh_dims(axis_sizes(8, pp=2, tp=2)) == ("pp", "dp", "tp")  # cp = 1: the mesh of before
    assert mesh_dims(axis_sizes(8, pp=2, cp=2)) == ("pp", "dp", "cp", "tp")
    with pytest.raises(ValueError, match=r"pp\*cp\*tp=12 does not divide the world size \(pp=3, dp=-1, cp=2"):
        resolve_sizes(3, -1, 2, 16, cp=2)
    with pytest.raises(ValueError, match="cp must be an int"):
        resolve_sizes(1, -1, 1, 4, cp=2.0)
