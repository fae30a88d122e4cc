"""Expert parallelism (expert_parallel/, issue 45): each block's experts split over ep ranks, the
tokens sent to them all-to-all, exact against transformers in one process.

Qwen3-MoE, Mixtral and DeepSeek-V3 (tiny: 8 routed experts, top-2; DeepSeek-V3 with its shared
expert and a dense first block), `mesh3d.build_mesh(..., ep=...)` composed with pp (ZBV's split
backward, 1F1B, interleaved), dp (FSDP and DDP), tp (ep within a tp group, and ep = dp x tp),
compile, and cp (with activation checkpointing: the recompute dispatches again): two SGD steps equal
transformers' own model in one process (every loss, every parameter, fp32, rel 1e-5). Each rank
holds only its own experts' rows, and its experts see only the tokens routed to them: every
routed (token, expert) pair of the step reaches exactly one rank. `pm.expert_load()` gives each
step's per-expert token counts of every block, summed over the ranks, equal to the one process's;
DeepSeek-V3's router biases move by them after each step (`mesh3d.train.update_expert_bias`, its
auxiliary-loss-free balancing) as they move in the one process.
"""

from __future__ import annotations

import contextlib
import functools

import hf_cases
import numpy as np
import pytest
import torch
from multiprocess import run_on_ranks

transformers = pytest.importorskip("transformers")

EIGHT_EXPERTS = {
    "qwen3_moe": dict(num_experts=8),
    "mixtral": dict(num_local_experts=8),
    "deepseek_v3": dict(
        first_k_dense_replace=1,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=16,
    ),
}
BATCH = 8
BIAS_RATE = 0.01  # DeepSeek-V3's router bias step (its paper: 0.001), larger so two steps move the routing
# (arch, (pp, dp, cp, tp), ep, parallelize's keywords)
CASES = [
    ("qwen3_moe", (2, 2, 1, 1), 2, dict(schedule="zbv", microbatches=2)),
    ("qwen3_moe", (1, 2, 1, 2), 4, dict(schedule="gpipe", microbatches=2)),
    ("mixtral", (2, 1, 1, 2), 2, dict(schedule="1f1b", microbatches=2, compile="aot_eager")),
    ("mixtral", (1, 4, 1, 1), 2, dict(schedule="gpipe", microbatches=2, dp_mode="ddp")),  # 2 replicas of each expert
    ("qwen3_moe", (1, 4, 1, 1), 2, dict(schedule="gpipe", microbatches=2)),  # FSDP over 2 holders of each expert
    ("deepseek_v3", (2, 2, 1, 1), 2, dict(schedule="interleaved_1f1b", microbatches=2)),
    ("qwen3_moe", (1, 2, 2, 1), 4, dict(schedule="gpipe", microbatches=2, activation_checkpoint="always")),
]


def _model(arch: str):
    return hf_cases.hf_model(arch, **EIGHT_EXPERTS[arch])


@contextlib.contextmanager
def _counting_rows(routed: list[int]):
    """Count the rows each call of an experts module's own forward gets, behind the dispatch."""
    from mesh3d.expert_parallel import experts_style

    dispatch = experts_style.dispatch_to_experts

    def counting(hidden, top_k_index, top_k_weights, experts_forward, *args, **kwargs):
        def counted(rows, local_ids, weights):
            routed.append(int(rows.shape[0]))
            return experts_forward(rows, local_ids, weights)

        return dispatch(hidden, top_k_index, top_k_weights, counted, *args, **kwargs)

    experts_style.dispatch_to_experts = counting
    try:
        yield
    finally:
        experts_style.dispatch_to_experts = dispatch


def _on_rank() -> list:
    import mesh3d
    from mesh3d.expert_parallel.experts_style import is_split_experts

    results = []
    for arch, (pp, dp, cp, tp), ep, kwargs in CASES:
        layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)
        pm = mesh3d.parallelize(_model(arch), layout, **kwargs)
        experts = [module for stage in pm.stages.values() for module in stage.modules() if is_split_experts(module)]
        # what this rank holds of each experts module: expert rows per weight, and the experts it runs
        held = {(m.num_experts, p.to_local().shape[0]) for m in experts for p in m.parameters()}
        routed = []  # the rows this rank's experts were handed, after the dispatch
        optimizer = torch.optim.SGD(pm.parameters(), lr=hf_cases.LR)
        losses, loads = [], []
        with _counting_rows(routed):
            for batch in hf_cases.masked_batches(BATCH):
                losses += hf_cases.optimizer_steps(pm, layout, optimizer, [batch])
                step_loads = pm.expert_load()
                loads.append({name: load.tolist() for name, load in step_loads.items()})
                mesh3d.train.update_expert_bias(pm, step_loads, BIAS_RATE)  # DeepSeek-V3's routers only
        outcome = (losses, pm.full_state_dict())
        results.append((outcome, layout.ep, held, sum(routed), loads))
    return results


def _count(count: torch.Tensor, module, args) -> None:
    count.add_(args[1].flatten().bincount(minlength=8))


def _reference(arch: str):
    """transformers in one process: the losses, state and each step's per-expert loads, the router
    biases (DeepSeek-V3) moved after each step as mesh3d.train.update_expert_bias moves them."""
    model = _model(arch)
    optimizer = torch.optim.SGD(model.parameters(), lr=hf_cases.LR)
    experts = {name: module for name, module in model.named_modules() if name.endswith("mlp.experts")}
    counts = {name: torch.zeros(8, dtype=torch.long) for name in experts}
    for name, module in experts.items():
        module.register_forward_pre_hook(functools.partial(_count, counts[name]))
    losses, loads = [], []
    for inputs, targets in hf_cases.masked_batches(BATCH):
        for count in counts.values():
            count.zero_()
        logits = model(inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        loads.append({name: count.tolist() for name, count in counts.items()})
        with torch.no_grad():
            for name, module in model.named_modules():
                if hasattr(module, "e_score_correction_bias"):
                    load = counts[name.rpartition(".")[0] + ".experts"].float()
                    module.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load)
    return (losses, {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}), loads


def test_expert_parallel_equals_transformers_in_one_process():
    results = run_on_ranks(_on_rank, 4, timeout=600)
    for index, (arch, sizes, ep, kwargs) in enumerate(CASES):
        reference, ref_loads = _reference(arch)
        outcome, got_ep, _, _, loads = results[0][index]
        assert got_ep == ep
        error, where = hf_cases.worst_error(outcome, reference)
        assert error <= hf_cases.TOLERANCE, (arch, sizes, ep, kwargs, where, error)
        # each step's routed-token counts per expert, summed over the ranks, on every rank
        assert all(rank_result[index][4] == ref_loads for rank_result in results), (loads, ref_loads)
        # every rank runs its own E/ep experts, holding at most their rows (FSDP shards them further)
        for rank_result in results:
            assert {local for local, _ in rank_result[index][2]} == {8 // ep}, rank_result[index][2]
            assert all(rows <= 8 // ep for _, rows in rank_result[index][2])
        # every routed (token, expert) pair of every forward reached exactly one rank's experts (the
        # recompute of activation checkpointing is a second forward)
        model = _model(arch)
        moe_layers = len(ref_loads[0])
        forwards = 2 if kwargs.get("activation_checkpoint") == "always" else 1
        pairs = forwards * hf_cases.STEPS * BATCH * hf_cases.SEQ_LEN * model.config.num_experts_per_tok * moe_layers
        assert sum(rank_result[index][3] for rank_result in results) == pairs


MOMENTUM = 0.9
# (pp, dp, ep, schedule) of each leg: steps 1-2 saved at ep 2 (two ranks hold each expert, FSDP-sharded),
# step 3 resumed at ep 4 and saved, step 4 at ep 1
LEGS = [((1, 4, 2), "gpipe"), ((1, 4, 4), "gpipe"), ((2, 2, 1), "zbv")]


def _save_resume_export(root: str) -> dict:
    import mesh3d

    batches = hf_cases.masked_batches(BATCH, steps=4)
    steps_of_leg = [batches[:2], batches[2:3], batches[3:]]
    losses, loaded_steps = [], []
    for leg, ((pp, dp, ep), schedule) in enumerate(LEGS):
        layout = mesh3d.build_mesh(pp=pp, dp=dp, ep=ep)
        pm = mesh3d.parallelize(_model("qwen3_moe") if leg == 0 else _other_weights(), layout, schedule=schedule)
        optimizer = torch.optim.SGD(pm.parameters(), lr=hf_cases.LR, momentum=MOMENTUM)
        if leg:
            loaded_steps.append(mesh3d.checkpoint.load(f"{root}/ckpt{leg - 1}", pm, optimizer)["step"])
        losses += hf_cases.optimizer_steps(pm, layout, optimizer, steps_of_leg[leg])
        if leg < len(LEGS) - 1:
            mesh3d.checkpoint.save(f"{root}/ckpt{leg}", pm, optimizer, step=len(losses))
    full = pm.full_state_dict()
    mesh3d.checkpoint.export_safetensors(pm, f"{root}/export")
    return {"losses": losses, "steps": loaded_steps, "state": full if layout.rank == 0 else None}


def _other_weights():
    return hf_cases.hf_model("qwen3_moe", seed=1, **EIGHT_EXPERTS["qwen3_moe"])


def test_a_checkpoint_saved_at_one_ep_resumes_at_another_and_exports(tmp_path):
    """Saved at ep 2, resumed at ep 4 (its momentum resharded too) and saved again, resumed at ep 1:
    the four steps' losses and the parameters after them equal transformers' own model trained four
    steps in one process; the export loads in transformers with the same logits."""
    results = run_on_ranks(_save_resume_export, 4, str(tmp_path), timeout=450)
    data = hf_cases.masked_batches(BATCH, steps=4)
    ref_losses, ref_state = hf_cases.reference_run("qwen3_moe", data, momentum=MOMENTUM, **EIGHT_EXPERTS["qwen3_moe"])
    for result in results:
        assert result["steps"] == [2, 3]
        assert np.allclose(result["losses"], ref_losses, rtol=hf_cases.TOLERANCE, atol=0), (
            result["losses"],
            ref_losses,
        )
    error, where = hf_cases.worst_error((results[0]["losses"], results[0]["state"]), (ref_losses, ref_state))
    assert error <= hf_cases.TOLERANCE, (where, error)

    reference = _model("qwen3_moe")
    reference.load_state_dict({name: torch.from_numpy(value) for name, value in ref_state.items()})
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    tokens = hf_cases.masked_batches(BATCH, seed=7)[0][0]
    with torch.no_grad():
        want, got = reference.eval()(tokens).logits, exported.eval()(tokens).logits
    assert ((got - want).norm() / want.norm()).item() <= hf_cases.TOLERANCE


# (arch, (pp, dp, cp, tp), ep, parallelize's keywords): the dispatch's host reads counted
SYNC_CASES = [
    ("qwen3_moe", (2, 2, 1, 1), 2, dict(schedule="1f1b", microbatches=2)),
    ("deepseek_v3", (1, 2, 1, 2), 4, dict(schedule="gpipe", microbatches=2)),  # a dense first block, tp
]


def _dispatch_syncs_on_rank() -> list:
    """Per case: the syncs of a step with its loss unread, the syncs inside each dispatch, and the
    dispatches one process would make (this rank's experts modules x microbatches)."""
    from host_syncs import HostSyncCounter
    from transformers import masking_utils

    import mesh3d
    from mesh3d.expert_parallel import experts_style
    from mesh3d.expert_parallel.experts_style import is_split_experts

    results = []
    for arch, (pp, dp, cp, tp), ep, kwargs in SYNC_CASES:
        layout = mesh3d.build_mesh(pp=pp, dp=dp, cp=cp, tp=tp, ep=ep)
        pm = mesh3d.parallelize(_model(arch), layout, **kwargs)
        layers = sum(is_split_experts(module) for stage in pm.stages.values() for module in stage.modules())
        optimizer = torch.optim.SGD(pm.parameters(), lr=hf_cases.LR)
        first, second = hf_cases.masked_batches(BATCH)[:2]
        hf_cases.optimizer_steps(pm, layout, optimizer, [first])
        inputs, targets = second
        share = slice(layout.dp_rank * len(inputs) // dp, (layout.dp_rank + 1) * len(inputs) // dp)
        per_dispatch, in_masks = [], []
        dispatch, find_packed = experts_style.dispatch_to_experts, masking_utils.find_packed_sequence_indices

        def counted(into: list, fn):
            def call(*args, **kw):
                with HostSyncCounter() as inside:
                    out = fn(*args, **kw)
                into.append(inside.ops)
                return out

            return call

        experts_style.dispatch_to_experts = counted(per_dispatch, dispatch)
        # transformers' own read of the position ids (is a row packed?) making its mask: the model's, not mesh3d's
        masking_utils.find_packed_sequence_indices = counted(in_masks, find_packed)
        try:
            with HostSyncCounter() as syncs:
                pm.step(inputs[share], targets[share])  # the loss unread
        finally:
            experts_style.dispatch_to_experts = dispatch
            masking_utils.find_packed_sequence_indices = find_packed
        model_own = sum(len(ops) for ops in in_masks)
        results.append((syncs.ops, per_dispatch, model_own, layers * kwargs["microbatches"]))
    return results


def test_expert_dispatch_reads_token_counts_once_per_layer_per_microbatch():
    """docs/performance.md: the dispatch's one host read (the uneven splits of the all-to-all) per
    experts module per microbatch, and nothing else of mesh3d's in the step; transformers' own
    mask code reads the position ids besides (nested counters record a read in both)."""
    for rank, results in enumerate(run_on_ranks(_dispatch_syncs_on_rank, 4, timeout=600)):
        for (arch, sizes, ep, _), (step_ops, per_dispatch, model_own, expected) in zip(
            SYNC_CASES, results, strict=True
        ):
            where = f"rank {rank} {arch} {sizes} ep={ep}"
            assert len(per_dispatch) == expected, f"{where}: {len(per_dispatch)} dispatches, expected {expected}"
            assert all(ops == ["Tensor.tolist"] for ops in per_dispatch), f"{where}: {per_dispatch}"
            assert len(step_ops) == expected + model_own, f"{where}: {len(step_ops)} syncs, {model_own} the model's"
