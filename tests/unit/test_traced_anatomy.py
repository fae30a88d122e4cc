"""The traced anatomy in one process: which container holds the blocks, what torch's split routes
between stages, stages that keep the model's names and compose to its forward, and the refusal of
a model torch.export cannot capture (raised before any process group exists)."""

import pytest
import torch
from sequential_cases import DIM, SEQ, VOCAB, Residual, SkipModel
from torch import nn

import mesh3d
from mesh3d.model.intake import anatomy_of

IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


class DataDependent(nn.Module):
    """Branches on a value: torch.export cannot capture it as one graph."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(DIM, DIM) for _ in range(4)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if x.sum() > 0:
                x = -x
        return x


def test_the_longest_container_holds_the_blocks_and_split_points_pick_theirs():
    model = SkipModel(tied=False)
    model.extra = nn.ModuleList([nn.Identity()])
    anatomy = anatomy_of(model, (IDS,))
    assert anatomy.layers == "blocks" and anatomy.first == ("emb",) and anatomy.last == ("head", "extra")
    assert len(anatomy.blocks(model)) == 8
    assert anatomy_of(model, (IDS,), ["extra.0"]).layers == "extra"
    with pytest.raises(ValueError, match="children of one nn.Sequential"):
        anatomy_of(model, (IDS,), ["blocks.2", "extra.0"])


def test_split_routes_the_skip_straight_to_its_consumer_and_stages_compose_to_the_model():
    model = SkipModel(tied=True)
    split = anatomy_of(model, (IDS,)).traced.split(["blocks.2", "blocks.4", "blocks.6"])
    assert split.skips == ((0, 3),)
    assert set(split.takes) == {(0, 1), (1, 2), (2, 3), (0, 3)}
    stages = [split.stage(model, s) for s in range(4)]
    names = [sorted(n for n, _ in stage.named_parameters()) for stage in stages]
    assert names[0] == sorted(
        ["emb.weight"]
        + [f"blocks.{i}.{part}.{p}" for i in (0, 1) for part in ("up", "down") for p in ("weight", "bias")]
    )
    assert "head.weight" in names[3] and isinstance(stages[1].get_submodule("blocks.2.up"), nn.Linear)
    # the runtime's calling convention (pipeline/routes.py): previous stage's outputs, then the skips'
    out0 = stages[0](IDS)
    out0 = out0 if isinstance(out0, tuple) else (out0,)
    h = stages[2](stages[1](*[out0[k] for k in split.takes[(0, 1)]]))
    out = stages[3](h, *[out0[k] for k in split.takes[(0, 3)]])
    assert torch.equal(out, model(IDS))


def test_a_model_torch_export_cannot_capture_is_refused_with_torchs_reason_before_any_collective():
    with pytest.raises(ValueError) as raised:
        mesh3d.parallelize(DataDependent(), pp=2, example_inputs=(torch.randn(2, DIM),))  # no process group exists
    message = str(raised.value)
    assert "torch.export cannot capture" in message and "mesh3d protocol" in message
    assert "DataDependent (traced)" in message and "data-dependent" in message.lower()


def test_a_plain_module_without_example_inputs_is_told_about_them():
    with pytest.raises(ValueError, match="example_inputs"):
        anatomy_of(Residual())


def test_splitting_leaves_the_model_as_it_was_so_it_can_be_split_again():
    """torch's pipeline() marks the split points on the model in place; a meta model is captured
    as it is (no copy), so another split of it (other points, another microbatch shape: the
    planner's, then parallelize's) must not find the marks of the last."""
    from mesh3d.model.meta_copy import meta_copy

    model = meta_copy(SkipModel(tied=False))
    traced = anatomy_of(model, (IDS,)).traced
    traced.split(["blocks.2", "blocks.4"])
    assert not any("_orig_forward" in block.__dict__ or "forward" in block.__dict__ for block in model.blocks)
    again = anatomy_of(model, (IDS[:1],)).traced.split(["blocks.4"])
    assert len(again.graphs) == 2 and again.skips == ()


class Scaled(nn.Module):
    """A second input, `scale`, read by the forward itself around the blocks."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Residual() for _ in range(4)])
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, *, scale):
        h = self.emb(ids) * scale[..., None]
        for block in self.blocks:
            h = block(h)
        return self.head(h * scale[..., None])


def test_a_second_input_named_by_the_example_inputs_is_a_keyword_of_the_stages_that_read_it():
    model, scale = Scaled(), torch.rand(IDS.shape, generator=torch.Generator().manual_seed(1))
    traced = anatomy_of(model, (IDS, {"scale": scale})).traced
    split = traced.split(["blocks.2"])
    assert split.per_sample == (("scale",), ("scale",))
    first, last = split.stage(model, 0), split.stage(model, 1)
    assert first.per_sample_inputs == ("scale",)
    torch.testing.assert_close(last(first(IDS, scale=scale), scale=scale), model(IDS, scale=scale), rtol=0, atol=0)
    # A stage that does not read it does not take it.
    three = traced.split(["blocks.1", "blocks.3"])
    assert three.per_sample == (("scale",), (), ("scale",)) and three.stage(model, 1).per_sample_inputs == ()
    with pytest.raises(ValueError, match=r"example_inputs must be \(tokens,\) or \(tokens, \{name: tensor\}\)"):
        anatomy_of(model, (IDS, {"scale": 1.0}))
