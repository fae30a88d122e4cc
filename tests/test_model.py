"""The LLaMA example: published shapes, the model protocol (partial stages), init, rotary embeddings."""

import copy
import math

import pytest
import torch

from examples.llama.config import CONFIGS, ModelArgs, RopeScaling, get_config
from examples.llama.model import Transformer, apply_rotary, count_parameters, loss_fn, rope_cache

TINY = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=32)


def meta_model(args):
    with torch.device("meta"):
        return Transformer(args)


def real_model(args, seed=0):
    model = meta_model(args).to_empty(device="cpu")
    model.init_weights(seed)
    return model


@pytest.mark.parametrize(
    "name, published, rel",
    [("8B", 8.03e9, 1e-3), ("70B", 70.55e9, 1e-4), ("1B", 1.24e9, 1e-2), ("3B", 3.21e9, 1e-2)],
)
def test_published_parameter_counts_on_meta(name, published, rel):
    model = meta_model(CONFIGS[name])
    assert all(p.is_meta for p in model.parameters())
    assert count_parameters(model) == pytest.approx(published, rel=rel)


def test_published_shapes():
    assert CONFIGS["8B"].ffn_hidden_dim == 14336
    assert CONFIGS["70B"].ffn_hidden_dim == 28672
    assert CONFIGS["1B"].ffn_hidden_dim == 8192
    assert CONFIGS["3B"].ffn_hidden_dim == 8192
    assert count_parameters(meta_model(CONFIGS["8B"])) == 8_030_261_248


def stage(model, keep_layers, first, last):
    """A pipeline stage the way mesh3d builds one: deep copy, then delete what it does not own."""
    part = copy.deepcopy(model)
    for key in list(part.layers.keys()):
        if key not in keep_layers:
            del part.layers[key]
    if not first:
        part.tok_embeddings = None
    if not last:
        part.norm = None
        part.output = None
    return part


@pytest.mark.parametrize("tied", [False, True])
def test_stages_compose_to_the_whole_model(tied):
    args = TINY.with_(tie_embeddings=tied)
    whole = real_model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    first = stage(whole, {"0", "1"}, first=True, last=False)
    middle = stage(whole, {"2"}, first=False, last=False)
    last = stage(whole, {"3"}, first=False, last=True)
    hidden = first(tokens)
    assert hidden.shape == (2, 16, args.dim)
    torch.testing.assert_close(last(middle(hidden)), whole(tokens), rtol=1e-6, atol=1e-6)
    names = {n for s in (first, middle, last) for n, _ in s.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()} | ({"output.weight"} if tied else set())


@pytest.mark.parametrize("tied", [False, True])
def test_init_on_a_stage_equals_init_of_the_whole(tied):
    """A stage materialized from meta on its own gets exactly the values of the unsplit model."""
    args = TINY.with_(tie_embeddings=tied)
    whole = real_model(args, seed=7)
    last = stage(meta_model(args), {"2", "3"}, first=False, last=True).to_empty(device="cpu")
    last.init_weights(seed=7)
    whole_params = dict(whole.named_parameters())
    for name, param in last.named_parameters():
        source = "tok_embeddings.weight" if tied and name == "output.weight" else name
        assert torch.equal(param, whole_params[source]), name
    torch.testing.assert_close(last.rope, whole.rope, rtol=0, atol=0)


def test_init_is_deterministic_per_seed_and_differs_across_seeds():
    a, b, c = real_model(TINY, seed=1), real_model(TINY, seed=1), real_model(TINY, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(pa, pc), name
    assert torch.equal(a.layers["0"].attention_norm.weight, torch.ones(TINY.dim))
    wo_std = a.layers["0"].attention.wo.weight.std().item()
    assert wo_std == pytest.approx(0.02 / math.sqrt(2 * TINY.n_layers), rel=0.2)


def test_tied_model_shares_one_parameter():
    model = real_model(TINY.with_(tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert "output.weight" in model.state_dict() and "tok_embeddings.weight" in model.state_dict()
    untied = count_parameters(real_model(TINY))
    assert untied - count_parameters(model) == TINY.vocab_size * TINY.dim


def test_rotary_table_is_a_non_persistent_buffer_rebuilt_from_meta():
    model = meta_model(TINY)
    assert model.rope.is_meta and "rope" not in model.state_dict()
    model.to_empty(device="cpu")
    torch.testing.assert_close(model.rope, rope_cache(TINY), rtol=0, atol=0)


def test_rotary_scores_depend_only_on_relative_position():
    args = TINY.with_(max_seq_len=64)
    cos, sin = rope_cache(args).unbind(1)
    q, k = torch.randn(args.head_dim, dtype=torch.float64), torch.randn(args.head_dim, dtype=torch.float64)

    def score(m, n):
        rq = apply_rotary(q, cos[m].double(), sin[m].double())
        rk = apply_rotary(k, cos[n].double(), sin[n].double())
        return torch.dot(rq, rk)

    torch.testing.assert_close(score(5, 2), score(40, 37), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(score(0, 0), torch.dot(q, k), rtol=1e-6, atol=1e-6)


def test_llama3_rope_scaling_keeps_high_and_divides_low_frequencies():
    args = TINY.with_(dim=512, n_heads=4, n_kv_heads=4, rope_theta=500000.0, max_seq_len=2)
    plain = rope_cache(args)[1, 0]  # angle of position 1 = the inverse frequencies (via cos)
    scaled = rope_cache(args.with_(rope_scaling=RopeScaling(factor=8.0)))[1, 0]
    assert plain[0] == scaled[0]  # highest frequency untouched
    lowest_plain, lowest_scaled = torch.acos(plain[63]), torch.acos(scaled[63])
    torch.testing.assert_close(lowest_scaled, lowest_plain / 8, rtol=1e-4, atol=0)


def test_grouped_query_attention_matches_repeated_kv_heads():
    """GQA with 2 kv heads equals full attention whose kv weights repeat each kv head."""
    gqa = real_model(TINY)
    mha = real_model(TINY.with_(n_kv_heads=TINY.n_heads))
    mha_params = dict(mha.named_parameters())
    with torch.no_grad():
        for name, param in gqa.named_parameters():
            if mha_params[name].shape == param.shape:
                mha_params[name].copy_(param)
    group = TINY.n_heads // TINY.kv_heads
    for key in ("wk", "wv"):
        for i in gqa.layers:
            w = getattr(gqa.layers[i].attention, key).weight.view(TINY.kv_heads, TINY.head_dim, TINY.dim)
            getattr(mha.layers[i].attention, key).weight.data.copy_(w.repeat_interleave(group, 0).flatten(0, 1))
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    torch.testing.assert_close(gqa(tokens), mha(tokens), rtol=1e-5, atol=1e-5)


def test_attention_is_causal():
    model = real_model(TINY)
    tokens = torch.randint(0, TINY.vocab_size, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % TINY.vocab_size
    torch.testing.assert_close(model(tokens)[:, :8], model(changed)[:, :8], rtol=0, atol=0)


def test_initial_loss_is_near_uniform():
    model = real_model(get_config("debug"))
    tokens = torch.randint(0, 256, (2, 64))
    assert loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).item() == pytest.approx(math.log(256), rel=0.02)


def test_config_errors_are_actionable():
    with pytest.raises(ValueError, match="n_heads=6 is not divisible by n_kv_heads=4"):
        ModelArgs(dim=48, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="unknown model config 'nope'"):
        get_config("nope")


def test_tp_plan_covers_every_linear_and_embedding():
    """Every weight-bearing module of a block and of the ends matches a pattern of the plan."""
    from fnmatch import fnmatch

    model = meta_model(TINY)
    plan = model.tp_plan
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            assert any(fnmatch(name, pattern) for pattern in plan), name
