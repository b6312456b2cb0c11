"""``distaff data prepare`` without ``--heldout-fraction`` holds out enough of the corpus for its own check."""

from __future__ import annotations

import json

import pytest

from distaff.launch.cli import main as distaff_main
from distaff.train.data.heldout import MIN_HELDOUT_TOKENS, choose_every


@pytest.mark.unit
@pytest.mark.parametrize("docs, every, enough", [
    (100_000, 100, True),   # a large corpus: 1%, as before
    (1_000, 20, True),      # 500k tokens: every 20th document (50 x 500 = 25,000), every 21st would be 23,500
    (50, 5, False),         # 25k tokens: at most 20% held out, and the line says the corpus is small
])
def test_every_is_the_largest_that_holds_the_minimum(docs, every, enough):
    choice = choose_every([500] * docs)
    assert (choice.every, choice.enough) == (every, enough)
    assert choice.tokens == 500 * (docs // every)
    assert f"1 document in {every} (" in choice.line() and "--heldout-fraction" in choice.line()
    assert ("small" in choice.line()) is not enough


@pytest.mark.unit
def test_long_documents_late_in_the_corpus_count_where_they_fall():
    lengths = [10] * 99 + [30_000] + [10] * 100     # document 100 alone holds enough
    assert choose_every(lengths).every == 100
    assert choose_every(lengths[:99] + [10, 30_000] + lengths[101:]).every < 100


@pytest.mark.integration
def test_prepare_without_a_fraction_chooses_one_says_so_and_does_not_warn(corpus_files, tokenizer_dir, tmp_path,
                                                                        capsys):
    out = tmp_path / "data"
    assert distaff_main(["data", "prepare", "--input", str(corpus_files[0]), "--tokenizer", str(tokenizer_dir),
                         "--seq-len", "64", "--out", str(out), "--workers", "1", "--no-progress"]) == 0
    captured = capsys.readouterr()
    chosen = [line for line in captured.out.splitlines() if "holding out 1 document in" in line]
    assert len(chosen) == 1 and f"{MIN_HELDOUT_TOKENS:,} or more wanted" in chosen[0], captured.out
    assert "warning" not in captured.err, captured.err
    heldout = json.loads((out / "manifest.json").read_text())["splits"]["heldout"]
    assert heldout["tokens"] >= MIN_HELDOUT_TOKENS
    every = int(chosen[0].split("document in ")[1].split(" ")[0])
    assert 5 <= every < 100       # 600,000 characters of Austen: 1% would hold too few
