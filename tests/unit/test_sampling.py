"""Next-token choice (examples/llama/sampling.py): greedy, temperature, top-k and top-p restrict what can be drawn."""

import math

import pytest
import torch

from examples.llama.sampling import Sampling, restrict, sample

# Probabilities 0.5, 0.3, 0.15, 0.05: the nucleus of top_p is read off by hand.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()[None]
DRAWS = 4000


def drawn(sampling: Sampling, logits: torch.Tensor = LOGITS, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return sample(logits.expand(DRAWS, -1), sampling, generator)  # one row per draw


def support(sampling: Sampling, logits: torch.Tensor = LOGITS) -> set[int]:
    return set(drawn(sampling, logits).tolist())


def test_greedy_is_the_argmax_of_each_row():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.9, 0.0]])
    assert sample(logits, Sampling(temperature=0)).tolist() == [1, 0]


@pytest.mark.parametrize("k, kept", [(1, {0}), (2, {0, 1}), (3, {0, 1, 2}), (4, {0, 1, 2, 3})])
def test_top_k_draws_only_the_k_most_likely(k, kept):
    assert support(Sampling(top_k=k)) == kept


@pytest.mark.parametrize("p, kept", [(0.4, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p_draws_only_the_nucleus(p, kept):
    # the fewest most likely tokens whose probabilities reach p: 0.5 | 0.5 + 0.3 | 0.5 + 0.3 + 0.15 | all
    assert support(Sampling(top_p=p)) == kept


def test_top_p_applies_to_the_tempered_distribution():
    # At temperature 2 the probabilities are those of sqrt(PROBS): 0.379, 0.294, 0.207, 0.120,
    # so the 0.7 nucleus holds three tokens (two at temperature 1).
    tempered = PROBS.sqrt() / PROBS.sqrt().sum()
    assert tempered[:2].sum() < 0.7 <= tempered[:3].sum()
    assert support(Sampling(temperature=2.0, top_p=0.7)) == {0, 1, 2}


def test_top_k_and_top_p_together_keep_the_smaller_set():
    assert support(Sampling(top_k=3, top_p=0.7)) == {0, 1}
    assert support(Sampling(top_k=1, top_p=0.9)) == {0}


def test_draws_follow_the_renormalized_distribution():
    tokens = drawn(Sampling(top_k=2))
    share = (tokens == 0).float().mean().item()
    want = 0.5 / 0.8
    # binomial standard deviation over DRAWS draws, five of them
    assert abs(share - want) < 5 * math.sqrt(want * (1 - want) / DRAWS)


def test_restrict_sets_the_rest_to_minus_infinity_row_by_row():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 9.0, 1.0]])
    out = restrict(logits, top_k=2)
    assert torch.isinf(out).tolist() == [[True, False, False, True], [True, True, False, False]]
    assert torch.equal(out[~torch.isinf(out)], logits[~torch.isinf(out)])


def test_the_same_seed_draws_the_same_tokens():
    assert torch.equal(drawn(Sampling(temperature=1.5), seed=3), drawn(Sampling(temperature=1.5), seed=3))
    assert not torch.equal(drawn(Sampling(temperature=1.5), seed=3), drawn(Sampling(temperature=1.5), seed=4))


@pytest.mark.parametrize(
    "bad", [dict(temperature=-0.1), dict(top_k=0), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=1.5)]
)
def test_bad_settings_are_refused_by_name(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        Sampling(**bad)
