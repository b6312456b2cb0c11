"""Fine-tuning data: labelled files (formats, bad input), labels, dev split, tokenisation, and the batches
(padded vs packed through a real classifier, exact resume, rank sharding of train and dev)."""

from __future__ import annotations

import gzip
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from distaff.train.data.errors import DataError
from distaff.train.finetune.labelled import (Example, InputFormat, LabelledSet, encode_labels, hold_out, label_names,
                                         load_labelled, read_examples, tokenize, truncated_lengths)
from distaff.train.data.sources import ReadStats
from distaff.train.data.tokenizer import load_tokenizer_info
from distaff.train.finetune.labelled_batches import EvalBatches, TrainBatches, model_inputs
from distaff.train.finetune.metrics import compute_metrics
from distaff.train.model.config import ConfigError
from finetune_data_probe import EVAL_BATCH, TRAIN_BATCH, evaluate, movie_data, tiny_classifier
from pretrain_fixtures import spawn_ranks, wait_all

MOVIES = "movie-snippets.tsv.gz"  # label<TAB>text, no header
PROBE = Path(__file__).with_name("finetune_data_probe.py")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path):
    return load_tokenizer_info(tokenizer_dir)


def _movie_rows(sample_data: Path) -> list[tuple[str, str]]:
    with gzip.open(sample_data / MOVIES, "rt", encoding="utf-8") as f:
        return [tuple(line.rstrip("\n").split("\t")) for line in f]


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# -- formats -------------------------------------------------------------------------------------------------
@pytest.mark.unit
def test_headerless_bundled_tsv_by_names_or_indices(sample_data: Path):
    rows = _movie_rows(sample_data)
    by_name = read_examples(sample_data / MOVIES, InputFormat(columns=("label", "text")), regression=False)
    by_index = read_examples(sample_data / MOVIES, InputFormat(text_column=1, label_column=0), regression=False)
    assert [(e.label, e.text) for e in by_name] == rows
    assert [(e.text, e.label, e.where) for e in by_name] == [(e.text, e.label, e.where) for e in by_index]
    assert by_name[41].where == f"{sample_data / MOVIES}:42"
    assert label_names(by_name) == sorted({label for label, _ in rows})


@pytest.mark.unit
def test_header_csv_jsonl_plain_and_gzip_read_the_same(tmp_path: Path):
    records = [{"s1": "a, quoted\nline", "s2": "second", "y": "pos"}, {"s1": "plain", "s2": "x \"y\"", "y": "neg"}]
    csv_text = 's1,s2,y\n"a, quoted\nline",second,pos\nplain,"x ""y""",neg\n'
    jsonl_text = "".join(json.dumps(r) + "\n" for r in records)
    fmt = InputFormat(text_column="s1", text_pair_column="s2", label_column="y")
    expected = [(r["s1"], r["s2"], r["y"]) for r in records]
    for name, text in (("d.csv", csv_text), ("d.jsonl", jsonl_text)):
        plain = _write(tmp_path / name, text)
        zipped = tmp_path / (name + ".gz")
        zipped.write_bytes(gzip.compress(text.encode()))
        for path in (plain, zipped):
            examples = read_examples(path, fmt, regression=False)
            assert [(e.text, e.text_pair, e.label) for e in examples] == expected, path
    # the CSV's second row starts on line 4 (the first spans lines 2-3)
    assert [e.where.rsplit(":", 1)[1] for e in read_examples(tmp_path / "d.csv", fmt, regression=False)] == ["2", "4"]


@pytest.mark.unit
def test_tsv_keeps_quotes_skips_blank_lines_and_a_bom(tmp_path: Path):
    path = _write(tmp_path / "q.tsv", '\ufefflabel\ttext\n1\t"quoted" start\n\n0\tsecond\n')  # with a BOM
    examples = read_examples(path, InputFormat(), regression=False)
    assert [(e.label, e.text, e.where) for e in examples] == [("1", '"quoted" start', f"{path}:2"),
                                                               ("0", "second", f"{path}:4")]


# -- bad input -----------------------------------------------------------------------------------------------
BAD_INPUTS = [
    ("missing.tsv", "sentence\tlabel\nhi\t1\n", InputFormat(), False,
     r"missing\.tsv: no column 'text' \(text_column\); the columns are \['sentence', 'label'\]"),
    ("missing.jsonl", '{"text": "a", "label": 1}\n{"txt": "b", "label": 0}\n', InputFormat(), False,
     r"missing\.jsonl:2: no column 'text' \(text_column\); this row has \['txt', 'label'\]"),
    ("short.tsv", "1\ta\n0\n", InputFormat(text_column=1, label_column=0), False,
     r"short\.tsv:2: 1 fields, expected 2 as in line 1"),
    ("index.tsv", "1\ta\n", InputFormat(text_column=2, label_column=0), False,
     r"index\.tsv:1: no column 2 \(text_column\); this row has 2 fields"),
    ("width.tsv", "1\ta\n0\tb\textra\n", InputFormat(columns=("label", "text")), False,
     r"width\.tsv:2: 3 fields, expected 2 as in columns"),
    ("tab.tsv", "label\ttext\n1\ta\tb\n", InputFormat(), False, r"tab\.tsv:2: 3 fields, expected 2 as in the header"),
    ("quote.csv", 'label,text\n1,"a\n0,good "q" x\n', InputFormat(), False, r"quote\.csv:3: ',' expected after"),
    ("open.csv", 'label,text\n1,a\n0,"never closed\n1,b\n1,c\n', InputFormat(), False,
     r"open\.csv:3: a quoted field starts in this row and is not closed before the end of the file"),
    ("nonnum.tsv", "label\ttext\n0.5\ta\nhigh\tb\n", InputFormat(), True,
     r"nonnum\.tsv:3: column 'label': regression label 'high' is not a finite number"),
    ("emptynum.tsv", "label\ttext\n\ta\n", InputFormat(), True,
     r"emptynum\.tsv:2: column 'label': regression label '' is not a finite number"),
    ("inf.jsonl", '{"text": "a", "score": "inf"}\n', InputFormat(label_column="score"), True,
     r"inf\.jsonl:1: column 'score': regression label 'inf' is not a finite number"),
    ("nolabel.tsv", "label\ttext\n1\ta\n \tb\n", InputFormat(), False, r"nolabel\.tsv:3: column 'label': empty label"),
    ("bad.jsonl", '{"text": "a", "label": 1}\n{"text": "b", \n', InputFormat(), False, r"bad\.jsonl:2: invalid JSON"),
    ("index.jsonl", '{"text": "a", "label": 1}\n', InputFormat(text_column=0, label_column=1), False,
     r"index\.jsonl: text_column 0 is an index"),
    ("data.txt", "x\n", InputFormat(), False, r"data\.txt: unknown labelled format"),
]


@pytest.mark.unit
@pytest.mark.parametrize("name,content,fmt,regression,expected", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_names_file_line_and_column(tmp_path, name, content, fmt, regression, expected):
    path = _write(tmp_path / name, content)
    with pytest.raises(DataError, match=expected):
        read_examples(path, fmt, regression=regression)


@pytest.mark.unit
def test_missing_file_and_config_mistakes(tmp_path: Path):
    with pytest.raises(DataError, match=r"nothere\.tsv: labelled input file not found"):
        read_examples(tmp_path / "nothere.tsv", InputFormat(), regression=False)
    with pytest.raises(ConfigError, match="partly by name and partly by index"):
        InputFormat(text_column=1, label_column="label")
    with pytest.raises(ConfigError, match="text_column must be"):
        InputFormat(text_column=-1)
    with pytest.raises(ConfigError, match="names a column twice"):
        InputFormat(columns=("text", "text"))
    with pytest.raises(ConfigError, match="columns must list the column names"):
        InputFormat(columns=["label", 3])
    assert InputFormat(columns=["label", "text"]).columns == ("label", "text")


@pytest.mark.unit
def test_empty_texts_are_counted_and_logged(tmp_path: Path, caplog):
    path = _write(tmp_path / "e.tsv", "label\ttext\tother\n1\ta\tb\n0\t  \tc\n1\td\t\n0\te\tf\n")
    stats = ReadStats()
    with caplog.at_level(logging.WARNING):
        single = read_examples(path, InputFormat(), regression=False, stats=stats)
    assert [e.text for e in single] == ["a", "d", "e"] and stats.skipped["empty_text"] == 1
    assert f"{path}: skipped 1 example(s) with an empty text" in caplog.text
    pairs = read_examples(path, InputFormat(text_pair_column="other"), regression=False, stats=stats)
    assert [e.text for e in pairs] == ["a", "e"] and stats.skipped["empty_text"] == 3
    only_empty = _write(tmp_path / "none.tsv", "label\ttext\n1\t \n")
    with pytest.raises(DataError, match=r"none\.tsv: no examples"):
        read_examples(only_empty, InputFormat(), regression=False)


@pytest.mark.integration
def test_unknown_label_and_dev_class_missing_from_train(tmp_path: Path, tokenizer):
    train = _write(tmp_path / "train.tsv", "label\ttext\nneg\ta\npos\tb\nneg\tc\n")
    dev = _write(tmp_path / "dev.tsv", "label\ttext\npos\td\nneutral\te\n")
    with pytest.raises(DataError, match=r"dev\.tsv:3: class 'neutral' does not occur in the train set"):
        load_labelled(train, InputFormat(), tokenizer, 32, regression=False, dev_file=dev)
    with pytest.raises(DataError, match=r"dev\.tsv:3: unknown label 'neutral' \(data\.labels: 2 classes: 'neg', 'pos'\)"):
        load_labelled(train, InputFormat(), tokenizer, 32, regression=False, dev_file=dev, labels=["neg", "pos"])
    with pytest.raises(DataError, match=r"train\.tsv:3: unknown label 'pos'"):
        load_labelled(train, InputFormat(), tokenizer, 32, regression=False, dev_file=dev, labels=["neg", "x"])
    data = load_labelled(train, InputFormat(), tokenizer, 32, regression=False, dev_file=dev,
                         labels=["pos", "neutral", "neg"])  # explicit: the order given, a dev-only class allowed
    assert data.label_names == ["pos", "neutral", "neg"] and data.num_labels == 3 and data.dev.labels.tolist() == [0, 1]
    assert data.train.labels.tolist() == [2, 0, 2]
    with pytest.raises(ConfigError, match="exactly one of dev_file and dev_fraction"):
        load_labelled(train, InputFormat(), tokenizer, 32, regression=False)


# -- labels, dev split, tokenisation -------------------------------------------------------------------------
@pytest.mark.unit
def test_label_order_numeric_then_string():
    make = lambda labels: [Example("t", None, label, f"f:{i}") for i, label in enumerate(labels)]  # noqa: E731
    assert label_names(make(["10", "2", "0", "2"])) == ["0", "2", "10"]
    assert label_names(make(["b", "a", "10"])) == ["10", "a", "b"]
    assert encode_labels(make(["10", "0"]), ["0", "2", "10"]).tolist() == [2, 0]
    with pytest.raises(DataError, match=r"^f: only one label value"):
        label_names(make(["1", "1"]))


@pytest.mark.unit
def test_one_class_written_several_ways_is_one_class(tmp_path):
    tsv = _write(tmp_path / "t.tsv", "label\ttext\n1\ta\n1.0\tb\n01\tc\n 1 \td\n0\te\n0.0\tf\n1e0\tg\n")
    examples = read_examples(tsv, InputFormat(), regression=False)
    assert label_names(examples) == ["0", "1"] and encode_labels(examples, ["0", "1"]).tolist() == [1, 1, 1, 1, 0, 0, 1]
    jsonl = _write(tmp_path / "t.jsonl", "".join(json.dumps({"text": t, "label": v}) + "\n"
                                                 for t, v in [("a", 1), ("b", 1.0), ("c", "1"), ("d", 0)]))
    assert [e.label for e in read_examples(jsonl, InputFormat(), regression=False)] == ["1", "1", "1", "0"]
    booleans = _write(tmp_path / "b.jsonl", "".join(json.dumps({"text": t, "label": v}) + "\n"
                                                    for t, v in [("a", True), ("b", "false"), ("c", False)]))
    assert label_names(read_examples(booleans, InputFormat(), regression=False)) == ["false", "true"]
    assert label_names(examples, ["1.0", "0"]) == ["1", "0"]                  # data.labels in the same form


@pytest.mark.unit
@pytest.mark.parametrize("rows,expected", [
    ([("a", False), ("b", 1), ("c", 0)], r"b\.jsonl:1: label false beside numeric labels \(.*b\.jsonl:2: 1\) is "
                                         r"ambiguous \(is false a class of its own, or 0\?\)"),
    ([("a", [1, 0]), ("b", 1)], r"b\.jsonl:1: column 'label': the label is a JSON list \[1, 0\]; a label is one "
                                r"class name or number"),
    ([("a", {"y": 1}), ("b", 1)], r"the label is a JSON object \{'y': 1\}"),
    ([("a", 0.37), ("b", 0.5), ("c", 1)], r"b\.jsonl:1: label 0\.37 is a fractional number: .* set data\.task="
                                          r"regression \(or list the classes in data\.labels\)"),
])
def test_labels_that_cannot_be_classes_as_written_are_refused(tmp_path, rows, expected):
    path = _write(tmp_path / "b.jsonl", "".join(json.dumps({"text": t, "label": v}) + "\n" for t, v in rows))
    with pytest.raises(DataError, match=expected):
        label_names(read_examples(path, InputFormat(), regression=False))


@pytest.mark.unit
def test_regression_targets_are_numbers_as_people_write_them(tmp_path):
    good = _write(tmp_path / "g.tsv", "label\ttext\n 2.5 \ta\n1e-3\tb\n-4\tc\n")
    assert [e.label for e in read_examples(good, InputFormat(), regression=True)] == [2.5, 0.001, -4.0]
    for bad in ("1_000", "0x10", "nan", "1,5"):
        path = _write(tmp_path / "b.tsv", f"label\ttext\n{bad}\ta\n")
        with pytest.raises(DataError, match=rf"b\.tsv:2: column 'label': regression label '{bad}' is not a finite"):
            read_examples(path, InputFormat(), regression=True)


@pytest.mark.unit
@pytest.mark.parametrize("labels,expected", [
    (["pos", "neg", "pos"], r"data\.labels: 'pos' is listed twice; list each class once"),
    (["1", "1.0"], r"data\.labels: '1' and '1\.0' name the same class"),
    (["only"], r"data\.labels: \['only'\] lists 1 class\(es\); classification needs two or more"),
])
def test_data_labels_mistakes_are_named(labels, expected):
    with pytest.raises(ConfigError, match=expected):
        label_names([Example("t", None, "pos", "f:1")], labels)


@pytest.mark.unit
def test_hold_out_is_seeded_disjoint_and_stratifiable():
    examples = [Example(f"t{i}", None, "a" if i % 4 else "b", f"f:{i}") for i in range(200)]
    train, dev = hold_out(examples, 0.1, seed=5)
    assert len(dev) == 20 and sorted(e.where for e in train + dev) == sorted(e.where for e in examples)
    assert hold_out(examples, 0.1, seed=5) == (train, dev)
    assert hold_out(examples, 0.1, seed=6)[1] != dev
    _, dev_strat = hold_out(examples, 0.1, seed=5, stratify=True)
    assert sum(e.label == "b" for e in dev_strat) == 5 and sum(e.label == "a" for e in dev_strat) == 15
    with pytest.raises(ConfigError, match="dev_fraction"):
        hold_out(examples, 1.0, seed=0)


def _brute_truncation(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    while len_a + len_b > budget:  # one token at a time off the longer text (the second on a tie)
        if len_a > len_b:
            len_a -= 1
        else:
            len_b -= 1
    return len_a, len_b


@pytest.mark.unit
def test_longest_first_truncation_matches_token_by_token():
    for budget in range(0, 12):
        for len_a in range(0, 15):
            for len_b in range(0, 15):
                assert truncated_lengths(len_a, len_b, budget) == _brute_truncation(len_a, len_b, budget)


@pytest.mark.integration
def test_tokenize_single_and_pairs(sample_data: Path, tokenizer):
    processor = tokenizer.processor()
    examples = read_examples(sample_data / MOVIES, InputFormat(columns=("label", "text")), regression=False)[:300]
    labels = encode_labels(examples, ["0", "1"])
    max_len = 24
    single = tokenize(examples, labels, tokenizer, max_len)
    pieces = [processor.encode(e.text) for e in examples]
    for ids, expected in zip(single.input_ids, pieces):
        assert ids.tolist() == [tokenizer.cls_id] + expected[:max_len - 2] + [tokenizer.sep_id]
    assert single.truncated == sum(len(p) + 2 > max_len for p in pieces) > 0 and single.token_type_ids is None
    pair_examples = [Example(a.text, b.text, a.label, a.where) for a, b in zip(examples, examples[1:])]
    pairs = tokenize(pair_examples, labels[:-1], tokenizer, max_len)
    for ids, types, a, b in zip(pairs.input_ids, pairs.token_type_ids, pieces, pieces[1:]):
        keep_a, keep_b = _brute_truncation(len(a), len(b), max_len - 3)
        assert ids.tolist() == [tokenizer.cls_id, *a[:keep_a], tokenizer.sep_id, *b[:keep_b], tokenizer.sep_id]
        assert types.tolist() == [0] * (keep_a + 2) + [1] * (keep_b + 1)
    assert pairs.truncated == sum(len(a) + len(b) + 3 > max_len for a, b in zip(pieces, pieces[1:]))


def _labelled_file(path: Path, rows: list[tuple[str, str]]) -> Path:
    """``rows`` of (label, text) as a headed TSV/CSV or JSONL file, gzipped when ``path`` ends in .gz."""
    name = path.name.removesuffix(".gz")
    if name.endswith(".jsonl"):
        text = "".join(json.dumps({"label": label, "text": body}) + "\n" for label, body in rows)
    else:
        sep = "\t" if name.endswith(".tsv") else ","
        quote = (lambda s: s) if sep == "\t" else (lambda s: '"' + s.replace('"', '""') + '"')
        text = f"label{sep}text\n" + "".join(f"{label}{sep}{quote(body)}\n" for label, body in rows)
    data = text.encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


class _EncodeSpy:
    """A SentencePiece processor that remembers the longest text it was asked to tokenize."""

    def __init__(self, processor):
        self.processor, self.longest = processor, 0

    def encode(self, texts, **kwargs):
        self.longest = max([self.longest, *map(len, texts)])
        return self.processor.encode(texts, **kwargs)


@pytest.mark.integration
@pytest.mark.parametrize("suffix", [".tsv", ".tsv.gz", ".csv", ".csv.gz", ".jsonl", ".jsonl.gz"])
def test_a_long_text_is_cut_before_it_is_tokenized_in_every_format(sample_data, tokenizer, tmp_path, monkeypatch,
                                                                  suffix):
    """The red-team repro made small: a 2 MB text among short ones. It is read (TSV refused fields over 131,072
    characters), only a bounded prefix of it is tokenized, and its tokens are the whole text's first ones."""
    rows = _movie_rows(sample_data)[:40]
    long_text = "One very long review. " + " ".join(body for _, body in _movie_rows(sample_data)) * 6
    assert len(long_text) > 2_000_000
    path = _labelled_file(tmp_path / f"train{suffix}", rows[:20] + [("1", long_text)] + rows[20:])
    spies = []
    real_processor = type(tokenizer).processor
    monkeypatch.setattr(type(tokenizer), "processor", lambda self: spies.append(_EncodeSpy(real_processor(self)))
                        or spies[-1])
    max_len = 64
    data = load_labelled(path, InputFormat(), tokenizer, max_len, regression=False, dev_fraction=0.1, seed=0)
    assert max(spy.longest for spy in spies) <= 8 * max_len                     # bounded by max_len, not the text
    everything = data.train.input_ids + data.dev.input_ids
    cut = tokenizer.processor().encode(long_text[:long_text.index(" ", 5000)])[:max_len - 2]
    assert sum(ids.tolist() == [tokenizer.cls_id, *cut, tokenizer.sep_id] for ids in everything) == 1
    assert data.train.truncated + data.dev.truncated >= 1


@pytest.mark.integration
def test_reading_and_tokenizing_a_long_text_takes_memory_bounded_by_the_text_not_the_tokenizer(sample_data, tokenizer,
                                                                                              tmp_path):
    """Python's peak allocation while loading a file with one 3.4 MB text stays within a few copies of that text
    (the line, its decoded string, the parsed field: 3.1x measured); tokenizing it whole peaked at 9x (token
    lists), besides the tokenizer's own C++ memory, which tracemalloc does not see."""
    import tracemalloc

    text = " ".join(body for _, body in _movie_rows(sample_data)) * 10
    path = _labelled_file(tmp_path / "train.jsonl", _movie_rows(sample_data)[:20] + [("0", text)])
    tracemalloc.start()
    try:
        load_labelled(path, InputFormat(), tokenizer, 128, regression=False, dev_fraction=0.1, seed=0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(text), f"peak {peak:,} bytes for a {len(text):,}-character text"


@pytest.mark.unit
def test_a_line_over_the_limit_is_one_error_naming_it(tmp_path, monkeypatch):
    from distaff.train.finetune import labelled

    monkeypatch.setattr(labelled, "MAX_LINE_BYTES", 1000)
    path = _labelled_file(tmp_path / "train.jsonl", [("0", "short"), ("1", "x " * 600), ("0", "also short")])
    with pytest.raises(DataError, match=rf"{path}:2: a line longer than 1,000 bytes .* shorten it"):
        read_examples(path, InputFormat(), regression=False)


# -- batches -------------------------------------------------------------------------------------------------
def _pair_set(sample_data: Path, tokenizer, count: int, max_len: int = 40) -> LabelledSet:
    examples = read_examples(sample_data / MOVIES, InputFormat(columns=("label", "text")), regression=False)[:count + 1]
    pairs = [Example(a.text, b.text, a.label, a.where) for a, b in zip(examples, examples[1:])]
    return tokenize(pairs, encode_labels(pairs, ["0", "1"]), tokenizer, max_len)


@pytest.mark.integration
def test_padded_and_packed_batches_give_each_example_its_own_logits(sample_data: Path, tokenizer):
    data = _pair_set(sample_data, tokenizer, 12, max_len=96)
    model = tiny_classifier(tokenizer.vocab_size)
    padded = next(iter(TrainBatches(data, batch_size=6, rank=0, world_size=1, seed=3, pad_id=tokenizer.pad_id)))
    packed = next(iter(TrainBatches(data, batch_size=6, rank=0, world_size=1, seed=3, pad_id=tokenizer.pad_id,
                                    packed=True)))
    assert torch.equal(padded["example_ids"], packed["example_ids"])
    assert len(set(data.lengths[padded["example_ids"].numpy()])) > 1  # the padding is exercised
    with torch.no_grad():
        got_padded = model(**model_inputs(padded))
        got_packed = model(**model_inputs(packed))
        alone = torch.cat([model(torch.from_numpy(data.input_ids[i]).long()[None],
                                 token_type_ids=torch.from_numpy(data.token_type_ids[i]).long()[None]).logits
                           for i in padded["example_ids"].tolist()])
    torch.testing.assert_close(got_padded.logits, alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_packed.logits, alone, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_packed.loss, got_padded.loss, atol=1e-6, rtol=1e-5)
    assert padded["labels"].tolist() == data.labels[padded["example_ids"].numpy()].tolist()


def _take(batches, count: int) -> list[dict]:
    iterator = iter(batches)
    return [next(iterator) for _ in range(count)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]
                                            for k in x) for x, y in zip(a, b)) and len(a) == len(b)


@pytest.mark.integration
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_resume_continues_with_exactly_the_same_batches(sample_data: Path, tokenizer, packed: bool):
    data = _pair_set(sample_data, tokenizer, 50)
    make = lambda: TrainBatches(data, batch_size=4, rank=1, world_size=2, seed=9,  # noqa: E731
                                pad_id=tokenizer.pad_id, packed=packed)
    assert make().steps_per_epoch == 6
    for stop in (3, 6, 8):  # mid-epoch, at the epoch's end, in the second epoch
        first = make()
        straight = _take(first, stop + 5)
        interrupted = make()
        _take(interrupted, stop)
        state = json.loads(json.dumps(interrupted.state_dict()))  # it survives a JSON round trip
        resumed = make()
        resumed.load_state_dict(state)
        assert _same(_take(resumed, 5), straight[stop:]), stop
    other = TrainBatches(data, batch_size=4, rank=1, world_size=2, seed=10, pad_id=0)
    with pytest.raises(ConfigError, match="run.seed: seed 9 in the checkpoint, 10 in this run; .* restore run.seed"):
        other.load_state_dict(state)
    wider = TrainBatches(data, batch_size=8, rank=1, world_size=2, seed=9, pad_id=0)
    with pytest.raises(ConfigError, match="data.batch_size: batch_size 4 in the checkpoint, 8 in this run"):
        wider.load_state_dict(state)
    old = {key: value for key, value in state.items() if key != "offset"}   # saved before re-dealing existed
    before_offsets = make()
    before_offsets.load_state_dict(old)
    assert before_offsets.state_dict() == state


@pytest.mark.integration
@pytest.mark.parametrize("saved_world,new_world,stop", [(2, 1, 2), (1, 3, 5), (3, 2, 1), (2, 3, 5)])
def test_resizing_re_deals_the_rest_of_the_epoch(sample_data: Path, tokenizer, saved_world, new_world, stop):
    """States of every rank of a ``saved_world`` run, after ``stop`` steps, continue on ``new_world`` ranks: the
    epoch's examples nobody read are dealt out once (but the few that no longer fill a step), then the next
    epoch starts as it would have."""
    data = _pair_set(sample_data, tokenizer, 50)
    make = lambda rank, world: TrainBatches(data, batch_size=4, rank=rank, world_size=world, seed=5,  # noqa: E731
                                            pad_id=0)
    old = [make(r, saved_world) for r in range(saved_world)]
    read = [i for r in old for batch in _take(r, stop) for i in batch["example_ids"].tolist()]
    states = [json.loads(json.dumps(r.state_dict())) for r in old]
    new = [make(r, new_world) for r in range(new_world)]
    for r in new:
        r.load_resized_state_dict(states)
    rest_steps = (50 - len(read)) // (new_world * 4)
    rest = [i for r in new for batch in _take(r, rest_steps) for i in batch["example_ids"].tolist()]
    epoch = old[0].order(0).tolist()
    assert sorted(read + rest) == sorted(epoch[:len(read) + len(rest)]) and len(set(read + rest)) == len(read + rest)
    assert 50 - len(read + rest) < new_world * 4                           # only what cannot fill a step is left
    assert [r.state_dict()["epoch"] for r in new] == [0] * new_world
    next_epoch = [_take(r, 1)[0]["example_ids"].tolist() for r in new]
    assert next_epoch == [make(r, new_world).order(1)[r * 4:(r + 1) * 4].tolist() for r in range(new_world)]
    assert all(r.state_dict()["epoch"] == 1 and r.state_dict()["offset"] == 0 for r in new)
    with pytest.raises(ConfigError, match="stand at different positions"):
        make(0, new_world).load_resized_state_dict([states[0], {**states[0], "step": states[0]["step"] + 1}])


@pytest.mark.integration
def test_training_ranks_share_out_each_epoch(sample_data: Path, tokenizer):
    data = _pair_set(sample_data, tokenizer, 50)
    ranks = [TrainBatches(data, batch_size=4, rank=r, world_size=2, seed=1, pad_id=0) for r in range(2)]
    steps = ranks[0].steps_per_epoch
    per_epoch: dict[int, list[int]] = {}
    for batches in (_take(r, 2 * steps) for r in ranks):
        for step, batch in enumerate(batches):
            per_epoch.setdefault(step // steps, []).extend(batch["example_ids"].tolist())
    assert [len(ids) for ids in per_epoch.values()] == [steps * 8] * 2
    assert all(len(set(ids)) == len(ids) for ids in per_epoch.values())  # no example on both ranks
    assert per_epoch[0] != per_epoch[1]  # reshuffled
    with pytest.raises(ConfigError, match="do not fill one step"):
        TrainBatches(data, batch_size=26, rank=0, world_size=2, seed=1, pad_id=0)


@pytest.mark.integration
@pytest.mark.parametrize("count,batch_size", [(23, 4), (16, 4), (3, 4)])
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_eval_ranks_cover_the_dev_set_exactly_once(sample_data: Path, tokenizer, count, batch_size, packed):
    data = _pair_set(sample_data, tokenizer, count)
    ranks = [EvalBatches(data, batch_size=batch_size, rank=r, world_size=2, pad_id=0, packed=packed) for r in range(2)]
    batches = [list(r) for r in ranks]
    assert len(batches[0]) == len(batches[1]) == len(ranks[0]) == -(-count // (2 * batch_size))
    seen = []
    for rank_batches in batches:
        for batch in rank_batches:
            assert len(batch["labels"]) == batch_size
            real = batch["weights"] > 0
            assert torch.equal(batch["example_ids"] >= 0, real)
            seen.extend(batch["example_ids"][real].tolist())
            assert batch["labels"][real].tolist() == data.labels[batch["example_ids"][real].numpy()].tolist()
    assert sorted(seen) == list(range(count))


@pytest.mark.integration
def test_regression_pairs_from_gzipped_jsonl_with_held_out_dev(tmp_path: Path, tokenizer):
    rng = np.random.default_rng(0)
    records = [{"a": f"sentence number {i}", "b": f"another {i % 7}", "score": round(float(rng.normal()), 3)}
               for i in range(40)]
    path = tmp_path / "sts.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    fmt = InputFormat(text_column="a", text_pair_column="b", label_column="score")
    data = load_labelled(path, fmt, tokenizer, 32, regression=True, dev_fraction=0.25, seed=4)
    assert data.num_labels == 1 and data.label_names is None and data.train.regression
    assert (len(data.train), len(data.dev)) == (30, 10)
    scores = sorted(data.train.labels.tolist() + data.dev.labels.tolist())
    assert scores == sorted(r["score"] for r in records)
    batch = next(iter(EvalBatches(data.dev, batch_size=4, rank=0, world_size=1, pad_id=0)))
    assert batch["labels"].dtype == torch.float32 and "token_type_ids" in batch
    with pytest.raises(ConfigError, match="regression task has none"):
        load_labelled(path, fmt, tokenizer, 32, regression=True, dev_fraction=0.25, labels=["0", "1"])
    with pytest.raises(ConfigError, match="regression task has none"):
        load_labelled(path, fmt, tokenizer, 32, regression=True, dev_fraction=0.25, stratify=True)


@pytest.mark.integration
def test_two_gloo_ranks_share_the_epoch_and_gather_the_dev_set_once(tokenizer_dir: Path, tmp_path: Path):
    (tmp_path / "spec.json").write_text(json.dumps({"tokenizer": str(tokenizer_dir), "out": str(tmp_path),
                                                    "packed": True}))
    codes = wait_all(spawn_ranks(tmp_path / "spec.json", tmp_path, program=(str(PROBE),)), timeout=300)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    got = json.loads((tmp_path / "gathered.json").read_text())
    # one process, padded batches: the reference
    data = movie_data(str(tokenizer_dir))
    logits, labels, weights, _ = evaluate(tiny_classifier(load_tokenizer_info(tokenizer_dir).vocab_size),
                                          EvalBatches(data.dev, batch_size=EVAL_BATCH, rank=0, world_size=1, pad_id=0))
    ids = torch.tensor(got["example_ids"])
    real = ids >= 0
    assert sorted(ids[real].tolist()) == list(range(len(data.dev))) and len(ids) % (2 * EVAL_BATCH) == 0
    torch.testing.assert_close(torch.tensor(got["logits"])[real], logits[ids[real]], atol=1e-5, rtol=1e-4)
    assert got["metrics"] == pytest.approx(compute_metrics(logits, labels, weights))
    steps = len(data.train) // (2 * TRAIN_BATCH)
    assert len(got["train_ids"]) == len(set(got["train_ids"])) == steps * 2 * TRAIN_BATCH


@pytest.mark.unit
def test_a_column_named_twice_in_the_header_is_refused(tmp_path: Path):
    path = tmp_path / "twice.tsv"
    path.write_text("label\ttext\ttext\npos\ta\tb\nneg\tc\td\n")
    with pytest.raises(DataError, match=r"twice\.tsv: column 'text' appears twice in the header"):
        read_examples(path, InputFormat(), regression=False)


@pytest.mark.unit
@pytest.mark.parametrize("odd", ["²", "--1", "1_000", "٣x"])
def test_labels_that_only_look_numeric_sort_as_text(odd: str):
    make = lambda labels: [Example("t", None, label, f"f:{i}") for i, label in enumerate(labels)]  # noqa: E731
    assert label_names(make(["10", "2", odd])) == sorted(["10", "2", odd])
    assert label_names(make(["10", "-2", "3"])) == ["-2", "3", "10"]


@pytest.mark.unit
def test_unseen_class_error_names_a_few_classes_and_the_count():
    names = [f"class{i}" for i in range(2000)]
    with pytest.raises(DataError) as err:
        encode_labels([Example("t", None, "other", "dev.tsv:7")], names)
    message = str(err.value)
    assert "dev.tsv:7: class 'other'" in message and "2000 classes: 'class0'" in message and len(message) < 300


@pytest.mark.unit
def test_a_corrupt_gzip_file_is_named_as_one(tmp_path: Path):
    rows = [(str(i % 2), f"some text number {i} with words") for i in range(3000)]
    data = bytearray(_labelled_file(tmp_path / "ok.tsv.gz", rows).read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.tsv.gz"
    bad.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"bad\.tsv\.gz: corrupt gzip file \(CRC check failed"):
        read_examples(bad, InputFormat(), regression=False)
