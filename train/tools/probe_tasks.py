"""SentEval-style probing tasks (Conneau et al. 2018, "What you can cram into a single $&!#* vector") built from
raw sentences, with no annotation: every label is a fact about the sentence's surface that the construction
itself fixes.

* **bshift**: two adjacent words swapped in half of the sentences (label 1), the rest left as written (label 0).
  Only words (letters and apostrophes) separated by one space are swapped, never the first word (its capital
  would give the swap away) and never two equal words; punctuation stays where it is. The same words occur in
  both classes, so only their order tells them apart.
* **coordinv**: sentences with exactly one ``", <conjunction> "`` (and, but, or, so, yet, nor) joining two
  clauses of at least three words, with no quotes or brackets, ending in ``.``, ``!``, ``?`` or nothing; in half
  of them the clauses change places (label 1), the end punctuation staying at the end. The capitals move
  with the position: the new first clause is capitalised, the old first word lower-cased, which is allowed only
  for words this text writes in lower case mid-sentence more often than capitalised (``I`` stays as it is), so
  a proper noun never ends up in lower case; sentences whose first word fails this are left out of both classes.
* **sentlen**: the number of words, in ``SENTLEN_BINS`` bins with (about) equal counts (label: the bin).
* **wc**: which one of ``WC_WORDS`` mid-frequency words the sentence contains (the words ranked after the
  ``WC_SKIP`` most common by how many sentences hold them); sentences holding none or several are left out,
  and every word keeps as many sentences as the rarest has.

Sentences come from documents split at ``.``, ``!`` or ``?`` followed by a capital (not after Mr., Mrs., Dr. and
the like), with whitespace collapsed; those of ``MIN_WORDS``-``MAX_WORDS`` words are kept, each distinct
sentence once. Everything random is drawn from ``numpy.random.default_rng((seed, task number))``: one seed gives
one set of tasks, byte for byte, and each sentence appears at most once per task.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

TASKS = ("bshift", "coordinv", "sentlen", "wc")
MIN_WORDS, MAX_WORDS = 5, 40
SENTLEN_BINS = 6
MIN_SENTENCES = 100     # fewer, and a task's dev split (--dev-fraction of it) is too small to measure accuracy on
WC_WORDS, WC_SKIP = 10, 50
CONJUNCTIONS = ("and", "but", "or", "so", "yet", "nor")

WORD = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)*")
# a sentence ends at . ! ? (and closing quotes/brackets) before whitespace and a capital or opening quote
BOUNDARY = re.compile(r"(?<=[.!?])([\"')\]]*)\s+(?=[\"'(\[]*[A-Z])")
ABBREVIATIONS = {"mr", "mrs", "ms", "dr", "st", "jr", "sr", "mt", "vs", "no", "col", "gen", "capt", "rev"}
COORDINATION = re.compile(r", (" + "|".join(CONJUNCTIONS) + r") ", re.IGNORECASE)
END = re.compile(r"[.!?]+$")
# quotes and brackets (an apostrophe inside a word is neither): a clause holding one could not move whole
QUOTED = re.compile(r"[\"()\[\]]|(?<![A-Za-z])'|'(?![A-Za-z])")


@dataclass(frozen=True)
class ProbeExample:
    text: str
    label: int
    source: str  # the sentence as written (for bshift and coordinv: before the change)


def split_sentences(document: str) -> list[str]:
    """The document's sentences, whitespace collapsed."""
    text = " ".join(document.split())
    sentences, start = [], 0
    for match in BOUNDARY.finditer(text):
        before = text[start:match.start()].rsplit(" ", 1)[-1].rstrip(".!?\"')]").lower()
        if before in ABBREVIATIONS:
            continue
        sentences.append(text[start:match.end(1)])
        start = match.end()
    sentences.append(text[start:])
    return [s.strip() for s in sentences if s.strip()]


def probe_sentences(documents: Iterable[str]) -> list[str]:
    """Every distinct sentence of ``MIN_WORDS``-``MAX_WORDS`` words, in order of first appearance."""
    seen: dict[str, None] = {}
    for document in documents:
        for sentence in split_sentences(document):
            if MIN_WORDS <= len(WORD.findall(sentence)) <= MAX_WORDS:
                seen.setdefault(sentence, None)
    return list(seen)


def task_rng(seed: int, task: str) -> np.random.Generator:
    return np.random.default_rng((seed, TASKS.index(task)))


def _balanced(candidates: Sequence, rng: np.random.Generator) -> tuple[list, np.ndarray]:
    """The candidates in a random order and labels with exactly ``len // 2`` ones, at random places."""
    order = [candidates[i] for i in rng.permutation(len(candidates))]
    labels = np.zeros(len(order), dtype=np.int64)
    labels[rng.permutation(len(order))[: len(order) // 2]] = 1
    return order, labels


def swappable_pairs(sentence: str) -> list[tuple[re.Match, re.Match]]:
    """Adjacent words (not the first) separated by exactly one space, different when lower-cased."""
    words = list(WORD.finditer(sentence))
    return [(a, b) for a, b in zip(words[1:], words[2:])
            if sentence[a.end():b.start()] == " " and a.group().lower() != b.group().lower()]


def bshift(sentences: Sequence[str], seed: int) -> list[ProbeExample]:
    rng = task_rng(seed, "bshift")
    order, labels = _balanced([s for s in sentences if swappable_pairs(s)], rng)
    examples = []
    for sentence, label in zip(order, labels):
        text = sentence
        if label:
            pairs = swappable_pairs(sentence)
            a, b = pairs[rng.integers(len(pairs))]
            text = sentence[:a.start()] + b.group() + " " + a.group() + sentence[b.end():]
        examples.append(ProbeExample(text, int(label), sentence))
    return examples


def lower_case_words(sentences: Sequence[str]) -> set[str]:
    """Words written in lower case more often than capitalised when not sentence-initial."""
    lower, upper = Counter(), Counter()
    for sentence in sentences:
        for word in WORD.findall(sentence)[1:]:
            (lower if word[0].islower() else upper)[word.lower()] += 1
    return {word for word, count in lower.items() if count > upper[word]}


def _clauses(sentence: str, lowerable: set[str]) -> tuple[str, str, str, str] | None:
    """(first clause, conjunction, second clause, end punctuation) of an invertible sentence, else None."""
    found = list(COORDINATION.finditer(sentence))
    if len(found) != 1:
        return None
    end = END.search(sentence)
    stop = end.start() if end else len(sentence)
    first, second = sentence[:found[0].start()], sentence[found[0].end():stop]
    if len(WORD.findall(first)) < 3 or len(WORD.findall(second)) < 3 or QUOTED.search(first + " " + second):
        return None
    head = WORD.match(first)
    if head is None or not (head.group() == "I" or head.group().startswith("I'") or head.group().lower() in lowerable):
        return None
    return first, found[0].group(1), second, sentence[stop:]


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def invert_clauses(first: str, conjunction: str, second: str, end: str) -> str:
    """``second, conjunction first<end>`` with the capitals moved."""
    head = WORD.match(first).group()
    if not (head == "I" or head.startswith("I'")):
        first = first[:1].lower() + first[1:]
    return f"{_capitalised(second)}, {conjunction} {first}{end}"


def coordinv(sentences: Sequence[str], seed: int) -> list[ProbeExample]:
    lowerable = lower_case_words(sentences)
    candidates = [(s, parts) for s in sentences if (parts := _clauses(s, lowerable)) is not None]
    order, labels = _balanced(candidates, task_rng(seed, "coordinv"))
    return [ProbeExample(invert_clauses(*parts) if label else sentence, int(label), sentence)
            for (sentence, parts), label in zip(order, labels)]


def sentlen(sentences: Sequence[str], seed: int) -> tuple[list[ProbeExample], list[int]]:
    """The examples and the bins' lower edges (words): bin ``k`` holds lengths in ``[edges[k], edges[k+1])``."""
    lengths = np.array([len(WORD.findall(s)) for s in sentences])
    edges = sorted({int(np.quantile(lengths, k / SENTLEN_BINS, method="lower")) for k in range(SENTLEN_BINS)})
    labels = np.searchsorted(edges, lengths, side="right") - 1
    order = task_rng(seed, "sentlen").permutation(len(sentences))
    return [ProbeExample(sentences[i], int(labels[i]), sentences[i]) for i in order], edges


def wc_words(sentences: Sequence[str]) -> list[str]:
    """The ``WC_WORDS`` words after the ``WC_SKIP`` most common, by sentences holding them (ties: alphabetical)."""
    counts = Counter(word for s in sentences for word in {w.lower() for w in WORD.findall(s)})
    ranked = sorted(counts, key=lambda word: (-counts[word], word))
    return ranked[WC_SKIP:WC_SKIP + WC_WORDS]


def wc(sentences: Sequence[str], seed: int) -> tuple[list[ProbeExample], list[str]]:
    """The examples (label: the index of the word) and the words."""
    words = wc_words(sentences)
    if len(words) < WC_WORDS:
        return [], words    # too few distinct words: no task (probe.py says so)
    by_word: dict[int, list[str]] = {i: [] for i in range(len(words))}
    for sentence in sentences:
        held = {w.lower() for w in WORD.findall(sentence)} & set(words)
        if len(held) == 1:
            by_word[words.index(held.pop())].append(sentence)
    rng = task_rng(seed, "wc")
    keep = min(len(group) for group in by_word.values())
    chosen = [(group[i], label) for label, group in by_word.items() for i in sorted(rng.permutation(len(group))[:keep])]
    return [ProbeExample(chosen[i][0], chosen[i][1], chosen[i][0]) for i in rng.permutation(len(chosen))], words


def build_tasks(sentences: Sequence[str], seed: int, tasks: Sequence[str] = TASKS) -> tuple[dict, dict]:
    """``{task: examples}`` and ``{task: what its labels mean}`` for the requested tasks."""
    built: dict[str, list[ProbeExample]] = {}
    meaning: dict[str, object] = {}
    for task in tasks:
        if task == "bshift":
            built[task], meaning[task] = bshift(sentences, seed), {"0": "as written", "1": "two adjacent words swapped"}
        elif task == "coordinv":
            built[task], meaning[task] = coordinv(sentences, seed), {"0": "as written", "1": "clauses inverted"}
        elif task == "sentlen":
            built[task], edges = sentlen(sentences, seed)
            meaning[task] = {str(k): f"{lo}-{(edges + [MAX_WORDS + 1])[k + 1] - 1} words" for k, lo in enumerate(edges)}
        else:
            built[task], words = wc(sentences, seed)
            meaning[task] = {str(k): word for k, word in enumerate(words)}
    return built, meaning
