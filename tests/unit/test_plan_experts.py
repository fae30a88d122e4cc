"""The planner's expert parallelism (mesh3d/planner/measure/experts.py): which ep degrees it plans,
the expert bytes a rank holds falling as 1/ep, the all-to-alls' time, and the refusals parallelize
would raise."""

import pytest

import mesh3d
from mesh3d.planner.hardware import Hardware

transformers = pytest.importorskip("transformers")

SIZES = dict(gpus=4, gpus_per_node=4, hardware="h100", seq_len=64, global_batch=4)
EXPERTS, HIDDEN, WIDTH, BLOCKS = 8, 64, 32, 3
EXPERT_ELEMENTS = EXPERTS * 3 * WIDTH * HIDDEN  # gate_up_proj (E, 2I, H) and down_proj (E, H, I), per block
# one rank, one microbatch, the model's own fp32: memory terms exact to the element
PINNED = {"pp": 1, "tp": 1, "microbatches": 1, "activation_checkpoint": "never", "param_dtype": None}


def moe_config():
    return transformers.Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=WIDTH,
        num_hidden_layers=BLOCKS,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def plans():
    return mesh3d.plan(moe_config(), fix=PINNED, **SIZES)


def by_ep(plans, dp_mode: str) -> dict[int, mesh3d.planner.Plan]:
    return {ep: next(p for p in plans if p.ep == ep and p.dp_mode == dp_mode) for ep in (1, 2, 4)}


def test_ep_is_searched_for_a_mixture_of_experts_and_handed_to_parallelize(plans):
    assert {p.ep for p in plans} == {1, 2, 4}
    for p in plans:
        assert (p.dp * p.cp * p.tp) % p.ep == 0
        assert p.parallelize_kwargs().get("ep", 1) == p.ep
        assert (f" ep={p.ep} " in p.row()) == (p.ep > 1)
        assert (p.time.ep_seconds > 0) == (p.ep > 1)
    dense = mesh3d.plan(
        transformers.LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, vocab_size=256),
        fix={"pp": 1, "tp": 1},
        **SIZES,
    )
    assert {p.ep for p in dense} == {1}


def test_a_replica_holds_a_1_over_ep_th_of_the_experts(plans):
    """DDP: each rank holds its E/ep experts whole; the rest of the model is the same at every ep."""
    ddp = by_ep(plans, "ddp")
    for ep in (2, 4):
        held = ddp[1].memory_per_rank.parameters - ddp[ep].memory_per_rank.parameters
        assert held == BLOCKS * EXPERT_ELEMENTS * 4 * (1 - 1 / ep)
        # each rank sends (ep - 1)/ep of its routed rows (tokens x top-2) in each all-to-all
        assert ddp[ep].time.ep_seconds > 0
    assert ddp[4].time.ep_seconds > ddp[2].time.ep_seconds


def test_fsdp_shards_the_experts_over_the_ranks_that_hold_them_and_gathers_1_over_ep(plans):
    """FSDP at rest: E/ep experts over dp x tp / ep ranks, the same bytes as E over dp; gathered
    (two blocks at a time, pp = 1 reshards after forward), a 1/ep-th of the experts."""
    fsdp = by_ep(plans, "fsdp")
    for ep in (2, 4):
        assert fsdp[ep].memory_per_rank.parameters == fsdp[1].memory_per_rank.parameters
        gathered = fsdp[1].memory_per_rank.communication - fsdp[ep].memory_per_rank.communication
        assert gathered == 2 * EXPERT_ELEMENTS * 4 * (1 - 1 / ep)


@pytest.mark.parametrize(
    "model, fix, hardware, message",
    [
        (moe_config, {"ep": 3}, "h100", "ep=3 does not divide the 8 experts"),
        (
            lambda: transformers.LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4),
            {"ep": 2},
            "h100",
            "declares no expert-parallel plan for it",
        ),
        (
            moe_config,
            {"ep": 2},
            Hardware("measured", 1e11, 2**34, 1e9, 1e9, 1e10, achievable_fraction=1.0, times_the_model=True),
            "a measured machine times the experts",
        ),
        (moe_config, {"ep": 0}, "h100", "fix ep=0; give a positive integer"),
    ],
)
def test_an_ep_the_model_or_machine_cannot_take_is_refused_by_name(model, fix, hardware, message):
    with pytest.raises(ValueError, match=message):
        mesh3d.plan(model(), fix=fix, **{**SIZES, "hardware": hardware})
