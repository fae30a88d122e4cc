"""The default loss's chunked cross-entropy against torch's own, whole: the same loss (its fp32 sum
only reordered) and bitwise the same gradient, with masked targets, in fp32 and bf16, chunks of
every size including one row and a remainder."""

import pytest
import torch
import torch.nn.functional as F

import mesh3d.model.loss as loss_module
from mesh3d.model.loss import IGNORE_INDEX, cross_entropy_loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 1000])
def test_chunks_give_torchs_loss_and_gradient(monkeypatch, dtype, chunk_rows):
    vocab = 11
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", chunk_rows * vocab)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 9, vocab, generator=generator).to(dtype)
    target = torch.randint(0, vocab, (2, 9), generator=generator)
    target[0, :4] = IGNORE_INDEX

    mine = logits.clone().requires_grad_()
    loss_sum, count = cross_entropy_loss(mine, target)
    loss_sum.backward()
    theirs = logits.clone().requires_grad_()
    reference = F.cross_entropy(
        theirs.flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    reference.backward()

    assert int(count) == 14
    torch.testing.assert_close(loss_sum, reference, rtol=1e-6, atol=0)
    assert mine.grad.dtype == dtype and torch.equal(mine.grad, theirs.grad)


def test_no_rows_sum_to_zero():
    loss_sum, count = cross_entropy_loss(torch.zeros(0, 5, requires_grad=True), torch.zeros(0, dtype=torch.long))
    assert float(loss_sum.detach()) == 0.0 and int(count) == 0
