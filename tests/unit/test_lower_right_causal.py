"""Context parallelism's causal calls on their own (mesh3d/context_parallel/lower_right_causal.py and
attention.py's causal blocks): a rank's queries attended run by run over the keys sorted by
position equal the whole sequence's causal attention at the rank's positions, forward and backward,
against SDPA on the whole sequence in one call (fp32, 1e-5)."""

import pytest
import torch

from mesh3d.context_parallel import attention
from mesh3d.context_parallel.attention import CausalQueries, GatheredAttention, _blocks_of
from mesh3d.context_parallel.call_verdicts import CAUSAL, StepVerdicts
from mesh3d.context_parallel.lower_right_causal import fused_takes, lower_right_causal
from mesh3d.context_parallel.sequence_cut import SequenceCut


def _qkv(heads=4, kv_heads=2, seq=24, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, dim, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, seq, dim, generator=generator, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("queries", [1, 5, 24])
def test_lower_right_causal_is_the_whole_causal_attention_s_last_rows(queries):
    q, k, v = _qkv()
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    q_last = q[..., -queries:, :].clone().requires_grad_(True)
    out = lower_right_causal(q_last, k, v, None, True)
    torch.testing.assert_close(out, whole[..., -queries:, :], rtol=1e-12, atol=1e-12)
    assert not fused_takes(q_last, k, v, True)  # on the CPU: the mask built for the call


def _rank_attention(cut: SequenceCut, q, k, v, monkeypatch, mask_pairs: int):
    """A cp rank's causal attention as attention.py runs it, its K/V gather done by hand."""
    monkeypatch.setattr(attention, "MASK_PAIRS", mask_pairs)
    mine = cut.positions
    causal = CausalQueries.of(mine, cut.gathered_positions)
    call = GatheredAttention(None, cut.cp, lambda device: None, None, True, CAUSAL, lambda _: None, causal)
    blocks = _blocks_of(call, q[..., mine, :], k[..., mine, :], v[..., mine, :])
    gathered = cut.gathered_positions[blocks.order]  # the keys' positions in the order attended
    assert gathered.tolist() == list(range(cut.seq_len))
    assert [r[0] for r in blocks.rows] == [0, *[r[1] for r in blocks.rows[:-1]]] and blocks.rows[-1][1] == len(mine)
    for start, stop, keys in blocks.rows:
        assert keys == int(mine[stop - 1]) + 1  # up to the block's last query, no further
        assert int(mine[stop - 1]) - int(mine[start]) == stop - start - 1  # one run of positions
    q_mine = q[..., mine, :].detach().clone().requires_grad_(True)
    out = torch.cat(
        [lower_right_causal(q_mine[..., a:b, :], k[..., :n, :], v[..., :n, :], None, True) for a, b, n in blocks.rows],
        dim=-2,
    )
    return out, q_mine, blocks.rows, causal.runs


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("mask_pairs", [2**21, 40])
def test_a_rank_s_causal_runs_equal_the_whole_sequence_at_its_positions(cp, mask_pairs, monkeypatch):
    seq = 2 * cp * 4
    q, k, v = (t.requires_grad_(True) for t in _qkv(seq=seq))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for rank in range(cp):
        cut = SequenceCut(cp, rank, seq)
        out, q_mine, rows, runs = _rank_attention(cut, q, k, v, monkeypatch, mask_pairs)
        if mask_pairs == 2**21:
            assert len(rows) == len(runs) <= 2  # a run a call (the middle rank's chunks make one run)
        else:
            assert len(rows) > len(runs)
            assert all((b - a) * n <= mask_pairs or b - a == 1 for a, b, n in rows)  # the mask a call builds
        torch.testing.assert_close(out, whole[..., cut.positions, :], rtol=1e-12, atol=1e-12)
        grad = torch.randn_like(out)
        got = torch.autograd.grad(out, (q_mine, k, v), grad)
        expected = torch.autograd.grad(whole[..., cut.positions, :], (q, k, v), grad, retain_graph=True)
        torch.testing.assert_close(got[0], expected[0][..., cut.positions, :], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[1], expected[1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got[2], expected[2], rtol=1e-12, atol=1e-12)


def test_runs_of_a_cut_are_its_head_and_tail_chunks():
    cut = SequenceCut(4, 1, 32)
    causal = CausalQueries.of(cut.positions, cut.gathered_positions)
    assert causal.runs == ((0, 4, 4), (4, 8, 24))


def test_the_cp_attention_bench_runs_at_tiny_sizes(capsys):
    """bench/cp_attention.py (the GPU figure of a cp rank's attention) at CPU sizes: a row per length."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import cp_attention

    cp_attention.main(
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "8",
            "--seq",
            "64",
            "128",
            "--cp",
            "2",
            "4",
            "--repeats",
            "1",
            "--hardware",
            "h100",
        ]
    )
    rows = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| 64 |") or line.startswith("| 128 |")
    ]
    assert [row.split("|")[3].strip() for row in rows] == ["2", "2"]  # a call per chunk


def test_causal_calls_go_without_mask_rows_and_documents_with_them(monkeypatch):
    """sdpa_calls.py routes is_causal, and a boolean mask that is causal on the rank's tokens, to the
    causal runs; a mask of several documents keeps its mask rows."""
    import torch.nn.functional as F

    from mesh3d.context_parallel import sdpa_calls
    from mesh3d.context_parallel.sdpa_calls import ContextParallelAttention, own_tokens_mask

    calls = []
    monkeypatch.setattr(sdpa_calls, "attend", lambda q, k, v, call: calls.append(call) or q)
    cut = SequenceCut(2, 1, 16)
    q = torch.randn(1, 2, 8, 4)
    with ContextParallelAttention(cut, None, StepVerdicts(cut.cp)):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(q, q, q, attn_mask=own_tokens_mask(cut, None))
    documents = torch.tensor([[0] * 6 + [1] * 10])
    with ContextParallelAttention(cut, None, StepVerdicts(cut.cp), documents):
        F.scaled_dot_product_attention(q, q, q, attn_mask=own_tokens_mask(cut, documents))
    assert [call.causal is not None for call in calls] == [True, True, False]
    assert calls[0].causal.runs == ((0, 8, 4),)  # cp rank 1 of 2 holds chunks 1 and 2: one run
    assert calls[2].mask(q.device).shape == (1, 1, 8, 16)


def test_a_causal_call_runs_under_a_dispatch_mode():
    """Selective checkpointing runs the recompute under a dispatch mode, where no tensor subclass
    (such as PyTorch's CausalBias) can be made: the calls build none."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v = (t.requires_grad_(True) for t in _qkv())
    with PassThrough():
        out = lower_right_causal(q[..., -5:, :], k, v, None, True)
        out.sum().backward()
    assert q.grad is not None and k.grad is not None
    with pytest.raises(ValueError, match="4 query heads and 2 key/value heads needs enable_gqa=True"):
        lower_right_causal(q[..., -5:, :], k, v, None, False)


def test_microbatches_of_one_document_a_row_are_attended_causally():
    """step/sequence_shards.py hands a microbatch's document ids to its attention only where a row
    holds several documents: the others' mask is the causal one, attended without mask rows."""
    from mesh3d.step.sequence_shards import _packed_microbatches

    documents = torch.tensor([[0, 0, 0, 0], [3, 3, 3, 3], [0, 0, 1, 1], [2, 2, 2, 2]])
    parts = _packed_microbatches(documents, 2)
    assert parts[0] is None and torch.equal(parts[1], documents[2:])
    assert _packed_microbatches(None, 2) is None
