"""The default loss's chunked cross-entropy under loss parallel (logits vocab-sharded over tp = 2):
the loss and the gradient of every rank's shard equal torch's `loss_parallel()` cross-entropy on
the whole logits, with chunks of one row, a few rows and all rows."""

import pytest
import torch
from multiprocess import run_on_ranks

pytestmark = pytest.mark.distributed


def _compare(chunk_rows_list):
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    import mesh3d.model.loss as loss_module
    from mesh3d.model.loss import IGNORE_INDEX, cross_entropy_loss

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    vocab = 12
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, vocab, generator=generator)
    target = torch.randint(0, vocab, (2, 7), generator=generator)
    target[1, 2:5] = IGNORE_INDEX
    errors = []
    for chunk_rows in chunk_rows_list:
        loss_module.LOSS_CHUNK_ELEMENTS = chunk_rows * vocab
        results = []
        for chunked in (True, False):
            sharded = distribute_tensor(logits.clone(), mesh, [Shard(2)]).requires_grad_()
            with loss_parallel():
                if chunked:
                    loss_sum, _ = cross_entropy_loss(sharded, target)
                else:
                    loss_sum = F.cross_entropy(
                        sharded.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
                    )
                loss_sum.backward()
            results.append((loss_sum.full_tensor(), sharded.grad.to_local()))
        (mine, mine_grad), (ref, ref_grad) = results
        if not torch.allclose(mine, ref, rtol=1e-6, atol=0) or not torch.allclose(mine_grad, ref_grad, rtol=1e-6):
            errors.append(f"chunk_rows={chunk_rows}: loss {float(mine)} vs {float(ref)}")
    dist.destroy_process_group()
    return errors


def test_chunked_loss_under_loss_parallel_equals_torchs():
    for errors in run_on_ranks(_compare, 2, [1, 3, 100], timeout=120):
        assert not errors, errors
