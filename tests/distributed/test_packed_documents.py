"""Packed documents through the pipeline: per-sample inputs (`pm.step(inputs, targets,
document_ids=...)`) handed to every stage, against one process running the same model on the same
batch with the same document ids (fp32, 1e-5: losses, grad norms, every parameter after 2 AdamW
steps); and bad per-sample inputs refused on every rank before any message.

Layouts: (pp, dp, tp) = (2, 1, 1) under ZBV (both ends on rank 0, a split backward) and (2, 2, 2)
interleaved with 2 virtual stages (dp shares of the ids, sequence parallel around the attention).
"""

from __future__ import annotations

import torch
from multiprocess import run_on_ranks
from pipeline_cases import LR, MAX_NORM, SEQ_LEN, STEPS, TOLERANCE, VOCAB, meta_model, tiny_args, tp_args, worst_error
from rank_errors import assert_raised_on_every_rank, messages_of

import mesh3d
from examples.llama.model import Transformer, loss_fn
from mesh3d.data.documents import document_ids

EOS = 0
GLOBAL_BATCH = 8


def packed_batches(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(inputs, targets, document ids): random tokens with a separator in about one place of four."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(STEPS):
        stream = torch.randint(1, VOCAB, (GLOBAL_BATCH, SEQ_LEN + 1), generator=generator)
        stream[torch.rand(stream.shape, generator=generator) < 0.25] = EOS
        inputs, targets = stream[:, :-1], stream[:, 1:]
        data.append((inputs, targets, document_ids(inputs, EOS)))
    return data


def reference(args, data):
    """One process, whole model, whole batch, the same document ids."""
    model = Transformer(args)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for inputs, targets, documents in data:
        loss = loss_fn(model(inputs, document_ids=documents), targets)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    across = loss_fn(model(data[0][0]), data[0][1]).item()  # the same tokens attending across documents
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return losses, norms, state, across, loss_fn(model(data[0][0], document_ids=data[0][2]), data[0][1]).item()


def _pipelined(pp, dp, tp, args, data, **kwargs):
    layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    pm = mesh3d.parallelize(meta_model(False, args=args), layout, loss_fn=loss_fn, **kwargs)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, norms = [], []
    share = slice(layout.dp_rank * GLOBAL_BATCH // dp, (layout.dp_rank + 1) * GLOBAL_BATCH // dp)
    for inputs, targets, documents in data:
        losses.append(pm.step(inputs[share], targets[share], document_ids=documents[share]).item())
        norms.append(pm.clip_grad_norm_(MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
    inputs, targets, documents = (t[share] for t in data[0])
    evaluated = (pm.evaluate(inputs, targets).item(), pm.evaluate(inputs, targets, document_ids=documents).item())
    return (losses, norms, pm.full_state_dict(), None), evaluated, pm


def _check_parity(result, ref):
    trained, (across, within) = result
    error, where = worst_error(trained, ref[:3])
    assert error <= TOLERANCE, f"relative error {error:.2e} at {where}"
    # The mask is real: across documents the loss differs; with the ids it is the reference's.
    assert abs(within - ref[4]) <= TOLERANCE * abs(ref[4]), (within, ref[4])
    assert abs(across - ref[3]) <= TOLERANCE * abs(ref[3]), (across, ref[3])
    assert abs(across - within) > 10 * TOLERANCE * abs(within), (across, within)  # far beyond rounding


def _zbv_and_errors(data):
    *result, pm = _pipelined(2, 1, 1, tiny_args(False), data, schedule="zbv", microbatches=4, virtual_stages=2)
    layout = pm.layout
    inputs, targets, documents = data[0]
    positions = torch.arange(SEQ_LEN).expand(GLOBAL_BATCH, SEQ_LEN).clone()
    beyond = positions.clone()
    if layout.rank == 1:  # one rank's bad data: every rank refuses it
        beyond[2, 5] = SEQ_LEN
    errors = messages_of(
        {
            "batch size": lambda: pm.step(inputs, targets, document_ids=documents[:6]),
            "out of range": lambda: pm.step(inputs, targets, position_ids=beyond),
            "float index": lambda: pm.evaluate(inputs, targets, position_ids=positions.float()),
            "unknown": lambda: pm.step(inputs, targets, attention_mask=torch.ones_like(inputs)),
            "positions fine": lambda: pm.evaluate(inputs, targets, position_ids=positions),
        }
    )
    return result, errors


def test_packed_documents_zbv_matches_one_process_and_bad_inputs_are_refused_everywhere():
    data = packed_batches()
    ref = reference(tiny_args(False), data)
    per_rank = run_on_ranks(_zbv_and_errors, 2, data, timeout=300)
    for result, _ in per_rank:
        _check_parity(result, ref)
    expected = {
        "batch size": "input 'document_ids' of shape (6, 8) holds 6 samples, the tokens of shape (8, 8) hold 8",
        "out of range": "per-sample input 'position_ids' holds 8 at position (2, 5), outside [0, 8)",
        "float index": "per-sample input 'position_ids' is torch.float32, but it is an index",
        "unknown": "per-sample input(s) ['attention_mask'] were given, but no pipeline stage takes them",
    }
    assert_raised_on_every_rank([errors for _, errors in per_rank], expected)
    assert all(errors["positions fine"] is None for _, errors in per_rank)


def _interleaved_3d(data):
    *result, _ = _pipelined(
        2, 2, 2, tp_args(False), data, schedule="interleaved_1f1b", microbatches=2, virtual_stages=2
    )
    return result


def test_packed_documents_3d_interleaved_matches_one_process():
    data = packed_batches(seed=1)
    ref = reference(tp_args(False), data)
    for result in run_on_ranks(_interleaved_3d, 8, data, timeout=300):
        _check_parity(result, ref)
