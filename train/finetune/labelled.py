"""Labelled text for fine-tuning: reading, checking, label vocabulary, dev split and tokenisation.

Input files are ``.tsv``, ``.csv`` or ``.jsonl``, each optionally gzipped (``.gz``). An
:class:`InputFormat` says which columns hold the text, the optional second text of a sentence pair, and
the label:

* **TSV/CSV with a header row** (the default): columns are selected by name, e.g.
  ``InputFormat(text_column="sentence", label_column="label")``.
* **Headerless TSV/CSV**: either give the columns names with ``columns=("label", "text")`` (every row must
  have exactly that many fields), or select columns by 0-based index (``text_column=1, label_column=0``).
  A header row is read exactly when ``columns`` is None and every selector is a name; mixing names and
  indices without ``columns`` is a :class:`ConfigError`.
* **JSONL**: one object per line; selectors are field names (an index is an error).

TSV is split on tabs with no quoting (GLUE's convention: a ``"`` is an ordinary character); CSV follows
Python's ``csv`` dialect (quoted fields may hold commas and newlines).

Bad input (every message names the file, and the line and column where there is one):

* a selected column missing -> :class:`DataError` naming the file and listing the available columns;
* a TSV/CSV row wider or narrower than the header, ``columns`` or (selection by index) the first row,
  a stray CSV quote, invalid JSON or UTF-8, a corrupt gzip stream -> error naming ``file:line``;
* an empty or whitespace-only text (or text pair) -> the row is skipped, counted in
  ``ReadStats.skipped["empty_text"]`` and logged with the count;
* regression: a missing, empty, non-numeric (``1_000`` included) or non-finite label -> error naming
  ``file:line`` and column;
* classification: a JSON list or object as a label, fractional numbers as labels (a regression's targets),
  ``true``/``false`` beside numbers (ambiguous) -> error naming ``file:line``; a label not in the explicit
  ``labels`` list -> error naming ``file:line`` and the value; a dev label the train set never has (labels
  taken from the train set) -> error naming the dev file, the line and the class;
* a line longer than :data:`MAX_LINE_BYTES` -> error naming ``file:line`` (long texts are fine: each is cut
  to ``max_len`` tokens, and only a bounded prefix of it is tokenized).

The tokenizer is a :class:`~distaff.train.data.tokenizer.TokenizerInfo`: ``load_tokenizer_info(folder)``,
where ``distaff.train.run.model_folder.load_model`` returns the folder of the model's tokenizer.

Typical use: ``data = load_labelled(train_file, fmt, tokenizer, max_len, regression=False, dev_fraction=0.1,
seed=0)`` gives ``data.train`` and ``data.dev`` (:class:`LabelledSet`), ``data.label_names`` (id2label),
``data.num_labels`` (the head's size) and ``data.stats``. Step by step it does::

    stats = ReadStats()
    train = read_examples(path, fmt, regression=False, stats=stats)
    train, dev = hold_out(train, fraction=0.1, seed=0)            # or dev = read_examples(dev_path, ...)
    names = label_names(train, explicit=None)                     # sorted distinct train labels
    train_set = tokenize(train, encode_labels(train, names), tokenizer, max_len=128)
    dev_set = tokenize(dev, encode_labels(dev, names), tokenizer, max_len=128)

Classification labels are canonical strings (:func:`class_name`: ``1``, ``1.0``, ``01`` and JSON ``1`` are
all ``"1"``; JSON ``true`` is ``"true"``); ``label_names`` gives id -> name, for ``id2label``. Without an
explicit list they are the train set's distinct values, sorted numerically when they are all integers
(so ``0, 1, 2, 10``) and as strings otherwise. For binary F1 the positive class is label id 1.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import json
import logging
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from distaff.train.core.errors import shown
from distaff.train.data.errors import DataError
from distaff.train.data.prepare import split_long_text
from distaff.train.data.sources import JSONL_SUFFIXES, ReadOptions, ReadStats, decode_utf8, numbered_lines
from distaff.train.data.tokenizer import TokenizerInfo
from distaff.train.model.config import ConfigError

log = logging.getLogger(__name__)

TSV_SUFFIXES = (".tsv", ".tsv.gz")
CSV_SUFFIXES = (".csv", ".csv.gz")
LABELLED_SUFFIXES = TSV_SUFFIXES + CSV_SUFFIXES + (".jsonl", ".jsonl.gz")
MAX_LINE_BYTES = 64 << 20   # one line (or CSV row) of a labelled file at most; longer is an error naming it
# a text is tokenized from a prefix of about this many characters per token of data.max_len, grown while it
# gives too few tokens, up to MAX_TEXT_CHARS: the tokenizer's memory (~30 bytes per character) stays bounded
CHARS_PER_TOKEN = 8
MAX_TEXT_CHARS = 1 << 20

Selector = str | int  # a column's name, or its 0-based index in a headerless TSV/CSV
_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")   # a number as people write one: no 1_000, inf
_INTEGER = re.compile(r"[+-]?\d+")


@dataclass(frozen=True)
class InputFormat:
    """Which columns of a labelled file hold the text, the optional pair text and the label."""

    text_column: Selector = "text"
    label_column: Selector = "label"
    text_pair_column: Selector | None = None
    columns: tuple[str, ...] | None = None  # names of a headerless TSV/CSV's columns, in order

    def __post_init__(self) -> None:
        if self.columns is not None:  # a YAML list is welcome
            object.__setattr__(self, "columns", tuple(self.columns))
            if not self.columns or not all(isinstance(name, str) and name for name in self.columns):
                raise ConfigError(f"columns must list the column names (non-empty strings), got {list(self.columns)}")
        selectors = self.selectors()
        for key, value in selectors.items():
            if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "" or \
                    (isinstance(value, int) and value < 0):
                raise ConfigError(f"{key} must be a column name or a 0-based index, got {shown(value)}")
        kinds = {isinstance(value, int) for value in selectors.values()}
        if self.columns is None and len(kinds) == 2:
            raise ConfigError(f"columns selected partly by name and partly by index ({selectors}): use all names "
                              "(with `columns` for a headerless file) or all indices")
        if self.columns is not None and len(set(self.columns)) != len(self.columns):
            raise ConfigError(f"columns {list(self.columns)} names a column twice")

    def selectors(self) -> dict[str, Selector]:
        """The set selectors by config key."""
        chosen = {"text_column": self.text_column, "label_column": self.label_column,
                  "text_pair_column": self.text_pair_column}
        return {key: value for key, value in chosen.items() if value is not None}

    @property
    def has_header(self) -> bool:
        return self.columns is None and all(isinstance(v, str) for v in self.selectors().values())


@dataclass(frozen=True)
class Example:
    text: str
    text_pair: str | None
    label: str | float  # classification: the label as written; regression: the target
    where: str  # "file:line", for error messages


@dataclass
class LabelledSet:
    """Tokenised examples: ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]``, at most ``max_len`` tokens."""

    source: str  # the file (or "held out of <file>") the examples came from
    input_ids: list[np.ndarray]  # int32 per example
    token_type_ids: list[np.ndarray] | None  # pairs: 0 up to the first [SEP], 1 after; None for single texts
    labels: np.ndarray  # int64 class ids, or float64 regression targets
    truncated: int = 0  # examples cut to max_len
    lengths: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.lengths = np.array([len(ids) for ids in self.input_ids], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def regression(self) -> bool:
        return self.labels.dtype.kind == "f"

    def fingerprint(self) -> str:
        """sha256 of the token ids, token types and labels: a resumed run checks it reads the same data."""
        digest = hashlib.sha256(self.lengths.tobytes())
        for arrays in (self.input_ids, self.token_type_ids or []):
            digest.update(np.concatenate(arrays).tobytes() if arrays else b"")
        digest.update(self.labels.tobytes())
        return digest.hexdigest()


# -- reading -------------------------------------------------------------------------------------------------
def check_labelled_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: labelled input file not found")
    if not path.name.endswith(LABELLED_SUFFIXES):
        raise DataError(f"{path}: unknown labelled format (expected .tsv, .csv or .jsonl, each optionally .gz)")
    return path


def _decoded_lines(path: Path) -> Iterator[tuple[int, str]]:
    options, stats = ReadOptions(), ReadStats()  # no skipping: a corrupt or non-UTF-8 file is an error
    for lineno, raw in numbered_lines(path, options, stats, MAX_LINE_BYTES):
        line = decode_utf8(raw, path, lineno, options, stats)
        yield lineno, line.removeprefix("\ufeff") if lineno == 1 else line  # a byte-order mark (spreadsheet exports)


def _delimited_rows(path: Path, fmt: InputFormat) -> Iterator[tuple[int, dict[Selector, str]]]:
    """(first line, row) of a TSV/CSV file; a row maps each column name and index to its field.

    Every row must have as many fields as the header, ``columns``, or (selection by index) the first row:
    a TSV text holding a tab would otherwise lose its tail silently."""
    lines = _decoded_lines(path)
    current = [0, 1]  # the line the csv reader last took, and the first line of the row it reads

    def text_lines() -> Iterator[str]:
        for lineno, line in lines:
            current[0] = lineno
            yield line

    # strict CSV: a stray quote is an error rather than a field that swallows the rows after it
    dialect = {"delimiter": "\t", "quoting": csv.QUOTE_NONE} if path.name.endswith(TSV_SUFFIXES) else {"strict": True}
    csv.field_size_limit(max(csv.field_size_limit(), MAX_LINE_BYTES))  # the default, 131,072, refuses long texts
    reader = csv.reader(text_lines(), **dialect)
    names = fmt.columns
    width = None if fmt.columns is None else (len(fmt.columns), "columns")  # (fields, where that number is from)
    for fields in _csv_rows(reader, path, current):
        row_line, current[1] = current[1], current[0] + 1
        if not fields:
            continue  # a blank line
        if width is None:
            width = (len(fields), "the header" if fmt.has_header else f"line {row_line}")
            if fmt.has_header:
                names = tuple(fields)
                _check_unique(path, names, "the header")
                _check_names(path, names, fmt)
                continue
        if len(fields) != width[0]:
            raise DataError(f"{path}:{row_line}: {len(fields)} fields, expected {width[0]} as in {width[1]}")
        row: dict[Selector, str] = dict(enumerate(fields))
        row.update(zip(names or (), fields))
        yield row_line, row
    if fmt.has_header and names is None:
        raise DataError(f"{path}: empty file (no header row)")


def _csv_rows(reader: Iterator[list[str]], path: Path, current: list[int]) -> Iterator[list[str]]:
    """The reader's rows; an error names the line where the row it was reading starts."""
    try:
        yield from reader
    except csv.Error as err:
        if "end of data" in str(err) or "field limit" in str(err):   # a quote that is never closed
            raise DataError(f"{path}:{current[1]}: a quoted field starts in this row and is not closed before "
                            f"{'the end of the file' if 'end of data' in str(err) else f'line {current[0]}'} "
                            f"(csv: {err}); close the quote, or double a quote inside a field (\"\")") from None
        raise DataError(f"{path}:{current[0]}: {err}") from None


def _check_unique(path: Path, names: Sequence[str], where: str) -> None:
    """A column named twice would be read from its last occurrence: the other one silently ignored."""
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise DataError(f"{path}: column {twice!r} appears twice in {where} {list(names)[:20]}; give every column "
                        "its own name (or set data.columns)")


def _check_names(path: Path, names: Sequence[str], fmt: InputFormat) -> None:
    for key, selector in fmt.selectors().items():
        if isinstance(selector, str) and selector not in names:
            raise DataError(f"{path}: no column {selector!r} ({key}); the columns are {list(names)}")


def _jsonl_rows(path: Path, fmt: InputFormat) -> Iterator[tuple[int, dict[Selector, object]]]:
    for key, selector in fmt.selectors().items():
        if isinstance(selector, int):
            raise DataError(f"{path}: {key} {selector} is an index; JSONL fields are selected by name")
    for lineno, line in _decoded_lines(path):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: invalid JSON ({err})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{lineno}: a JSON object per line expected, got {type(record).__name__}")
        yield lineno, record


def _rows(path: Path, fmt: InputFormat) -> Iterator[tuple[int, dict]]:
    if path.name.endswith(JSONL_SUFFIXES):
        return _jsonl_rows(path, fmt)
    if fmt.columns is not None:
        _check_names(path, fmt.columns, fmt)
    return _delimited_rows(path, fmt)


def _field(row: dict, selector: Selector, key: str, where: str) -> object:
    if selector not in row:
        available = [k for k in row if isinstance(k, str)] or f"{len(row)} fields (0..{len(row) - 1})"
        raise DataError(f"{where}: no column {selector!r} ({key}); this row has {available}")
    return row[selector]


def _text(value: object, selector: Selector, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{where}: column {selector!r} holds {type(value).__name__} {shown(value)}, not text")
    return value


def parse_number(text: str) -> float | None:
    """``text`` as a number when it is written as one (``1``, ``-0.5``, ``1e-3``, spaces around allowed); None
    for anything else, ``1_000``, ``inf``, ``nan`` and ``0x10`` included (Python's ``float`` takes some of them)."""
    text = text.strip()
    return float(text) if _NUMBER.fullmatch(text) else None


def _label(value: object, selector: Selector, where: str, regression: bool) -> str | float:
    if regression:
        target = parse_number(value) if isinstance(value, str) else \
            float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        if target is None or not math.isfinite(target):
            raise DataError(f"{where}: column {selector!r}: regression label {shown(value)} is not a finite number")
        return target
    if value is None or (isinstance(value, str) and not value.strip()):
        raise DataError(f"{where}: column {selector!r}: empty label")
    return class_name(value, f"{where}: column {selector!r}")


def class_name(value: object, where: str) -> str:
    """A classification label as one canonical string, so that one class is never two: numbers written
    differently are one (``1``, ``1.0``, ``01`` and JSON ``1`` -> ``"1"``; ``0.50`` -> ``"0.5"``), JSON
    ``true``/``false`` are ``"true"``/``"false"``, other text is kept (stripped). A JSON list or object, or a
    non-finite number, is an error naming ``where``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = value.strip()
        if _INTEGER.fullmatch(text):
            return str(int(text))
        number = parse_number(text)
        if number is None:
            return text
    elif isinstance(value, int):
        return str(value)
    elif isinstance(value, float):
        number = value
    else:
        raise DataError(f"{where}: the label is a JSON {'list' if isinstance(value, list) else 'object'} "
                        f"{shown(value)}; a label is one class name or number")
    if not math.isfinite(number):
        raise DataError(f"{where}: label {shown(value)} is not a finite number")
    return str(int(number)) if number.is_integer() else repr(number)


@contextlib.contextmanager
def _blame_corrupt_gzip(path: Path) -> Iterator[None]:
    """A flipped bit in a gzipped file decompresses to garbage that is caught (by the CRC) only at its end, so the
    first error seen is a garbled row: when a ``.gz`` file's row is wrong, check the whole stream and name the
    real cause."""
    try:
        yield
    except DataError:
        if not path.name.endswith(".gz"):
            raise
        try:
            with gzip.open(path, "rb") as f:
                while f.read(1 << 20):
                    pass
        except (OSError, EOFError, zlib.error) as err:
            raise DataError(f"{path}: corrupt gzip file ({err}); re-create or re-download it") from None
        raise


def read_examples(path: str | Path, fmt: InputFormat, *, regression: bool,
                  stats: ReadStats | None = None) -> list[Example]:
    """Every example of a labelled file, checked; empty texts are skipped and counted in ``stats``."""
    path = check_labelled_file(path)
    with _blame_corrupt_gzip(path):
        return _read_examples(path, fmt, regression, stats)


def _read_examples(path: Path, fmt: InputFormat, regression: bool, stats: ReadStats | None) -> list[Example]:
    stats = stats if stats is not None else ReadStats()
    examples, empty = [], 0
    for lineno, row in _rows(path, fmt):
        where = f"{path}:{lineno}"
        text = _text(_field(row, fmt.text_column, "text_column", where), fmt.text_column, where)
        pair = None
        if fmt.text_pair_column is not None:
            pair = _text(_field(row, fmt.text_pair_column, "text_pair_column", where), fmt.text_pair_column, where)
        label = _label(_field(row, fmt.label_column, "label_column", where), fmt.label_column, where, regression)
        if not text.strip() or (pair is not None and not pair.strip()):
            empty += 1
            log.debug("skipped empty text %s", where)
            continue
        examples.append(Example(text, pair, label, where))
    if empty:
        stats.skipped["empty_text"] += empty
        log.warning("%s: skipped %d example(s) with an empty text", path, empty)
    if not examples:
        raise DataError(f"{path}: no examples (every row empty or skipped)")
    return examples


def read_texts(path: str | Path, column: Selector, columns: Sequence[str] | None = None) -> list[str]:
    """One column of a TSV/CSV/JSONL file, every non-blank field in file order (no labels needed): by name
    (header row or ``columns``) or by 0-based index in a headerless file. Same checks and errors as above."""
    path = check_labelled_file(path)
    fmt = InputFormat(text_column=column, label_column=column, columns=tuple(columns) if columns else None)
    with _blame_corrupt_gzip(path):
        texts = [_text(_field(row, column, "text_column", f"{path}:{lineno}"), column, f"{path}:{lineno}")
                 for lineno, row in _rows(path, fmt)]
    texts = [text for text in texts if text.strip()]
    if not texts:
        raise DataError(f"{path}: no text in column {column!r}")
    return texts


# -- labels and splits ---------------------------------------------------------------------------------------
def label_names(train: Sequence[Example], explicit: Sequence[str] | None = None) -> list[str]:
    """Class names by id: ``explicit`` (``data.labels``) as given, else the train set's distinct labels, sorted;
    names are canonical (:func:`class_name`)."""
    if explicit is not None:
        return _explicit_names(explicit)
    _check_label_kinds(train)
    found = {str(example.label) for example in train}
    names = sorted(found, key=_label_order(found))
    if len(names) < 2:
        raise DataError(f"{train[0].where.rsplit(':', 1)[0]}: only one label value {names} in the train set; "
                        "classification needs two or more (or list them in `labels`)")
    return names


def _label_order(names: set[str]) -> Callable[[str], object]:
    """Numeric order when every name is a number as :func:`parse_number` reads one (``-1``, ``10``; not
    ``²``, which ``str.isdigit`` calls a digit, nor ``--1``), else text order."""
    return (lambda name: parse_number(name)) if all(parse_number(n) is not None for n in names) else str


def _explicit_names(explicit: Sequence[str]) -> list[str]:
    names = [class_name(name, "data.labels") for name in explicit]
    for i, name in enumerate(names):
        if name in names[:i]:
            first = explicit[names.index(name)]
            twice = (f"{shown(explicit[i])} is listed twice" if first == explicit[i] else
                     f"{shown(first)} and {shown(explicit[i])} name the same class")
            raise ConfigError(f"data.labels: {twice}; list each class once")
    if len(names) < 2:
        raise ConfigError(f"data.labels: {shown(list(explicit))} lists {len(names)} class(es); classification needs "
                          "two or more")
    return names


def _check_label_kinds(train: Sequence[Example]) -> None:
    """Labels that cannot be classes as written: fractional numbers (targets of a regression), or true/false
    beside numbers (is ``true`` the class ``1``?)."""
    numeric = [e for e in train if parse_number(str(e.label)) is not None]
    fractional = next((e for e in numeric if not float(str(e.label)).is_integer()), None)
    if fractional is not None:
        raise DataError(f"{fractional.where}: label {fractional.label} is a fractional number: classes need names "
                        "or whole numbers; for real-valued targets set data.task=regression (or list the classes "
                        "in data.labels)")
    boolean = next((e for e in train if e.label in ("true", "false")), None)
    if boolean is not None and numeric:
        raise DataError(f"{boolean.where}: label {boolean.label} beside numeric labels ({numeric[0].where}: "
                        f"{numeric[0].label}) is ambiguous (is {boolean.label} a class of its own, or "
                        f"{int(boolean.label == 'true')}?); write every label one way")


def encode_labels(examples: Sequence[Example], names: Sequence[str] | None, *, explicit: bool = False) -> np.ndarray:
    """Class ids (int64) for ``names``, or the float64 targets when ``names`` is None (regression).

    A label outside ``names`` is an error naming its ``file:line``: an unknown value when ``explicit``
    (the user's ``labels`` list), else a class the train set lacks."""
    if names is None:
        return np.array([example.label for example in examples], dtype=np.float64)
    index = {name: i for i, name in enumerate(names)}
    ids = np.empty(len(examples), dtype=np.int64)
    for i, example in enumerate(examples):
        if example.label not in index:
            if explicit:
                raise DataError(f"{example.where}: unknown label {shown(example.label)} (data.labels: {_few(names)})")
            raise DataError(f"{example.where}: class {shown(example.label)} does not occur in the train set "
                            f"(its {_few(names)}); list every class in data.labels to allow it")
        ids[i] = index[example.label]
    return ids


def _few(names: Sequence[str], shown_at_most: int = 8) -> str:
    """``N classes: a, b, c, ...``: a long list of classes named in part, so that the error stays one line."""
    listed = ", ".join(shown(name) for name in names[:shown_at_most])
    return f"{len(names)} classes: {listed}{', ...' if len(names) > shown_at_most else ''}"


def hold_out(examples: Sequence[Example], fraction: float, seed: int,
             stratify: bool = False) -> tuple[list[Example], list[Example]]:
    """(train, dev): ``round(fraction * n)`` examples drawn at random with ``seed`` (per class when ``stratify``),
    each part kept in file order."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"dev_fraction must lie in (0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    groups: dict[object, list[int]] = {}
    for i, example in enumerate(examples):
        groups.setdefault(example.label if stratify else None, []).append(i)
    dev: list[int] = []
    for members in groups.values():
        dev.extend(rng.permutation(members)[:round(fraction * len(members))].tolist())
    chosen = set(dev)
    if not chosen or len(chosen) == len(examples):
        raise DataError(f"{examples[0].where.rsplit(':', 1)[0]}: dev_fraction {fraction} of {len(examples)} "
                        f"examples leaves {len(chosen)} for dev and {len(examples) - len(chosen)} for train")
    return ([e for i, e in enumerate(examples) if i not in chosen], [e for i, e in enumerate(examples) if i in chosen])


# -- tokenisation --------------------------------------------------------------------------------------------
def truncated_lengths(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """Longest-first truncation of two texts to ``budget`` tokens together: tokens come off the longer text
    (off the second on a tie) one at a time, so both end near ``budget / 2`` when both are long."""
    if len_a + len_b <= budget:
        return len_a, len_b
    half_b = budget // 2
    half_a = budget - half_b
    if len_a <= half_a:
        return len_a, budget - len_a
    if len_b <= half_b:
        return budget - len_b, len_b
    return half_a, half_b


def leading_ids(processor, texts: Sequence[str], budget: int) -> list[tuple[list[int], bool]]:
    """Each text's first ``budget + 1`` token ids (all of them when it has fewer) and whether those are all of
    its tokens. Only a prefix of a long text is tokenized, cut before a whitespace (so its tokens are those of
    the whole): ``CHARS_PER_TOKEN`` characters per token at first, four times more while that gives too few
    tokens, up to ``MAX_TEXT_CHARS``. The tokenizer's memory is thus bounded whatever a text's length."""
    result: list[tuple[list[int], bool] | None] = [None] * len(texts)
    pending, chars = list(range(len(texts))), CHARS_PER_TOKEN * (budget + 1)
    while pending:
        pieces = [next(split_long_text(texts[i], chars)) for i in pending]
        for i, piece, ids in zip(pending, pieces, processor.encode(pieces)):
            whole = len(piece) == len(texts[i])
            if whole or len(ids) > budget or chars >= MAX_TEXT_CHARS:
                result[i] = (ids[:budget + 1], whole and len(ids) <= budget + 1)
        pending, chars = [i for i in pending if result[i] is None], min(4 * chars, MAX_TEXT_CHARS)
    return result


def tokenize(examples: Sequence[Example], labels: np.ndarray, tokenizer: TokenizerInfo, max_len: int,
             source: str = "") -> LabelledSet:
    """``[CLS] a [SEP] (b [SEP])`` ids per example, cut longest-first to ``max_len``; truncations counted.
    Long texts are cut before they are tokenized (:func:`leading_ids`)."""
    pairs = examples[0].text_pair is not None if examples else False
    if max_len < (5 if pairs else 3):
        raise ConfigError(f"max_len {max_len} leaves no room for text between the special tokens")
    processor = tokenizer.processor()
    budget = max_len - (3 if pairs else 2)
    first = leading_ids(processor, [e.text for e in examples], budget)
    second = leading_ids(processor, [e.text_pair for e in examples], budget) if pairs else [([], True)] * len(examples)
    cls, sep = [tokenizer.cls_id], [tokenizer.sep_id]
    ids, types, truncated = [], [], 0
    for (a, whole_a), (b, whole_b) in zip(first, second):
        # lengths capped at budget + 1 give the cut of the whole lengths (truncated_lengths needs no more)
        keep_a, keep_b = truncated_lengths(len(a), len(b), budget)
        truncated += (keep_a, keep_b) != (len(a), len(b)) or not (whole_a and whole_b)
        head = cls + a[:keep_a] + sep
        tail = b[:keep_b] + sep if pairs else []
        ids.append(np.array(head + tail, dtype=np.int32))
        types.append(np.repeat(np.array([0, 1], dtype=np.int32), [len(head), len(tail)]))
    if truncated:
        log.warning("%s: %d of %d examples truncated to max_len %d", source, truncated, len(examples), max_len)
    return LabelledSet(source, ids, types if pairs else None, labels, truncated)


def display_names(names: list[str] | None, readable: dict) -> list[str] | None:
    """Class id -> the name an export shows (``id2label``): ``readable[value]`` (``data.label_names``) where
    given, else the label value itself. A value that is no class, or two classes given one name, is an error."""
    if names is None or not readable:
        return names
    given = {class_name(value, "data.label_names"): str(name).strip() for value, name in readable.items()}
    strange = sorted(set(given) - set(names))
    if strange:
        raise ConfigError(f"data.label_names: {strange} {'is' if len(strange) == 1 else 'are'} not a label of the "
                          f"data (its labels: {names}); name those")
    shown_names = [given.get(name, name) for name in names]
    if len(set(shown_names)) < len(shown_names):
        raise ConfigError(f"data.label_names: two classes would both be called {shown_names}; give each its own name")
    return shown_names


# -- all of it -----------------------------------------------------------------------------------------------
@dataclass
class LabelledData:
    train: LabelledSet
    dev: LabelledSet
    label_names: list[str] | None  # class id -> name (id2label); None for regression
    stats: ReadStats  # skips over both files (``skipped["empty_text"]``)

    @property
    def num_labels(self) -> int:
        """The classifier head's size: the number of classes, 1 for regression."""
        return 1 if self.label_names is None else len(self.label_names)


def load_labelled(train_file: str | Path, fmt: InputFormat, tokenizer: TokenizerInfo, max_len: int, *,
                  regression: bool, dev_file: str | Path | None = None, dev_fraction: float = 0.0, seed: int = 0,
                  stratify: bool = False, labels: Sequence[str] | None = None) -> LabelledData:
    """Read, check, split and tokenise a fine-tuning data set. The dev set is ``dev_file``, or else
    ``dev_fraction`` of ``train_file`` held out with ``seed``."""
    if (dev_file is None) == (dev_fraction == 0.0):
        raise ConfigError("give exactly one of dev_file and dev_fraction (> 0) for the dev set")
    if regression and (labels is not None or stratify):
        raise ConfigError("labels and stratify are about classes; a regression task has none")
    stats = ReadStats()
    train = read_examples(train_file, fmt, regression=regression, stats=stats)
    if dev_file is not None:
        dev, dev_source = read_examples(dev_file, fmt, regression=regression, stats=stats), str(dev_file)
    else:
        train, dev = hold_out(train, dev_fraction, seed, stratify)
        dev_source = f"{dev_fraction} held out of {train_file}"
    names = None if regression else label_names(train, labels)
    train_ids = encode_labels(train, names, explicit=labels is not None)
    dev_ids = encode_labels(dev, names, explicit=labels is not None)
    return LabelledData(tokenize(train, train_ids, tokenizer, max_len, str(train_file)),
                        tokenize(dev, dev_ids, tokenizer, max_len, dev_source), names, stats)
