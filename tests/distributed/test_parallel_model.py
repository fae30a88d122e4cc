"""ParallelModel around the schedule: names, whole-model state, evaluation, ties, a CPU-built model.

On 1 and 2 ranks: the names and whole-model state of a CPU-built model, evaluation, a tie on one
rank shared rather than sent, the defaults and the bytes on the wire, gradient accumulation across
steps, frozen parameters, and errors on every rank.
"""

import torch
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE, batches, meta_model, pipeline_run, reference_run, relative, tiny_args, worst_error
from rank_errors import assert_raised_on_every_rank, messages_of
from torch import nn

import mesh3d
from examples.llama.model import Transformer, loss_fn
from mesh3d.pipeline.schedule.communicators import direction
from mesh3d.pipeline.schedule.ir import Kind


def _state_and_names(tied):
    """pp=2 on a model built on CPU: its values are kept; names and state are the unsplit model's."""
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    model = Transformer(tiny_args(tied))
    model.init_weights(5)
    pm = mesh3d.parallelize(model, layout, schedule="1f1b", microbatches=2, loss_fn=loss_fn)
    full = pm.full_state_dict()
    same = sorted(full) == sorted(model.state_dict()) and all(
        torch.equal(full[k], v) for k, v in model.state_dict().items()
    )
    names = [n for n, _ in pm.named_parameters()]
    on_cpu = all(t.device.type == "cpu" for t in full.values())

    inputs, targets = batches(4)[0]
    loss = pm.evaluate(inputs, targets).item()
    with torch.no_grad():
        want = loss_fn(model(inputs), targets).item()
    no_grads = all(p.grad is None for p in pm.parameters())

    # A state whose two tied names disagree is refused; a proper one loads into both copies.
    other = Transformer(tiny_args(tied))
    other.init_weights(6)
    state = other.state_dict()
    refused = not tied
    if tied:
        disagreeing = dict(state, **{"output.weight": torch.zeros_like(state["output.weight"])})
        try:
            pm.load_full_state_dict(disagreeing)
        except ValueError as error:
            refused = "one tied weight" in str(error)
    pm.load_full_state_dict(state)
    reloaded = pm.full_state_dict()
    reloaded_ok = refused and all(torch.equal(reloaded[k], other.state_dict()[k]) for k in state)
    tie_synced = torch.equal(reloaded["output.weight"], reloaded["tok_embeddings.weight"]) if tied else True
    return same, on_cpu, names, relative(loss, want), no_grads, reloaded_ok, tie_synced


def test_state_names_and_evaluation_on_two_ranks():
    for tied in (False, True):
        per_rank = run_on_ranks(_state_and_names, 2, tied, timeout=60)
        every_name = {n for n, _ in Transformer(tiny_args(tied)).named_parameters(remove_duplicate=False)}
        names = [set(r[2]) for r in per_rank]
        assert names[0] | names[1] == every_name, tied
        assert not names[0] & names[1]
        if tied:
            assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]
        for rank, (same, on_cpu, _, eval_error, no_grads, reloaded_ok, tie_synced) in enumerate(per_rank):
            assert same and on_cpu, (rank, tied)
            assert eval_error <= TOLERANCE and no_grads, (rank, tied, eval_error)
            assert reloaded_ok and tie_synced, (rank, tied)


def _one_rank_interleaved(reference):
    """pp=1 with two stages on the one rank: ties are shared in memory, nothing is sent."""
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1)
    result = pipeline_run(layout, True, batches(6), schedule="interleaved_1f1b", microbatches=3, virtual_stages=2)
    pm = result[-1]
    tie = pm._tied.ties[0]
    shared = pm.stages[0].tok_embeddings.weight is pm.stages[1].output.weight
    return worst_error(result, reference), tie.group is None, tie.ranks, shared, pm.counters.messages_sent


def test_tie_on_one_rank_is_shared_not_sent():
    reference = reference_run(True, batches(6))
    (error, where), no_group, ranks, shared, messages = run_on_ranks(_one_rank_interleaved, 1, reference, timeout=60)[0]
    assert error <= TOLERANCE, where
    assert no_group and ranks == [0] and shared and messages == 0


def _defaults_and_counters():
    pm = mesh3d.parallelize(meta_model(tied=False), pp=2)  # the mesh from keywords; interleaved, v=2, m=pp
    inputs, targets = batches(4)[0]
    pm.step(inputs, targets)
    c = pm.counters
    assert (pm.layout.pp, pm.layout.dp, pm.layout.tp) == (2, 1, 1)
    return (
        pm.schedule.name,
        pm.schedule.virtual_stages,
        pm.schedule.microbatches,
        c.bytes_sent,
        c.messages_sent,
        repr(pm),
    )


def test_defaults_and_bytes_on_the_wire():
    per_rank = run_on_ranks(_defaults_and_counters, 2, timeout=60)
    for name, v, m, bytes_sent, messages, text in per_rank:
        assert (name, v, m) == ("interleaved_1f1b", 2, 2)
        # 4 stages, 3 boundaries; each rank sends forward or backward across each: fp32 (2, 8, 32) per microbatch
        activation = 2 * 8 * 32 * 4
        assert messages * activation == bytes_sent
        assert "interleaved_1f1b" in text
    assert sum(r[4] for r in per_rank) == 2 * 3 * 2  # 3 boundaries x (activation + gradient) x 2 microbatches


class Toy(nn.Module):
    """No init_weights: parallelize falls back to reset_parameters."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(4)})

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return x


def _edge_cases(reference_grads):
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=1)
    out = {}
    data = batches(4)

    # Two steps without zero_grad accumulate like plain PyTorch, tied copies included.
    pm = mesh3d.parallelize(meta_model(tied=True), layout, schedule="1f1b", microbatches=2, loss_fn=loss_fn)
    groups_after_first = len(layout._subgroups) + len(layout._own_groups)
    for inputs, targets in data[:2]:
        pm.step(inputs, targets)
    out["accumulated"] = max(relative(p.grad, torch.from_numpy(reference_grads[n])) for n, p in pm.named_parameters())
    out["groups reused"] = len(layout._subgroups) + len(layout._own_groups) == groups_after_first
    # Each kind of traffic on a group of its own: activations, gradients, the tie (not the pp group).
    channels, pp_group = pm._runtime.peers.channels, layout.group("pp")
    sending = next(a for a in pm._runtime.train_actions if a.kind in (Kind.SEND_F, Kind.SEND_B))
    out["own communicators"] = (
        sorted(channels) == [("backward", 0, 1), ("forward", 0, 1)]
        and len({id(g) for g in (*channels.values(), pp_group, pm._tied.ties[0].group)}) == 4
        and pm._runtime.peers.group_of(sending) is channels[(direction(sending.kind), 0, 1)]
    )
    pm2 = mesh3d.parallelize(meta_model(tied=True), layout, schedule="gpipe", microbatches=2, loss_fn=loss_fn)
    out["groups reused"] &= (
        len(layout._subgroups) + len(layout._own_groups) == groups_after_first
        and pm2._tied.ties[0].group is pm._tied.ties[0].group
    )

    # evaluate leaves the training counters and the modules' modes alone.
    pm.train(False)
    peak = pm.peak_live_activations
    pm.evaluate(*data[0])
    out["evaluate keeps state"] = pm.peak_live_activations == peak > 0 and not any(
        s.training for s in pm.stages.values()
    )

    # A frozen first stage and a frozen tied weight: nothing to backpropagate there, no grads.
    model = meta_model(tied=True)
    for name, param in model.named_parameters():
        if name.startswith(("tok_embeddings", "layers.0.", "layers.1.", "layers.2.", "layers.3.")):
            param.requires_grad_(False)
    frozen = mesh3d.parallelize(model, layout, schedule="1f1b", microbatches=2, loss_fn=loss_fn)
    frozen.step(*data[0])
    out["frozen"] = [(n, p.grad is None) for n, p in frozen.named_parameters()]

    # Errors that only the last stage could see, and autocast, fail on every rank before any message,
    # and leave the accumulated gradients (tied ones included) as they were.
    grads_before = {n: p.grad.clone() for n, p in pm.named_parameters()}
    out["errors"] = messages_of(
        {
            "bad targets": lambda: pm.step(data[0][0], data[0][1][:, :3]),
            "autocast": lambda: _under_autocast(pm, *data[0]),
            "shared block": lambda: mesh3d.parallelize(_shared_block_model(), layout, schedule="gpipe", microbatches=2),
        }
    )
    out["grads kept"] = all(
        p.grad is not None and torch.equal(p.grad, grads_before[n]) for n, p in pm.named_parameters()
    )

    # Losses that cannot run on meta tensors are not rejected by the up-front check.
    weight = torch.rand(64)

    def weighted(output, target):
        return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), weight=weight)

    def masked(output, target):
        keep = target.flatten() != 0
        return torch.nn.functional.cross_entropy(output.flatten(0, 1)[keep], target.flatten()[keep])

    out["meta-hostile losses"] = []
    for loss in (weighted, masked):
        other = mesh3d.parallelize(meta_model(tied=False), layout, schedule="1f1b", microbatches=2, loss_fn=loss)
        out["meta-hostile losses"].append(torch.isfinite(other.step(*data[0])).item())

    # Freezing one rank's copy of a tied weight (by its local name) must not mismatch collectives.
    for name, param in pm.named_parameters():
        if name == "tok_embeddings.weight":
            param.requires_grad_(False)
    pm.zero_grad()
    out["one copy frozen"] = torch.isfinite(pm.step(*data[0])).item()

    # Without init_weights, each stage draws its own values (ranks start from the same RNG state).
    toy = mesh3d.parallelize(
        Toy().to("meta"), layout, schedule="gpipe", microbatches=2, loss_fn=torch.nn.functional.mse_loss
    )
    full = toy.full_state_dict()
    out["distinct init"] = not torch.equal(full["layers.0.weight"], full["layers.2.weight"])
    return out


def _under_autocast(pm, inputs, targets):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pm.step(inputs, targets)


def _shared_block_model():
    model = meta_model(tied=False)
    model.layers["7"] = model.layers["0"]
    return model


EDGE_ERRORS = {
    "bad targets": "targets of shape (4, 3) differ in batch or sequence size",
    "autocast": "torch.autocast, which mesh3d does not support yet",
    "shared block": "module 'layers.7' is also registered as 'layers.0'",
}


def test_edge_cases_on_two_ranks():
    reference = Transformer(tiny_args(True))
    reference.init_weights()
    for inputs, targets in batches(4)[:2]:
        loss_fn(reference(inputs), targets).backward()
    grads = {n: p.grad.numpy().copy() for n, p in reference.named_parameters(remove_duplicate=False)}
    per_rank = run_on_ranks(_edge_cases, 2, grads, timeout=90)
    for rank, out in enumerate(per_rank):
        assert out["accumulated"] <= TOLERANCE, (rank, out["accumulated"])
        assert out["groups reused"], rank
        assert out["own communicators"], rank
        assert out["evaluate keeps state"], rank
        for name, no_grad in out["frozen"]:
            frozen = name.startswith(("tok_embeddings", "output", "layers.0.", "layers.1.", "layers.2.", "layers.3."))
            assert no_grad == frozen, (rank, name)
        assert out["distinct init"], rank
        assert out["grads kept"], rank
        assert out["meta-hostile losses"] == [True, True], rank
        assert out["one copy frozen"], rank
    assert_raised_on_every_rank([out["errors"] for out in per_rank], EDGE_ERRORS)
