"""The Hugging Face adapter: mesh3d holds no model's names; a model without an adapter exports under
its own names; an adapter's names, tie and config are what export writes and import reads; an
import that would leave a model tensor unset or a checkpoint tensor unplaced refuses, naming it.

One plain process (pp = dp = tp = 1): mesh3d.parallelize needs no launcher there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import mesh3d
from mesh3d.checkpoint import HFAdapter

MESH3D = Path(mesh3d.__file__).resolve().parent
# The LLaMA example's module names; they live in examples/llama/hf_adapter.py, never in the library.
LLAMA_NAMES = re.compile(
    r"tok_embeddings|attention\.wq|attention\.wk|attention\.wv|attention\.wo|feed_forward|attention_norm|ffn_norm"
)


def test_the_library_holds_no_llama_parameter_name():
    sources = [p for p in MESH3D.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert any(p.name == "safetensors_io.py" for p in sources)  # the walk reached the sources
    hits = [
        f"{path.relative_to(MESH3D.parent)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if LLAMA_NAMES.search(line)
    ]
    assert hits == []


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x)


class Toy(nn.Module):
    """A protocol-following model with Hugging Face-style names and no adapter."""

    def __init__(self, vocab: int = 12, dim: int = 8, layers: int = 2, tied: bool = False, config=None):
        super().__init__()
        self.tied = tied  # a stage may hold neither end; the flag stays
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim) for i in range(layers)})
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        if config is not None:
            self.config = config

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


class ToyAdapter(HFAdapter):
    """Names under a `model.` prefix, the head as `lm_head`; the pair tied when the config says so."""

    tied_pair = ("embed.weight", "head.weight")
    ignored_hf = ("model.layers.*.rotary.inv_freq",)

    def __init__(self, config: dict):
        self.config = config

    def to_hf(self, name: str) -> str:
        return "lm_head.weight" if name == "head.weight" else f"model.{name}"

    def hf_config(self) -> dict:
        return dict(self.config)

    def config_mismatch(self, theirs: dict) -> str | None:
        if theirs.get("hidden_size") != self.config["hidden_size"]:
            return (
                f"hidden_size is {theirs.get('hidden_size')!r} there but {self.config['hidden_size']!r} in this model"
            )
        return None


class AdaptedToy(Toy):
    def hf_adapter(self) -> ToyAdapter:
        return ToyAdapter({"model_type": "toy", "hidden_size": 8, "tie_word_embeddings": self.tied})


def _parallel(model: nn.Module, seed: int = 0):
    torch.manual_seed(seed)
    for param in model.parameters():
        nn.init.normal_(param)
    return mesh3d.parallelize(model)


def _saved(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def test_a_model_without_an_adapter_exports_under_its_own_names(tmp_path):
    pm = _parallel(Toy())
    mesh3d.checkpoint.export_safetensors(pm, tmp_path, config={"model_type": "toy"})
    saved, state = _saved(tmp_path), pm.full_state_dict()
    assert (
        sorted(saved)
        == sorted(state)
        == sorted(
            [
                "embed.weight",
                "layers.0.proj.weight",
                "layers.0.proj.bias",
                "layers.1.proj.weight",
                "layers.1.proj.bias",
                "head.weight",
            ]
        )
    )
    assert all(torch.equal(saved[name], state[name]) for name in state)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "toy"


def test_a_model_without_an_adapter_exports_its_config_attribute_or_asks_for_one(tmp_path):
    pm = _parallel(Toy(config={"model_type": "toy", "hidden_size": 8}))
    mesh3d.checkpoint.export_safetensors(pm, tmp_path / "own")
    assert json.loads((tmp_path / "own" / "config.json").read_text())["hidden_size"] == 8
    with pytest.raises(ValueError, match="pass config="):
        mesh3d.checkpoint.export_safetensors(_parallel(Toy()), tmp_path / "none")


def test_a_tied_model_without_an_adapter_writes_the_tie_once_and_reads_it_back(tmp_path):
    pm = _parallel(Toy(tied=True), seed=1)
    mesh3d.checkpoint.export_safetensors(pm, tmp_path, config={"model_type": "toy", "tie_word_embeddings": True})
    assert "head.weight" not in _saved(tmp_path) and "embed.weight" in _saved(tmp_path)
    again = _parallel(Toy(tied=True), seed=2)
    mesh3d.checkpoint.import_safetensors(again, tmp_path)
    state, want = again.full_state_dict(), pm.full_state_dict()
    assert all(torch.equal(state[name], want[name]) for name in want)


@pytest.mark.parametrize("tied", [False, True])
def test_an_adapter_decides_names_tie_and_config(tmp_path, tied):
    pm = _parallel(AdaptedToy(tied=tied), seed=3)
    mesh3d.checkpoint.export_safetensors(pm, tmp_path)
    saved, state = _saved(tmp_path), pm.full_state_dict()
    names = {
        "model.embed.weight",
        "model.layers.0.proj.weight",
        "model.layers.0.proj.bias",
        "model.layers.1.proj.weight",
        "model.layers.1.proj.bias",
    }
    assert set(saved) == names | (set() if tied else {"lm_head.weight"})
    assert torch.equal(saved["model.layers.1.proj.bias"], state["layers.1.proj.bias"])
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is tied
    untied = _parallel(AdaptedToy(), seed=4)  # a tied checkpoint gives an untied model its head from the embedding
    mesh3d.checkpoint.import_safetensors(untied, tmp_path)
    assert all(torch.equal(untied.full_state_dict()[name], state[name]) for name in state)


def _write(directory: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    directory.mkdir()
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(directory / "model.safetensors"))
    if config is not None:
        (directory / "config.json").write_text(json.dumps(config))
    return directory


def _hf_state(pm) -> dict[str, torch.Tensor]:
    adapter = pm.stages[0].hf_adapter()
    return {adapter.to_hf(name): tensor for name, tensor in pm.full_state_dict().items()}


def test_import_refuses_a_checkpoint_tensor_it_has_no_place_for(tmp_path):
    pm = _parallel(AdaptedToy(), seed=5)
    extra = {
        **_hf_state(pm),
        "model.layers.0.proj.scale": torch.ones(8),
        "model.layers.1.rotary.inv_freq": torch.ones(4),
    }
    before = pm.full_state_dict()
    with pytest.raises(
        ValueError, match=r"holds 1 tensor\(s\) this model has no place for \('model.layers.0.proj.scale'\)"
    ):
        mesh3d.checkpoint.import_safetensors(pm, _write(tmp_path / "extra", extra))
    assert all(torch.equal(pm.full_state_dict()[n], before[n]) for n in before)  # nothing was read
    ignored = {**_hf_state(pm), "model.layers.1.rotary.inv_freq": torch.ones(4)}  # listed in ignored_hf
    mesh3d.checkpoint.import_safetensors(pm, _write(tmp_path / "ignored", ignored))


def test_import_refuses_a_checkpoint_that_leaves_a_model_tensor_unset(tmp_path):
    pm = _parallel(AdaptedToy(), seed=6)
    lacking = {name: t for name, t in _hf_state(pm).items() if name != "model.layers.1.proj.bias"}
    with pytest.raises(
        ValueError, match=r"has no tensor 'model.layers.1.proj.bias' \(this model's layers.1.proj.bias\)"
    ):
        mesh3d.checkpoint.import_safetensors(pm, _write(tmp_path / "lacking", lacking))


def test_import_asks_the_adapter_about_the_config(tmp_path):
    pm = _parallel(AdaptedToy(), seed=7)
    other = _write(tmp_path / "other", _hf_state(pm), {"model_type": "toy", "hidden_size": 16})
    with pytest.raises(ValueError, match="holds a different model: hidden_size is 16 there but 8 in this model"):
        mesh3d.checkpoint.import_safetensors(pm, other)


def test_the_llama_example_refuses_a_checkpoint_with_biases_it_lacks(tmp_path):
    """A Qwen2-style checkpoint (Llama names plus q/k/v biases) would lose its biases in the LLaMA example."""
    from examples.llama.config import get_config
    from examples.llama.model import Transformer

    args = get_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=16, max_seq_len=8)
    pm = mesh3d.parallelize(Transformer(args))
    mesh3d.checkpoint.export_safetensors(pm, tmp_path / "llama")
    tensors = _saved(tmp_path / "llama")
    biases = {
        f"model.layers.{i}.self_attn.{p}_proj.bias": torch.zeros(8 if p != "q" else 32) for i in range(2) for p in "qkv"
    }
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    with pytest.raises(
        ValueError,
        match=r"holds 6 tensor\(s\) this model has no place for "
        r"\('model.layers.0.self_attn.k_proj.bias', 'model.layers.0.self_attn.q_proj.bias'",
    ):
        mesh3d.checkpoint.import_safetensors(pm, _write(tmp_path / "qwen2", {**tensors, **biases}, config))
    mesh3d.checkpoint.import_safetensors(pm, tmp_path / "llama")  # its own export loads
