"""The test side of the errors-on-every-rank harness (rank_errors.py): what it lets through and what it fails."""

import pytest
from rank_errors import assert_raised_on_every_rank

EXPECTED = {"bad size": "tp=4 does not divide"}


def test_every_rank_with_the_expected_error_passes_and_other_cases_are_left_alone():
    per_rank = [{"bad size": "ValueError: tp=4 does not divide n_heads=6", "still works": True}] * 4
    assert_raised_on_every_rank(per_rank, EXPECTED)


@pytest.mark.parametrize(
    "message, says",
    [
        (None, "rank 2: bad size did not raise"),
        ("NotImplementedError: tp=4 does not divide n_heads=6", "NotImplementedError"),
        ("ValueError: something else", "rank 2: bad size: ValueError: something else"),
    ],
)
def test_one_rank_without_the_error_fails_naming_it(message, says):
    per_rank = [{"bad size": "ValueError: tp=4 does not divide n_heads=6"}] * 4
    per_rank[2] = {"bad size": message}
    with pytest.raises(AssertionError, match=says):
        assert_raised_on_every_rank(per_rank, EXPECTED)
