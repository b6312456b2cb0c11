"""Baselines for text classification: what a fine-tuned encoder has to beat, and what its pretraining put in it.

**Bag of words.** Unigrams and bigrams of lower-cased words, weighted by tf-idf (``1 + log(count)``
times ``log((1 + n_docs) / (1 + doc_freq)) + 1``, each row scaled to unit length), feed a multinomial
logistic regression with an L2 penalty, fitted full-batch by L-BFGS in float64. The vocabulary and
the idf come from the training split only. Nothing is random but the split, so a seed gives one
answer::

    python -m distaff.train.tools.baselines --train data/movie-snippets.tsv.gz --dev-fraction 0.2 --seed 1

**Linear probe** (``--probe MODEL``). The same logistic regression on an encoder's frozen features: each
text encoded as ``[CLS] pieces [SEP]`` by the full encoder (``distaff embed``'s pass), its final hidden
states averaged over its tokens, each feature standardised with the training rows' mean and standard
deviation. Probing the pretrained weights and the same architecture with random weights tells whether
pretraining put information about the task into the features, separately from whether fine-tuning
finds it.

The file is read and split by the fine-tuning data module (``distaff.train.finetune.labelled``: the same
formats, checks and errors, and the same dev rows as ``distaff finetune`` with ``data.dev_fraction`` and
``data.split_seed``); the default columns are the bundled sample's, a headerless ``label<TAB>text``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from distaff.train.core.errors import MAX_SEED, command_main, document_ranges, float_arg, int_arg
from distaff.train.core.files import check_apart
from distaff.train.core.threads import configure_threads
from distaff.train.finetune.labelled import Example, InputFormat, encode_labels, hold_out, label_names, read_examples
from distaff.train.tools.embed import embed_ids, encode, model_and_tokenizer

BUNDLED_COLUMNS = InputFormat(columns=("label", "text"))   # data/movie-snippets.tsv.gz

WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


@dataclass(frozen=True)
class BaselineResult:
    dev_accuracy: float
    majority_accuracy: float  # always the training split's most common label, on the dev split
    train_examples: int
    dev_examples: int
    features: int
    seed: int


def ngrams(text: str) -> list[str]:
    """The text's lower-cased words and adjacent word pairs."""
    words = WORD.findall(text.lower())
    return words + [f"{a} {b}" for a, b in zip(words, words[1:])]


class TfIdf:
    """tf-idf vectors over the n-grams seen in at least ``min_count`` training documents."""

    def __init__(self, train_texts: Sequence[str], min_count: int = 2):
        doc_freq = Counter(gram for text in train_texts for gram in set(ngrams(text)))
        kept = sorted(gram for gram, count in doc_freq.items() if count >= min_count)
        self.index = {gram: i for i, gram in enumerate(kept)}
        n_docs = len(train_texts)
        self.idf = torch.tensor([math.log((1 + n_docs) / (1 + doc_freq[g])) + 1 for g in kept], dtype=torch.float64)

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """A sparse ``[len(texts), n_grams]`` float64 matrix, rows of unit length (or zero)."""
        rows, cols, tf = [], [], []
        for row, text in enumerate(texts):
            for gram, count in Counter(ngrams(text)).items():
                if gram in self.index:
                    rows.append(row)
                    cols.append(self.index[gram])
                    tf.append(1 + math.log(count))
        cols_t = torch.tensor(cols, dtype=torch.long)
        rows_t = torch.tensor(rows, dtype=torch.long)
        values = torch.tensor(tf, dtype=torch.float64) * self.idf[cols_t]
        norms = torch.zeros(len(texts), dtype=torch.float64).index_add_(0, rows_t, values.square()).sqrt()
        return torch.sparse_coo_tensor(torch.stack([rows_t, cols_t]), values / norms[rows_t],
                                       (len(texts), len(self.index)), check_invariants=True).coalesce()


class LogisticRegression(torch.nn.Module):
    """Multinomial logistic regression."""

    def __init__(self, n_features: int, n_classes: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n_features, n_classes, dtype=torch.float64))
        self.bias = torch.nn.Parameter(torch.zeros(n_classes, dtype=torch.float64))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features @ self.weight + self.bias   # sparse (tf-idf) or dense (probe) features


def fit_logistic(features: torch.Tensor, labels: torch.Tensor, l2: float, steps: int = 200) -> LogisticRegression:
    """Minimises mean cross-entropy + ``l2/2 * |W|^2`` (bias free) from zero weights."""
    model = LogisticRegression(features.shape[1], int(labels.max()) + 1)
    optimizer = torch.optim.LBFGS(model.parameters(), max_iter=steps, history_size=20,
                                  tolerance_grad=1e-9, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(features), labels) + 0.5 * l2 * model.weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    return model


PROBE_L2 = 1e-2   # on standardised features; the bag of words' 1e-4 suits unit-length sparse rows


Featurise = Callable[[list[str], list[str]], tuple[torch.Tensor, torch.Tensor]]


def bag_of_words(train_texts: list[str], dev_texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """tf-idf rows of both splits, the vocabulary and idf from the training texts."""
    vectorise = TfIdf(train_texts)
    return vectorise(train_texts), vectorise(dev_texts)


def frozen_encoder(model_path: str | Path, max_length: int = 128, tokenizer_dir: str | Path | None = None,
                   field: str = "--probe") -> Featurise:
    """The probe's features of ``model_path``'s frozen encoder (loaded once; each distinct text encoded once),
    standardised with the training rows' mean and standard deviation."""
    encoder, _, tokenizer = model_and_tokenizer(model_path, tokenizer_dir, field)
    cache: dict[str, np.ndarray] = {}

    def embed(texts: list[str]) -> torch.Tensor:
        new = [text for text in dict.fromkeys(texts) if text not in cache]
        if new:
            cache.update(zip(new, embed_ids(encoder, encode(new, tokenizer, max_length), "mean")))
        return torch.from_numpy(np.stack([cache[text] for text in texts]))

    def features(train_texts: list[str], dev_texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        train_x, dev_x = embed(train_texts), embed(dev_texts)
        mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-12)
        return (train_x - mean) / std, (dev_x - mean) / std

    return features


def run_baseline(path: Path, dev_fraction: float, seed: int, l2: float = 1e-4,
                 fmt: InputFormat = BUNDLED_COLUMNS) -> BaselineResult:
    """The bag of words: split ``path`` as fine-tuning does, fit on the training rows, score the dev rows."""
    train, dev = hold_out(read_examples(path, fmt, regression=False), dev_fraction, seed)
    return fit_and_score(train, dev, bag_of_words, l2, seed)


def run_probe(model_path: str | Path, path: Path, dev_fraction: float, seed: int, l2: float = PROBE_L2,
              fmt: InputFormat = BUNDLED_COLUMNS, max_length: int = 128) -> BaselineResult:
    """The linear probe of ``model_path``'s frozen encoder (a distaff run, checkpoint or model folder, or an
    HF DeBERTa-v2/v3 folder, with its tokenizer beside it), on the same split as the bag of words."""
    train, dev = hold_out(read_examples(path, fmt, regression=False), dev_fraction, seed)
    return fit_and_score(train, dev, frozen_encoder(model_path, max_length), l2, seed)


def fit_and_score(train: Sequence[Example], dev: Sequence[Example], featurise: Featurise, l2: float, seed: int,
                  labels: Sequence[str] | None = None) -> BaselineResult:
    """Fit the logistic regression on ``train``'s features and labels, score ``dev``; the classes are ``labels``
    (in id order) or else the training rows' own."""
    names = label_names(train, labels)
    explicit = labels is not None
    train_y, dev_y = (torch.from_numpy(encode_labels(part, names, explicit=explicit)) for part in (train, dev))
    train_x, dev_x = featurise([e.text for e in train], [e.text for e in dev])
    model = fit_logistic(train_x, train_y, l2)
    with torch.no_grad():
        predicted = model(dev_x).argmax(1)
    majority = int(torch.bincount(train_y).argmax())
    return BaselineResult(dev_accuracy=(predicted == dev_y).double().mean().item(),
                          majority_accuracy=(dev_y == majority).double().mean().item(),
                          train_examples=len(train), dev_examples=len(dev), features=train_x.shape[1], seed=seed)


def main(argv: list[str] | None = None) -> int:
    return command_main("distaff baselines", _main, argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="distaff baselines", description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=Path, required=True,
                        help="a headerless label<TAB>text file (.tsv or .tsv.gz), like data/movie-snippets.tsv.gz")
    parser.add_argument("--dev-fraction",
                        type=float_arg("--dev-fraction", low=0, low_open=True, high=1, high_open=True),
                        default=0.2, help="share of the rows held out for scoring")
    parser.add_argument("--seed", type=int_arg("--seed", high=MAX_SEED),
                        default=1, help="seeds the train/dev split (as data.split_seed)")
    parser.add_argument("--l2", type=float_arg("--l2", low=0),
                        help=f"L2 penalty on the weights (default 1e-4; {PROBE_L2:g} with --probe)")
    parser.add_argument("--probe", metavar="MODEL",
                        help="a linear probe of this model's frozen encoder instead of the bag of words")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = document_ranges(parser).parse_args(argv)
    if args.json:       # before the run: --json over the training file would replace the data
        check_apart(("--json", args.json), [("--train", args.train), ("--probe", args.probe)])
    configure_threads()
    if args.probe:
        result = run_probe(args.probe, args.train, args.dev_fraction, args.seed, PROBE_L2 if args.l2 is None else args.l2)
    else:
        result = run_baseline(args.train, args.dev_fraction, args.seed, 1e-4 if args.l2 is None else args.l2)
    what = (f"linear probe of {args.probe}: dev accuracy", f"{result.features} frozen features") if args.probe \
        else ("bag-of-words dev accuracy", f"{result.features} n-grams")
    print(f"{what[0]} {result.dev_accuracy:.4f} (majority class {result.majority_accuracy:.4f}; "
          f"{result.train_examples} train / {result.dev_examples} dev rows, {what[1]}, seed {result.seed})")
    if args.json:
        args.json.write_text(json.dumps(asdict(result), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
