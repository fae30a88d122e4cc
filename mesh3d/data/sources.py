"""Text corpora on disk: which files a list of `paths` names, how they split into work, and their documents, streamed.

Three formats, told apart by suffix:
- plain text (`.txt`, `.md`, `.py`, or any explicitly named file of another suffix): a file is one document;
- `.jsonl`: a document per line, its text in one field (default "text");
- `.parquet`: a document per row, its text in one string column (default "text"); needs pyarrow.

Nothing here holds a whole file: a file is cut into byte ranges (at line starts) or row groups,
and each range yields its text in bounded batches, so a corpus larger than memory tokenizes.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

TEXT_SUFFIXES = (".txt", ".md", ".py")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
DIRECTORY_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES

# One batch handed to the tokenizer: big enough to keep its threads busy, small enough to bound memory.
BATCH_CHARS = 1 << 20


def expand_data_paths(specs) -> list[Path]:
    """Files, directories (searched recursively for DIRECTORY_SUFFIXES) and glob patterns, in a stable order."""
    if isinstance(specs, (str, Path)):
        specs = [specs]
    files: list[Path] = []
    for spec in map(str, specs):
        path = Path(spec)
        if not path.exists() and any(c in spec for c in "*?["):
            matches = sorted(Path(m) for m in glob.glob(spec, recursive=True))
            if not matches:
                raise FileNotFoundError(f"paths: the pattern {spec!r} matches no file")
            files += [f for m in matches for f in _files_of(m)]
        else:
            files += _files_of(path)
    if not files:
        raise FileNotFoundError(
            f"paths: no data files ({', '.join(DIRECTORY_SUFFIXES)}) found in {[str(s) for s in specs]}"
        )
    return files


def _files_of(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in DIRECTORY_SUFFIXES)
    return [path]  # a missing file is reported, with the others, by the cache builder


def file_format(path: Path) -> str:
    if path.suffix in JSONL_SUFFIXES:
        return "jsonl"
    if path.suffix in PARQUET_SUFFIXES:
        return "parquet"
    return "text"


@dataclass(frozen=True)
class Span:
    """Part of one file: lines starting in bytes [start, stop), or parquet row groups [start, stop).

    `first`/`last` say whether it holds the file's beginning/end: a plain-text file is one
    document, so only its first span may open it and only its last may close it.
    """

    path: str
    format: str
    start: int
    stop: int
    first: bool
    last: bool


def plan_spans(files: list[Path], span_bytes: int) -> list[tuple[Span, int]]:
    """Every file cut into spans of about `span_bytes` (its uncompressed size for parquet), with their sizes."""
    spans: list[tuple[Span, int]] = []
    for path in files:
        fmt = file_format(path)
        if fmt == "parquet":
            metadata = _parquet_file(path).metadata
            sizes = [metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)]
            bounds = _group_bounds(sizes, span_bytes)
        else:
            size = path.stat().st_size
            bounds = [(a, min(a + span_bytes, size)) for a in range(0, max(size, 1), span_bytes)]
            sizes = None
        for k, (a, b) in enumerate(bounds):
            weight = sum(sizes[a:b]) if sizes is not None else b - a
            spans.append((Span(str(path), fmt, a, b, first=k == 0, last=k == len(bounds) - 1), weight))
    return spans


def _group_bounds(sizes: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive row groups together up to `budget` bytes (at least one each); one empty span for none."""
    bounds, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > budget:
            bounds.append((start, i))
            start, total = i, 0
        total += size
    bounds.append((start, len(sizes)))
    return bounds


def iter_documents(span: Span, text_field: str = "text") -> Iterator[list[tuple[str | bytes, bool, bool]]]:
    """Batches of (text, opens_a_document, closes_a_document) pieces of the span, in order."""
    if span.format == "parquet":
        yield from _parquet_batches(span, text_field)
        return
    batch, chars = [], 0
    for piece in _text_pieces(span) if span.format == "text" else _jsonl_documents(span, text_field):
        batch.append(piece)
        chars += len(piece[0])
        if chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _lines(span: Span) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of every line that starts in [start, stop): spans partition a file's lines."""
    with open(span.path, "rb") as f:
        if span.start > 0:
            f.seek(span.start - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line under way belongs to the previous span
        offset = f.tell()
        while offset < span.stop:
            line = f.readline()
            if not line:
                return
            yield offset, line
            offset += len(line)


def _text_pieces(span: Span) -> Iterator[tuple[bytes, bool, bool]]:
    """The span's text in pieces of about BATCH_CHARS ending at line ends, so no piece holds the whole file.

    Bytes, not str: the byte tokenizer keeps a file's exact bytes (even where they are not UTF-8);
    a Hugging Face tokenizer decodes them itself."""
    chunk: list[bytes] = []
    size, opened = 0, not span.first
    for _, line in _lines(span):
        chunk.append(line)
        size += len(line)
        if size >= BATCH_CHARS:
            yield b"".join(chunk), not opened, False
            chunk, size, opened = [], 0, True
    yield b"".join(chunk), not opened, span.last


def _jsonl_documents(span: Span, field: str) -> Iterator[tuple[str, bool, bool]]:
    for offset, line in _lines(span):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{span.path}: the line at byte {offset} is not JSON ({e.msg})") from None
        text = record.get(field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{span.path}: the line at byte {offset} has no string field {field!r} (it has {keys}); "
                f"pass the field's name as text_field"
            )
        yield text, True, True


def _parquet_file(path):
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow (or mesh3d[text])") from e
    return pq.ParquetFile(path)


def _parquet_batches(span: Span, field: str) -> Iterator[list[tuple[str, bool, bool]]]:
    parquet = _parquet_file(span.path)
    names = parquet.schema_arrow.names
    if field not in names:
        raise ValueError(f"{span.path}: no column {field!r} (it has {names}); pass the column's name as text_field")
    if span.stop <= span.start:
        return
    for batch in parquet.iter_batches(batch_size=1024, row_groups=range(span.start, span.stop), columns=[field]):
        yield [(text or "", True, True) for text in batch.column(0).to_pylist()]
