"""The bag-of-words baseline: its tf-idf against a hand computation, a separable toy it must learn, the
real movie-review sample where it must beat the majority class, determinism, and bad input."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import pytest
import torch

from distaff.train.baselines import TfIdf, dev_split, main, ngrams, read_labelled, run_baseline
from distaff.train.data.errors import DataError

pytestmark = pytest.mark.unit


def test_ngrams_are_lower_cased_words_and_adjacent_pairs():
    assert ngrams("A fine, FINE film's end") == ["a", "fine", ",", "fine", "film's", "end",
                                                  "a fine", "fine ,", ", fine", "fine film's", "film's end"]


def test_tfidf_matches_a_hand_computation():
    vectorise = TfIdf(["good good film", "bad film", "good plot"], min_count=2)
    assert sorted(vectorise.index) == ["film", "good"]  # every other n-gram is in one document only
    idf = {"film": math.log(4 / 3) + 1, "good": math.log(4 / 3) + 1}
    good, film = (1 + math.log(2)) * idf["good"], idf["film"]
    expected = torch.tensor([[film, good], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    expected[0] /= math.hypot(film, good)
    got = vectorise(["good good film", "bad film", "good plot", "unseen words"]).to_dense()
    order = [vectorise.index["film"], vectorise.index["good"]]
    torch.testing.assert_close(got[:, order], expected)


def _write_tsv(path: Path, rows: list[tuple[int, str]]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.writelines(f"{label}\t{text}\n" for label, text in rows)
    return path


def test_learns_a_separable_toy(tmp_path: Path):
    rng = random.Random(0)
    filler = ["the", "plot", "actors", "music", "scenes", "story", "cast", "ending"]
    rows = [(label, " ".join(rng.sample(filler, 4) + [("dull", "superb")[label]] + rng.sample(filler, 3)))
            for label in [0, 1] * 60]
    result = run_baseline(_write_tsv(tmp_path / "toy.tsv.gz", rows), dev_fraction=0.25, seed=3)
    assert result.dev_examples == 30 and result.train_examples == 90
    assert result.dev_accuracy == 1.0


def test_beats_the_majority_class_on_the_movie_sample(sample_data: Path):
    result = run_baseline(sample_data / "movie-snippets.tsv.gz", dev_fraction=0.2, seed=1)
    assert (result.train_examples, result.dev_examples) == (2400, 600)
    assert result.dev_accuracy > result.majority_accuracy + 0.1, result


def test_a_seed_gives_one_answer_and_seeds_give_different_splits(tmp_path: Path, sample_data: Path):
    train, dev = dev_split(3000, 0.2, seed=1)
    assert len(dev) == 600 and sorted(train + dev) == list(range(3000))
    assert dev_split(3000, 0.2, seed=1) == (train, dev) and dev_split(3000, 0.2, seed=2)[1] != dev
    rows = list(zip(*read_labelled(sample_data / "movie-snippets.tsv.gz")))[:400]
    small = _write_tsv(tmp_path / "small.tsv.gz", rows)
    assert run_baseline(small, 0.25, seed=5) == run_baseline(small, 0.25, seed=5)


def test_bad_rows_name_the_file_and_line(tmp_path: Path, capsys):
    no_tab = tmp_path / "no-tab.tsv"
    no_tab.write_text("1\tfine\n0 awful\n")
    with pytest.raises(DataError, match=r"no-tab.tsv:2: expected label<TAB>text"):
        read_labelled(no_tab)
    bad_label = tmp_path / "bad-label.tsv"
    bad_label.write_text("1\tfine\npositive\tgreat\n")
    assert main(["--train", str(bad_label)]) == 2
    assert "bad-label.tsv:2: label must be an integer >= 0, got 'positive'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="dev_fraction"):
        dev_split(10, 1.0, seed=0)


def test_cli_prints_and_writes_the_result(tmp_path: Path, sample_data: Path):
    out = tmp_path / "bow.json"
    assert main(["--train", str(sample_data / "movie-snippets.tsv.gz"), "--seed", "2", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["seed"] == 2 and written["dev_examples"] == 600 and 0.6 < written["dev_accuracy"] < 0.9
