"""train.py --help states each flag's default where it is a value (examples/llama/arguments.py)."""

import re

from examples.llama.arguments import build_parser


def _help() -> str:
    return re.sub(r"\s+", " ", build_parser().format_help())  # the terminal's width aside


def test_help_shows_the_defaults():
    said = _help()
    for flag, default in (
        ("--warmup WARMUP", 20),
        ("--lr LR", 0.003),
        ("--steps STEPS", 200),
        ("--seq-len SEQ_LEN", 128),
    ):
        assert re.search(rf"{flag} [^-]*\(default: {default}\)", said), flag
    assert "sequences per optimizer step, all ranks together (default: 16)" in said  # --global-batch
    assert "(default: interleaved_1f1b)" in said and "(default: debug)" in said


def test_help_says_no_default_twice_nor_none():
    said = _help()
    assert "(default: None)" not in said and "(default: False)" not in said
    assert "(default: pp) (default" not in said  # --microbatches says its own
