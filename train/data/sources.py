"""Reading raw corpora into documents: ``.txt``/``.txt.gz``, ``.jsonl``/``.jsonl.gz``, ``.parquet`` and
``.tsv``/``.csv`` (``.gz`` too) with a header row, one document per row from the text column.

Bad input raises :class:`DataError` naming the file and line; with ``skip_bad`` the bad document (or,
for a corrupt compressed stream, the rest of that file) is skipped, counted in :class:`ReadStats` and
logged. Empty documents are always skipped and counted: they carry no tokens.
"""

from __future__ import annotations

import csv
import gzip
import json
import logging
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Sequence

from distaff.train.core.files import decode_text
from distaff.train.data.errors import DataError

log = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json.gz")
PARQUET_SUFFIXES = (".parquet",)
TABLE_SUFFIXES = {".tsv": "\t", ".tsv.gz": "\t", ".csv": ",", ".csv.gz": ","}   # suffix -> column delimiter
FORMATS = ".txt, .jsonl, .tsv, .csv (each also .gz) or .parquet"


@dataclass(frozen=True)
class ReadOptions:
    doc_per_file: bool = False  # .txt: the whole file is one document instead of blank-line separated ones
    text_field: str = "text"  # .jsonl field / .parquet, .tsv, .csv column holding the text
    skip_bad: bool = False  # skip (count, log) bad documents instead of raising


@dataclass(frozen=True)
class Document:
    source: str
    line: int  # first line of the document in its file (1-based; row number for parquet)
    text: str


@dataclass
class ReadStats:
    skipped: Counter = field(default_factory=Counter)  # reason -> count

    def skip(self, reason: str, where: str, err: object, skip_bad: bool) -> None:
        if not skip_bad:
            raise DataError(f"{where}: {err}")
        self.skipped[reason] += 1
        log.warning("skipped (%s) %s: %s", reason, where, err)


def check_inputs(paths: Sequence[str | Path]) -> list[Path]:
    """Fail before any work if an input is missing or of an unknown format."""
    resolved = [Path(p) for p in paths]
    for path in resolved:
        if path.is_dir():
            raise DataError(f"{path}: is a directory; pass the input files in it")
        if not path.is_file():
            raise DataError(f"{path}: input file not found")
        if not path.name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES + tuple(TABLE_SUFFIXES)):
            raise DataError(f"{path}: unknown input format (expected {FORMATS})")
    return resolved


def iter_documents(paths: Sequence[str | Path], options: ReadOptions,
                   stats: ReadStats | None = None) -> Iterator[Document]:
    stats = stats if stats is not None else ReadStats()
    for path in check_inputs(paths):
        yield from iter_file_documents(path, options, stats)


def iter_file_documents(path: Path, options: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    if path.name.endswith(PARQUET_SUFFIXES):
        docs = _parquet_documents(path, options, stats)
    elif path.name.endswith(tuple(TABLE_SUFFIXES)):
        docs = _table_documents(path, options, stats)
    else:
        docs = _line_documents(path, options, stats)
    for doc in docs:
        if doc.text.strip():
            yield doc
        else:
            stats.skipped["empty_document"] += 1
            log.debug("skipped empty document %s:%d", doc.source, doc.line)


def _open_binary(path: Path) -> BinaryIO:
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def numbered_lines(path: Path, options: ReadOptions, stats: ReadStats,
                   max_line_bytes: int | None = None) -> Iterator[tuple[int, bytes]]:
    """Lines of a (possibly gzipped) file; a corrupt stream is an error naming the file and line. With
    ``max_line_bytes`` no more than that is read for one line (memory bound): a longer line is an error."""
    lineno = 0
    try:
        with _open_binary(path) as f:
            lines = iter(f) if max_line_bytes is None else iter(lambda: f.readline(max_line_bytes + 1), b"")
            for lineno, line in enumerate(lines, start=1):
                if max_line_bytes is not None and len(line) > max_line_bytes:
                    raise DataError(f"{path}:{lineno}: a line longer than {max_line_bytes:,} bytes (the limit of a "
                                    "labelled example; its text is cut to data.max_len tokens anyway): shorten it")
                yield lineno, line
    except (EOFError, zlib.error, gzip.BadGzipFile) as err:
        stats.skip("corrupt_file", f"{path}: after line {lineno}", f"corrupt compressed stream ({err})", options.skip_bad)


def decode_utf8(raw: bytes, path: Path, first_line: int, options: ReadOptions, stats: ReadStats) -> str | None:
    """``raw`` (lines of ``path`` from ``first_line`` on) as text; a byte that is not UTF-8 is a DataError naming
    the file, line and byte (:func:`~distaff.train.core.files.decode_text`), or with ``skip_bad`` a counted skip."""
    try:
        return decode_text(raw, str(path), first_line=first_line, error=DataError, nul_ok=True)
    except DataError as err:
        if not options.skip_bad:
            raise
        stats.skip("invalid_utf8", f"{path}:{first_line}", err, skip_bad=True)
        return None


def _line_documents(path: Path, options: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    lines = numbered_lines(path, options, stats)
    if path.name.endswith(JSONL_SUFFIXES):
        yield from _jsonl_documents(path, lines, options, stats)
    elif options.doc_per_file:
        yield from _emit(path, 1, b"".join(line for _, line in lines), options, stats)
    else:
        yield from _paragraph_documents(path, lines, options, stats)


def _emit(path: Path, first_line: int, raw: bytes, options: ReadOptions, stats: ReadStats) -> Iterable[Document]:
    text = decode_utf8(raw, path, first_line, options, stats)
    return () if text is None else (Document(str(path), first_line, text.strip("\n")),)


def _paragraph_documents(path: Path, lines: Iterable[tuple[int, bytes]], options: ReadOptions,
                         stats: ReadStats) -> Iterator[Document]:
    """Documents separated by one or more blank lines."""
    buffer: list[bytes] = []
    first = 0
    for lineno, line in lines:
        if line.strip():
            if not buffer:
                first = lineno
            buffer.append(line)
        elif buffer:
            yield from _emit(path, first, b"".join(buffer), options, stats)
            buffer = []
    if buffer:
        yield from _emit(path, first, b"".join(buffer), options, stats)


def _jsonl_documents(path: Path, lines: Iterable[tuple[int, bytes]], options: ReadOptions,
                     stats: ReadStats) -> Iterator[Document]:
    for lineno, line in lines:
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        decoded = decode_utf8(line, path, lineno, options, stats)
        if decoded is None:
            continue
        try:
            record = json.loads(decoded)
        except json.JSONDecodeError as err:
            stats.skip("invalid_json", where, f"invalid JSON ({err})", options.skip_bad)
            continue
        text = record.get(options.text_field) if isinstance(record, dict) else None
        if text is None and isinstance(record, dict) and options.text_field in record:
            text = ""  # an explicit null is an empty document
        if not isinstance(text, str):
            stats.skip("missing_field", where, f"no string field {options.text_field!r}", options.skip_bad)
            continue
        yield Document(str(path), lineno, text)


def _parquet_documents(path: Path, options: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        reader = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable parquet file ({err})") from err
    if options.text_field not in reader.schema_arrow.names:
        raise DataError(f"{path}: no column {options.text_field!r} (columns: {reader.schema_arrow.names})")
    row = 0
    try:
        for batch in reader.iter_batches(columns=[options.text_field]):
            for text in batch.column(0).to_pylist():
                row += 1
                yield Document(str(path), row, text or "")
    except pa.ArrowException as err:
        stats.skip("corrupt_file", f"{path}: after row {row}", f"corrupt parquet data ({err})", options.skip_bad)



MAX_FIELD_CHARS = 1 << 30   # the csv module's default limit (131,072 characters) would refuse a long document


def _table_documents(path: Path, options: ReadOptions, stats: ReadStats) -> Iterator[Document]:
    """One document per row of a TSV/CSV file with a header row, from its ``text_field`` column (quoted fields
    may hold newlines and delimiters, as the csv module reads them), each named by the line it starts on."""
    delimiter = next(d for suffix, d in TABLE_SUFFIXES.items() if path.name.endswith(suffix))
    last_line = [0]     # the file line the reader has read up to

    def text_lines() -> Iterator[str]:
        for lineno, raw in numbered_lines(path, options, stats):
            last_line[0] = lineno
            text = decode_utf8(raw, path, lineno, options, stats)
            if text is not None:
                yield text

    csv.field_size_limit(max(csv.field_size_limit(), MAX_FIELD_CHARS))
    reader = csv.reader(text_lines(), delimiter=delimiter)
    try:
        header = next(reader, [])
        if options.text_field not in header:
            raise DataError(f"{path}: no column {options.text_field!r} in its header row (columns: {header}); "
                            "name the text column with --text-field")
        column = header.index(options.text_field)
        first_line = last_line[0] + 1
        for row in reader:
            if len(row) > column:
                yield Document(str(path), first_line, row[column])
            elif row:
                stats.skip("missing_field", f"{path}:{first_line}",
                           f"{len(row)} column(s), no {options.text_field!r}", options.skip_bad)
            first_line = last_line[0] + 1
    except csv.Error as err:
        kind = "TSV" if delimiter == "\t" else "CSV"
        stats.skip("invalid_table", f"{path}:{last_line[0]}", f"not readable as {kind} ({err})", options.skip_bad)
