"""The timeout argument and what counts as a peer failure, in one process. (A stopped rank becoming an
error on every other rank: tests/distributed/test_hang.py.)"""

import torch.distributed as dist

from mesh3d.distributed.peer_timeout import PeerTimeout, is_peer_failure, located, waiting_for


def test_timeout_argument_and_what_counts_as_a_peer_failure():
    from datetime import timedelta

    import pytest

    from mesh3d.distributed.process_group import as_timeout

    assert as_timeout(10) == timedelta(seconds=10) and as_timeout(None) is None
    for bad in (0, -1, "10", True):
        with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
            as_timeout(bad)
    assert is_peer_failure(RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete"))
    assert is_peer_failure(RuntimeError("Read error [127.0.0.1]:62617: Connection reset by peer"))
    assert not is_peer_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_peer_failure(ValueError("timeout"))


# Texts as ProcessGroupNCCL and NCCL write them (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp,
# NCCLUtils.cpp; NCCL's ncclGetErrorString), as they reach Python.
NCCL_PEER_FAILURES = [
    dist.DistBackendError(
        "NCCL communicator was aborted on rank 2. Original reason for failure was: [PG ID 1 PG GUID 3(mesh_pp) "
        "Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=RECV, NumelIn=4096, "
        "NumelOut=4096, Timeout(ms)=10000) ran for 10012 milliseconds before timing out."
    ),
    dist.DistBackendError(
        "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited or there "
        "was a network error, NCCL version 2.27.3\nncclRemoteError: A call failed possibly due to a network error "
        "or a remote process exiting prematurely."
    ),
    RuntimeError(
        "Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA kernels, "
        "subsequent GPU operations might run on corrupted/incomplete data."
    ),
    dist.DistNetworkError("failed to recv, got 0 bytes"),
]
NCCL_OWN_ERRORS = [
    dist.DistBackendError(
        "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.cpp:77, invalid usage (run with NCCL_DEBUG=WARN "
        "for details), NCCL version 2.27.3\nncclInvalidUsage: This usually reflects invalid usage of NCCL library."
    ),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.27.3"),
]


def test_nccl_texts_of_a_lost_peer_are_peer_failures_and_its_own_errors_are_not():
    assert all(is_peer_failure(error) for error in NCCL_PEER_FAILURES)
    assert not any(is_peer_failure(error) for error in NCCL_OWN_ERRORS)


def test_an_nccl_abort_inside_a_wait_names_the_wait_and_the_coordinates():
    import pytest

    from mesh3d.distributed.process_group import as_timeout

    with pytest.raises(PeerTimeout) as caught:
        with located(5, (1, 0, 1), as_timeout(10), "pm.step"):
            with waiting_for("P2P recv of the activation of stage 1, microbatch 0, from stage 0 on global rank 1"):
                raise NCCL_PEER_FAILURES[0]
    message = str(caught.value)
    assert message.startswith("rank 5 (mesh coordinate pp 1, dp 0, tp 1): a peer did not answer within")
    assert "waited for P2P recv of the activation of stage 1, microbatch 0" in message
    assert "NCCL communicator was aborted on rank 2" in message
