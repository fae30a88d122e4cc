"""The global token mean with masked targets equals one process, at every 8-rank layout.

A third of the target positions are -100, one sample counts a single position and one counts
none, so microbatches and dp shares count very different numbers of tokens. The reference is one
process computing F.cross_entropy(logits, targets, ignore_index=-100) on the whole global batch
and calling backward(); mesh3d must give the same loss and every gradient after one step (fp32,
rel <= 1e-5), with its default loss and with a user's (loss_sum, count) loss. A mean loss (the
old contract, mean of microbatch means) is shown to differ on the same batch, so the comparison
can fail. Bad loss results fail on every rank before any message.

13 cases over the 10 layouts of 8 ranks (FSDP at each, DDP at (1,8,1), (2,2,2) and (1,2,4), the two losses
alternating over them, GPipe, 1F1B and interleaved, tied and untied; one block per stage); the mean
loss at (2,4,1) is more than 5 % off. On 4 ranks at (2,1,2): a 3-tuple, a per-token loss, a float
count (found on meta) and a float count from a loss that cannot run on meta (found on the last
stage) each raise the same ValueError on every rank; a count that depends on the output is an error
at the next step or flush; a batch with nothing counted gives loss 0 and zero gradients; evaluate gives the
token mean.
"""

import torch
import torch.nn.functional as F
from multiprocess import run_on_ranks
from pipeline_cases import SEQ_LEN, TOLERANCE, VOCAB, fewest_layers, meta_model, relative, tp_args
from torch.distributed.tensor import DTensor

import mesh3d
from examples.llama.model import Transformer
from examples.llama.model import loss_fn as mean_loss

GLOBAL_BATCH = 16
LAYOUTS_8 = [
    (8, 1, 1),
    (1, 8, 1),
    (1, 1, 8),
    (4, 2, 1),
    (4, 1, 2),
    (2, 4, 1),
    (1, 4, 2),
    (2, 1, 4),
    (1, 2, 4),
    (2, 2, 2),
]
SCHEDULES = ["interleaved_1f1b", "1f1b", "gpipe"]
# DDP alone, under tp, and under all three axes: each loss once (FSDP covers every layout)
DDP_LAYOUTS = [(1, 8, 1), (1, 2, 4), (2, 2, 2)]


def masked_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator)
    targets = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=generator)
    targets[torch.rand(targets.shape, generator=generator) < 1 / 3] = -100
    targets[3] = -100
    targets[3, 5] = 7  # one counted position
    targets[10] = -100  # none
    return inputs, targets


def pair_loss(output, target):
    """A user's (loss_sum, count) loss, without a count() method: mesh3d probes it for the count."""
    loss_sum = F.cross_entropy(output.flatten(0, -2).float(), target.flatten(), ignore_index=-100, reduction="sum")
    return loss_sum, (target != -100).sum()


def reference(tied: bool, batch, layers: int = 8) -> tuple[float, dict[str, torch.Tensor]]:
    model = Transformer(tp_args(tied, layers))
    model.init_weights()
    inputs, targets = batch
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    grads = {name: p.grad.numpy().copy() for name, p in model.named_parameters(remove_duplicate=False)}
    return loss.item(), grads


def full_grads(pm) -> dict[str, torch.Tensor]:
    """Every local parameter's whole gradient (DTensor shards gathered; every rank of a pp rank
    holds the same names in the same order, so the gathers pair up)."""
    return {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for name, p in pm.named_parameters()}


def cases() -> list[tuple]:
    """(layout, tied, loss, parallelize options): every layout with FSDP, DDP at (1,8,1), (2,2,2)
    and (1,2,4), the two losses alternating over them (each at pp, dp and tp layouts), the three
    schedules spread."""
    chosen = []
    for i, layout in enumerate(LAYOUTS_8):
        loss, other = ("default", "pair") if i % 2 == 0 else ("pair", "default")
        chosen.append((layout, i % 2 == 0, loss, {"schedule": SCHEDULES[i % 3]}))
        if layout in DDP_LAYOUTS:
            chosen.append((layout, i % 2 == 1, other, {"schedule": SCHEDULES[(i + 2) % 3], "dp_mode": "ddp"}))
    return chosen


def _layers(pp: int, options: dict) -> int:
    return fewest_layers(pp, options)  # one block per stage: the loss's semantics do not need depth


def _one_step(layout, tied, loss, options, batch):
    pm = mesh3d.parallelize(
        meta_model(tied, args=tp_args(tied, _layers(layout.pp, options))),
        layout,
        loss_fn={"default": None, "pair": pair_loss, "mean": mean_loss}[loss],
        **options,
    )
    inputs, targets = batch
    share = slice(layout.dp_rank * GLOBAL_BATCH // layout.dp, (layout.dp_rank + 1) * GLOBAL_BATCH // layout.dp)
    value = pm.step(inputs[share], targets[share]).item()
    return value, full_grads(pm)


def _run_cases(batch, references):
    layouts, outcome = {}, {}
    for layout_sizes, tied, loss, options in cases():
        if layout_sizes not in layouts:
            layouts[layout_sizes] = mesh3d.build_mesh(*layout_sizes)
        value, grads = _one_step(layouts[layout_sizes], tied, loss, options, batch)
        ref_loss, ref_grads = references[(tied, _layers(layout_sizes[0], options))]
        errors = {"loss": relative(value, ref_loss)}
        errors |= {name: relative(g, torch.from_numpy(ref_grads[name])) for name, g in grads.items()}
        where = max(errors, key=errors.get)
        outcome[f"{layout_sizes} tied={tied} loss={loss} {options}"] = (errors[where], where)
    # The old contract on the same batch: the mean of microbatch means, which masks make wrong.
    # Per-token losses of a fresh model are all near ln(vocab), so the loss moves little; the
    # gradients, which weigh each token's direction, move a lot.
    mean_of_means = {"schedule": "1f1b", "microbatches": 2}
    _, grads = _one_step(layouts[(2, 4, 1)], False, "mean", mean_of_means, batch)
    want = references[(False, _layers(2, mean_of_means))][1]
    errors = {name: relative(g, torch.from_numpy(want[name])) for name, g in grads.items()}
    outcome["mean of means"] = (max(errors.values()), "gradients")
    return outcome


def test_masked_targets_give_the_global_token_mean_at_every_8_rank_layout():
    batch = masked_batch()
    models = {(tied, _layers(layout[0], options)) for layout, tied, _, options in cases()}
    models.add((False, _layers(2, {"schedule": "1f1b"})))  # the mean of means
    references = {(tied, layers): reference(tied, batch, layers) for tied, layers in models}
    per_rank = run_on_ranks(_run_cases, 8, batch, references, timeout=600)
    failures = []
    for rank, outcome in enumerate(per_rank):
        mean_of_means, _ = outcome.pop("mean of means")
        assert mean_of_means > 0.05, f"rank {rank}: the mean of microbatch means should differ on this batch"
        assert len(outcome) == len(cases())
        failures += [
            f"rank {rank} {case}: relative error {error:.2e} at {where}"
            for case, (error, where) in outcome.items()
            if error > TOLERANCE
        ]
    assert not failures, "\n".join(failures)


def _three_item_loss(output, target):
    loss_sum, count = pair_loss(output, target)
    return loss_sum, count, count


def _per_token_loss(output, target):
    return F.cross_entropy(output.flatten(0, -2).float(), target.flatten(), reduction="none")


def _float_count_loss(output, target):
    loss_sum, count = pair_loss(output, target)
    return loss_sum, count.float()


def _float_count_loss_not_on_meta(output, target):
    """Cannot run on meta tensors (.item()), so it is only found out on the last stage's real data."""
    loss_sum, count = pair_loss(output, target)
    return loss_sum, float(count.item())


def _count_from_output_loss(output, target):
    loss_sum, _ = pair_loss(output, target)
    return loss_sum, (output.argmax(-1) != 0).sum()


BAD_LOSSES = {
    _three_item_loss: "tuple of 3 items",
    _per_token_loss: "0-dim",
    _float_count_loss: "count a torch.float32 tensor",
    _float_count_loss_not_on_meta: "count a float",
}


def _errors_and_edge_cases(batch, references):
    layout = mesh3d.build_mesh(pp=2, dp=1, tp=2)
    inputs, targets = batch
    seen = {}
    for bad, expected in BAD_LOSSES.items():
        pm = mesh3d.parallelize(meta_model(True, args=tp_args(True)), layout, loss_fn=bad)
        with_error = None
        try:
            pm.step(inputs, targets)
        except ValueError as error:
            with_error = str(error)
        seen[bad.__name__] = (with_error is not None and expected in with_error, with_error)
    # Judged one call late (step/late_verdicts.py): by the next step, or by the flush that ends a run.
    for late in ("step", "flush"):
        pm = mesh3d.parallelize(meta_model(True, args=tp_args(True)), layout, loss_fn=_count_from_output_loss)
        pm.step(inputs, targets)  # its update is made, its check is on its way to the host
        case = f"count from output, raised by the {late}"
        try:
            pm.step(inputs, targets) if late == "step" else pm.flush()
            seen[case] = (False, None)
        except ValueError as error:
            seen[case] = ("must depend on the target only" in str(error), str(error))

    # Nothing counted anywhere: loss 0 and zero gradients, never NaN.
    pm = mesh3d.parallelize(meta_model(True, args=tp_args(True)), layout)
    nothing = torch.full_like(targets, -100)
    value = pm.step(inputs, nothing).item()
    grads = full_grads(pm)
    seen["nothing counted"] = (value == 0.0 and all(bool((g == 0).all()) for g in grads.values()), value)
    pm.zero_grad()
    # Still in step after every refusal; evaluate gives the global token mean too.
    got = pm.evaluate(inputs, targets).item()
    seen["evaluate"] = (relative(got, references[True][0]) <= TOLERANCE, got)
    return seen


def test_bad_loss_results_fail_on_every_rank_and_empty_batches_give_zero():
    batch = masked_batch(1)
    references = {True: reference(True, batch)}
    for rank, seen in enumerate(run_on_ranks(_errors_and_edge_cases, 4, batch, references, timeout=120)):
        for case, (ok, detail) in seen.items():
            assert ok, f"rank {rank} {case}: {detail}"
