"""activation_checkpoint="selective" on one LLaMA block on CPU, against "never" and "always".

The policy (mesh3d/pipeline/activation_checkpoint.py) must keep the matmul and attention outputs
and recompute the rest: the backward reruns the block's norms and activations but none of its
matmuls or its attention, the memory kept between forward and backward lies strictly between
"always" (nothing but the input) and "never" (everything), and the gradients are exactly
"never"'s. The runtime's way (cache in the forward, recompute before the backward, then B, or I
and W, over that graph: runtime.py) is checked the same way, with a split backward.
"""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from pipeline_cases import tiny_args
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from examples.llama.model import Transformer
from mesh3d.pipeline.activation_checkpoint import SAVED_OPS, selective_contexts
from mesh3d.pipeline.backward_halves import backward_input, backward_weight

aten = torch.ops.aten
MATMUL_AND_ATTENTION = (aten.mm.default, aten._scaled_dot_product_flash_attention_for_cpu.default)
CHEAP = (aten.silu.default, aten.rsqrt.default, aten.mean.dim)  # in the forward only, never in a backward


class _Watch(TorchDispatchMode):
    """Counts every op; in the forward, also keeps a weak reference to each result's storage."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.results: dict[int, tuple[StorageWeakRef, int]] = {}
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops[func] += 1
        if self.recording:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    self.results.setdefault(storage.data_ptr(), (StorageWeakRef(storage), storage.nbytes()))
        return out

    def kept_bytes(self, exclude: list[torch.Tensor]) -> int:
        """Bytes of the forward's results still alive (held for the backward), but those in the
        storages of `exclude` (the output, and what existed before: views of weights or inputs)."""
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        return sum(n for ptr, (ref, n) in self.results.items() if ptr not in skip and not ref.expired())


def _block():
    torch.manual_seed(0)
    model = Transformer(tiny_args(False, n_layers=1))
    model.init_weights()
    return model.layers["0"], model.rope


def _forward(mode: str, block, rope, x):
    if mode == "never":
        return block(x, rope)
    if mode == "always":
        return checkpoint(block, x, rope, use_reentrant=False)
    return checkpoint(block, x, rope, use_reentrant=False, context_fn=selective_contexts)


def _run(mode: str):
    """(forward ops, backward ops, bytes kept between them, input and weight gradients)."""
    block, rope = _block()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    with _Watch() as watch:
        out = _forward(mode, block, rope, x)
        kept = watch.kept_bytes(exclude=[out, x, rope, *block.parameters()])
        forward_ops = watch.ops.copy()
        watch.ops.clear()
        watch.recording = False
        out.backward(grad)
    return forward_ops, watch.ops, kept, [x.grad] + [p.grad for p in block.parameters()]


def test_selective_keeps_matmuls_and_attention_and_recomputes_the_rest():
    never, always, selective = _run("never"), _run("always"), _run("selective")
    forward_ops = never[0]
    for op in MATMUL_AND_ATTENTION + CHEAP:
        assert forward_ops[op] > 0, f"{op} is not in a LLaMA block's forward on CPU any more"
    for op in MATMUL_AND_ATTENTION:
        assert op in SAVED_OPS
        # "always" reruns them in the backward (all but what nothing saved: torch's checkpoint stops
        # its recompute early); "selective" takes them from its cache, as "never" keeps them.
        assert always[1][op] > never[1][op], op
        assert selective[1][op] == never[1][op], f"selective recomputed {op}"
    for op in CHEAP:
        assert op not in SAVED_OPS
        assert never[1][op] == 0, op
        assert selective[1][op] == always[1][op] == forward_ops[op], f"selective did not recompute {op}"
    assert always[2] < selective[2] < never[2], (
        f"bytes kept: always {always[2]}, selective {selective[2]}, never {never[2]}"
    )
    for mode, result in (("always", always), ("selective", selective)):
        for got, want in zip(result[3], never[3]):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{mode}: gradients differ from never's")


def _block_input_and_grad():
    block, rope = _block()
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
    return block, rope, x, torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))


def test_split_backward_reads_the_cache_once_at_input_grad():
    """The runtime's path: the forward caches (its own graph dropped), the recompute before I
    runs under the cache and both halves use its graph: "never"'s gradients, and no matmul rerun."""
    block, rope, x0, grad = _block_input_and_grad()
    x = x0.clone().requires_grad_(True)
    block(x, rope).backward(grad)
    want = [x.grad] + [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)

    x = x0.clone().requires_grad_(True)
    caching, cached = selective_contexts()
    checkpoint(block, x, rope, use_reentrant=False, context_fn=lambda: (caching, contextlib.nullcontext()))
    with _Watch() as watch, cached:
        out = block(x, rope)
    assert watch.ops[aten.mm.default] == 0 and watch.ops[aten.silu.default] == 1, dict(watch.ops)
    input_grad, pending = backward_input(out, grad, x)
    backward_weight(pending)
    for got, expected in zip([input_grad] + [p.grad for p in block.parameters()], want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_kept_selective_graph_cannot_serve_both_halves():
    """One reason the runtime recomputes before I: I and W over the checkpointed graph itself are
    two backward passes, and torch hands out the selective cache once."""
    block, rope, x0, grad = _block_input_and_grad()
    x = x0.clone().requires_grad_(True)
    out = checkpoint(block, x, rope, use_reentrant=False, context_fn=selective_contexts)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        _, pending = backward_input(out, grad, x)
        backward_weight(pending)
