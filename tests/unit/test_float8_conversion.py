"""float8= in one process: which linears are converted (on meta), the tp plan's float8 styles, the
refusals and their messages, mesh3d without torchao, and float8's numerics against fp32 and bf16.

The numerics bounds: float8 e4m3 keeps 3 mantissa bits (a relative step of 2^-4 to 2^-3 per element)
and e5m2 gradients 2 bits, so a float8 model is close to its fp32 self, not equal; averaged over a
loss or a gradient's norm, the rounding mostly cancels. Measured on this CPU (torch 2.13, torchao
0.18), two AdamW steps of float8_cases' model: loss within 2.1e-4 of fp32's (bf16's own gap: 3e-5),
grad norm within 2.6e-3 (bf16: 2.3e-3), each gradient's norm-relative error at most 0.115 (e5m2 output gradients).
Bounds: 1e-3 on the losses, 1e-2 on grad norms, 0.25 per gradient: an unconverted model passes
trivially, so the conversion itself is checked by name (test_converted_names).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch
from float8_cases import block_linears, data, float8_args, one_process
from pipeline_cases import meta_model, relative, tp_args
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

from examples.llama.model import Transformer, llama_tp_plan
from mesh3d.model.float8 import RECIPES, Float8Config, convertible, torchao_float8
from mesh3d.model.intake import anatomy_of
from mesh3d.tensor.plan import check_plan

pytest.importorskip("torchao.float8")

BLOCK_LINEARS = (
    "attention.wq",
    "attention.wk",
    "attention.wv",
    "attention.wo",
    "feed_forward.w1",
    "feed_forward.w2",
    "feed_forward.w3",
)


def _resolve(float8, model=None, tp=1, ep=1, shards=True, never_drains=False, traced=False):
    model = model if model is not None else meta_model(False, args=float8_args())
    plan = check_plan(model, llama_tp_plan(), tp) if tp > 1 else {}
    return Float8Config.resolve(
        float8,
        model,
        anatomy_of(model),
        plan,
        tp=tp,
        ep=ep,
        shards_weights=shards,
        never_drains=never_drains,
        traced=traced,
    )


def test_converted_names():
    """On meta: every block linear, never the embedding or the head; a dim not a multiple of 16 stays."""
    config = _resolve("tensorwise")
    assert set(config.modules) == {f"layers.{i}.{name}" for i in range(4) for name in BLOCK_LINEARS}
    # tp_args: FFN width 176 = 11 * 16, halved by tp = 2 to 88: the FFN linears stay as they are under tp
    wide = meta_model(False, args=tp_args(False, n_layers=2))
    assert len(convertible(wide, anatomy_of(wide))) == 14
    under_tp = _resolve("tensorwise", wide, tp=2)
    assert not any("feed_forward" in name for name in under_tp.modules) and len(under_tp.modules) == 8
    model = meta_model(False, args=float8_args())
    config.convert([model])
    from torchao.float8.float8_linear import Float8Linear

    converted = sorted(n for n, m in model.named_modules() if isinstance(m, Float8Linear))
    assert converted == sorted(config.modules) and model.output.weight.is_meta
    assert type(model.output) is torch.nn.Linear and type(model.tok_embeddings) is torch.nn.Embedding


def test_tp_plan_gets_float8_styles():
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    plan = _resolve("tensorwise", tp=2).tp_plan
    assert type(plan["layers.0.attention.wq"]) is Float8ColwiseParallel
    assert type(plan["layers.0.feed_forward.w2"]) is Float8RowwiseParallel
    assert type(plan["layers.0.attention"]) is PrepareModuleInput  # a module input keeps its plain style
    assert type(plan["output"]) is ColwiseParallel  # the head is not converted


def test_all_gather_and_scales():
    """Float8 all-gather with tensorwise under FSDP only; precomputed scales unless updates come mid-step."""
    assert _resolve("tensorwise").all_gather and _resolve("tensorwise").precompute
    assert not _resolve("rowwise").all_gather
    assert not _resolve("tensorwise", shards=False).all_gather  # DDP, or stages not wrapped
    never_drain = _resolve("tensorwise", never_drains=True)
    assert never_drain.all_gather and not never_drain.precompute
    assert _resolve(None) == Float8Config()


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"float8": "fp8"}, ["float8='fp8'", "'tensorwise'", "'rowwise'", "None"]),
        ({"float8": "rowwise", "tp": 2}, ["float8='rowwise'", "tp=2", "'tensorwise'"]),
        ({"float8": "tensorwise", "ep": 2}, ["ep=2", "float8=None"]),
        ({"float8": "tensorwise", "traced": True}, ["traced", "float8=None"]),
    ],
)
def test_refusals_name_the_values(kwargs, words):
    with pytest.raises(ValueError) as raised:
        _resolve(kwargs.pop("float8"), **kwargs)
    assert all(word in str(raised.value) for word in words), str(raised.value)


def test_nothing_to_convert_is_refused():
    with torch.device("meta"):
        model = Transformer(float8_args().__class__(dim=24, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=8))
    with pytest.raises(ValueError, match="divisible by 16"):
        _resolve("tensorwise", model)


def test_missing_torchao_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # a None entry makes `import torchao` raise ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ImportError, match=r'pip install "mesh3d\[float8\]"'):
        torchao_float8()
    with pytest.raises(ImportError, match=r'pip install "mesh3d\[float8\]"'):
        _resolve("tensorwise")
    assert _resolve(None) == Float8Config()  # float8 off needs no torchao


def test_mesh3d_imports_no_torchao_at_load():
    """torchao is optional: no mesh3d module imports it at module level (only inside functions)."""
    package = Path(__file__).resolve().parents[2] / "mesh3d"
    for path in package.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torchao" for n in names), f"{path} imports torchao at load"


def test_recipes_are_torchaos():
    float8 = torchao_float8()
    for recipe in RECIPES:
        float8.Float8LinearConfig.from_recipe_name(recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_float8_close_to_fp32_and_bf16(recipe):
    batches = data()
    got = one_process(recipe, batches)
    for dtype in (torch.float32, torch.bfloat16):
        want = one_process(None, batches, dtype=dtype)
        for a, b in zip(got[0], want[0]):
            assert relative(a, b) <= 1e-3, f"{recipe} vs {dtype}: losses {got[0]} vs {want[0]}"
        for a, b in zip(got[1], want[1]):
            assert relative(a, b) <= 1e-2, f"{recipe} vs {dtype}: grad norms {got[1]} vs {want[1]}"
    _gradients_close(recipe)


def _gradients_close(recipe: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    inputs, targets = data(steps=1)[0]
    grads = []
    for converted in (False, True):
        model = Transformer(float8_args())
        model.init_weights()
        if converted:
            names = block_linears(model)
            config = Float8LinearConfig.from_recipe_name(recipe)
            convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name in names)
        torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    errors = {n: relative(grads[1][n], g) for n, g in grads[0].items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= 0.25, f"{recipe}: gradient of {worst} off by {errors[worst]:.3f}"
    print(f"{recipe}: worst gradient {worst} off by {errors[worst]:.3f}")


def test_router_stays_high_precision():
    """A mixture of experts' router (a linear named `gate` or `router`, as Mixtral's was) picks experts
    by comparing its outputs: never converted, though its dims are multiples of 16."""
    model = meta_model(False, args=float8_args())
    with torch.device("meta"):
        model.layers["0"].feed_forward.gate = torch.nn.Linear(64, 16, bias=False)
        model.layers["0"].feed_forward.router = torch.nn.Linear(64, 16, bias=False)
    names = convertible(model, anatomy_of(model))
    assert len(names) == 4 * 7 and not any(name.endswith(("gate", "router")) for name in names), names
