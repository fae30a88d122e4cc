"""The LLaMA example: published shapes, the model protocol (partial stages), init, rotary embeddings."""

import copy
import math

import pytest
import torch

from examples.llama.attention import apply_rotary, rope_cache
from examples.llama.config import CONFIGS, ModelArgs, RopeScaling, get_config
from examples.llama.model import Transformer, count_parameters, loss_fn

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


def llama31_scaled_frequencies_reference(head_dim, theta, factor, low, high, original):
    """Llama 3.1's published rule, written out frequency by frequency."""
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / theta ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(freq)
        elif wavelen > original / low:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return out


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_matches_the_published_rule(factor):
    args = TINY.with_(
        dim=2048, n_heads=16, n_kv_heads=16, rope_theta=500000.0, max_seq_len=2, rope_scaling=RopeScaling(factor=factor)
    )
    table = rope_cache(args)
    # Position 1's angles are the frequencies; recover them from cos and sin without ambiguity.
    angles = torch.atan2(table[1, 1, : args.head_dim // 2].double(), table[1, 0, : args.head_dim // 2].double())
    expected = llama31_scaled_frequencies_reference(args.head_dim, 500000.0, factor, 1.0, 4.0, 8192)
    torch.testing.assert_close(angles, torch.tensor(expected, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    blended = [i for i, f in enumerate(expected) if 8192 / 4 <= 2 * math.pi / f <= 8192]
    assert blended, "the test must cover the blended middle band"


def test_bf16_forward_and_backward():
    model = real_model(TINY).to(torch.bfloat16)
    tokens = torch.randint(0, TINY.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.dtype == torch.bfloat16
    loss_fn(logits, tokens).backward()
    assert model.layers["0"].attention.wq.weight.grad.dtype == torch.bfloat16


def test_init_ignores_wrapper_prefixes_in_parameter_names():
    """Activation-checkpoint wrappers rename parameters; init must still match the plain model."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = real_model(TINY, seed=4)
    wrapped = meta_model(TINY)
    for key in list(wrapped.layers.keys()):
        wrapped.layers[key] = checkpoint_wrapper(wrapped.layers[key])
    wrapped.to_empty(device="cpu")
    wrapped.init_weights(seed=4)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    for (name, a), b in zip(plain.named_parameters(), wrapped.parameters()):
        assert torch.equal(a, b), name


def test_sequence_longer_than_max_seq_len_is_a_clear_error():
    model = real_model(TINY)
    with pytest.raises(ValueError, match="sequence length 40 exceeds the model's max_seq_len=32"):
        model(torch.zeros(1, 40, dtype=torch.long))


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
