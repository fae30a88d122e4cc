"""The tokenizer's journey into the model: which token ends a document, and how many embedding rows.

- `HFTokenizer(path, eos_token=...)` takes the choice; a tokenizer with exactly one special token
  uses it; one that declares none is refused listing its special tokens and naming `eos_token`
  (train.py: `--eos-token`).
- train.py takes the vocabulary from the tokenizer when `--vocab-size` is not given, padded to a
  multiple of lcm(64, tp); a smaller `--vocab-size` is refused naming both sizes.
- The padding rows are never an input or a target: every id of a tokenized corpus is below the
  tokenizer's size (checked against the `tokenizers` library itself), and the model declares that
  size, so the batch check refuses an id in the padding rows.
"""

import json
import math
from argparse import Namespace

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

from text_corpus import documents, train_bpe, write_jsonl  # noqa: E402

from examples.llama.config import ModelArgs, get_config, padded_vocab_size  # noqa: E402
from examples.llama.model import Transformer  # noqa: E402
from examples.llama.text_data import build_datasets, build_tokenizer, fit_vocab  # noqa: E402
from mesh3d.data import HFTokenizer, TokenDataset  # noqa: E402
from mesh3d.data.hf_tokenizer import NoEOSTokenError  # noqa: E402
from mesh3d.model.intake import anatomy_of  # noqa: E402
from mesh3d.step.batch_check import batch_problem, declared_vocab_size  # noqa: E402

END = "<|end|>"


@pytest.fixture(scope="module")
def docs():
    return documents(200, seed=2)


@pytest.fixture(scope="module")
def own_end(tmp_path_factory, docs):
    """300 tokens, one special token of its own name, no tokenizer_config.json."""
    return train_bpe(tmp_path_factory.mktemp("own") / "tokenizer.json", docs, vocab_size=300, special_tokens=[END])


@pytest.fixture(scope="module")
def two_specials(tmp_path_factory, docs):
    return train_bpe(
        tmp_path_factory.mktemp("two") / "tokenizer.json", docs, vocab_size=300, special_tokens=["<pad>", END]
    )


def _args(**flags) -> Namespace:
    defaults = dict(tokenizer=None, init_from_hf=None, eos_token=None, token_file=None, vocab_size=None, tp=1)
    return Namespace(**{**defaults, **flags})


def test_a_single_special_token_ends_each_document(own_end, docs):
    from tokenizers import Tokenizer

    tok = HFTokenizer(own_end)
    reference = Tokenizer.from_file(str(own_end))
    assert tok.vocab_size == reference.get_vocab_size() == 300
    assert (tok.separator, tok.separator_token, tok.separator_id) == ("eos", END, reference.token_to_id(END))


def test_eos_token_chooses_among_several(two_specials):
    with pytest.raises(NoEOSTokenError) as refused:
        HFTokenizer(two_specials)
    message = str(refused.value)
    assert "['<pad>', '<|end|>']" in message and "eos_token=TOKEN" in message and "--" not in message
    assert refused.value.special_tokens == ["<pad>", END]

    chosen = HFTokenizer(two_specials, eos_token=END)
    assert (chosen.separator, chosen.separator_id) == ("eos", 1)
    assert HFTokenizer(two_specials, eos_token="<pad>").name != chosen.name  # another separator, another cache

    with pytest.raises(NoEOSTokenError, match=r"'<\|nope\|>' is not in the vocabulary.*\['<pad>', '<\|end\|>'\]"):
        HFTokenizer(two_specials, eos_token="<|nope|>")


def test_an_explicit_eos_token_wins_over_the_declared_one(tmp_path, own_end):
    (tmp_path / "tokenizer.json").write_text(own_end.read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": END}))
    assert HFTokenizer(tmp_path).separator == "bos"
    assert HFTokenizer(tmp_path, eos_token=END).separator == "eos"


def test_the_trainer_words_the_refusal_in_its_flag(two_specials):
    with pytest.raises(SystemExit, match=r"\['<pad>', '<\|end\|>'\].*--eos-token TOKEN"):
        build_tokenizer(_args(tokenizer=str(two_specials)))
    assert build_tokenizer(_args(tokenizer=str(two_specials), eos_token="<pad>")).separator_id == 0
    with pytest.raises(SystemExit, match="--eos-token <pad> needs a Hugging Face tokenizer"):
        build_tokenizer(_args(eos_token="<pad>"))


def test_padded_vocab_size_rule():
    for tokens in (1, 63, 64, 65, 256, 300, 50257, 128256):
        for tp in (1, 2, 3, 4, 6, 8, 16):
            padded = padded_vocab_size(tokens, tp)
            step = math.lcm(64, tp)
            assert padded % tp == 0 and padded % 64 == 0 and tokens <= padded < tokens + step, (tokens, tp)
    assert padded_vocab_size(300) == 320 and padded_vocab_size(50257) == 50304 and padded_vocab_size(256) == 256
    # The same rows under every power-of-two tp up to 64: a checkpoint resumes under any of them.
    assert {padded_vocab_size(300, tp) for tp in (1, 2, 4, 8, 16, 32, 64)} == {320}


def test_the_vocabulary_comes_from_the_tokenizer(own_end):
    tok = HFTokenizer(own_end)
    debug = get_config("debug")
    taken = fit_vocab(debug, tok, _args(tp=2))
    assert (taken.vocab_size, taken.tokenizer_vocab_size) == (320, 300)
    given = fit_vocab(debug.with_(vocab_size=512), tok, _args(vocab_size=512))
    assert (given.vocab_size, given.tokenizer_vocab_size) == (512, 300)
    with pytest.raises(SystemExit, match=r"--vocab-size 256 is smaller than the tokenizer's 300 .*--vocab-size 300"):
        fit_vocab(debug, tok, _args(vocab_size=256))
    assert fit_vocab(debug, tok, _args(token_file="ids.npy")) == debug  # pre-tokenized: no tokenizer to follow
    with pytest.raises(ValueError, match="tokenizer_vocab_size=300 must be in"):
        debug.with_(vocab_size=256, tokenizer_vocab_size=300)


def test_padding_rows_are_never_a_target(tmp_path, own_end, docs):
    from tokenizers import Tokenizer

    tok = HFTokenizer(own_end)
    config = fit_vocab(get_config("debug", n_layers=1), tok, _args(tp=8))
    assert config.vocab_size == 320
    shard = write_jsonl(tmp_path / "docs.jsonl", docs)
    dataset = TokenDataset.from_corpus([shard], 16, tok, cache_dir=tmp_path / "cache", workers=1)
    # Every id the samples hold (inputs and targets: one stream) against the tokenizers library's own.
    reference = Tokenizer.from_file(str(own_end))
    end = reference.token_to_id(END)
    want = [i for doc in docs for i in reference.encode(doc, add_special_tokens=False).ids + [end]]
    assert np.array_equal(np.asarray(dataset.tokens), want)
    targets = np.concatenate([dataset[i][1].numpy() for i in range(len(dataset))])
    assert targets.max() < 300 <= config.vocab_size

    with torch.device("meta"):
        model = Transformer(config)
    assert model.tok_embeddings.weight.shape[0] == model.output.weight.shape[0] == 320
    assert declared_vocab_size(anatomy_of(model).vocab_size) == 300  # what parallelize hands the batch check
    inputs = torch.zeros(2, 4, dtype=torch.long)
    ok = torch.full((2, 4), 299)
    assert batch_problem(inputs, ok, declared_vocab_size(anatomy_of(model).vocab_size)) is None
    padding = ok.clone()
    padding[1, 2] = 300  # the first padding row
    assert "target 300 at position (1, 2) is outside [0, 300)" in batch_problem(inputs, padding, 300)
    assert "input token id 319" in batch_problem(torch.full((2, 4), 319), ok, 300)
    with torch.device("meta"):  # a model without padding declares all its rows, as before
        unpadded = Transformer(ModelArgs(dim=32, n_layers=1, n_heads=4, vocab_size=64))
    assert declared_vocab_size(anatomy_of(unpadded).vocab_size) == 64


def test_library_errors_name_library_parameters_and_the_trainer_adds_its_flags(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "a.jsonl", ["x"], field="content")
    args = Namespace(
        token_file=None,
        data=[str(tmp_path / "a.jsonl")],
        seq_len=4,
        text_field="text",
        tokenize_workers=1,
        eval_every=0,
    )
    with pytest.raises(ValueError, match="pass the field's name as text_field") as refused:
        TokenDataset.from_corpus(args.data, 4, cache_dir=tmp_path / "c")
    assert "--" not in str(refused.value)
    with pytest.raises(FileNotFoundError, match=r"paths: the pattern .* matches no file"):
        TokenDataset.from_corpus([str(tmp_path / "*.parquet")], 4, cache_dir=tmp_path / "c")
    monkeypatch.setenv("MESH3D_CACHE", str(tmp_path / "c"))
    with pytest.raises(ValueError) as refused:
        build_datasets(args, None)
    assert "--text-field" in refused.value.__notes__[0] and "--data" in refused.value.__notes__[0]
