"""A Hugging Face model's export and import, with the adapter derived from the model itself.

Tiny real architectures (tests/hf_cases.py) in one plain process (pp = dp = tp = 1, two virtual
stages, so each stage's config lists only its own blocks' layer_types): the export is a directory
`from_pretrained` reads, whose logits equal the model's; the import reads what `save_pretrained`
writes, sharded or not; a checkpoint of another architecture, with a tensor the model lacks, without
one it has, or with a config that computes differently is refused, naming it. The library imports
without transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_cases import TOLERANCE, VOCAB, hf_config, hf_model
from safetensors import safe_open

import mesh3d

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def _parallel(model):
    return mesh3d.parallelize(model, schedule="interleaved_1f1b", virtual_stages=2)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(TOKENS).logits


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def _saved_names(directory: Path) -> set[str]:
    names: set[str] = set()
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            names |= set(f.keys())
    return names


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])  # tied with q/k/v biases; untied
def test_export_is_a_directory_from_pretrained_reads(tmp_path, arch):
    original = hf_model(arch)
    want, own_names = _logits(original), set(original.state_dict())
    pm = _parallel(hf_model(arch))
    assert list(pm.full_state_dict()) == list(original.state_dict())  # the model's own names, in its order
    mesh3d.checkpoint.export_safetensors(pm, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [type(original).__name__]
    assert config.get("layer_types") == getattr(original.config, "layer_types", None)  # the whole model's
    tied = original.config.tie_word_embeddings
    assert _saved_names(tmp_path) == own_names - ({"lm_head.weight"} if tied else set())  # a tie stored once
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is type(original) and reloaded.config.tie_word_embeddings == tied
    assert _relative(_logits(reloaded), want) <= TOLERANCE


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_import_reads_what_save_pretrained_writes_sharded_or_not(tmp_path, arch):
    source = hf_model(arch, seed=3)
    source.save_pretrained(tmp_path / "one")
    source.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    want = source.state_dict()
    for directory in ("one", "sharded"):
        pm = _parallel(hf_model(arch, seed=4))
        mesh3d.checkpoint.import_safetensors(pm, tmp_path / directory)
        state = pm.full_state_dict()
        assert all(torch.equal(state[name], want[name]) for name in want), directory


def test_import_refuses_another_architecture_naming_what_differs(tmp_path):
    """Qwen2's checkpoint (q/k/v biases) into a Llama of the same sizes: refused by model_type with
    its config, and without a config by the 12 bias tensors the Llama has no place for."""
    hf_model("qwen2").save_pretrained(tmp_path / "qwen2")
    llama = _parallel(hf_model("llama"))
    before = llama.full_state_dict()
    with pytest.raises(ValueError, match="model_type is 'qwen2' there but 'llama' in this model"):
        mesh3d.checkpoint.import_safetensors(llama, tmp_path / "qwen2")
    (tmp_path / "qwen2" / "config.json").unlink()
    with pytest.raises(
        ValueError,
        match=r"holds 12 tensor\(s\) this model has no place for "
        r"\('model.layers.0.self_attn.k_proj.bias', 'model.layers.0.self_attn.q_proj.bias'",
    ):
        mesh3d.checkpoint.import_safetensors(llama, tmp_path / "qwen2")
    assert all(torch.equal(llama.full_state_dict()[n], before[n]) for n in before)  # nothing was read


def test_import_refuses_a_checkpoint_lacking_a_tensor_or_computing_differently(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_model("qwen2").save_pretrained(tmp_path / "whole")
    pm = _parallel(hf_model("qwen2", seed=1))

    lacking = tmp_path / "lacking"
    lacking.mkdir()
    tensors = load_file(str(tmp_path / "whole" / "model.safetensors"))
    del tensors["model.layers.2.self_attn.v_proj.bias"]
    save_file(tensors, str(lacking / "model.safetensors"))
    (lacking / "config.json").write_text((tmp_path / "whole" / "config.json").read_text())
    with pytest.raises(ValueError, match=r"has no tensor 'model.layers.2.self_attn.v_proj.bias'"):
        mesh3d.checkpoint.import_safetensors(pm, lacking)

    config = json.loads((tmp_path / "whole" / "config.json").read_text())
    (tmp_path / "whole" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    with pytest.raises(ValueError, match="rms_norm_eps is 0.001 there but 1e-06 in this model"):
        mesh3d.checkpoint.import_safetensors(pm, tmp_path / "whole")
    # Fields that only initialize or generate do not count.
    (tmp_path / "whole" / "config.json").write_text(json.dumps({**config, "initializer_range": 0.5, "eos_token_id": 7}))
    mesh3d.checkpoint.import_safetensors(pm, tmp_path / "whole")


def test_a_tied_checkpoint_gives_an_untied_model_its_head_from_the_embedding(tmp_path):
    hf_model("mistral", seed=5, tie_word_embeddings=True).save_pretrained(tmp_path)
    pm = _parallel(hf_model("mistral"))  # untied
    mesh3d.checkpoint.import_safetensors(pm, tmp_path)
    state = pm.full_state_dict()
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    assert hf_config("mistral").tie_word_embeddings is False


def test_the_library_imports_without_transformers():
    blocked = (
        "import sys; sys.modules['transformers'] = None; import mesh3d, mesh3d.checkpoint, mesh3d.train; print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", blocked],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(Path(mesh3d.__file__).resolve().parents[1])},
    )
    assert result.stdout.strip() == "ok", result.stderr
