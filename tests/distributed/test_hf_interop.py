"""Hugging Face round trip: transformers' LlamaForCausalLM -> mesh3d at (2,2,2) -> transformers.

A randomly initialized tiny LlamaForCausalLM (GQA: 8 heads, 2 kv heads; tied and untied) is saved
with save_pretrained; mesh3d imports it at (pp, dp, tp) = (2, 2, 2) and its logits equal
transformers' on the same tokens (relative error <= 1e-4); mesh3d exports it back (one file, and
sharded with an index) and transformers loads the export and gives the same logits again. Each
rank reads only the slices of the tensors it owns. `transformers` is a test dependency only.

Import errors: an untied checkpoint into a tied model, fewer layers (config), another vocabulary
(shapes, no config), a missing directory; a tied checkpoint into an untied model copies the
embedding into the head.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from multiprocess import run_on_ranks

import mesh3d
from examples.llama.config import ModelArgs
from examples.llama.model import Transformer

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
BATCH, SEQ_LEN, VOCAB = 4, 16, 96
SHARD_BYTES = 40_000  # small enough that the export is split into several files

_captured: list[torch.Tensor] = []


def _capturing_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The last stage's loss; keeps the logits it was given so the test can compare them."""
    if not logits.is_meta:  # mesh3d first checks the loss on meta tensors
        _captured.append(logits.detach().clone())
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _hf_model(tied: bool):
    torch.manual_seed(1 + tied)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ_LEN,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(config).eval()


def _logits(model, tokens: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return model(tokens).logits.float().numpy()


def _import_evaluate_export(directories: dict, tokens: np.ndarray) -> dict:
    from mesh3d.checkpoint import safetensors_io

    layout = mesh3d.build_mesh(pp=2, dp=2, tp=2)
    tokens = torch.from_numpy(tokens)
    share = slice(layout.dp_rank * BATCH // 2, (layout.dp_rank + 1) * BATCH // 2)
    read = []  # elements this rank read from the files
    safe_open = safetensors_io.safe_open

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            inner = self.inner.get_slice(name)

            class Slice:
                def get_shape(self):
                    return inner.get_shape()

                def __getitem__(self, window):
                    values = inner[window]
                    read.append(values.numel())
                    return values

            return Slice()

    safetensors_io.safe_open = CountingOpen
    results = {}
    for tied, (hf_dir, out_dir, sharded_dir) in directories.items():
        config = json.loads(open(f"{hf_dir}/config.json").read())
        with torch.device("meta"):
            model = Transformer(ModelArgs.from_hf_config(config))
        pm = mesh3d.parallelize(model, layout, loss_fn=_capturing_loss)  # default: interleaved, v = 2
        read.clear()
        mesh3d.checkpoint.import_safetensors(pm, hf_dir)
        local_numel = sum(
            t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in pm.state_map.local().values()
        )
        _captured.clear()
        pm.evaluate(tokens[share], tokens[share])
        logits = torch.cat(_captured).numpy() if _captured else None
        mesh3d.checkpoint.export_safetensors(pm, out_dir)
        mesh3d.checkpoint.export_safetensors(pm, sharded_dir, max_shard_size=SHARD_BYTES)
        results[tied] = {
            "logits": logits,
            "dp_rank": layout.dp_rank,
            "read": sum(read),
            "local": local_numel,
            "whole": sum(s[0].numel() for s in pm.state_map.specs.values()),
        }
    return results


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    directories, originals = {}, {}
    for tied in (False, True):
        model = _hf_model(tied)
        hf_dir = root / f"hf_tied{tied}"
        model.save_pretrained(hf_dir, max_shard_size="50KB")  # several files and an index
        originals[tied] = _logits(model, tokens)
        directories[tied] = (str(hf_dir), str(root / f"export_tied{tied}"), str(root / f"sharded_tied{tied}"))
    per_rank = run_on_ranks(_import_evaluate_export, 8, directories, tokens.numpy(), timeout=300)
    return tokens, directories, originals, per_rank


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("tied", [False, True])
def test_imported_logits_equal_transformers(round_trip, tied):
    _, _, originals, per_rank = round_trip
    last_stage = [r[tied] for r in per_rank if r[tied]["logits"] is not None]
    assert len(last_stage) == 4  # pp rank 1: 2 dp x 2 tp ranks
    for result in last_stage:
        share = slice(result["dp_rank"] * BATCH // 2, (result["dp_rank"] + 1) * BATCH // 2)
        assert _relative(result["logits"], originals[tied][share]) <= TOLERANCE


@pytest.mark.parametrize("tied", [False, True])
def test_each_rank_reads_only_its_slices(round_trip, tied):
    _, _, _, per_rank = round_trip
    for result in per_rank:
        r = result[tied]
        # A rank holding a tied output head reads the embedding rows it owns for it too.
        assert r["read"] == r["local"], r
        assert r["read"] < r["whole"] / 4


@pytest.mark.parametrize("tied", [False, True])
def test_exported_directory_loads_in_transformers_with_the_same_logits(round_trip, tied):
    tokens, directories, originals, _ = round_trip
    _, out_dir, sharded_dir = directories[tied]
    for directory in (out_dir, sharded_dir):
        reloaded = transformers.LlamaForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
        assert reloaded.config.tie_word_embeddings == tied
        assert _relative(_logits(reloaded, tokens), originals[tied]) <= TOLERANCE
    files = sorted(p.name for p in __import__("pathlib").Path(sharded_dir).iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    from safetensors import safe_open

    with safe_open(f"{out_dir}/model.safetensors", framework="pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) == (not tied)
    assert "model.layers.3.self_attn.k_proj.weight" in names and len(names) == 4 * 9 + 2 + (not tied)


def _import_errors(directories: dict, no_config_dir: str, other_rope_dir: str, scratch: str) -> dict:
    layout = mesh3d.build_mesh()
    untied_export, tied_export = directories[False][1], directories[True][1]
    base = ModelArgs.from_hf_config(json.loads(open(f"{untied_export}/config.json").read()))

    def parallel(args):
        with torch.device("meta"):
            model = Transformer(args)
        return mesh3d.parallelize(model, layout)

    def message(fn) -> str:
        try:
            fn()
        except (ValueError, FileNotFoundError) as error:
            return str(error)
        return "no error"

    out = {
        "untied into tied": message(
            lambda: mesh3d.checkpoint.import_safetensors(parallel(base.with_(tie_embeddings=True)), untied_export)
        ),
        "fewer layers": message(
            lambda: mesh3d.checkpoint.import_safetensors(parallel(base.with_(n_layers=2)), untied_export)
        ),
        "other vocab, no config": message(
            lambda: mesh3d.checkpoint.import_safetensors(parallel(base.with_(vocab_size=128)), no_config_dir)
        ),
        "missing": message(lambda: mesh3d.checkpoint.import_safetensors(parallel(base), f"{untied_export}/nothing")),
        "other rope": message(lambda: mesh3d.checkpoint.import_safetensors(parallel(base), other_rope_dir)),
    }
    # Exporting again into the same directory leaves nothing of the earlier export to be mixed in.
    model = parallel(base)
    mesh3d.checkpoint.export_safetensors(model, scratch, max_shard_size=SHARD_BYTES)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    mesh3d.checkpoint.export_safetensors(model, scratch)
    out["listing after re-export"] = sorted(__import__("os").listdir(scratch))
    again = parallel(base)
    mesh3d.checkpoint.import_safetensors(again, scratch)
    out["re-export imports the new weights"] = all(
        torch.equal(a, b) for a, b in zip(again.full_state_dict().values(), model.full_state_dict().values())
    )
    untied = parallel(base)
    mesh3d.checkpoint.import_safetensors(untied, tied_export)  # a tied checkpoint: the head is the embedding
    state = untied.full_state_dict()
    out["tied into untied: head equals embedding"] = torch.equal(state["output.weight"], state["tok_embeddings.weight"])
    return out


def test_import_refuses_what_does_not_fit(round_trip, tmp_path):
    _, directories, _, _ = round_trip
    import shutil

    no_config = tmp_path / "no_config"
    shutil.copytree(directories[False][1], no_config)
    (no_config / "config.json").unlink()
    other_rope = tmp_path / "other_rope"
    shutil.copytree(directories[False][1], other_rope)
    config = json.loads((other_rope / "config.json").read_text())
    config["rope_theta"] = config["rope_parameters"]["rope_theta"] = 500000.0
    (other_rope / "config.json").write_text(json.dumps(config))
    out = run_on_ranks(
        _import_errors, 1, directories, str(no_config), str(other_rope), str(tmp_path / "again"), timeout=120
    )[0]
    assert "has an output head of its own (lm_head.weight, untied embeddings)" in out["untied into tied"]
    assert "holds a different model: num_hidden_layers is 4 there but 2 in this model" in out["fewer layers"]
    assert (
        "model.embed_tokens.weight has shape (96, 64)" in out["other vocab, no config"]
        and "tok_embeddings.weight is (128, 64)" in out["other vocab, no config"]
    )
    assert "has neither model.safetensors nor model.safetensors.index.json" in out["missing"]
    assert out["tied into untied: head equals embedding"] is True
    assert "rotary setting rope_theta is 500000.0 there but 10000.0 in this model" in out["other rope"]
    assert out["listing after re-export"] == ["checksums.json", "config.json", "model.safetensors"]
    assert out["re-export imports the new weights"] is True
