"""Tokenization throughput into the token cache: byte and BPE tokenizers, 1 and N worker processes.

    python bench/tokenization.py --mb 64 --workers 1 2

Generates a JSONL corpus of --mb megabytes (short documents from tests/text_corpus.py's grammar),
trains a byte-level BPE tokenizer (vocabulary --vocab) on a sample of it, then builds the token
cache from scratch for each tokenizer and worker count, and once more with the cache in place (a
hit). Prints MB/s of input, tokens/s, and the peak resident memory of the building process and of
its workers above the process's size before the build (Linux /proc; workers are forked from it, and
RUSAGE_CHILDREN is the largest of every worker so far, so later rows never read lower than earlier ones).
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from text_corpus import documents, train_bpe, write_jsonl  # noqa: E402

from mesh3d.data import ByteTokenizer, HFTokenizer, build_token_cache  # noqa: E402


def _rss_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return float("nan")


def _corpus(root: Path, megabytes: float) -> Path:
    docs = documents(5000, seed=0)
    path = write_jsonl(root / "sample.jsonl", docs)
    block = path.read_text()
    with open(root / "corpus.jsonl", "w") as f:
        while f.tell() < megabytes * 1e6:
            f.write(block)
    path.unlink()
    return root / "corpus.jsonl"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=64, help="corpus size in MB")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab", type=int, default=4096)
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="mesh3d-bench-tokenize-"))
    try:
        corpus = _corpus(root, args.mb)
        size_mb = corpus.stat().st_size / 1e6
        bpe = HFTokenizer(train_bpe(root / "tok" / "tokenizer.json", documents(5000, seed=0), vocab_size=args.vocab))
        print(f"corpus: {size_mb:.1f} MB of JSONL; BPE vocabulary {bpe.vocab_size}")
        print(
            f"{'tokenizer':>10} {'workers':>7} {'seconds':>8} {'MB/s':>7} {'Mtokens/s':>9} {'main +MB':>8} "
            f"{'worker +MB':>10}"
        )
        for name, tokenizer in (("bytes", ByteTokenizer()), ("bpe", bpe)):
            for workers in args.workers:
                cache = root / f"cache-{name}-{workers}"
                before = _rss_mb("VmRSS")
                open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) from here on
                began = time.perf_counter()
                tokens = build_token_cache([corpus], tokenizer, cache_dir=cache, workers=workers)
                seconds = time.perf_counter() - began
                workers_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
                print(
                    f"{name:>10} {workers:>7} {seconds:8.2f} {size_mb / seconds:7.1f} "
                    f"{len(tokens) / seconds / 1e6:9.2f} "
                    f"{_rss_mb('VmHWM') - before:8.0f} {workers_peak - before if workers > 1 else 0:10.0f}",
                    flush=True,
                )
            began = time.perf_counter()
            build_token_cache([corpus], tokenizer, cache_dir=cache)
            print(
                f"{name:>10} {'hit':>7} {time.perf_counter() - began:8.3f}   "
                f"(the cache in place: {len(tokens):,} tokens)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
