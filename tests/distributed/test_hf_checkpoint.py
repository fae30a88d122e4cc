"""A Hugging Face model through the distributed checkpoint: save under one layout, resume under another, export.

A tiny transformers Qwen2ForCausalLM (q/k/v biases, tied embeddings; tests/hf_cases.py) trains 2
steps at (pp, dp, tp) = (2, 2, 2), interleaved, and is saved with its optimizer (SGD with momentum:
state to reshard); a model of other weights at (4, 1, 2), 1F1B, loads the checkpoint and trains 2
more. The reference is transformers' own model trained 4 steps in one process on the whole batch:
the losses of steps 3-4 and every parameter after step 4 equal it (fp32, relative 1e-5). The
resumed model is exported; `AutoModelForCausalLM.from_pretrained` of the export gives the
reference's logits (1e-5). One launch of 8 ranks; tensor parallelism from the model's own
`base_model_tp_plan` on both sides.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hf_cases import LR, TOLERANCE, hf_model, masked_batches, optimizer_steps, reference_run
from multiprocess import run_on_ranks

import mesh3d

transformers = pytest.importorskip("transformers")

ARCH = "qwen2"
BATCH = 8
MOMENTUM = 0.9
SAVED_AT, RESUMED_AT = (2, 2, 2), (4, 1, 2)


def _save_resume_export(root: str) -> dict:
    batches = masked_batches(BATCH, steps=4)
    layout = mesh3d.build_mesh(*SAVED_AT)
    pm = mesh3d.parallelize(hf_model(ARCH), layout, schedule="interleaved_1f1b", microbatches=2)
    optimizer = torch.optim.SGD(pm.parameters(), lr=LR, momentum=MOMENTUM)
    before = optimizer_steps(pm, layout, optimizer, batches[:2])
    mesh3d.checkpoint.save(f"{root}/ckpt", pm, optimizer, step=2)

    layout = mesh3d.build_mesh(*RESUMED_AT)
    pm = mesh3d.parallelize(hf_model(ARCH, seed=1), layout, schedule="1f1b", microbatches=4)  # other weights
    optimizer = torch.optim.SGD(pm.parameters(), lr=LR, momentum=MOMENTUM)
    state = mesh3d.checkpoint.load(f"{root}/ckpt", pm, optimizer)
    after = optimizer_steps(pm, layout, optimizer, batches[2:])
    full = {name: tensor.numpy() for name, tensor in pm.full_state_dict().items()}
    mesh3d.checkpoint.export_safetensors(pm, f"{root}/export")
    return {"losses": before + after, "step": state["step"], "state": full if layout.rank == 0 else None}


def test_resume_under_another_layout_then_export_equals_transformers(tmp_path):
    results = run_on_ranks(_save_resume_export, 8, str(tmp_path), timeout=300)
    ref_losses, ref_state = reference_run(ARCH, masked_batches(BATCH, steps=4), momentum=MOMENTUM)
    for result in results:
        assert result["step"] == 2
        assert np.allclose(result["losses"], ref_losses, rtol=TOLERANCE, atol=0), (result["losses"], ref_losses)
    state = results[0]["state"]
    assert list(state) == list(ref_state)  # the model's own names, in its order
    errors = {name: np.linalg.norm(state[name] - want) / np.linalg.norm(want) for name, want in ref_state.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOLERANCE, (worst, errors[worst])

    reference = hf_model(ARCH)
    reference.load_state_dict({name: torch.from_numpy(value) for name, value in ref_state.items()})
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(exported) is type(reference)
    tokens = masked_batches(BATCH, seed=7)[0][0]
    with torch.no_grad():
        want, got = reference.eval()(tokens).logits, exported.eval()(tokens).logits
    assert ((got - want).norm() / want.norm()).item() <= TOLERANCE
