"""Tokenize a corpus once, in parallel worker processes, into a memory-mapped `.npy` token cache.

The cache file `tokens-<fingerprint>.npy` is keyed by the files' paths, sizes and modification
times, the tokenizer (its name changes with its vocabulary and separator) and, for JSONL and
Parquet, the text field: a second run with the same inputs opens it in milliseconds; a changed
file or tokenizer builds a new one.

Building streams: each worker tokenizes one span of a file at a time (sources.py) and writes its
ids to a part file; the parts are then concatenated behind an .npy header. No process ever holds
more than a batch of text and its ids, so a corpus larger than memory works. One process builds a
given cache while the others wait on a file lock (the ranks of a torchrun job all ask for it), and
the result appears by an atomic rename, so no reader sees a partial file.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from mesh3d.data.sources import Span, expand_data_paths, file_format, iter_documents, plan_spans

# Work for one task: small enough that two workers share even a single file, large enough that the
# per-task cost (a process round trip, a part file) is noise.
SPAN_BYTES = 8 << 20


def default_cache_dir() -> Path:
    return Path(os.environ.get("MESH3D_CACHE", Path.home() / ".cache" / "mesh3d"))


def default_workers() -> int:
    """The CPUs this process may run on (its affinity, under a batch scheduler), at most 8."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cpus or 1))


def build_token_cache(
    paths,
    tokenizer,
    *,
    text_field: str = "text",
    cache_dir: str | Path | None = None,
    workers: int | None = None,
    progress: bool = False,
) -> np.ndarray:
    """The corpus at `paths` (files, directories, globs) as one memory-mapped 1-D array of token ids.

    Each document is followed by the tokenizer's end-of-document id (or preceded by its
    beginning-of-document id, for a tokenizer that declares only that). `tokenizer` is a
    `ByteTokenizer`, an `HFTokenizer`, or anything with `name`, `dtype`, `separator` ("eos" or
    "bos"), `separator_id` and `encode_batch(texts) -> list of arrays`. `workers` processes
    tokenize (default: the CPU count, at most 8; one, this process, inside a daemonic process,
    which may start none); `progress` prints a progress line to stderr.
    """
    files = expand_data_paths(paths)
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"data files not found: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    cached = cache_dir / f"tokens-{fingerprint(files, tokenizer, text_field)}.npy"
    if not cached.exists():
        with _exclusive(cached.with_suffix(".lock")):
            if not cached.exists():  # another process may have built it while this one waited
                if multiprocessing.current_process().daemon:
                    # a launcher's daemonic worker (multiprocessing's pool, a test's ranks) may
                    # start no child: tokenize here rather than fail
                    workers = 1
                _build(files, tokenizer, text_field, cached, workers or default_workers(), progress)
    return np.load(cached, mmap_mode="r")


def fingerprint(files: list[Path], tokenizer, text_field: str = "text") -> str:
    """What the cache is keyed by: the tokenizer, each file's path, size and mtime, the text field where it matters."""
    digest = hashlib.sha256(tokenizer.name.encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    if any(file_format(p) != "text" for p in files):
        digest.update(f"field\0{text_field}".encode())
    return digest.hexdigest()[:20]


@contextmanager
def _exclusive(lock_path: Path):
    import fcntl

    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(files, tokenizer, text_field: str, cached: Path, workers: int, progress: bool) -> None:
    tasks = _tasks(plan_spans(files, SPAN_BYTES))
    parts_dir = cached.with_suffix(".parts")
    shutil.rmtree(parts_dir, ignore_errors=True)  # left by a builder that died
    parts_dir.mkdir()
    meter = _Progress(sum(size for _, size in tasks), enabled=progress)
    counts = [0] * len(tasks)
    try:
        if workers == 1 or len(tasks) == 1:
            _init_worker(tokenizer, text_field)
            for i, (spans, size) in enumerate(tasks):
                counts[i] = _tokenize_spans(spans, parts_dir / f"{i:06d}.bin")
                meter.advance(size, counts[i])
        else:
            # fork: a worker starts in milliseconds (no re-import of torch); it touches no torch state.
            context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
            with ProcessPoolExecutor(
                min(workers, len(tasks)),
                mp_context=context,
                initializer=_init_worker,
                initargs=(tokenizer, text_field, True),
            ) as pool:
                futures = {
                    pool.submit(_tokenize_spans, spans, parts_dir / f"{i:06d}.bin"): (i, size)
                    for i, (spans, size) in enumerate(tasks)
                }
                for future in as_completed(futures):
                    i, size = futures[future]
                    counts[i] = future.result()
                    meter.advance(size, counts[i])
        _concatenate(parts_dir, counts, np.dtype(tokenizer.dtype), cached)
    finally:
        shutil.rmtree(parts_dir, ignore_errors=True)
    meter.finish()


def _tasks(spans: list[tuple[Span, int]]) -> list[tuple[list[Span], int]]:
    """Consecutive spans together up to SPAN_BYTES: a corpus of many small files makes few tasks."""
    tasks: list[tuple[list[Span], int]] = []
    for span, size in spans:
        if tasks and tasks[-1][1] + size <= SPAN_BYTES:
            tasks[-1][0].append(span)
            tasks[-1] = (tasks[-1][0], tasks[-1][1] + size)
        else:
            tasks.append(([span], size))
    return tasks


def _concatenate(parts_dir: Path, counts: list[int], dtype: np.dtype, cached: Path) -> None:
    """The parts, in order, behind one .npy header, written to a temporary name and renamed into place."""
    tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (sum(counts),)}
    with open(tmp, "wb") as out:
        np.lib.format.write_array_header_2_0(out, header)
        for i in range(len(counts)):
            with open(parts_dir / f"{i:06d}.bin", "rb") as part:
                shutil.copyfileobj(part, out, 8 << 20)
    os.replace(tmp, cached)


# -- worker side: one tokenizer per worker process, set up once ----------------------------------

_worker: dict = {}


def _init_worker(tokenizer, text_field: str, one_of_many: bool = False) -> None:
    if one_of_many:
        # The workers share the cores already: one thread each, not a Rust thread pool per worker.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.update(tokenizer=tokenizer, text_field=text_field)


def _tokenize_spans(spans: list[Span], out_path: Path) -> int:
    """Tokenize spans, in order, into `out_path` (raw ids); returns how many ids it wrote."""
    tokenizer, text_field = _worker["tokenizer"], _worker["text_field"]
    separator = np.array([tokenizer.separator_id], dtype=tokenizer.dtype)
    before = tokenizer.separator == "bos"
    written = 0
    with open(out_path, "wb") as out:
        batches = (batch for span in spans for batch in iter_documents(span, text_field))
        for batch in batches:
            for (_, opens, closes), ids in zip(batch, tokenizer.encode_batch([text for text, _, _ in batch])):
                pieces = [separator] if before and opens else []
                pieces.append(ids)
                if closes and not before:
                    pieces.append(separator)
                for piece in pieces:
                    out.write(piece.astype(tokenizer.dtype, copy=False).tobytes())
                    written += len(piece)
    return written


class _Progress:
    """`tokenizing: 42% (84.0/200.0 MB, 83.5M tokens, 61.2 MB/s)` on stderr: redrawn in place on a
    terminal, a line every few seconds in a log."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.enabled = max(total_bytes, 1), enabled
        self.done = self.tokens = 0
        self.began = self.shown = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def advance(self, size: int, tokens: int) -> None:
        self.done += size
        self.tokens += tokens
        now = time.perf_counter()
        if self.enabled and (self.tty or now - self.shown >= 5.0):
            self.shown = now
            print(self._line(now), end="\r" if self.tty else "\n", file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.enabled:
            print(self._line(time.perf_counter()), file=sys.stderr, flush=True)

    def _line(self, now: float) -> str:
        elapsed = max(now - self.began, 1e-9)
        return (
            f"tokenizing: {100 * self.done / self.total:3.0f}% ({self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB, "
            f"{self.tokens / 1e6:.1f}M tokens, {self.done / 1e6 / elapsed:.1f} MB/s, {elapsed:.1f} s)"
        )
