"""Data parallelism over the dp axis: FSDP2 or DDP per pipeline stage, gradients reduced once per
step, and the mixed-precision policy they carry."""

from mesh3d.data_parallel.gradient_sync import GradientSync
from mesh3d.data_parallel.mixed_precision import MixedPrecision
from mesh3d.data_parallel.wrap import DP_MODES, DataParallelConfig, apply_data_parallel

__all__ = ["DP_MODES", "DataParallelConfig", "GradientSync", "MixedPrecision", "apply_data_parallel"]
