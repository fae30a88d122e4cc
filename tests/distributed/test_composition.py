"""How the tensor and data axes behave inside the pipeline, beyond parity (test_composition_parity.py).

- data-parallel gradients are reduced once per step per FSDP/DDP group, never per microbatch,
  counted at the collective itself;
- with sequence parallel each P2P message carries 1/tp of the stage-boundary activation;
- evaluate, full_state_dict and load_full_state_dict work on sharded (DTensor) parameters;
- bad tensor/data-parallel configurations raise the same clear error on every rank, without hanging;
- a step that fails midway leaves nothing behind in FSDP for the next step.

Also: large-step SGD (lr 0.5) with padded tied shards at (1,2,2), (1,4,1) FSDP and DDP, and
(2,2,1) matches one process: Adam at lr 1e-4 (the parity tests) normalizes small gradient errors
away, plain SGD does not. Ties held on one rank: a failed step keeps the tied weight's earlier
gradient, a stage failing before the other ever ran raises its own error (not one from the FSDP
reset), freezing one name freezes the weight, and a state dict whose tied names disagree is
refused.
"""

import torch
import torch.distributed as dist
from multiprocess import run_on_ranks
from pipeline_cases import SEQ_LEN, batches, meta_model, tp_args
from rank_errors import assert_raised_on_every_rank, message_of, messages_of
from torch.distributed.tensor.parallel import ColwiseParallel

import mesh3d
from examples.llama.config import ModelArgs
from examples.llama.model import Transformer, loss_fn
from mesh3d.pipeline.schedule.ir import Kind

GLOBAL_BATCH = 16


def _count_dp_reductions(layout, fn):
    """Run fn() and count the gradient reductions (reduce-scatter or all-reduce) issued on the dp group."""
    dp_ranks = layout.group_ranks("dp")
    counts = {"reduce_scatter": 0, "all_reduce": 0}
    originals = {"reduce_scatter": dist.reduce_scatter_single, "all_reduce": dist.all_reduce}

    def counting(kind):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            if group is not None and dist.get_process_group_ranks(group) == dp_ranks:
                counts[kind] += 1
            return originals[kind](*args, **kwargs)

        return call

    dist.reduce_scatter_single, dist.all_reduce = counting("reduce_scatter"), counting("all_reduce")
    try:
        fn()
    finally:
        dist.reduce_scatter_single, dist.all_reduce = originals["reduce_scatter"], originals["all_reduce"]
    return counts


def _sync_bytes_and_state():
    layout = mesh3d.build_mesh(pp=2, dp=2, tp=2)
    inputs, targets = batches(GLOBAL_BATCH)[0]
    share = slice(layout.dp_rank * GLOBAL_BATCH // 2, (layout.dp_rank + 1) * GLOBAL_BATCH // 2)
    inputs, targets = inputs[share], targets[share]
    m = 4
    results = {}
    for dp_mode in ("fsdp", "ddp"):
        pm = mesh3d.parallelize(
            meta_model(True, args=tp_args(True)), layout, loss_fn=loss_fn, microbatches=m, dp_mode=dp_mode
        )
        # Groups that own parameters directly: every block, and a stage root holding the embedding or the head.
        groups = sum(
            len(stage.layers) + int(index in (0, pm.schedule.n_stages - 1)) for index, stage in pm.stages.items()
        )
        evaluated = pm.evaluate(inputs, targets).item()
        counts = _count_dp_reductions(layout, lambda: pm.step(inputs, targets))
        synced_backwards = pm._grad_sync.synced_backwards
        counters = pm.counters
        sends = sum(1 for a in pm._runtime.train_actions if a.kind in (Kind.SEND_F, Kind.SEND_B))
        receives = sum(1 for a in pm._runtime.train_actions if a.kind in (Kind.RECV_F, Kind.RECV_B))
        # One microbatch's boundary activation is (batch/m, seq, dim) fp32; sequence parallel sends 1/tp of it.
        message_bytes = (len(inputs) // m) * SEQ_LEN * tp_args(True).dim * 4 // layout.tp
        # Evaluation between steps must not leave gathered parameters for the next step to reuse stale.
        optimizer = torch.optim.SGD(pm.parameters(), lr=0.5)
        optimizer.step()
        after_first_update = pm.evaluate(inputs, targets).item()
        optimizer.step()  # the same gradients again: the parameters move on
        optimizer.zero_grad()
        stepped = pm.step(inputs, targets).item()
        evaluated_again = pm.evaluate(inputs, targets).item()
        results[dp_mode] = {
            "fresh_after_evaluate": (after_first_update, stepped, evaluated_again),
            "reductions": counts["reduce_scatter" if dp_mode == "fsdp" else "all_reduce"],
            "groups": groups,
            "synced_backwards": synced_backwards,
            "local_stages": len(pm.stages),
            "bytes": (counters.bytes_sent, counters.bytes_received, counters.messages_sent),
            "expected_bytes": (sends * message_bytes, receives * message_bytes, sends),
            "evaluate_then_step": (evaluated, pm.counters.peak_live_activations > 0),
        }
    # Whole-model state through DTensor shards: read, change, load, read back; the tie follows the load.
    state = pm.full_state_dict()
    changed = {k: v + 1.0 for k, v in state.items()}
    changed["output.weight"] = changed["tok_embeddings.weight"]
    pm.load_full_state_dict(changed)
    back = pm.full_state_dict()
    results["state_roundtrip"] = max((back[k] - changed[k]).abs().max().item() for k in changed)
    results["tied_equal"] = torch.equal(back["output.weight"], back["tok_embeddings.weight"])
    return results


def test_dp_reduction_once_per_step_and_sequence_parallel_bytes():
    per_rank = run_on_ranks(_sync_bytes_and_state, 8, timeout=300)
    for rank, results in enumerate(per_rank):
        for dp_mode in ("fsdp", "ddp"):
            r = results[dp_mode]
            # Per microbatch would be m times as many (m = 4).
            assert r["reductions"] == r["groups"] > 0, (rank, dp_mode, r)
            assert r["synced_backwards"] == r["local_stages"], (rank, dp_mode, r)
            assert r["bytes"] == r["expected_bytes"], (rank, dp_mode, r)
            assert r["evaluate_then_step"][1]
            after_first_update, stepped, evaluated_again = r["fresh_after_evaluate"]
            assert stepped != after_first_update and abs(stepped - evaluated_again) <= 1e-6 * abs(stepped), (rank, r)
        assert results["state_roundtrip"] == 0.0, rank
        assert results["tied_equal"], rank


def _bad_configs():
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=4)
    layout_dp = mesh3d.build_mesh(pp=1, dp=2, tp=2)

    def model(**changes):
        base = dict(dim=64, n_layers=2, n_heads=16, n_kv_heads=8, vocab_size=64, multiple_of=16, max_seq_len=16)
        with torch.device("meta"):
            return Transformer(ModelArgs(**(base | changes)))

    cases = {
        "kv heads": lambda: mesh3d.parallelize(model(n_kv_heads=2), layout),
        "heads": lambda: mesh3d.parallelize(model(dim=48, n_heads=6, n_kv_heads=6), layout),
        "ffn width": lambda: mesh3d.parallelize(model(multiple_of=10), layout),
        "vocab": lambda: mesh3d.parallelize(model(vocab_size=66), layout),
        "pattern matches nothing": lambda: mesh3d.parallelize(
            model(), layout, tp_plan={"layers.*.attn.wq": ColwiseParallel()}
        ),
        "weight dim": lambda: _weight_dim_case(layout),
        "ddp with reshard": lambda: mesh3d.parallelize(model(), layout_dp, dp_mode="ddp", reshard_after_forward=True),
        "unknown dp mode": lambda: mesh3d.parallelize(model(), layout_dp, dp_mode="zero3"),
        "hsdp group not dividing dp": lambda: mesh3d.parallelize(model(), layout_dp, dp_mode="hsdp", dp_shard=3),
    }
    messages = messages_of(cases)
    models = {}
    for name, options, seq in (
        ("sequence not divisible", {}, 6),
        ("loss parallel without sharded output", {"loss_parallel": True}, 8),
    ):
        pm = models[name] = mesh3d.parallelize(model(), layout, loss_fn=loss_fn, **options)
        tokens = torch.zeros(2, seq, dtype=torch.long)
        messages[name] = message_of(lambda: pm.step(tokens, tokens))
    messages["aborted step leaves no trace"] = _aborted_step_leaves_no_trace(layout_dp)
    messages["tie edge cases"] = _tie_edge_cases(layout, mesh3d.build_mesh(pp=1, dp=4, tp=1))
    pm = models["sequence not divisible"]  # the failed step left it usable
    messages["still works"] = torch.isfinite(
        pm.evaluate(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    ).item()
    return messages


FAILING = {"calls": 0, "fail_at": None}


def _failing_loss(output, target):
    if output.is_meta:  # the engine's shape check before the schedule
        return loss_fn(output, target)
    FAILING["calls"] += 1
    if FAILING["calls"] == FAILING["fail_at"]:
        raise RuntimeError("loss failed on purpose")
    return loss_fn(output, target)


def _aborted_step_leaves_no_trace(layout) -> float:
    """A step that fails in its second microbatch (after the first backward accumulated unreduced
    FSDP gradients), then zero_grad and a clean step: gradients equal a fresh model's clean step."""
    inputs, targets = batches(GLOBAL_BATCH)[0]
    share = slice(layout.dp_rank * GLOBAL_BATCH // 2, (layout.dp_rank + 1) * GLOBAL_BATCH // 2)
    inputs, targets = inputs[share], targets[share]
    grads = []
    for fail in (True, False):
        pm = mesh3d.parallelize(
            meta_model(True, args=tp_args(True)), layout, loss_fn=_failing_loss, schedule="1f1b", microbatches=2
        )
        if fail:
            FAILING.update(calls=0, fail_at=2)
            try:
                pm.step(inputs, targets)
            except RuntimeError:
                pass
            pm.zero_grad()
        FAILING.update(fail_at=None)
        pm.step(inputs, targets)
        grads.append({n: p.grad.full_tensor() for n, p in pm.named_parameters()})
    return max(((grads[0][n] - grads[1][n]).norm() / grads[1][n].norm()).item() for n in grads[1])


def _tie_edge_cases(layout_tp, layout_dp) -> dict:
    """Ties held on one rank (pp = 1, two stages per rank): under tp alone one shared Parameter,
    under dp one copy per stage."""
    out = {}
    inputs, targets = batches(GLOBAL_BATCH)[0]
    share = slice(layout_dp.dp_rank * 4, layout_dp.dp_rank * 4 + 4)

    # A failed step keeps the tied weight's earlier gradient, like every other parameter's.
    pm = mesh3d.parallelize(meta_model(True, args=tp_args(True)), layout_tp, loss_fn=_failing_loss)
    FAILING.update(fail_at=None)
    pm.step(inputs, targets)
    FAILING.update(calls=0, fail_at=1)
    try:
        pm.step(inputs, targets)
    except RuntimeError:
        pass
    FAILING.update(fail_at=None)
    out["tied grad kept"] = dict(pm.named_parameters())["tok_embeddings.weight"].grad is not None

    # A stage that fails before the other stage ever ran: the user sees the real error.
    pm = mesh3d.parallelize(meta_model(True, args=tp_args(True)), layout_dp, loss_fn=loss_fn)
    try:
        pm.step(torch.full((4, SEQ_LEN), 10_000), targets[share])
        out["first failure"] = None
    except Exception as error:
        out["first failure"] = type(error).__name__
    pm.zero_grad()
    out["works after"] = torch.isfinite(pm.step(inputs[share], targets[share])).item()

    # Freezing one name of a tied weight freezes the weight, as in the unsplit model.
    pm = mesh3d.parallelize(meta_model(True, args=tp_args(True)), layout_dp, loss_fn=loss_fn)
    dict(pm.named_parameters())["tok_embeddings.weight"].requires_grad_(False)
    before = pm.full_state_dict()["tok_embeddings.weight"]
    _sgd_run(pm, lambda x, y: pm.step(x[share], y[share]), batches(GLOBAL_BATCH)[:2])
    after = pm.full_state_dict()
    out["frozen tie unchanged"] = torch.equal(after["tok_embeddings.weight"], before) and torch.equal(
        after["output.weight"], before
    )

    # A state dict whose tied names disagree is refused (on every rank, before any collective).
    state = dict(after)
    state["output.weight"] = state["output.weight"] + 1
    out["disagreeing tie"] = message_of(lambda: pm.load_full_state_dict(state))
    return out


def _weight_dim_case(layout):
    """A plan that shards a 6-wide Linear over tp=4 (no model-declared size catches it)."""
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(8, 6)})
    return mesh3d.parallelize(model, layout, tp_plan={"layers.0": ColwiseParallel()})


EXPECTED = {
    "kv heads": "tp=4 does not divide n_kv_heads=2 of Transformer; choose tp among [1, 2]",
    "heads": "tp=4 does not divide n_heads=6 of Transformer",
    "ffn width": "tp=4 does not divide ffn_hidden_dim=170 of Transformer",
    "vocab": "tp=4 does not divide vocab_size=66 of Transformer",
    "pattern matches nothing": "tp_plan: patterns ['layers.*.attn.wq'] match no module of Transformer",
    "weight dim": "tp=4 does not divide dim 0 (size 6) of 'layers.0.weight', which ColwiseParallel shards",
    "ddp with reshard": "reshard_after_forward=True was given with dp_mode='ddp'",
    "unknown dp mode": "dp_mode='zero3'; choose one of ['fsdp', 'hsdp', 'ddp']",
    "hsdp group not dividing dp": "dividing dp=2; got dp_shard=3. Choose one of [1, 2]",
    "sequence not divisible": "sequence length 6 is not divisible by tp=4",
    "loss parallel without sharded output": "loss_parallel=True needs the model output to stay a vocab-sharded DTensor",
}


def test_tensor_and_data_errors_on_every_rank_without_hanging():
    per_rank = run_on_ranks(_bad_configs, 4, timeout=120)
    for rank, messages in enumerate(per_rank):
        assert messages.pop("still works") is True
        assert messages.pop("aborted step leaves no trace") < 1e-6, rank
        ties = messages.pop("tie edge cases")
        assert ties["tied grad kept"] and ties["works after"] and ties["frozen tie unchanged"], (rank, ties)
        # Out-of-vocabulary ids are now refused by the batch check on every rank before any message.
        assert ties["first failure"] == "ValueError", (rank, ties)
        assert "are one tied weight in the model" in (ties["disagreeing tie"] or ""), (rank, ties)
    assert_raised_on_every_rank(per_rank, EXPECTED)


SGD_LR = 0.5  # large, plain SGD: a gradient or a stale shard shows in the parameters (Adam would normalize it away)
SGD_CASES = [((1, 2, 2), "fsdp"), ((1, 4, 1), "fsdp"), ((1, 4, 1), "ddp"), ((2, 2, 1), "fsdp")]
ODD_VOCAB = 66  # 66 rows (33 per tp rank) do not shard evenly over dp = 2 or 4: FSDP pads the tied weight


def _sgd_run(model, step, data):
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    for inputs, targets in data:
        step(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()


def _sgd_reference():
    model = Transformer(tp_args(True).with_(vocab_size=ODD_VOCAB))
    model.init_weights()
    _sgd_run(model, lambda x, y: loss_fn(model(x), y).backward(), batches(GLOBAL_BATCH))
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _sgd_cases(reference):
    errors = {}
    for (pp, dp, tp), dp_mode in SGD_CASES:
        layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
        pm = mesh3d.parallelize(
            meta_model(True, args=tp_args(True).with_(vocab_size=ODD_VOCAB)), layout, loss_fn=loss_fn, dp_mode=dp_mode
        )
        share = slice(layout.dp_rank * GLOBAL_BATCH // dp, (layout.dp_rank + 1) * GLOBAL_BATCH // dp)
        _sgd_run(pm, lambda x, y: pm.step(x[share], y[share]), batches(GLOBAL_BATCH))
        state = pm.full_state_dict()
        errors[((pp, dp, tp), dp_mode)] = max(
            ((state[k] - torch.from_numpy(v)).norm() / torch.from_numpy(v).norm()).item() for k, v in reference.items()
        )
    return errors


def test_tied_weight_with_padded_fsdp_shards_trains_like_one_process():
    """Both tie ends on one rank (pp = 1, two stages per rank) or on two; the tied weight's rows do not
    divide by dp, so FSDP pads its shards. Large-step SGD makes any stale copy visible."""
    per_rank = run_on_ranks(_sgd_cases, 4, _sgd_reference(), timeout=180)
    for rank, errors in enumerate(per_rank):
        for case, error in errors.items():
            assert error <= 1e-5, (rank, case, error)
