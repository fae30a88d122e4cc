"""Context parallelism's causal calls on a GPU (mesh3d/context_parallel/lower_right_causal.py): a
chunk's queries over the keys up to its own go to a fused kernel, with no mask, and equal the
whole sequence's causal attention at their rows, forward and backward (bf16 against fp32 math on
the same inputs: BF16_TOLERANCE, and well under how far a diagonal one key off lands). Under
MESH3D_GPU_TESTS_ON_CPU=1 the CPU's mask path is checked (in fp32) instead of the kernel choice."""

from __future__ import annotations

import torch
from gpu_cases import BF16_TOLERANCE, FP32_TOLERANCE, needs_gpu, run_on_gpu_ranks

pytestmark = needs_gpu


def _against_whole(device: str):
    from mesh3d.context_parallel.lower_right_causal import fused_takes, lower_right_causal

    results = []
    for dtype, heads, kv_heads, seq, start, stop in (
        (torch.bfloat16, 32, 8, 4096, 3328, 3840),  # flash, grouped K/V heads
        (torch.bfloat16, 8, 8, 2048, 512, 1536),
        (torch.bfloat16, 32, 8, 1024, 0, 1024),  # as many queries as keys: is_causal
        (torch.float32, 32, 8, 2048, 1024, 1536),  # fp32: the memory-efficient kernel, K/V heads repeated
    ):
        if device != "cuda":
            dtype = torch.float32
        generator = torch.Generator(device=device).manual_seed(seq + heads)
        q, k, v = (
            torch.randn(1, h, seq, 128, generator=generator, device=device, dtype=dtype)
            for h in (heads, kv_heads, kv_heads)
        )
        grad = torch.randn(1, heads, stop - start, 128, generator=generator, device=device, dtype=dtype)
        rows, keys = slice(start, stop), stop  # a chunk's queries over the keys up to its last
        fused = fused_takes(q[..., rows, :], k, v, True) if start else None  # square: SDPA's is_causal, no mask
        q_ = q[..., rows, :].detach().requires_grad_(True)
        k_, v_ = (t[..., :keys, :].detach().requires_grad_(True) for t in (k, v))
        out = lower_right_causal(q_, k_, v_, None, True)
        got = [out, *torch.autograd.grad(out, (q_, k_, v_), grad)]
        # the reference: the whole sequence in fp32, SDPA's math over every row
        q32, k32, v32 = (t.float().detach().requires_grad_(True) for t in (q, k, v))
        whole = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
        expected = [whole[..., rows, :], *torch.autograd.grad(whole[..., rows, :], (q32, k32, v32), grad.float())]
        expected[1] = expected[1][..., rows, :]
        expected[2], expected[3] = expected[2][..., :keys, :], expected[3][..., :keys, :]
        errors = [
            float((g.detach().float() - e.detach()).norm() / e.detach().norm())
            for g, e in zip(got, expected, strict=True)
        ]
        # the same rows with the diagonal one key off either way: how far a wrong alignment lands
        scores = (
            q32[..., rows, :] @ k32[..., :keys, :].repeat_interleave(heads // kv_heads, 1).transpose(-1, -2)
        ) / 128**0.5
        values = v32[..., :keys, :].repeat_interleave(heads // kv_heads, 1)
        shifted = min(
            float(
                ((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values) - expected[0]).norm()
                / expected[0].norm()
            )
            for mask in (
                torch.ones(stop - start, keys, dtype=torch.bool, device=device).tril(start + d)
                for d in ((1,) if start == 0 else (-1, 1))  # one key fewer would leave the first row none
            )
        )
        results.append((dtype, fused, errors, shifted))
    return results


def test_causal_chunks_run_fused_and_equal_the_whole_sequence(device):
    for dtype, fused, errors, shifted in run_on_gpu_ranks(_against_whole, 1, device, timeout=300)[0]:
        tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else FP32_TOLERANCE if device == "cpu" else 1e-4
        assert fused in (None, device == "cuda")  # flash (or memory-efficient) attention: no mask built
        assert max(errors) <= tolerance, (dtype, errors)
        assert errors[0] < shifted / 4, (dtype, errors, shifted)  # the diagonal where it belongs
