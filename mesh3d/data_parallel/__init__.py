"""Data parallelism over the dp axis: FSDP2 or DDP per pipeline stage, gradients reduced once per
step, and the mixed-precision policy they carry.

    DP_MODES        # the values parallelize(dp_mode=) takes
"""

from mesh3d.data_parallel.wrap import DP_MODES

__all__ = ["DP_MODES"]
