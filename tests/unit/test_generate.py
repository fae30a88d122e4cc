"""Generation (examples/llama/generate.py): the KV cache gives the full forward's logits, and the
loop gives the tokens a plain full-forward loop would."""

import pytest
import torch
from generate_cases import full_forward_greedy, strengthen

from examples.llama.config import ModelArgs
from examples.llama.generate import generate
from examples.llama.kv_cache import KVCache
from examples.llama.model import Transformer
from examples.llama.sampling import Sampling
from examples.llama.trained_model import TrainedSource

TOLERANCE = 1e-5  # fp32, relative
# Grouped-query attention (8 heads, 2 kv heads), so the cache holds fewer heads than the queries use.
ARGS = ModelArgs(
    dim=64, n_layers=3, n_heads=8, n_kv_heads=2, vocab_size=96, multiple_of=16, max_seq_len=48, rope_theta=10000.0
)


def model(tied: bool = False) -> Transformer:
    with torch.device("meta"):
        m = Transformer(ARGS.with_(tie_embeddings=tied))
    return strengthen(m.to_empty(device="cpu")).eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunks", [[20], [1] * 20, [7, 1, 5, 1, 6], [12, 8]])
def test_cached_logits_equal_the_full_forward(tied, chunks):
    m = model(tied)
    tokens = torch.randint(0, ARGS.vocab_size, (3, sum(chunks)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(tokens)
        cache = KVCache(m.args, batch_size=3, max_len=sum(chunks))
        pieces, start = [], 0
        for size in chunks:  # the prompt in one piece or several, then one position at a time
            pieces.append(m(tokens[:, start : start + size], cache=cache))
            start += size
    assert cache.length == sum(chunks)
    assert relative_error(torch.cat(pieces, dim=1), want) <= TOLERANCE


def test_a_cache_refuses_more_positions_than_it_holds():
    m = model()
    cache = KVCache(m.args, batch_size=1, max_len=4)
    with torch.no_grad():
        m(torch.zeros(1, 3, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="max_len=4"):
            m(torch.zeros(1, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="max_seq_len=48"):
        KVCache(m.args, batch_size=1, max_len=49)


@pytest.mark.parametrize("prompt", [[5], [1, 2, 3], list(range(10, 30))])
def test_greedy_generation_equals_the_full_forward_loop(prompt):
    m = model()
    got = generate(m, prompt, 16, Sampling(temperature=0))
    assert got.tolist() == [full_forward_greedy(m, prompt, 16)]


def test_rows_stop_at_the_stop_id_and_generation_ends_when_all_have():
    m = model()
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    free = generate(m, prompts, 12, Sampling(temperature=0))
    stop = int(free[0, 2])  # what row 0 writes third
    first = {row: next(i for i, t in enumerate(free[row].tolist() + [stop]) if t == stop) for row in (0, 1)}
    got = generate(m, prompts, 12, Sampling(temperature=0), stop_id=stop)
    assert got.shape[1] == min(12, max(first.values()) + 1)
    for row in (0, 1):
        assert got[row, : first[row]].tolist() == free[row, : first[row]].tolist()
        assert set(got[row, first[row] :].tolist()) <= {stop}


def test_sampling_is_seeded_and_stays_below_vocab_size():
    m = model()
    hot = Sampling(temperature=5.0)  # nearly uniform: every id would turn up
    a = generate(m, [[1, 2]] * 8, 20, hot, seed=7, vocab_size=10)
    assert a.max() < 10
    assert torch.equal(a, generate(m, [[1, 2]] * 8, 20, hot, seed=7, vocab_size=10))
    assert not torch.equal(a, generate(m, [[1, 2]] * 8, 20, hot, seed=8, vocab_size=10))


def test_generation_longer_than_the_model_is_refused_with_the_numbers():
    m = model()
    with pytest.raises(ValueError, match=r"need 50 positions.*max_seq_len=48"):
        generate(m, list(range(10)), 40)
    with pytest.raises(ValueError, match="non-empty"):
        generate(m, [], 4)


def test_a_directory_that_holds_no_model_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        TrainedSource.open(tmp_path)
