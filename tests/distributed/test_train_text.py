"""train.py on your own corpus and tokenizer: a BPE tokenizer.json trained here, JSONL and Parquet shards.

- One process and (pp, dp, tp) = (2, 1, 2) on 4 ranks train with the same losses and the same
  held-out eval losses (relative 1e-4, as in test_torchrun.py), and the loss falls.
- The second run finds the token cache the first one built (it tokenizes nothing).
- The one-process run's step-3 checkpoint resumed at dp=2 gives the same later losses and eval loss:
  the held-out split and the data position survive a change of layout.
- A tokenizer larger than the model's vocabulary is refused, naming both sizes.
- A new user's journey: a tokenizer.json of 300 tokens whose one special token is its own `<|end|>`,
  no tokenizer_config.json, and only --tokenizer and --data: it trains at tp=2 (2 ranks here, for
  cost; the README's 8-rank command was run by hand) with the vocabulary padded to 320 rows.
"""

import json
import math
import shutil
import subprocess

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("pyarrow")

from test_torchrun import TIMEOUT_S, _assert_close  # noqa: E402
from text_corpus import documents, train_bpe, write_jsonl, write_parquet  # noqa: E402
from train_launch import run_train  # noqa: E402

STEPS = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = documents(1200, seed=3)
    tokenizer = train_bpe(root / "tokenizer" / "tokenizer.json", docs, vocab_size=384)
    write_jsonl(root / "shards" / "part-0.jsonl", docs[:500])
    write_jsonl(root / "shards" / "part-1.jsonl", docs[500:800])
    write_parquet(root / "extra.parquet", docs[800:], row_group_size=100)
    return root, tokenizer


def _flags(corpus) -> list[str]:
    root, tokenizer = corpus
    return [
        "--tokenizer",
        str(tokenizer),
        "--vocab-size",
        "384",
        "--data",
        str(root / "shards" / "*.jsonl"),
        str(root / "extra.parquet"),
        "--n-layers",
        "4",
        "--seq-len",
        "32",
        "--global-batch",
        "8",
        "--steps",
        str(STEPS),
        "--warmup",
        "2",
        "--eval-every",
        "4",
        "--eval-batches",
        "2",
        "--log-every",
        "1",
    ]


def _run(corpus, *args: str, torchrun: int = 0, check: bool = True) -> subprocess.CompletedProcess:
    """train.py in one process, or on `torchrun` ranks as torchrun starts them (tests/train_launch.py)."""
    env = {"MESH3D_CACHE": str(corpus[0] / "cache")}
    return run_train([*_flags(corpus), *args], nproc=torchrun, env=env, timeout=TIMEOUT_S, check=check)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bpe_on_jsonl_and_parquet_one_process_and_212_and_resumed(tmp_path, corpus):
    ckpt = tmp_path / "ckpt"
    one = _run(
        corpus, "--metrics", str(tmp_path / "one.jsonl"), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"
    )
    assert "tokenizing: 100%" in one.stderr and "HFTokenizer(" in one.stdout
    assert "eval_loss" in one.stdout and "eval_ppl" in one.stdout
    straight = _records(tmp_path / "one.jsonl")
    losses = [r["loss"] for r in straight]
    assert losses[0] == pytest.approx(math.log(384), rel=0.05)  # a uniform guess over the BPE vocabulary
    assert sum(losses[-2:]) / 2 < losses[0] - 1.0, losses
    evals = [(r["step"], r["eval_loss"]) for r in straight if "eval_loss" in r]
    assert [step for step, _ in evals] == [4, 8] and evals[1][1] < evals[0][1]
    assert all(r["eval_perplexity"] == pytest.approx(math.exp(r["eval_loss"])) for r in straight if "eval_loss" in r)

    layout = _run(corpus, "--pp", "2", "--dp", "1", "--tp", "2", "--metrics", str(tmp_path / "212.jsonl"), torchrun=4)
    assert "tokenizing" not in layout.stderr  # the cache the first run built
    assert len(list((corpus[0] / "cache").glob("tokens-*.npy"))) == 1
    parallel = _records(tmp_path / "212.jsonl")
    assert parallel[0]["loss"] == pytest.approx(straight[0]["loss"], rel=1e-5)
    _assert_close([r["loss"] for r in parallel], losses)
    _assert_close([r["eval_loss"] for r in parallel if "eval_loss" in r], [loss for _, loss in evals])

    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    shutil.copytree(ckpt / "step4", resume_dir / "step4")
    _run(
        corpus,
        "--dp",
        "2",
        "--checkpoint-dir",
        str(resume_dir),
        "--resume",
        "--metrics",
        str(tmp_path / "resumed.jsonl"),
        torchrun=2,
    )
    resumed = _records(tmp_path / "resumed.jsonl")
    assert [r["step"] for r in resumed] == list(range(5, STEPS + 1))
    _assert_close([r["loss"] for r in resumed], losses[4:])
    _assert_close([resumed[-1]["eval_loss"]], [evals[1][1]])


def test_a_tokenizer_larger_than_the_model_is_refused(corpus):
    done = _run(corpus, "--vocab-size", "256", "--metrics", "", check=False)
    assert done.returncode != 0
    assert "--vocab-size 256 is smaller than the tokenizer's 384 tokens" in done.stderr
    assert "pass --vocab-size 384 or more" in done.stderr


def test_a_tokenizer_with_its_own_end_token_and_no_flags_but_tokenizer_and_data(tmp_path):
    docs = documents(600, seed=4)
    tokenizer = train_bpe(tmp_path / "tok" / "tokenizer.json", docs, vocab_size=300, special_tokens=["<|end|>"])
    write_jsonl(tmp_path / "corpus.jsonl", docs)
    argv = [
        "--tp",
        "2",
        "--tokenizer",
        str(tokenizer),
        "--data",
        str(tmp_path / "corpus.jsonl"),
        # cost only: fewer and shorter steps than the defaults
        "--n-layers",
        "2",
        "--seq-len",
        "32",
        "--steps",
        "4",
        "--log-every",
        "1",
        "--metrics",
        str(tmp_path / "train.jsonl"),
        "--export-hf",
        str(tmp_path / "hf"),
    ]
    done = run_train(argv, nproc=2, env={"MESH3D_CACHE": str(tmp_path / "cache")}, timeout=TIMEOUT_S)
    assert "eos='<|end|>' (id 0)" in done.stdout
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["vocab_size"] == 320  # 300 tokens padded to a multiple of 64 (and of tp)
    losses = [r["loss"] for r in _records(tmp_path / "train.jsonl")]
    assert len(losses) == 4 and losses[0] == pytest.approx(math.log(320), rel=0.05) and losses[-1] < losses[0]


def test_which_tokenizer(tmp_path, corpus):
    from argparse import Namespace

    from examples.llama.text_data import build_tokenizer
    from mesh3d.data import ByteTokenizer, HFTokenizer

    hf_dir = tmp_path / "llama"
    hf_dir.mkdir()
    own = corpus[1]
    other = train_bpe(hf_dir / "tokenizer.json", documents(50), vocab_size=300)
    pick = lambda tokenizer, init_from_hf: build_tokenizer(  # noqa: E731
        Namespace(tokenizer=tokenizer, init_from_hf=init_from_hf, eos_token=None)
    )
    assert isinstance(pick(None, None), ByteTokenizer)
    assert isinstance(pick(None, str(tmp_path)), ByteTokenizer)  # a Hugging Face directory without tokenizer.json
    assert pick(None, str(hf_dir)).path == other and isinstance(pick(None, str(hf_dir)), HFTokenizer)
    assert pick(str(own), str(hf_dir)).path == own  # one named on the command line wins
