"""The baselines. Bag of words: its tf-idf against a hand computation, a separable toy it must learn, the real
movie-review sample where it must beat the majority class, determinism, and bad input. Linear probe: a word
rule it must read off frozen random features, labels it must not, the CLI."""

from __future__ import annotations

import gzip
import json
import math
import random
from pathlib import Path

import pytest
import torch

from distaff.train.finetune.labelled import hold_out, read_examples
from distaff.train.tools.baselines import BUNDLED_COLUMNS, TfIdf, main, ngrams, run_baseline, run_probe

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
    examples = read_examples(sample_data / "movie-snippets.tsv.gz", BUNDLED_COLUMNS, regression=False)
    small = _write_tsv(tmp_path / "small.tsv.gz", [(e.label, e.text) for e in examples[:400]])
    assert run_baseline(small, 0.25, seed=5) == run_baseline(small, 0.25, seed=5)
    assert run_baseline(small, 0.25, seed=5) != run_baseline(small, 0.25, seed=6)


def test_scores_the_dev_rows_fine_tuning_holds_out(tmp_path: Path):
    """The rows fine-tuning holds out (``hold_out``, seed 4) get the opposite word-label rule to all others: a
    baseline fitted and scored on exactly that split is wrong on every dev row, any other split would not be."""
    rows = [(i % 2, ("dull", "superb")[i % 2]) for i in range(80)]
    first = _write_tsv(tmp_path / "first.tsv.gz", rows)
    _, dev = hold_out(read_examples(first, BUNDLED_COLUMNS, regression=False), 0.25, seed=4)
    dev_lines = {int(e.where.rsplit(":", 1)[1]) for e in dev}
    flipped = [(label, ("superb", "dull")[label] if line in dev_lines else text)
               for line, (label, text) in enumerate(rows, 1)]
    result = run_baseline(_write_tsv(tmp_path / "flipped.tsv.gz", flipped), 0.25, seed=4)
    assert result.dev_examples == len(dev) == 20 and result.dev_accuracy == 0.0


def test_bad_rows_name_the_file_and_line(tmp_path: Path, capsys):
    no_tab = tmp_path / "no-tab.tsv"
    no_tab.write_text("1\tfine\n0 awful\n")
    assert main(["--train", str(no_tab)]) == 2
    assert "no-tab.tsv:2" in capsys.readouterr().err
    assert main(["--train", str(tmp_path / "missing.tsv")]) == 2
    assert "missing.tsv" in capsys.readouterr().err
    assert main(["--train", str(_write_tsv(tmp_path / "ok.tsv.gz", [(0, "a"), (1, "b")])), "--dev-fraction", "1"]) == 2
    assert "--dev-fraction: expected a finite number > 0 and < 1, got '1'" in capsys.readouterr().err


def test_cli_prints_and_writes_the_result(tmp_path: Path, sample_data: Path):
    out = tmp_path / "bow.json"
    assert main(["--train", str(sample_data / "movie-snippets.tsv.gz"), "--seed", "2", "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["seed"] == 2 and written["dev_examples"] == 600 and 0.6 < written["dev_accuracy"] < 0.9


def _word_rule_rows(labels: list[int]) -> list[tuple[int, str]]:
    """Sentences of shuffled filler around one word, "dull" on even rows and "superb" on odd ones."""
    rng = random.Random(0)
    filler = ["the", "plot", "actors", "music", "scenes", "story", "cast", "ending"]
    return [(label, " ".join(rng.sample(filler, 4) + [("dull", "superb")[i % 2]] + rng.sample(filler, 3)))
            for i, label in enumerate(labels)]


def test_probe_finds_a_word_the_frozen_features_carry(small_model_dir: Path, tmp_path: Path):
    """Random-weight features still carry which word a sentence holds: the probe must read the rule off them,
    and must not when the labels ignore the words (same sentences, labels drawn at random)."""
    rule = _write_tsv(tmp_path / "rule.tsv.gz", _word_rule_rows([i % 2 for i in range(120)]))
    result = run_probe(small_model_dir, rule, dev_fraction=0.25, seed=3)
    assert (result.train_examples, result.dev_examples, result.features) == (90, 30, 32)
    assert result.dev_accuracy >= 0.9, result
    coin = random.Random(1)
    noise = _write_tsv(tmp_path / "noise.tsv.gz", _word_rule_rows([coin.randrange(2) for _ in range(120)]))
    assert run_probe(small_model_dir, noise, dev_fraction=0.25, seed=3).dev_accuracy < 0.75


def test_probe_cli_prints_writes_and_names_a_missing_model(small_model_dir: Path, tmp_path: Path, capsys):
    data = _write_tsv(tmp_path / "rule.tsv.gz", _word_rule_rows([i % 2 for i in range(80)]))
    out = tmp_path / "probe.json"
    assert main(["--train", str(data), "--probe", str(small_model_dir), "--seed", "2", "--json", str(out)]) == 0
    assert "linear probe of" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["features"] == 32 and written["dev_examples"] == 16
    assert main(["--train", str(data), "--probe", str(tmp_path / "no-model")]) == 2
    assert "no-model" in capsys.readouterr().err
