"""The device the GPU tests run on: "cuda", or "cpu" under MESH3D_GPU_TESTS_ON_CPU=1 (tests/gpu_cases.py)."""

import pytest
from gpu_cases import gpu_test_device


@pytest.fixture
def device() -> str:
    found = gpu_test_device()
    if found is None:  # the files' own skip normally comes first
        pytest.skip("needs a CUDA GPU")
    return found
