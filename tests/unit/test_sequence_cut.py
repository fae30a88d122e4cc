"""Context parallelism's cut, on its own: which tokens each cp rank holds, that every rank attends
over as many (query, key) pairs under a causal mask, and the masks mesh3d extends, against the
whole sequence's."""

import pytest
import torch

from mesh3d.context_parallel.sdpa_calls import mask_rows, own_tokens_mask
from mesh3d.context_parallel.sequence_cut import SequenceCut, whole_positions
from mesh3d.data.documents import document_ids, documents_from_positions


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_head_and_tail_chunks_cover_the_sequence_once_with_equal_causal_work(cp):
    seq = 2 * cp * 5
    cuts = [SequenceCut(cp, r, seq) for r in range(cp)]
    held = torch.cat([cut.positions for cut in cuts])
    assert sorted(held.tolist()) == list(range(seq))
    assert torch.equal(cuts[0].gathered_positions, held)  # the order keys arrive in from the gather
    for cut in cuts:
        assert cut.positions.tolist() == sorted(cut.positions.tolist())  # sequence order: masks rely on it
    pairs = {int((cut.positions + 1).sum()) for cut in cuts}  # keys each query sees under a causal mask
    assert len(pairs) == 1


def test_a_length_that_does_not_cut_is_refused_naming_the_sizes():
    with pytest.raises(ValueError, match="sequence length 10 does not cut into 2\\*cp=4 equal chunks"):
        SequenceCut(2, 0, 10)


def test_own_tokens_mask_is_the_whole_mask_on_the_rank_s_tokens():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4, (3, 16), generator=generator)
    documents = document_ids(tokens, separator=0)
    whole = mask_rows(torch.arange(16), torch.arange(16), documents)
    for rank in range(4):
        cut = SequenceCut(4, rank, 16)
        mine = cut.positions
        assert torch.equal(own_tokens_mask(cut, documents), whole[:, :, mine][:, :, :, mine])
        rows = mask_rows(mine, cut.gathered_positions, documents)  # what the rank attends with
        assert torch.equal(rows, whole[:, :, mine][:, :, :, cut.gathered_positions])


def test_positions_and_documents_from_the_whole_rows():
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    positions = whole_positions(torch.zeros(1, 8, dtype=torch.long), {"document_ids": documents})
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert documents_from_positions(positions).tolist() == documents.tolist()  # transformers' reading
    plain = whole_positions(torch.zeros(2, 8, dtype=torch.long), {})
    assert plain.tolist() == [list(range(8))] * 2
    assert documents_from_positions(plain).tolist() == [[0] * 8] * 2
