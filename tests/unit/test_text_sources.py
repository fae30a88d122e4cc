"""Bring-your-own corpus and tokenizer, in one process: Hugging Face tokenizers, .txt/.jsonl/.parquet
sources streamed into the token cache by worker processes, and the held-out split.

References are computed independently of the code under test: ids straight from the `tokenizers`
library document by document, sample ids carried in the tokens themselves. (The memory bound and
evaluation at (2, 2, 2): tests/distributed/test_text_data.py.)
"""

import json

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from text_corpus import END_OF_TEXT, documents, train_bpe, write_jsonl, write_parquet  # noqa: E402

from mesh3d.data import (  # noqa: E402  # noqa: E402
    ByteTokenizer,
    DistributedLoader,
    HFTokenizer,
    TokenDataset,
    build_token_cache,
    sources,
    split_heldout,
    token_cache,
)


@pytest.fixture(scope="module")
def docs():
    return documents(300, seed=1)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory, docs):
    return train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json", docs)


def reference_stream(tokenizer_path, docs, separator="eos") -> np.ndarray:
    """Each document's ids from the `tokenizers` library itself, with the separator after (or before) it."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    sep = [tok.token_to_id(END_OF_TEXT)]
    ids = []
    for doc in docs:
        own = tok.encode(doc, add_special_tokens=False).ids
        ids += own + sep if separator == "eos" else sep + own
    return np.array(ids)


def test_hf_tokenizer_declares_its_separator(tmp_path, bpe, docs):
    tok = HFTokenizer(bpe)
    assert tok.vocab_size == 384 and tok.dtype == np.uint16
    assert (tok.separator, tok.separator_token, tok.separator_id) == ("eos", END_OF_TEXT, 0)
    assert tok.decode(tok.encode(docs[0])) == docs[0]
    assert HFTokenizer(bpe.parent).name == tok.name  # the directory names its tokenizer.json

    # tokenizer_config.json beside it is the most explicit declaration: here a BOS-only tokenizer.
    bos_dir = tmp_path / "bos"
    bos_dir.mkdir()
    (bos_dir / "tokenizer.json").write_text(bpe.read_text())
    (bos_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": END_OF_TEXT}}))
    bos = HFTokenizer(bos_dir)
    assert bos.separator == "bos" and bos.name != tok.name

    # A TemplateProcessing post-processor declares it too ("$A <eos>" here).
    from tokenizers import Tokenizer, processors

    templated = Tokenizer.from_file(str(bpe))
    templated.post_processor = processors.TemplateProcessing(
        single=f"$A {END_OF_TEXT}", special_tokens=[(END_OF_TEXT, 0)]
    )
    (tmp_path / "templated").mkdir()
    templated.save(str(tmp_path / "templated" / "tokenizer.json"))
    assert HFTokenizer(tmp_path / "templated").separator == "eos"

    bare = train_bpe(tmp_path / "bare" / "tokenizer.json", docs)
    spec = json.loads(bare.read_text())
    spec["added_tokens"] = []
    bare.write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="declares no end-of-sequence"):
        HFTokenizer(bare)


def test_every_format_streams_the_same_documents(tmp_path, bpe, docs, monkeypatch):
    """txt (a file a document), jsonl and parquet (several row groups), through 2 worker processes with spans
    and batches so small that files are cut mid-way: the ids of the documents in order, each once."""
    monkeypatch.setattr(token_cache, "SPAN_BYTES", 2000)
    monkeypatch.setattr(sources, "BATCH_CHARS", 500)
    tok = HFTokenizer(bpe)
    want = reference_stream(bpe, docs)
    text_dir = tmp_path / "txt"
    text_dir.mkdir()
    for i, doc in enumerate(docs):
        (text_dir / f"{i:04d}.txt").write_text(doc)
    write_jsonl(tmp_path / "shards" / "a.jsonl", docs[:150])
    write_jsonl(tmp_path / "shards" / "b.jsonl", docs[150:])
    write_parquet(tmp_path / "docs.parquet", docs, field="body", row_group_size=40)
    cases = {
        "a directory of .txt": ([text_dir], "text"),
        "a glob of .jsonl": ([str(tmp_path / "shards" / "*.jsonl")], "text"),
        "parquet row groups": ([tmp_path / "docs.parquet"], "body"),
    }
    for name, (paths, field) in cases.items():
        got = build_token_cache(paths, tok, text_field=field, cache_dir=tmp_path / "cache", workers=2)
        assert got.dtype == np.uint16 and np.array_equal(got, want), name
    bos_stream = build_token_cache(
        [tmp_path / "docs.parquet"],
        _bos_tokenizer(tmp_path, bpe),
        text_field="body",
        cache_dir=tmp_path / "cache",
        workers=2,
    )
    assert np.array_equal(bos_stream, reference_stream(bpe, docs, separator="bos"))


def _bos_tokenizer(tmp_path, bpe) -> HFTokenizer:
    (tmp_path / "bos").mkdir(exist_ok=True)
    (tmp_path / "bos" / "tokenizer.json").write_text(bpe.read_text())
    (tmp_path / "bos" / "tokenizer_config.json").write_text(json.dumps({"bos_token": END_OF_TEXT}))
    return HFTokenizer(tmp_path / "bos")


def test_a_long_text_file_is_cut_at_line_starts_and_stays_one_document(tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "SPAN_BYTES", 1000)
    monkeypatch.setattr(sources, "BATCH_CHARS", 300)
    text = "".join(f"line {i} é\n" * (i % 3) + ("\n" if i % 7 == 0 else "") for i in range(800)).encode()
    (tmp_path / "long.txt").write_bytes(text + b"\xff no newline at the end")  # not UTF-8: bytes kept as they are
    got = build_token_cache([tmp_path / "long.txt"], ByteTokenizer(), cache_dir=tmp_path / "c", workers=2)
    assert bytes(got) == text + b"\xff no newline at the end\x00"


def test_cache_hits_and_rebuilds(tmp_path, bpe, docs):
    shard = write_jsonl(tmp_path / "a.jsonl", docs[:50])
    cache = tmp_path / "cache"
    first = build_token_cache([shard], HFTokenizer(bpe), cache_dir=cache)
    [cached] = cache.glob("tokens-*.npy")
    stamp = cached.stat().st_mtime_ns
    again = build_token_cache([shard], HFTokenizer(bpe), cache_dir=cache)
    assert cached.stat().st_mtime_ns == stamp and np.array_equal(first, again)  # a hit: nothing rewritten

    write_jsonl(shard, docs[:49])  # a changed file: a new entry with the new contents
    assert np.array_equal(
        build_token_cache([shard], HFTokenizer(bpe), cache_dir=cache), reference_stream(bpe, docs[:49])
    )
    other = train_bpe(tmp_path / "other" / "tokenizer.json", docs, vocab_size=320)  # another tokenizer
    assert np.array_equal(
        build_token_cache([shard], HFTokenizer(other), cache_dir=cache), reference_stream(other, docs[:49])
    )
    assert len(list(cache.glob("tokens-*.npy"))) == 3
    assert not list(cache.glob("*.tmp")) and not list(cache.glob("*.parts"))


def test_source_errors(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["x"], field="content")
    with pytest.raises(ValueError, match="no string field 'text'.*'content'.*text_field"):
        build_token_cache([tmp_path / "a.jsonl"], ByteTokenizer(), cache_dir=tmp_path / "c")
    write_parquet(tmp_path / "a.parquet", ["x"], field="content")
    with pytest.raises(ValueError, match="no column 'text'.*text_field"):
        build_token_cache([tmp_path / "a.parquet"], ByteTokenizer(), cache_dir=tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="matches no file"):
        build_token_cache([str(tmp_path / "*.json")], ByteTokenizer(), cache_dir=tmp_path / "c")
    assert not list((tmp_path / "c").glob("*.npy"))


def test_heldout_samples_are_never_trained_on():
    seq_len = 4
    ids = np.repeat(np.arange(1000, dtype=np.int32), seq_len)  # every token of sample i is i
    dataset = TokenDataset(np.append(ids, 0), seq_len)
    train, heldout = split_heldout(dataset, 64, seed=7)
    assert len(heldout) == 64 and len(train) == len(dataset) - 64
    assert set(heldout.ids).isdisjoint(train.ids) and set(heldout.ids) | set(train.ids) == set(range(1000))
    again_train, again_heldout = split_heldout(dataset, 64, seed=7)
    assert np.array_equal(again_heldout.ids, heldout.ids) and np.array_equal(again_train.ids, train.ids)
    assert not np.array_equal(split_heldout(dataset, 64, seed=8)[1].ids, heldout.ids)

    loader = DistributedLoader(train, 16, seed=7)
    seen = set()
    for _ in range(2 * len(train) // 16):  # two epochs
        inputs, _ = next(loader)
        seen |= set(inputs[:, 0].tolist())
    assert seen == set(train.ids.tolist())  # by id: every training sample, no held-out one
    inputs, _ = heldout.batch([0, 1])
    assert inputs[:, 0].tolist() == heldout.ids[:2].tolist()
    with pytest.raises(ValueError, match="cannot hold out 1000 of 1000"):
        split_heldout(dataset, 1000, seed=0)
