"""Bad data refused on every rank before the first message (issue 16), at (pp, dp, tp) = (2, 1, 2).

The LLaMA example declares its vocabulary (64 here). Each bad batch below makes pm.step (and
pm.evaluate) raise the same ValueError on every rank: an input id equal to the vocabulary size
(on one rank only: the verdict must still be everyone's), a negative input id, a target above
the vocabulary (on another single rank), float token ids, float targets, targets of another
sequence length and of another batch size. A barrier after each proves no rank hangs. The step
after them, with good data, equals the first step of a freshly built model (fp32, rel 1e-5).
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys

import torch
from checkpoint_cases import full_state, worst_relative_error
from multiprocess import run_on_ranks
from pipeline_cases import LR, MAX_NORM, TOLERANCE, VOCAB, batches, meta_model, tp_args
from rank_errors import messages_of
from rank_errors import raised as raised_by

import mesh3d
from examples.llama.config_errors import agreed_errors_said_once
from examples.llama.model import loss_fn
from mesh3d.distributed.printed_once import _hook

# name -> (the rank that holds the bad batch, or None for all, what the message must say)
CASES = {
    "input id = vocab": (3, f"input token id {VOCAB} at position (0, 1) is outside [0, {VOCAB})"),
    "negative input id": (None, "input token id -1 at position (1, 0) is outside"),
    "target above vocab": (0, f"target 1000 at position (2, 3) is outside [0, {VOCAB}) or -100 (ignored)"),
    "float inputs": (None, "inputs are torch.float32, but the model takes token ids"),
    "float targets": (None, "targets are torch.float32, but the model's targets are token ids"),
    "shorter targets": (None, "differ in batch or sequence size"),
    "fewer targets": (None, "differ in batch or sequence size"),
}


def _bad(name: str, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = inputs.clone(), targets.clone()
    if name == "input id = vocab":
        inputs[0, 1] = VOCAB
    elif name == "negative input id":
        inputs[1, 0] = -1
    elif name == "target above vocab":
        targets[0, 0] = -100  # the ignore index is allowed
        targets[2, 3] = 1000
    elif name == "float inputs":
        inputs = inputs.float()
    elif name == "float targets":
        targets = targets.float()
    elif name == "shorter targets":
        targets = targets[:, :-1]
    else:
        targets = targets[:-2]
    return inputs, targets


def _build(layout):
    pm = mesh3d.parallelize(
        meta_model(False, n_layers=4, args=tp_args(False, 4)), layout, loss_fn=loss_fn, microbatches=2
    )
    return pm, torch.optim.AdamW(pm.parameters(), lr=LR)


def _one_step(pm, optimizer, inputs, targets) -> float:
    loss = pm.step(inputs, targets).item()
    pm.clip_grad_norm_(MAX_NORM)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _refuse_then_train() -> dict:
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=2)
    pm, optimizer = _build(layout)
    good = batches(4)[0]
    cases = {}
    for name, (holder, _) in CASES.items():
        inputs, targets = _bad(name, *good) if holder in (None, layout.rank) else good
        for call in (pm.step, pm.evaluate):
            cases[(name, call.__name__)] = functools.partial(call, inputs, targets)
    messages = messages_of(cases)
    after = _one_step(pm, optimizer, *good)
    state = full_state(pm)
    fresh_pm, fresh_optimizer = _build(layout)
    fresh = _one_step(fresh_pm, fresh_optimizer, *good)
    return {"messages": messages, "loss": (after, fresh), "error": worst_relative_error(state, full_state(fresh_pm))}


def test_bad_batches_are_refused_on_every_rank():
    results = run_on_ranks(_refuse_then_train, 4, timeout=120)
    for rank, result in enumerate(results):
        for name, (holder, text) in CASES.items():
            for call in ("step", "evaluate"):
                message = result["messages"][(name, call)]
                assert message is not None, (rank, name, call, "did not raise")
                same = (
                    message.split(" (found on rank")[0]
                    == results[0]["messages"][(name, call)].split(" (found on rank")[0]
                )
                assert same, (rank, name, message)
                assert f"pm.{call}: bad batch: " in message and text in message, (rank, name, message)
                if holder not in (None, rank):
                    assert f"(found on rank {holder})" in message, (rank, name, message)
        after, fresh = result["loss"]
        assert abs(after - fresh) <= TOLERANCE * abs(fresh), (after, fresh)
        error, at = result["error"]
        assert error <= TOLERANCE, (error, at)


def _bad_id_on_dp_rank_1() -> tuple[str | None, int, str, str]:
    """dp=2, 4 rows per rank: rank 1's row 1 holds the bad id, which is row 5 of the global batch.
    The error as pm.step raises it; then as train.py says it (its `main`'s decorator): the exit
    status and what this rank wrote to stderr; last, what build_mesh's excepthook would print of it
    (printed_once.py) in a user's own script."""
    layout = mesh3d.build_mesh(pp=1, dp=2, tp=1)
    pm = mesh3d.parallelize(meta_model(False, n_layers=2), layout, loss_fn=loss_fn, microbatches=1)
    inputs, targets = batches(4)[0]
    if layout.dp_rank == 1:
        inputs = inputs.clone()
        inputs[1, 3] = VOCAB
    error = raised_by(functools.partial(pm.step, inputs, targets))
    hooked = io.StringIO()
    with contextlib.redirect_stderr(hooked):
        _hook(lambda kind, error, traceback: print(f"traceback of {kind.__name__}", file=sys.stderr), layout.rank)(
            type(error), error, None
        )
    raised = f"{type(error).__name__}: {error}"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            agreed_errors_said_once(pm.step)(inputs, targets)
        except SystemExit as done:
            return raised, done.code, stderr.getvalue(), hooked.getvalue()
    return raised, 0, stderr.getvalue(), hooked.getvalue()


def test_a_bad_id_is_placed_in_the_global_batch_and_said_once():
    said = f"input token id {VOCAB} at position (5, 3) is outside"
    rank_0, rank_1 = run_on_ranks(_bad_id_on_dp_rank_1, 2, timeout=120)
    (raised_0, code_0, stderr_0, hooked_0), (raised_1, code_1, stderr_1, hooked_1) = rank_0, rank_1
    assert said in raised_0 and said in raised_1, (raised_0, raised_1)
    assert (code_0, code_1) == (2, 2)
    # rank 0 alone, one line in train.py's form; rank 1, which found it, says nothing of its own
    assert stderr_0.startswith(f"error: pm.step: bad batch: {said}") and stderr_0.count("\n") == 1, stderr_0
    assert stderr_1 == "", stderr_1
    # a user's script (build_mesh's hook): rank 0 prints its traceback, rank 1 owns its finding
    assert hooked_0 == "traceback of ValueError\n", hooked_0  # Python's own printer, stood in for here
    assert hooked_1 == "[rank 1] stopped on the ValueError it found, which rank 0 printed\n", hooked_1
