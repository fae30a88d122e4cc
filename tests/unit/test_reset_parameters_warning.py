"""A model given on meta without init_weights() is no longer filled silently: parallelize warns
(ResetParametersWarning) that its values differ from the model built on a device, says what to
add, and names each parameter no reset_parameters() fills; a model with init_weights, or given
with values, is not warned about. One process: a private world of one, pp = dp = tp = 1."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mesh3d
from mesh3d.model.reset_parameters_warning import ResetParametersWarning


class Scale(nn.Module):
    """A parameter of its own and no reset_parameters(): nothing fills it after to_empty()."""

    def __init__(self, dim: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.gain


class Plain(nn.Module):
    """The protocol without init_weights."""

    def __init__(self, dim: int = 8, vocab: int = 16):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(dim, dim), Scale(dim)) for i in range(2)})
        self.output = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return h if self.output is None else self.output(h)


class Seeded(Plain):
    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        for name, param in self.named_parameters():
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed + len(name))))


def _parallelize(model: nn.Module) -> list[warnings.WarningMessage]:
    layout = mesh3d.build_mesh(pp=1, dp=1, tp=1, device="cpu")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mesh3d.parallelize(model, layout, schedule="gpipe", dp_mode="ddp", seed=0)
    finally:
        dist.destroy_process_group()
    return [w for w in caught if issubclass(w.category, ResetParametersWarning)]


def test_a_meta_model_without_init_weights_is_warned_about_by_name():
    with torch.device("meta"):
        model = Plain()
    (warning,) = _parallelize(model)
    text = str(warning.message)
    assert "Plain was given on the meta device and has no init_weights()" in text
    assert "add `init_weights(self, seed=None)`" in text and "build the model on a device" in text
    assert "No reset_parameters() fills layers.0.1.gain, layers.1.1.gain" in text


@pytest.mark.parametrize("kind", ["init_weights", "values"])
def test_no_warning_with_init_weights_or_values(kind):
    if kind == "values":
        model = Plain()
    else:
        with torch.device("meta"):
            model = Seeded()
    assert _parallelize(model) == []
