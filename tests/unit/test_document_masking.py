"""Packed documents in the LLaMA example, on one process: document ids from separators, positions
restarting with each document, block-causal attention (each document's logits and loss equal the
document run alone), and which per-sample inputs a stage declares."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from examples.llama.config import ModelArgs
from examples.llama.model import Transformer, loss_fn
from mesh3d.data.documents import document_ids, positions_in_documents
from mesh3d.model.stage_inputs import declared_index_bounds, stage_input_names
from mesh3d.step.per_sample_check import per_sample_problem

EOS = 0


def test_document_ids_and_positions_from_separators():
    tokens = torch.tensor([[5, 6, EOS, 7, 8, 9, EOS, 3], [EOS, 1, 2, EOS, EOS, 4, 5, 6]])
    ids = document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 2, 3, 3, 3]]
    assert positions_in_documents(ids).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 0, 0, 1, 2]]


@pytest.fixture
def model():
    torch.manual_seed(0)
    model = Transformer(
        ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
    )
    model.init_weights(seed=3)
    return model


def test_each_document_is_its_own_sequence(model):
    """Logits and loss of every document of a packed row equal that document run alone (positions
    from 0, nothing else to attend to); across documents they differ (the mask is real)."""
    generator = torch.Generator().manual_seed(1)
    stream = torch.randint(1, 64, (2, 17), generator=generator)
    stream[0, [4, 10]] = EOS
    stream[1, 6] = EOS
    inputs, targets = stream[:, :-1], stream[:, 1:]
    ids = document_ids(inputs, EOS)
    packed = model(inputs, document_ids=ids)
    for row in range(2):
        for doc in ids[row].unique():
            span = (ids[row] == doc).nonzero().flatten()
            alone = model(inputs[row : row + 1, span])
            torch.testing.assert_close(packed[row : row + 1, span], alone, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                loss_fn(packed[row : row + 1, span], targets[row : row + 1, span]),
                loss_fn(alone, targets[row : row + 1, span]),
                rtol=1e-5,
                atol=1e-6,
            )
    across = model(inputs)
    assert (across[:, 5:] - packed[:, 5:]).abs().max() > 1e-2  # the later documents saw the earlier ones
    # One document per row is the plain causal model; positions given explicitly are used as given.
    torch.testing.assert_close(model(inputs, document_ids=torch.zeros_like(ids)), across, rtol=0, atol=0)
    torch.testing.assert_close(
        model(inputs, document_ids=ids, position_ids=positions_in_documents(ids)), packed, rtol=0, atol=0
    )


def test_stage_declares_inputs_by_keyword_only_parameters_or_attribute(model):
    assert stage_input_names(model) == {"document_ids", "position_ids"}
    assert stage_input_names(nn.Linear(2, 2)) == frozenset()
    declared = nn.Linear(2, 2)
    declared.per_sample_inputs = ("attention_mask",)
    assert stage_input_names(declared) == {"attention_mask"}
    assert declared_index_bounds(model) == {"position_ids": 16, "document_ids": 16}


def test_per_sample_problems_name_the_input_and_values():
    tokens = torch.zeros(4, 8, dtype=torch.long)
    bounds = {"position_ids": 8}
    fine = torch.arange(8).expand(4, 8)
    assert per_sample_problem(tokens, {"position_ids": fine, "mask": torch.ones(4, 1, 8, 8)}, bounds) is None
    assert "holds 3 samples, the tokens of shape (4, 8) hold 4" in per_sample_problem(
        tokens, {"mask": torch.ones(3, 8)}, bounds
    )
    bad = fine.clone()
    bad[1, 2] = -1
    assert "holds -1 at position (1, 2), outside [0, 8)" in per_sample_problem(tokens, {"position_ids": bad}, bounds)
    assert "has shape (4, 7); it is an index per token" in per_sample_problem(
        tokens, {"position_ids": fine[:, :7]}, bounds
    )
    assert "is int; pass a tensor" in per_sample_problem(tokens, {"mask": 3}, bounds)
