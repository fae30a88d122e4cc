"""parallelize's data-parallel arguments checked before any collective: HSDP's dp_shard."""

import pytest
import torch

from mesh3d.data_parallel.mixed_precision import MixedPrecision
from mesh3d.data_parallel.wrap import DataParallelConfig

PRECISION = MixedPrecision(None, torch.float32)


def test_hsdp_takes_a_dp_shard_dividing_dp():
    config = DataParallelConfig.resolve("hsdp", None, 1, 8, PRECISION, 4, 4)  # dp x cp = 8, dp = 4
    assert (config.mode, config.dp_shard, config.reshard_after_forward) == ("hsdp", 4, True)
    assert "dp_shard=4" in str(config)


def test_a_dp_shard_that_does_not_fit_is_refused_by_name():
    with pytest.raises(ValueError, match=r"dividing dp=4; got dp_shard=3. Choose one of \[1, 2, 4\]"):
        DataParallelConfig.resolve("hsdp", None, 1, 4, PRECISION, 3)
    with pytest.raises(ValueError, match="needs dp_shard"):
        DataParallelConfig.resolve("hsdp", None, 1, 4, PRECISION)
    with pytest.raises(ValueError, match="dp_shard=2 was given with dp_mode='fsdp'"):
        DataParallelConfig.resolve("fsdp", None, 1, 4, PRECISION, 2)
