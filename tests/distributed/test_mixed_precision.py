"""bf16 mixed precision at (2,2,2) interleaved FSDP, (2,4,1) DDP and (4,1,2) ZBV (dp = 1): fp32
parameters, a loss curve that follows fp32's (12 steps at (2,2,2), the first 8 elsewhere), half
the bytes across stage boundaries (against an fp32 step at (2,2,2): every layout sends through
the same messages), and checkpoints of fp32 master weights that resume under another layout.

The reference loss curve is one fp32 process on the same data. The data has a pattern to learn
(each sequence steps through the vocabulary by a fixed stride), so the loss falls far and the 3 %
bound on the last losses means something.
"""

import math

import torch
from multiprocess import run_on_ranks
from pipeline_cases import SEQ_LEN, VOCAB, meta_model, tp_args

import mesh3d
from examples.llama.model import Transformer

GLOBAL_BATCH = 16
STEPS = 20
LR = 3e-3
LAYOUTS = {(2, 2, 2): {}, (2, 4, 1): {"dp_mode": "ddp", "schedule": "1f1b"}, (4, 1, 2): {"schedule": "zbv"}}
# The reference learns over STEPS; the layouts follow its first steps: 12 at (2,2,2), by which the
# loss has fallen by a quarter, 8 elsewhere (by a sixth).
STEPS_AT = {(2, 2, 2): 12, (2, 4, 1): 8, (4, 1, 2): 8}


def stride_batches(steps: int = STEPS, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=generator)
        stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=generator)
        tokens = (start + stride * torch.arange(SEQ_LEN + 1)) % VOCAB
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def fp32_reference(data) -> list[float]:
    model = Transformer(tp_args(False))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in data:
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train(pm, layout, data) -> tuple[list[float], torch.optim.Optimizer, list[str]]:
    """Losses, the optimizer, and the dtypes of the gradients the optimizer was handed."""
    optimizer = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses, grad_dtypes = [], set()
    for inputs, targets in data:
        share = slice(layout.dp_rank * GLOBAL_BATCH // layout.dp, (layout.dp_rank + 1) * GLOBAL_BATCH // layout.dp)
        losses.append(pm.step(inputs[share], targets[share]).item())
        pm.clip_grad_norm_(1.0)
        grad_dtypes |= {str(p.grad.dtype) for p in pm.parameters() if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    return losses, optimizer, sorted(grad_dtypes)


def _bf16_runs(data, checkpoint_dir):
    results = {}
    for sizes, options in LAYOUTS.items():
        layout = mesh3d.build_mesh(*sizes)
        pm = mesh3d.parallelize(meta_model(False, args=tp_args(False)), layout, param_dtype=torch.bfloat16, **options)
        losses, optimizer, grad_dtypes = _train(pm, layout, data[: STEPS_AT[sizes]])
        results[sizes] = {
            "losses": losses,
            "param dtypes": sorted({str(p.dtype) for p in pm.parameters()}),
            "grad dtypes": grad_dtypes,
            "bytes": (pm.counters.bytes_sent, pm.counters.bytes_received),
        }
        if sizes == (2, 2, 2):
            fp32 = mesh3d.parallelize(meta_model(False, args=tp_args(False)), layout, **options)
            _train(fp32, layout, data[:1])  # the counters hold the last step's bytes
            results[sizes]["fp32 bytes"] = (fp32.counters.bytes_sent, fp32.counters.bytes_received)
            saved_pm, saved_layout = pm, layout
            saved_path = f"{checkpoint_dir}/step{STEPS_AT[sizes]}"
            mesh3d.checkpoint.save(saved_path, pm, optimizer)
            saved_state = pm.full_state_dict()
    # The bf16 checkpoint holds fp32 master weights and resumes at (4,1,2) with a fresh optimizer.
    layout = mesh3d.build_mesh(4, 1, 2)
    resumed = mesh3d.parallelize(meta_model(False, args=tp_args(False)), layout, param_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=LR)
    mesh3d.checkpoint.load(saved_path, resumed, optimizer)
    loaded = resumed.full_state_dict()
    next_batch = stride_batches(1, seed=1)
    results["resume"] = {
        "same values": all(torch.equal(loaded[k], saved_state[k]) for k in saved_state),
        "dtypes": sorted({str(v.dtype) for v in loaded.values()}),
        "next loss here": _train(resumed, layout, next_batch)[0][0],
        "next loss at (2,2,2)": _train(saved_pm, saved_layout, next_batch)[0][0],
    }
    return results


def test_bf16_follows_fp32_with_half_the_bytes_and_resumes_elsewhere(tmp_path):
    data = stride_batches()
    reference = fp32_reference(data)
    assert reference[-1] < 0.6 * reference[0], "the reference should learn the pattern"
    per_rank = run_on_ranks(_bf16_runs, 8, data, str(tmp_path), timeout=480)
    for rank, results in enumerate(per_rank):
        resume = results.pop("resume")
        assert resume["same values"] and resume["dtypes"] == ["torch.float32"], f"rank {rank}: {resume}"
        assert math.isclose(resume["next loss here"], resume["next loss at (2,2,2)"], rel_tol=1e-2), (
            f"rank {rank}: {resume}"
        )
        for sizes, got in results.items():
            where = f"rank {rank} {sizes}"
            assert got["param dtypes"] == ["torch.float32"] and got["grad dtypes"] == ["torch.float32"], (
                f"{where}: {got}"
            )
            assert abs(got["losses"][0] - reference[0]) <= 1e-2, (
                f"{where}: first loss {got['losses'][0]} vs {reference[0]}"
            )
            steps = STEPS_AT[sizes]
            last, last_ref = sum(got["losses"][-5:]) / 5, sum(reference[steps - 5 : steps]) / 5
            assert abs(last - last_ref) <= 0.03 * last_ref, f"{where}: last-5 mean {last} vs fp32 {last_ref}"
            sent, received = got["bytes"]
            assert sizes[0] == 1 or sent + received > 0, f"{where}: nothing crossed a stage boundary"
            if "fp32 bytes" in got:
                assert (2 * sent, 2 * received) == got["fp32 bytes"], f"{where}: {got['bytes']} vs {got['fp32 bytes']}"
