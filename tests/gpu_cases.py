"""What the GPU tests (tests/gpu/) share: the device they run on, exact fp32, their tolerances.

They run where CUDA is, one rank on cuda:0 with NCCL, and are skipped elsewhere: every file there
sets `pytestmark = needs_gpu`.
MESH3D_GPU_TESTS_ON_CPU=1 runs them on CPU with gloo instead, to prove the tests' own logic on a
machine without a GPU; the numbers they compare then come from the same kernels.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from typing import Any, Callable

import numpy as np
import pytest
import torch
from multiprocess import VISIBLE_GPUS_ENV, run_on_ranks

ON_CPU_ENV = "MESH3D_GPU_TESTS_ON_CPU"
FP32_TOLERANCE = 1e-5  # relative, TF32 off: GPU and CPU kernels sum in different orders
BF16_TOLERANCE = 2e-2  # relative: bf16 rounds each matmul's output to 8 bits of mantissa


def _visible_gpus() -> dict[str, str | None]:
    """CUDA_VISIBLE_DEVICES as the suite found it (tests/conftest.py hides the GPUs from the rest)."""
    found = os.environ.get(VISIBLE_GPUS_ENV, "all")
    return {"CUDA_VISIBLE_DEVICES": None if found == "all" else found}


@functools.cache
def _cuda_present() -> bool:
    """Whether a process shown the suite's GPUs has CUDA (asked in a fresh one: this one sees none)."""
    if torch.version.cuda is None:  # a CPU build of torch: no question to ask
        return False
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({k: v for k, v in _visible_gpus().items() if v is not None})
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.is_available())"]
    return subprocess.run(probe, env=env, capture_output=True, text=True, timeout=300).stdout.strip() == "True"


def gpu_test_device() -> str | None:
    """ "cuda" where CUDA is, "cpu" under MESH3D_GPU_TESTS_ON_CPU=1, else None (the tests skip)."""
    if _cuda_present():
        return "cuda"
    return "cpu" if os.environ.get(ON_CPU_ENV) == "1" else None


def run_on_gpu_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """multiprocess.run_on_ranks with the suite's GPUs shown to the ranks."""
    return run_on_ranks(fn, world_size, *args, timeout=timeout, env=_visible_gpus())


needs_gpu = [
    pytest.mark.cuda,
    pytest.mark.skipif(gpu_test_device() is None, reason=f"needs a CUDA GPU ({ON_CPU_ENV}=1 runs the logic on CPU)"),
]


def exact_fp32() -> None:
    """fp32 matmuls and convolutions in full fp32 on CUDA (no TF32), whatever set them before."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9's switch
        matmul.fp32_precision = "ieee"
        conv.fp32_precision = "ieee"
    else:
        matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def compile_backend(device: str) -> str:
    """inductor on the GPU; on CPU aot_eager, which traces the same graphs without a C++ toolchain."""
    return "inductor" if device == "cuda" else "aot_eager"


def as_numpy(state: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A state dict as CPU numpy arrays (they pickle by value back to the test process)."""
    return {k: v.detach().float().cpu().numpy().copy() for k, v in state.items()}
