"""The checkpoint path on a GPU: one rank on cuda:0 with NCCL (tests/gpu_cases.py says when it runs).

- save after 2 steps, load into a fresh model, 2 more steps: the same losses and parameters as 4
  uninterrupted steps (relative <= 1e-5), and the CUDA RNG state comes back;
- a transformers LlamaForCausalLM imported on the GPU gives its logits (relative <= 1e-4), and a
  bf16 export is written in bf16 and loads in transformers;
- a checkpoint of a fused AdamW on the GPU resumes on the CPU (gloo) with a plain AdamW.

Run on an H100 (torch 2.11 there): all three pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from checkpoint_cases import build, full_state, train, worst_relative_error
from gpu_cases import needs_gpu, run_on_gpu_ranks
from pipeline_cases import TOLERANCE

import mesh3d

pytestmark = needs_gpu


def _resume_on_gpu(root: str, device: str):
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device=device)
    assert ("nccl" in layout.backend) == (device == "cuda"), layout
    pm, optimizer, loader = build(layout, True)
    losses = train(pm, optimizer, loader, 2)
    mesh3d.checkpoint.save(f"{root}/step2", pm, optimizer, step=2, data_state=loader.state_dict())
    drawn = torch.rand(4, device=device).tolist()
    losses += train(pm, optimizer, loader, 2)
    uninterrupted = full_state(pm)

    pm, optimizer, loader = build(layout, True, init_seed=1)
    state = mesh3d.checkpoint.load(f"{root}/step2", pm, optimizer)
    rng_back = torch.rand(4, device=device).tolist() == drawn
    loader.load_state_dict(state["data_state"])
    resumed = train(pm, optimizer, loader, 2)
    return losses, resumed, uninterrupted, full_state(pm), rng_back


def test_save_load_resume_on_gpu(tmp_path, device):
    losses, resumed, uninterrupted, state, rng_back = run_on_gpu_ranks(
        _resume_on_gpu, 1, str(tmp_path), device, timeout=300
    )[0]
    assert rng_back
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, losses[2:])) <= TOLERANCE
    error, where = worst_relative_error(state, uninterrupted)
    assert error <= TOLERANCE, f"{error:.2e} at {where}"


def _hf_on_gpu(hf_dir: str, out_dir: str, tokens: np.ndarray, device: str):
    import json

    from examples.llama.config import ModelArgs
    from examples.llama.model import Transformer

    layout = mesh3d.build_mesh(device=device)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf_config(json.loads(open(f"{hf_dir}/config.json").read())))
    pm = mesh3d.parallelize(model, layout, virtual_stages=1)
    mesh3d.checkpoint.import_safetensors(pm, hf_dir)
    stage = pm.stages[0]
    with torch.no_grad():
        logits = stage(torch.from_numpy(tokens).to(device)).float().cpu().numpy()
    mesh3d.checkpoint.export_safetensors(pm, out_dir, dtype=torch.bfloat16)
    return logits


def _transformers_on_gpu(hf_dir: str, tokens, device: str):
    """transformers' own logits on the device (in a rank: the test process is shown no GPU)."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval().to(device)
    with torch.no_grad():
        return hf(torch.from_numpy(tokens).to(device)).logits.float().cpu().numpy()


def test_hugging_face_import_and_bf16_export_on_gpu(tmp_path, device):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, 128, (2, 32))
    want = run_on_gpu_ranks(_transformers_on_gpu, 1, str(tmp_path / "hf"), tokens.numpy(), device)[0]
    got = run_on_gpu_ranks(
        _hf_on_gpu, 1, str(tmp_path / "hf"), str(tmp_path / "bf16"), tokens.numpy(), device, timeout=300
    )[0]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-4

    from safetensors import safe_open

    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    with torch.no_grad():
        bf16 = reloaded.float()(tokens).logits.numpy()
    assert np.linalg.norm(bf16 - want) / np.linalg.norm(want) <= 2e-2  # bf16 rounding of the weights


def _save_with_fused_adamw_on_gpu(root: str, device: str):
    layout = mesh3d.build_mesh(device=device)
    pm, _, loader = build(layout, True)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4, fused=True)
    train(pm, optimizer, loader, 2)
    mesh3d.checkpoint.save(f"{root}/gpu", pm, optimizer, step=2, data_state=loader.state_dict())
    losses = train(pm, optimizer, loader, 2)
    return losses, full_state(pm)


def _resume_on_cpu(root: str):
    layout = mesh3d.build_mesh(device="cpu")
    pm, _, loader = build(layout, True, init_seed=1)
    optimizer = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    state = mesh3d.checkpoint.load(f"{root}/gpu", pm, optimizer)
    loader.load_state_dict(state["data_state"])
    fused = optimizer.param_groups[0]["fused"]
    return train(pm, optimizer, loader, 2), full_state(pm), fused


def test_a_gpu_checkpoint_of_a_fused_optimizer_resumes_on_cpu(tmp_path, device):
    losses, want = run_on_gpu_ranks(_save_with_fused_adamw_on_gpu, 1, str(tmp_path), device, timeout=300)[0]
    resumed, got, fused = run_on_gpu_ranks(_resume_on_cpu, 1, str(tmp_path), timeout=300)[0]
    assert not fused  # the implementation flag stays the CPU optimizer's
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, losses)) <= 1e-4  # GPU vs CPU kernels
    error, where = worst_relative_error(got, want)
    assert error <= 1e-4, f"{error:.2e} at {where}"
