"""The timeout argument and what counts as a peer failure, in one process. (A stopped rank becoming an
error on every other rank: tests/distributed/test_hang.py.)"""


def test_timeout_argument_and_what_counts_as_a_peer_failure():
    from datetime import timedelta

    import pytest

    from mesh3d.distributed.peer_timeout import is_peer_failure
    from mesh3d.mesh import _as_timeout

    assert _as_timeout(10) == timedelta(seconds=10) and _as_timeout(None) is None
    for bad in (0, -1, "10", True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            _as_timeout(bad)
    assert is_peer_failure(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete"))
    assert is_peer_failure(RuntimeError("Read error [127.0.0.1]:62617: Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("timeout"))
