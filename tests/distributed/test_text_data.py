"""The token cache and the held-out split at scale and on ranks: a 200 MB corpus tokenized with a bounded rise
in memory (in a fresh interpreter, so its peak is its own), and held-out evaluation at (2, 2, 2) equal to one
process. (Tokenizers, sources, the cache and the split in one process: tests/unit/test_text_sources.py.)
"""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from multiprocess import run_on_ranks
from test_torchrun import ROOT

from mesh3d.data import TokenDataset, split_heldout

_MEMORY_PROBE = """
import os, resource, sys
from pathlib import Path
from mesh3d.data import ByteTokenizer, build_token_cache

def rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024

root = Path(sys.argv[1])
block = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\\n" for i in range(20_000))
with open(root / "book.txt", "w") as f:  # one 100 MB document
    while f.tell() < 100e6:
        f.write(block)
with open(root / "docs.jsonl", "w") as f:  # 100 MB of short documents
    text = "a short document " * 20
    line = '{"text": "%s"}\\n' % text
    f.write(line * int(100e6 // len(line)))
expected = (root / "book.txt").stat().st_size + 1 + int(100e6 // len(line)) * (len(text) + 1)
corpus_mb = sum(p.stat().st_size for p in root.iterdir()) / 1e6
before = rss_mb("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
tokens = build_token_cache(
    [root / "book.txt", root / "docs.jsonl"], ByteTokenizer(), cache_dir=root / "cache", workers=2
)
main_peak = rss_mb("VmHWM")
workers_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # forked from this process at `before`
book = (root / "book.txt").open("rb").read(1000)
assert bytes(tokens[:1000]) == book and bytes(tokens[-len(text) - 1:]) == text.encode() + b"\\0"
print(corpus_mb, len(tokens), expected, main_peak - before, workers_peak - before)
"""


def test_a_corpus_larger_than_the_memory_it_uses(tmp_path):
    """200 MB tokenized with a rise in resident memory (main process and each worker) under 100 MB."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_MEMORY_PROBE), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    corpus_mb, tokens, expected, main_rise, worker_rise = map(float, done.stdout.split())
    assert corpus_mb >= 200 and tokens == expected
    assert main_rise < 100 and worker_rise < 100, (main_rise, worker_rise)


def _tokenize_in_a_daemon(root: str):
    from pathlib import Path

    from mesh3d.data import ByteTokenizer, build_token_cache, token_cache

    token_cache.SPAN_BYTES = 1 << 12  # several tasks: the parallel path, were it taken
    (Path(root) / "a.txt").write_text("a line of text\n" * 2000)
    tokens = build_token_cache([Path(root) / "a.txt"], ByteTokenizer(), cache_dir=root, workers=2)
    return len(tokens), bytes(tokens[:15])


def test_a_daemonic_process_tokenizes_in_itself(tmp_path):
    """A launcher's daemonic worker (run_on_ranks' ranks, multiprocessing's pools) may start no
    process: the cache is built there in one process rather than failing on an empty cache."""
    [(count, head)] = run_on_ranks(_tokenize_in_a_daemon, 1, str(tmp_path), timeout=60)
    assert count == 2000 * 15 + 1 and head == b"a line of text\n"


def _heldout_eval(pp: int, dp: int, tp: int):
    import torch

    import mesh3d
    from examples.llama.config import get_config
    from examples.llama.model import Transformer, llama_tp_plan
    from mesh3d.train import HeldOutEvaluator

    layout = mesh3d.build_mesh(pp=pp, dp=dp, tp=tp)
    with torch.device("meta"):
        model = Transformer(get_config("debug", n_layers=4, max_seq_len=32))
    pm = mesh3d.parallelize(model, layout, tp_plan=llama_tp_plan())
    tokens = np.random.default_rng(0).integers(0, 256, 32 * 200 + 1).astype(np.uint8)
    _, heldout = split_heldout(TokenDataset(tokens, 32), 3 * 8, seed=5)
    evaluator = HeldOutEvaluator(heldout, 8, layout, batches=3)
    shares = [inputs[:, 0].tolist() for inputs, _ in evaluator.batches]
    return evaluator(pm), shares, layout.coordinate


def test_eval_loss_at_222_equals_one_process():
    [(reference, whole_batches, _)] = run_on_ranks(_heldout_eval, 1, 1, 1, 1, timeout=120)
    per_rank = run_on_ranks(_heldout_eval, 8, 2, 2, 2, timeout=120)
    for metrics, _, _ in per_rank:
        assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
        assert metrics["eval_perplexity"] == pytest.approx(np.exp(metrics["eval_loss"]), rel=1e-12)
    assert 5.0 < reference["eval_loss"] < 6.5  # an untrained model on random bytes: about ln 256
    shares = {dp_rank: batches for _, batches, (_, dp_rank, _) in per_rank}
    assert [a + b for a, b in zip(shares[0], shares[1])] == whole_batches  # the same held-out batches, split by dp
