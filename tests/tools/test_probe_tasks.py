"""Probing tasks (train/tools/probe_tasks.py) and the pretraining-overlap check (train/tools/probe_overlap.py): built
deterministically from the bundled movie sentences, balanced, each change really made (and only it); sentences
found in a real data dir's training split exactly when an independent check on the raw text finds them; and
how ``--model NAME=PATH`` is read."""

from __future__ import annotations

import gzip
import random
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from distaff.train.data.sources import ReadOptions, iter_documents
from distaff.train.finetune.labelled import read_texts
from distaff.train.tools.probe import Encoder, parse_encoder
from distaff.train.tools.probe_overlap import find_in_tokens, pretrained_on, run_data_dir
from distaff.train.tools.probe_tasks import (COORDINATION, MAX_WORDS, MIN_WORDS, SENTLEN_BINS, WC_WORDS, WORD, bshift,
                                       build_tasks, coordinv, probe_sentences, sentlen, split_sentences, wc, wc_words)

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def movie_sentences(sample_data: Path) -> list[str]:
    return probe_sentences(read_texts(sample_data / "movie-snippets.tsv.gz", 1))


def test_sentences_are_split_deduplicated_and_length_filtered():
    assert split_sentences('He said "Go."  Then Mr. Darcy\nleft! Did he? yes. (It rained.) Fine.') == \
        ['He said "Go."', "Then Mr. Darcy left!", "Did he? yes.", "(It rained.)", "Fine."]
    text = "One two three four five. One two three four five. Too short here. " + " ".join(["word"] * 41) + "."
    assert probe_sentences([text, "One two three four five."]) == ["One two three four five."]


def test_every_task_is_built_the_same_way_from_the_same_seed(movie_sentences: list[str]):
    first, meaning = build_tasks(movie_sentences, seed=0)
    again, _ = build_tasks(list(movie_sentences), seed=0)
    other, _ = build_tasks(movie_sentences, seed=1)
    assert first == again
    for task in first:
        assert first[task] != other[task], task
        assert len({e.source for e in first[task]}) == len(first[task]), f"{task}: a sentence used twice"
        assert len({e.text for e in first[task]}) == len(first[task]), f"{task}: a text twice (in train and dev?)"
    assert set(meaning["bshift"]) == {"0", "1"} and len(meaning["wc"]) == WC_WORDS


def _non_words(text: str) -> str:
    return WORD.sub("_", text)


def test_bshift_swaps_exactly_two_adjacent_words_in_exactly_half(movie_sentences: list[str]):
    examples = bshift(movie_sentences, seed=0)
    assert len(examples) > 0.95 * len(movie_sentences)
    assert sum(e.label for e in examples) == len(examples) // 2
    positions = Counter()
    for e in examples:
        if e.label == 0:
            assert e.text == e.source
            continue
        words, before = WORD.findall(e.text), WORD.findall(e.source)
        changed = [i for i, (a, b) in enumerate(zip(words, before)) if a != b]
        assert len(changed) == 2 and changed[1] == changed[0] + 1 and changed[0] >= 1, (e.source, e.text)
        i = changed[0]
        assert (words[i], words[i + 1]) == (before[i + 1], before[i])
        assert _non_words(e.text) == _non_words(e.source)   # punctuation and spacing untouched
        positions[i] += 1
    assert len(positions) > 10   # the swapped pair is drawn anywhere in the sentence, not always at one place


def test_coordinv_swaps_the_two_clauses_and_moves_the_capitals(movie_sentences: list[str]):
    examples = coordinv(movie_sentences, seed=0)
    assert len(examples) > 200 and sum(e.label for e in examples) == len(examples) // 2
    for e in examples:
        assert len(COORDINATION.findall(e.text)) == 1
        if e.label == 0:
            assert e.text == e.source
            continue
        old, new = COORDINATION.split(e.source), COORDINATION.split(e.text)
        assert old[1] == new[1]                                    # the same conjunction
        strip = lambda clause: re.sub(r"[.!?]+$", "", clause).lower()   # noqa: E731
        assert strip(new[0]) == strip(old[2]) and strip(new[2]) == strip(old[0]), (e.source, e.text)
        assert e.text[0].isupper() or not e.text[0].isalpha()
        ending = lambda text: re.search(r"[.!?]*$", text).group()   # noqa: E731
        assert ending(e.text) == ending(e.source)                  # the end punctuation (or none) stays at the end


def test_coordinv_never_lower_cases_a_name_and_keeps_i():
    names = ["Jackson directs the film well, but the script lets him down badly."] + \
            ["Jackson is here." for _ in range(3)] + ["I liked the songs a lot, but the plot made no sense."] + \
            ["The cast is strong, but the story drags on and on."] + ["the cast the story the plot it is ."] * 2
    built = {e.source: e for e in coordinv(names, seed=0)}
    assert "Jackson directs the film well, but the script lets him down badly." not in built
    assert set(built) == {"I liked the songs a lot, but the plot made no sense.",
                          "The cast is strong, but the story drags on and on."}
    for seed in range(8):   # whichever of the two is inverted, the capitals are right
        for e in coordinv(names, seed=seed):
            if e.label and e.source.startswith("I "):
                assert e.text == "The plot made no sense, but I liked the songs a lot."
            elif e.label:
                assert e.text == "The story drags on and on, but the cast is strong."


def test_sentlen_bins_grow_with_length_and_are_about_equal(movie_sentences: list[str]):
    examples, edges = sentlen(movie_sentences, seed=0)
    assert len(edges) == SENTLEN_BINS and sorted(e.text for e in examples) == sorted(movie_sentences)
    for e in examples:
        n = len(WORD.findall(e.text))
        assert edges[e.label] <= n and (e.label == len(edges) - 1 or n < edges[e.label + 1])
    counts = Counter(e.label for e in examples)
    assert max(counts.values()) < 1.6 * min(counts.values()), counts
    assert MIN_WORDS <= edges[0] and edges[-1] <= MAX_WORDS


def test_wc_sentences_hold_exactly_their_word_and_classes_are_equal(movie_sentences: list[str]):
    examples, words = wc(movie_sentences, seed=0)
    assert words == wc_words(movie_sentences) and len(words) == WC_WORDS
    counts = Counter(e.label for e in examples)
    assert len(counts) == WC_WORDS and len(set(counts.values())) == 1 and len(examples) >= 200
    for e in examples:
        held = {w.lower() for w in WORD.findall(e.text)} & set(words)
        assert held == {words[e.label]}
    common = Counter(w for s in movie_sentences for w in {x.lower() for x in WORD.findall(s)})
    assert all(common[w] < common["the"] for w in words) and "the" not in words   # mid-frequency, not the top


def test_find_in_tokens_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, 3000).astype(np.uint64)   # a small alphabet: many partial matches
    starts = rng.integers(0, 2990, 40)
    inside = [tokens[s:s + int(rng.integers(5, 10))].tolist() for s in starts]
    outside = [rng.integers(0, 6, int(rng.integers(5, 12))).tolist() for _ in range(200)] + [[7, 1, 2, 3, 4], []]
    text = "".join(map(chr, (tokens + 65).tolist()))
    expected = [bool(seq) and "".join(chr(t + 65) for t in seq) in text for seq in inside + outside]
    got = find_in_tokens(inside + outside, tokens)
    assert got == expected and all(got[:40]) and not all(got[40:]) and any(got[40:])


def _train_documents(corpus_files: list[Path], heldout_every: int) -> list[str]:
    """The documents the data_dir fixture trained on, read from the raw text (every k-th is held out)."""
    docs = [" ".join(d.text.split()) for d in iter_documents(corpus_files, ReadOptions())]
    return [d for number, d in enumerate(docs, 1) if number % heldout_every]


def test_overlap_with_a_data_dirs_training_split_matches_the_raw_text(data_dir: Path, corpus_files: list[Path],
                                                                     sample_data: Path):
    """Sentences of the fixture's Austen slice (trained on, bar its held-out documents) and of later Austen text
    (never): flagged exactly when they occur in a training document of the raw input."""
    with gzip.open(sample_data / "austen-emma-pride.txt.gz", "rt", encoding="utf-8") as handle:
        text = handle.read(900_000)
    trained = probe_sentences(text[:600_000].split("\n\n"))
    later = probe_sentences(text[700_000:].split("\n\n"))
    sentences = random.Random(0).sample(trained, 300) + random.Random(1).sample(later, 300)
    documents = "\n".join(_train_documents(corpus_files, heldout_every=20))
    expected = [s in documents for s in sentences]
    got = pretrained_on(sentences, data_dir)
    assert got == expected
    assert sum(got[:300]) > 250 and sum(got[:300]) < 300   # held-out documents are not pretraining text
    assert sum(got[300:]) < 10


def test_a_runs_data_dir_is_read_from_its_saved_config(tmp_path: Path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000010").mkdir(parents=True)
    (run / "config.yaml").write_text("data:\n  dir: some/data\n")
    assert run_data_dir(run) == run_data_dir(run / "checkpoints" / "step-00000010") == Path("some/data")
    assert run_data_dir(tmp_path) is None


def test_model_names_and_paths(tmp_path: Path):
    odd = tmp_path / "lr=1e-3"
    odd.mkdir()
    assert parse_encoder(f"mlm={odd}") == Encoder("mlm", odd)
    assert parse_encoder(str(odd)) == Encoder(str(odd), odd)
    assert parse_encoder("runs/x") == Encoder("runs/x", Path("runs/x"))
