"""Token sources, cache, samples, and the deterministic, resumable, dp-aware loader, in one process.

The loader's dp shares are built here for every dp rank side by side; test_loader_on_ranks.py checks that real
ranks at (2, 2, 2) draw the same batches."""

import sysconfig

import numpy as np
import pytest
import torch

from mesh3d.data import ByteTokenizer, DistributedLoader, TokenDataset, load_token_file, stdlib_sources, tokenize_files


@pytest.fixture
def stream():
    """A synthetic token stream whose values are their own positions (mod 251)."""
    return (np.arange(10_000) % 251).astype(np.uint8)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' * x\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256


def test_stdlib_corpus_is_the_standard_library_only():
    files = stdlib_sources()
    root = sysconfig.get_paths()["stdlib"]
    assert len(files) > 100
    assert all(str(f).startswith(root) and f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts or "dist-packages" in f.parts for f in files)
    assert any(f.name == "os.py" for f in files)
    assert files == stdlib_sources()  # stable order


def test_tokenized_text_is_cached_and_memory_mapped(tmp_path):
    docs = [tmp_path / "a.txt", tmp_path / "b.txt"]
    docs[0].write_text("hello")
    docs[1].write_text("world!")
    cache = tmp_path / "cache"
    tokens = tokenize_files(docs, cache_dir=cache)
    assert isinstance(tokens, np.memmap)
    assert bytes(tokens) == b"hello\x00world!\x00"
    [cached] = cache.glob("tokens-*.npy")
    stamp = cached.stat().st_mtime_ns
    again = tokenize_files(docs, cache_dir=cache)
    assert cached.stat().st_mtime_ns == stamp and np.array_equal(again, tokens)
    docs[1].write_text("changed")  # a changed file gets a new cache entry
    assert bytes(tokenize_files(docs, cache_dir=cache)) == b"hello\x00changed\x00"
    assert len(list(cache.glob("tokens-*.npy"))) == 2
    assert not list(cache.glob("*.tmp"))


def test_text_files_and_directories(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.md").write_text("x" * 50)
    (tmp_path / "y.txt").write_text("y" * 50)
    (tmp_path / "skip.bin").write_bytes(b"\x01" * 50)
    ds = TokenDataset.from_text_files(tmp_path, seq_len=8, cache_dir=tmp_path / "c")
    assert len(ds.tokens) == 102 and set(bytes(ds.tokens)) == {0, ord("x"), ord("y")}
    with pytest.raises(FileNotFoundError, match="not found"):
        TokenDataset.from_text_files([tmp_path / "missing.txt"], seq_len=8, cache_dir=tmp_path / "c")


def test_pre_tokenized_files(tmp_path, stream):
    ids = stream.astype(np.uint16) * 3
    np.save(tmp_path / "ids.npy", ids)
    ids.tofile(tmp_path / "ids.bin")
    for ds in (
        TokenDataset.from_token_file(tmp_path / "ids.npy", seq_len=16),
        TokenDataset.from_token_file(tmp_path / "ids.bin", seq_len=16, dtype="uint16"),
    ):
        assert np.array_equal(ds.tokens, ids)
    with pytest.raises(ValueError, match="needs its dtype"):
        load_token_file(tmp_path / "ids.bin")


def test_samples_are_shifted_windows(stream):
    ds = TokenDataset(stream, seq_len=16)
    assert len(ds) == (10_000 - 1) // 16
    single_in, single_tgt = ds[3]
    assert single_in.shape == single_tgt.shape == (16,)
    inputs, targets = ds.batch([0, 3])
    assert torch.equal(inputs[1], single_in) and torch.equal(targets[1], single_tgt)
    assert inputs.dtype == torch.int64 and inputs.shape == (2, 16)
    assert torch.equal(inputs[1], torch.from_numpy(stream[48:64].astype(np.int64)))
    assert torch.equal(targets[1], torch.from_numpy(stream[49:65].astype(np.int64)))
    with pytest.raises(ValueError, match="cannot fill one sample"):
        TokenDataset(stream[:10], seq_len=16)


def global_batches(ds, global_batch, dp, steps, start_state=None, **kw):
    """The global batch of each step, assembled from all dp ranks' shares in dp order."""
    loaders = [DistributedLoader(ds, global_batch, dp_rank=r, dp_size=dp, **kw) for r in range(dp)]
    if start_state:
        for loader in loaders:
            loader.load_state_dict(start_state)
    out = []
    for _ in range(steps):
        shares = [next(loader) for loader in loaders]
        out.append(tuple(torch.cat(parts) for parts in zip(*shares)))
    return out, loaders[0].state_dict()


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_dp_shares_cover_the_global_batch_of_dp1(stream, dp):
    ds = TokenDataset(stream, seq_len=16)
    reference, _ = global_batches(ds, 8, 1, steps=5, seed=3)
    sharded, _ = global_batches(ds, 8, dp, steps=5, seed=3)
    for (ref_in, ref_tgt), (got_in, got_tgt) in zip(reference, sharded):
        assert torch.equal(ref_in, got_in) and torch.equal(ref_tgt, got_tgt)


def test_deterministic_and_seed_dependent(stream):
    ds = TokenDataset(stream, seq_len=16)
    a, _ = global_batches(ds, 8, 1, steps=3, seed=0)
    b, _ = global_batches(ds, 8, 1, steps=3, seed=0)
    c, _ = global_batches(ds, 8, 1, steps=3, seed=1)
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))


@pytest.mark.parametrize("dp_before, dp_after", [(1, 1), (2, 4), (4, 1), (8, 2)])
def test_resume_at_the_exact_sample_under_another_dp(stream, dp_before, dp_after):
    ds = TokenDataset(stream, seq_len=16)
    uninterrupted, _ = global_batches(ds, 8, 1, steps=7, seed=5)
    _, state = global_batches(ds, 8, dp_before, steps=3, seed=5)
    assert state["position"] == 24
    resumed, _ = global_batches(ds, 8, dp_after, steps=4, start_state=state, seed=5)
    for (ref, _), (got, _) in zip(uninterrupted[3:], resumed):
        assert torch.equal(ref, got)


def test_every_sample_once_per_epoch_then_a_new_order(stream):
    ds = TokenDataset(stream[: 16 * 40 + 1], seq_len=16)  # 40 samples, 5 steps of 8 per epoch
    loader = DistributedLoader(ds, 8, seed=0)
    first_token = lambda batch: batch[0][:, 0].tolist()  # noqa: E731 - sample i starts with token 16*i % 251
    epoch0 = sum((first_token(next(loader)) for _ in range(5)), [])
    epoch1 = sum((first_token(next(loader)) for _ in range(5)), [])
    expected = sorted((16 * i) % 251 for i in range(40))
    assert sorted(epoch0) == sorted(epoch1) == expected
    assert epoch0 != epoch1 and loader.epoch == 2


def test_unshuffled_order_is_sequential(stream):
    loader = DistributedLoader(TokenDataset(stream, seq_len=16), 4, shuffle=False)
    inputs, _ = next(loader)
    assert inputs[:, 0].tolist() == [0, 16, 32, 48]


def test_loader_errors(stream):
    ds = TokenDataset(stream, seq_len=16)
    with pytest.raises(ValueError, match="global_batch_size=6 must be a positive multiple of dp_size=4"):
        DistributedLoader(ds, 6, dp_rank=0, dp_size=4)
    with pytest.raises(ValueError, match="dp_rank=4, dp_size=4"):
        DistributedLoader(ds, 8, dp_rank=4, dp_size=4)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        DistributedLoader(TokenDataset(stream[:100], seq_len=16), 8)
    state = DistributedLoader(ds, 8, seed=1).state_dict()
    with pytest.raises(ValueError, match="seed: saved 1, now 2"):
        DistributedLoader(ds, 8, seed=2).load_state_dict(state)
