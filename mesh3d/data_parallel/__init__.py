"""Data parallelism over the dp axis: FSDP2 or DDP per pipeline stage, gradients reduced once per step."""

from mesh3d.data_parallel.gradient_sync import GradientSync
from mesh3d.data_parallel.wrap import DP_MODES, DataParallelConfig, apply_data_parallel

__all__ = ["DP_MODES", "DataParallelConfig", "GradientSync", "apply_data_parallel"]
