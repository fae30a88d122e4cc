"""The stage builder: layer assignment, split points, block deletion, unsplit FQNs, copies without waste."""

import itertools
import random

import pytest
import torch
from pipeline_cases import meta_model, tiny_args
from torch import nn

from examples.llama.model import Transformer
from mesh3d.model.cut import block_parameter_counts, cut_stage
from mesh3d.model.intake import anatomy_of, protocol_anatomy
from mesh3d.model.meta_copy import meta_copy
from mesh3d.pipeline.split import assign_layers, split_point_counts


def build_stage(model, stage, n_stages, layer_range):
    return cut_stage(model, anatomy_of(model), stage, n_stages, layer_range)


def sizes(ranges):
    return [len(r) for r in ranges]


def test_uniform_assignment():
    assert sizes(assign_layers(8, 4)) == [2, 2, 2, 2]
    assert sizes(assign_layers(8, 3)) == [3, 3, 2]  # earlier stages take the extra layers
    assert sizes(assign_layers(5, 5)) == [1] * 5
    ranges = assign_layers(10, 4)
    assert [r.start for r in ranges] == [0, 3, 6, 8] and ranges[-1].stop == 10


def test_end_weight_lightens_the_first_and_last_stage():
    # embedding and head each cost one layer: 10 units over 4 stages, at most 3 per stage
    assert sizes(assign_layers(8, 4, first_cost=1.0, last_cost=1.0)) == [2, 3, 2, 1]
    assert sizes(assign_layers(16, 4, first_cost=2.0, last_cost=2.0)) == [3, 5, 5, 3]


def test_assignment_minimizes_the_most_expensive_stage():
    rng = random.Random(0)
    for _ in range(50):
        n_layers, n_stages = rng.randint(2, 8), rng.randint(1, 4)
        if n_stages > n_layers:
            continue
        costs = [rng.uniform(0.5, 3.0) for _ in range(n_layers)]
        first, last = rng.uniform(0, 3), rng.uniform(0, 3)

        def stage_costs(counts):
            bounds = list(itertools.accumulate([0] + list(counts)))
            out = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
            out[0] += first
            out[-1] += last
            return out

        best = min(
            max(stage_costs(c))
            for c in itertools.product(range(1, n_layers + 1), repeat=n_stages)
            if sum(c) == n_layers
        )
        got = assign_layers(n_layers, n_stages, layer_costs=costs, first_cost=first, last_cost=last)
        assert max(stage_costs(sizes(got))) == pytest.approx(best)


def test_assignment_by_parameter_count():
    model = meta_model(tied=False)
    per_layer, first, last = block_parameter_counts(model, anatomy_of(model))
    assert len(per_layer) == 8 and len(set(per_layer)) == 1
    assert first == 64 * 32 and last == 32 + 64 * 32  # embedding; final norm + head
    # a heavy head pushes layers towards the front
    assert sizes(assign_layers(8, 2, layer_costs=[1.0] * 8, last_cost=4.0)) == [6, 2]


def test_explicit_and_invalid_assignments():
    assert sizes(assign_layers(8, 3, layers_per_stage=[1, 5, 2])) == [1, 5, 2]
    with pytest.raises(
        ValueError, match=r"must list 3 counts .* of at least one layer each, adding up to the model's 8"
    ):
        assign_layers(8, 3, layers_per_stage=[4, 4])
    with pytest.raises(ValueError, match="must list"):
        assign_layers(8, 2, layers_per_stage=[8, 0])


def test_the_ends_may_stand_alone_where_the_model_has_them():
    """The Llama 3 paper's split: the first stage the embedding alone, the last the output layer and
    loss alone (126 blocks over 16 x 8 stages); never a middle stage without a block."""
    both = (True, True)
    assert sizes(assign_layers(126, 128, layers_per_stage=[0] + [1] * 126 + [0], ends_alone=both))[:3] == [0, 1, 1]
    assert sizes(assign_layers(8, 2, layers_per_stage=[8, 0], ends_alone=both)) == [8, 0]
    with pytest.raises(ValueError, match=r"the first and the last may be 0 \(a stage of its end alone\)"):
        assign_layers(8, 4, layers_per_stage=[0, 8, 0, 0], ends_alone=both)
    with pytest.raises(ValueError, match=r"of at least one layer each; the last may be 0"):
        assign_layers(8, 2, layers_per_stage=[0, 8], ends_alone=(False, True))
    with pytest.raises(ValueError, match=r"or give layers_per_stage with the first or last stage at 0"):
        assign_layers(4, 6, ends_alone=both)
    with pytest.raises(ValueError, match=r"virtual_stages <= 4$"):  # two more stages than blocks at most
        assign_layers(4, 7, ends_alone=both)
    with pytest.raises(ValueError, match=r"needs a model whose anatomy names its ends: not a traced one"):
        assign_layers(4, 2, layers_per_stage=[0, 4])
    with pytest.raises(ValueError, match=r"cannot split 4 layers into 8 pipeline stages .* pp \* virtual_stages <= 4"):
        assign_layers(4, 8)


@pytest.mark.parametrize("tied", [False, True])
def test_stages_keep_the_unsplit_names(tied):
    model = meta_model(tied)
    every_name = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    ranges = assign_layers(8, 3)
    stages = [build_stage(model, s, 3, ranges[s]) for s in range(3)]
    names = [{n for n, _ in st.named_parameters(remove_duplicate=False)} for st in stages]
    assert set().union(*names) == every_name
    assert list(stages[1].layers.keys()) == ["3", "4", "5"]
    assert stages[0].tok_embeddings is not None and stages[0].norm is None and stages[0].output is None
    assert stages[2].tok_embeddings is None and stages[2].output is not None
    assert all(not (a & b) for a, b in itertools.combinations(names, 2))  # every name on one stage
    assert len(model.layers) == 8  # the model itself is untouched


def test_stage_copies_only_what_it_owns():
    model = Transformer(tiny_args(tied=True))
    model.init_weights(4)
    stage = build_stage(model, 1, 4, range(2, 4))
    assert sum(p.numel() for p in stage.parameters()) == sum(p.numel() for p in model.layers["2"].parameters()) * 2
    for name, param in stage.named_parameters():
        original = model.get_parameter(name)
        assert torch.equal(param, original) and param.data_ptr() != original.data_ptr()
    # the last stage of a tied model holds the head with the embedding's values
    last = build_stage(model, 3, 4, range(6, 8))
    assert torch.equal(last.output.weight, model.tok_embeddings.weight)


def test_composed_stages_equal_the_whole_model():
    model = Transformer(tiny_args(tied=True))
    model.init_weights(1)
    tokens = torch.randint(0, 64, (2, 8))
    ranges = assign_layers(8, 3)
    h = tokens
    for s in range(3):
        h = build_stage(model, s, 3, ranges[s])(h)
    torch.testing.assert_close(h, model(tokens), rtol=0, atol=0)


def test_meta_copy_keeps_ties_and_moves_nothing():
    model = Transformer(tiny_args(tied=True))
    copy = meta_copy(model)
    assert all(p.is_meta for p in copy.parameters())
    assert copy.output.weight is copy.tok_embeddings.weight
    assert not model.tok_embeddings.weight.is_meta


def test_model_without_a_layers_moduledict():
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(2, 2)])

    with pytest.raises(ValueError, match=r"Blocks has no nn.ModuleDict attribute 'layers' \(found ModuleList\)"):
        protocol_anatomy(Blocks())
    with pytest.raises(ValueError, match="found nothing"):
        protocol_anatomy(nn.Linear(2, 2))
    gapped = nn.Module()
    gapped.layers = nn.ModuleDict({"0": nn.Linear(2, 2), "2": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match="must be keyed '0'..'1' in order"):
        protocol_anatomy(gapped)


def test_an_nn_sequential_splits_at_its_children():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(5)])
    anatomy = anatomy_of(model)
    ranges = assign_layers(5, 2)
    stages = [cut_stage(model, anatomy, s, 2, ranges[s]) for s in range(2)]
    assert [list(st._modules) for st in stages] == [["0", "1", "2"], ["3", "4"]]
    assert {n for st in stages for n, _ in st.named_parameters()} == {n for n, _ in model.named_parameters()}
    x = torch.randn(3, 6)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)


def test_split_points_name_where_stages_begin():
    model = meta_model(tied=False)
    anatomy = anatomy_of(model)
    assert split_point_counts(anatomy, [str(i) for i in range(8)], ["layers.3", "layers.6"]) == [3, 3, 2]
    with pytest.raises(ValueError, match=r"'layers.9' is not a block of Transformer.*one of \['layers.0'"):
        split_point_counts(anatomy, [str(i) for i in range(8)], ["layers.9"])
    with pytest.raises(ValueError, match="distinct blocks in model order"):
        split_point_counts(anatomy, [str(i) for i in range(8)], ["layers.6", "layers.3"])
    with pytest.raises(ValueError, match="none the first block"):
        split_point_counts(anatomy, [str(i) for i in range(8)], ["layers.0"])
