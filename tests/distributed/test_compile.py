"""compile=True (torch.compile per block, inductor) with activation checkpointing "always", tied
weights, tensor parallelism and FSDP: the first losses equal eager's (fp32, rel <= 1e-5), and
parameter names stay the unsplit model's. At (2,1,1) also the zero-bubble schedule ZB-H1, with
the quick aot_eager backend; and "selective" checkpointing around compiled blocks (aot_eager)
under ZB-H1 against eager "always", and at (1,2,2) with DDP and bf16 against eager "never".
(Compiled blocks under "except_last", with DDP: test_never_drain.py's compositions.)

Compiling costs tens of seconds per rank on a CPU, so the models are tiny (2 blocks) and the
cases few: (2,1,1) for the pipeline, (1,2,2) for tensor and data parallelism (4 ranks compiling
where (2,2,2) had 8, each the same one block graph; compiled blocks under pp x tp:
test_expert_parallel.py, under pp x cp: test_context_parallel.py).
"""

import pytest
from multiprocess import run_on_ranks
from pipeline_cases import TOLERANCE, batches, meta_model, relative, tp_args

import mesh3d

GLOBAL_BATCH = 8


def _losses(layout, compile, steps=2, **options):
    import torch
    from torch._dynamo.utils import counters

    counters.clear()
    if compile:
        torch._dynamo.reset()  # build this run's graphs: a run with an earlier run's backend would reuse its graphs
    options.setdefault("activation_checkpoint", "always")
    pm = mesh3d.parallelize(meta_model(True, args=tp_args(True, n_layers=2)), layout, compile=compile, **options)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    losses = []
    for inputs, targets in batches(GLOBAL_BATCH)[:steps]:
        share = slice(layout.dp_rank * GLOBAL_BATCH // layout.dp, (layout.dp_rank + 1) * GLOBAL_BATCH // layout.dp)
        losses.append(pm.step(inputs[share], targets[share]).item())
        pm.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
    graphs = counters["stats"]["unique_graphs"]  # what torch.compile built (0 when eager)
    names = sorted(name for name, _ in pm.named_parameters())
    return losses, names, pm.counters.recomputed_forwards, graphs, options["activation_checkpoint"]


def _eager_and_compiled(sizes):
    import torch

    layout = mesh3d.build_mesh(*sizes)
    pairs = {"inductor": (_losses(layout, False), _losses(layout, True))}
    if sizes == (2, 1, 1):
        # A split-backward schedule (I, then W over the kept graph), which torch refuses with compiled blocks.
        zb = {"schedule": "zero_bubble", "microbatches": 4}
        eager_zb = _losses(layout, False, **zb)
        pairs["aot_eager zero_bubble"] = (eager_zb, _losses(layout, "aot_eager", **zb))
        # Selective checkpointing around compiled blocks: its cache is filled at F and read at I.
        pairs["aot_eager zero_bubble selective"] = (
            eager_zb,
            _losses(layout, "aot_eager", activation_checkpoint="selective", **zb),
        )
    if sizes == (1, 2, 2):
        # DDP and bf16 too, with the quick backend (same kernels as eager, so equal losses).
        ddp_bf16 = {"dp_mode": "ddp", "param_dtype": torch.bfloat16}
        pairs["aot_eager ddp bf16 selective"] = (
            _losses(layout, False, activation_checkpoint="never", **ddp_bf16),
            _losses(layout, "aot_eager", activation_checkpoint="selective", **ddp_bf16),
        )
    return pairs


@pytest.mark.parametrize("sizes", [(2, 1, 1), (1, 2, 2)], ids=str)
def test_compiled_blocks_equal_eager(sizes):
    world = sizes[0] * sizes[1] * sizes[2]
    for rank, pairs in enumerate(run_on_ranks(_eager_and_compiled, world, sizes, timeout=600)):
        for case, (eager, compiled) in pairs.items():
            (
                (eager_losses, eager_names, eager_recomputed, eager_graphs, eager_ac),
                (losses, names, recomputed, graphs, _),
            ) = eager, compiled
            where = f"rank {rank} {case}"
            assert eager_graphs == 0 and graphs >= 1, f"{where}: {graphs} graphs compiled (eager: {eager_graphs})"
            errors = [relative(a, b) for a, b in zip(losses, eager_losses)]
            assert max(errors) <= TOLERANCE, f"{where}: compiled {losses} vs eager {eager_losses}"
            assert names == eager_names, f"{where}: parameter names changed: {set(names) ^ set(eager_names)}"
            assert recomputed > 0, f"{where}: activation checkpointing did not recompute"
            assert eager_recomputed == (0 if eager_ac == "never" else recomputed), (
                f"{where}: {eager_recomputed} eager recomputes"
            )
