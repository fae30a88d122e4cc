"""The output head fused with the cross-entropy (`parallelize(fused_loss=True)`,
mesh3d/model/fused_head_loss.py) against the head and the default loss unfused: the same loss and
gradients, with several chunks of rows and ignored targets; under parallelize for the mesh3d
protocol and each transformers model type it accepts; and its refusals.

One process (a private world of one). The layouts of more ranks are in
tests/distributed/test_composition.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import mesh3d
import mesh3d.model.loss as loss_module
from examples.llama.config import ModelArgs
from examples.llama.model import Transformer
from mesh3d.model.fused_head_loss import (
    FUSED_HEAD_MODEL_TYPES,
    _LinearCrossEntropy,
    check_fused_loss,
    fuse_head,
    fused_cross_entropy,
    head_targets,
)
from mesh3d.model.loss import IGNORE_INDEX, cross_entropy_loss

VOCAB = 48


def _rows(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(13, 16, generator=g).to(dtype)
    weight = (torch.randn(VOCAB, 16, generator=g) / 4).to(dtype)
    bias = torch.randn(VOCAB, generator=g).to(dtype)
    target = torch.randint(0, VOCAB, (13,), generator=g)
    target[[2, 3, 9]] = IGNORE_INDEX
    return rows, weight, bias, target


def _grads(fused: bool, dtype, with_bias: bool):
    rows, weight, bias, target = (t.clone() for t in _rows(dtype))
    leaves = [rows.requires_grad_(), weight.requires_grad_()] + ([bias.requires_grad_()] if with_bias else [])
    b = bias if with_bias else None
    if fused:
        loss = _LinearCrossEntropy.apply(rows, weight, b, target, IGNORE_INDEX)
    else:
        loss, _ = cross_entropy_loss(F.linear(rows, weight, b), target)
    (loss * 0.37).backward()
    return loss.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("chunk_rows", [1, 4, 13])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_equals_head_then_loss_in_fp32(monkeypatch, chunk_rows, with_bias):
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", chunk_rows * VOCAB)
    (loss, grads), (want, want_grads) = _grads(True, torch.float32, with_bias), _grads(False, torch.float32, with_bias)
    # the same chunks summed in the same order; a matmul over fewer rows may round differently
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_fused_in_bf16_rounds_the_weight_gradient_once(monkeypatch):
    """The logits and gradients are computed in bf16 as unfused, the weight's summed over the
    chunks in fp32 and rounded once, as one bf16 matmul over all rows rounds it: within a bf16
    rounding step (2**-8) of the unfused ones."""
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 4 * VOCAB)
    (loss, grads), (want, want_grads) = _grads(True, torch.bfloat16, True), _grads(False, torch.bfloat16, True)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)  # an fp32 sum of fp32 losses
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-8, atol=1e-3)


def _step(model, fused: bool, tokens, labels):
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        pm = mesh3d.parallelize(model, layout, schedule="gpipe", microbatches=2, dp_mode="ddp", fused_loss=fused)
        loss = pm.step(tokens, labels)
        evaluated = pm.evaluate(tokens, labels)
        grads = {n: p.grad.clone() for stage in pm.stages.values() for n, p in stage.named_parameters()}
    finally:
        dist.destroy_process_group()
    return loss, evaluated, grads


def _batch(vocab):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (4, 12), generator=g)
    labels = torch.randint(0, vocab, (4, 12), generator=g)
    labels[0, :5] = IGNORE_INDEX
    return tokens, labels


def _assert_same(fused, unfused):
    (loss, evaluated, grads), (want, want_evaluated, want_grads) = fused, unfused
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(evaluated, want_evaluated, rtol=1e-6, atol=0)
    assert grads.keys() == want_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("tied", [False, True])
def test_parallelize_fused_loss_equals_unfused_mesh3d_protocol(monkeypatch, tied):
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 7 * 64)  # several chunks of a microbatch's 24 rows
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
    torch.manual_seed(0)
    model = Transformer(args.with_(tie_embeddings=tied))
    tokens, labels = _batch(64)
    results = [_step(_copy(model), fused, tokens, labels) for fused in (True, False)]
    _assert_same(*results)


@pytest.mark.parametrize("model_type", FUSED_HEAD_MODEL_TYPES)
def test_parallelize_fused_loss_equals_unfused_transformers(monkeypatch, model_type):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 7 * 64)
    config = transformers.AutoConfig.for_model(
        model_type,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    tokens, labels = _batch(64)
    results = [_step(_copy(model), fused, tokens, labels) for fused in (True, False)]
    _assert_same(*results)


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_the_pair_loss_passes_on_the_sum_its_head_returned_and_nothing_else():
    stage = torch.nn.Module()
    stage.output = torch.nn.Linear(16, VOCAB)
    fuse_head(stage)
    target = torch.tensor([[1, IGNORE_INDEX, 2]])
    with head_targets(target):
        total = stage.output(torch.randn(1, 3, 16))
    loss, count = fused_cross_entropy(total, target)
    assert loss is total and int(count) == 2
    meta_logits = torch.empty(1, 3, VOCAB, device="meta")  # the meta check of the loss's kind (loss.py)
    assert fused_cross_entropy(meta_logits, target)[0].shape == ()
    with pytest.raises(RuntimeError, match="not the loss its fused head computes"):
        fused_cross_entropy(torch.zeros(1, 3, VOCAB), target)  # never a silent zero loss
    with pytest.raises(RuntimeError, match="not the loss its fused head returned"):
        fused_cross_entropy(total / 2, target)  # a model's arithmetic on its head's output
    with head_targets(target), pytest.raises(ValueError, match="the head got 2 rows and the microbatch has 3"):
        stage.output(torch.randn(1, 2, 16))


class _Headless(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4)})


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(fused_loss="yes"), "must be True or False"),
        (dict(loss_fn=lambda output, target: output.mean()), "a loss_fn was given"),
        (dict(tp=2), "tp=2 shards the head"),
        (dict(traced=True), "traced"),
    ],
)
def test_refusals_say_what_to_change(kwargs, words):
    args = dict(fused_loss=True, model=Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32)))
    args.update(loss_fn=None, tp=1, traced=False)
    args.update(kwargs)
    with pytest.raises(ValueError, match=words) as info:
        check_fused_loss(args["fused_loss"], args["model"], args["loss_fn"], args["tp"], args["traced"])
    assert "fused_loss=False" in str(info.value) or "True or False" in str(info.value)


class _ScaledHead(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 0.5


def test_refused_without_a_head_and_for_an_unchecked_transformers_model():
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32))
    check_fused_loss(True, model, cross_entropy_loss, 1, False)  # the default loss, given by name
    with pytest.raises(ValueError, match="no nn.Linear head named 'output' or 'lm_head'"):
        check_fused_loss(True, _Headless(), None, 1, False)
    model.output = _ScaledHead(16, 32)
    with pytest.raises(ValueError, match="_ScaledHead with a forward of its own"):
        check_fused_loss(True, model, None, 1, False)
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "gemma2", hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=32
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="model_type 'gemma2'"):
        check_fused_loss(True, model, None, 1, False)


class _WidestLogits(torch.utils._python_dispatch.TorchDispatchMode):
    """The most rows of logits (a result whose last dim is the vocabulary) any op writes at once."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # a view writes nothing (the head's weight transposed is vocab wide)
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            # (meta: the runtime's shape run of the stage's meta copy, which holds no memory)
            if isinstance(t, torch.Tensor) and not t.is_meta and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


@pytest.mark.parametrize("fused, most_rows", [(True, 7), (False, 24)])
def test_fused_never_writes_a_microbatchs_logits_whole(monkeypatch, fused, most_rows):
    """A microbatch is 2 x 12 = 24 rows; fused, no op writes more logits than a chunk's 7 rows."""
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 7 * 64)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        pm = mesh3d.parallelize(
            Transformer(args), layout, schedule="gpipe", microbatches=2, dp_mode="ddp", fused_loss=fused
        )
        widest = _WidestLogits(64)
        with widest:
            pm.step(*_batch(64))
    finally:
        dist.destroy_process_group()
    assert widest.rows == most_rows


class _HalvedOutput(Transformer):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) / 2


def test_a_model_that_transforms_its_heads_output_is_stopped_at_its_first_step():
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        pm = mesh3d.parallelize(_HalvedOutput(args), layout, schedule="gpipe", dp_mode="ddp", fused_loss=True)
        with pytest.raises(RuntimeError, match="not the loss its fused head returned"):
            pm.step(*_batch(64))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("fused", [True, False])
def test_selective_checkpointing_of_a_whole_last_stage_keeps_no_chunk_of_logits(monkeypatch, fused):
    """ZBV checkpoints each stage whole under "selective", caching every matmul's result: fused, the
    head's chunks are recomputed instead (model/fused_head_loss.py's computing_fused_head)."""
    import mesh3d.pipeline.activation_checkpoint as checkpointing

    kept_logits = []
    policy = checkpointing.save_matmuls_and_attention

    def spy(ctx, op, *args, **kwargs):
        decision = policy(ctx, op, *args, **kwargs)
        if decision == checkpointing.CheckpointPolicy.MUST_SAVE and op is torch.ops.aten.mm.default:
            if args[1].shape[-1] == 64:  # a result as wide as the vocabulary: logits
                kept_logits.append(args[0].shape[0])
        return decision

    monkeypatch.setattr(checkpointing, "save_matmuls_and_attention", spy)
    monkeypatch.setattr(loss_module, "LOSS_CHUNK_ELEMENTS", 7 * 64)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=16)
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        pm = mesh3d.parallelize(
            Transformer(args),
            layout,
            schedule="zbv",
            microbatches=2,
            dp_mode="ddp",
            activation_checkpoint="selective",
            fused_loss=fused,
        )
        pm.step(*_batch(64))
    finally:
        dist.destroy_process_group()
    assert sum(kept_logits) == (0 if fused else 2 * 24)  # unfused: both microbatches' 24 rows
