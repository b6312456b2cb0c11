"""Fine-tuning metrics against hand-worked cases and brute-force textbook formulas (no scipy/sklearn here)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distaff.train.finetune.metrics import (accuracy, average_ranks, compute_metrics, f1, mcc, pearson,
                                            spearman)

pytestmark = pytest.mark.unit


def _counts(pred, gold, k):
    tp = sum(1 for p, g in zip(pred, gold) if p == k and g == k)
    fp = sum(1 for p, g in zip(pred, gold) if p == k and g != k)
    fn = sum(1 for p, g in zip(pred, gold) if p != k and g == k)
    return tp, fp, fn


def _brute_f1(pred, gold, k):
    tp, fp, fn = _counts(pred, gold, k)
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)  # F1 = 2TP / (2TP + FP + FN)


def _brute_mcc(pred, gold, num_labels):
    """MCC as the correlation of the one-hot matrices (Gorodkin's definition), by loops."""
    n = len(pred)
    x = [[1.0 if p == k else 0.0 for k in range(num_labels)] for p in pred]
    y = [[1.0 if g == k else 0.0 for k in range(num_labels)] for g in gold]

    def cov(a, b):
        total = 0.0
        for k in range(num_labels):
            mean_a = sum(row[k] for row in a) / n
            mean_b = sum(row[k] for row in b) / n
            total += sum((a[i][k] - mean_a) * (b[i][k] - mean_b) for i in range(n))
        return total

    denominator = math.sqrt(cov(x, x) * cov(y, y))
    return 0.0 if denominator == 0 else cov(x, y) / denominator


def _brute_ranks(values):
    return [sum(v < x for v in values) + (sum(v == x for v in values) + 1) / 2 for x in values]


def test_hand_worked_binary_case():
    pred = np.array([1, 1, 0, 0, 1, 0])
    gold = np.array([1, 0, 0, 1, 1, 0])
    # TP 2 (rows 0, 4), FP 1 (row 1), FN 1 (row 3), TN 2: P = R = 2/3
    assert accuracy(pred, gold) == pytest.approx(4 / 6)
    assert f1(pred, gold, 2) == pytest.approx(2 / 3)
    assert mcc(pred, gold, 2) == pytest.approx((2 * 2 - 1 * 1) / math.sqrt(3 * 3 * 3 * 3))


def test_binary_f1_is_the_positive_class_only():
    pred, gold = np.array([0, 0, 0, 1]), np.array([0, 0, 1, 1])
    assert f1(pred, gold, 2) == pytest.approx(2 / 3)  # class 1: TP 1, FN 1; class 0 alone would give 0.8
    assert f1(np.zeros(4, dtype=int), gold, 2) == 0.0  # no positive predicted: precision 0/0 counts as 0


@pytest.mark.parametrize("num_labels", [2, 3, 5])
def test_random_cases_match_brute_force(num_labels):
    rng = np.random.default_rng(num_labels)
    for _ in range(20):
        n = int(rng.integers(1, 40))
        gold = rng.integers(0, num_labels, n)
        pred = np.where(rng.random(n) < 0.6, gold, rng.integers(0, num_labels, n))
        present = sorted(set(gold) | set(pred))
        expected_f1 = (_brute_f1(pred, gold, 1) if num_labels == 2 else
                       sum(_brute_f1(pred, gold, k) for k in present) / len(present))
        assert f1(pred, gold, num_labels) == pytest.approx(expected_f1)
        assert mcc(pred, gold, num_labels) == pytest.approx(_brute_mcc(pred, gold, num_labels), abs=1e-12)
        assert accuracy(pred, gold) == pytest.approx(sum(p == g for p, g in zip(pred, gold)) / n)


def test_mcc_extremes_and_degenerate_cases():
    gold = np.array([0, 1, 2, 0, 1, 2])
    assert mcc(gold, gold, 3) == pytest.approx(1.0)
    assert mcc(1 - np.array([0, 1, 0, 1]), np.array([0, 1, 0, 1]), 2) == pytest.approx(-1.0)
    assert mcc(np.zeros(6, dtype=int), gold, 3) == 0.0  # one predicted class: denominator 0


def test_pearson_and_spearman_with_ties():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    y = np.array([5.0, 6.0, 7.0, 8.0, 7.0])
    assert average_ranks(y).tolist() == [1.0, 2.0, 3.5, 5.0, 3.5]
    assert average_ranks(np.array([2.0, 2.0, 2.0, 1.0])).tolist() == [3.0, 3.0, 3.0, 1.0]
    assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])
    assert spearman(x, y) == pytest.approx(np.corrcoef([1, 2, 3, 4, 5], [1, 2, 3.5, 5, 3.5])[0, 1])
    assert spearman(x, np.exp(x)) == pytest.approx(1.0)  # any increasing map
    assert pearson(x, np.exp(x)) < 0.95
    assert math.isnan(pearson(x, np.ones(5))) and math.isnan(spearman(np.ones(5), x))


def test_random_regression_cases_match_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(20):
        n = int(rng.integers(3, 30))
        x = rng.integers(0, 6, n).astype(float)  # small integers: many ties
        y = x + rng.normal(size=n)
        assert average_ranks(x).tolist() == pytest.approx(_brute_ranks(x.tolist()))
        assert spearman(x, y) == pytest.approx(np.corrcoef(_brute_ranks(x.tolist()), _brute_ranks(y.tolist()))[0, 1])
        assert pearson(x, y) == pytest.approx(np.corrcoef(x, y)[0, 1])


def test_compute_metrics_leaves_out_weight_zero_fillers():
    logits = torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 1, 1, 0])
    weights = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last row is a filler, predicted wrong
    got = compute_metrics(logits, labels, weights)
    pred, gold = np.array([0, 1, 0]), np.array([0, 1, 1])
    assert got == pytest.approx({"accuracy": 2 / 3, "f1": _brute_f1(pred, gold, 1), "mcc": _brute_mcc(pred, gold, 2)})
    regression = compute_metrics(torch.tensor([1.0, 2.0, 3.0, 9.0]), torch.tensor([1.0, 2.5, 2.0, 0.0]), weights)
    assert regression["pearson"] == pytest.approx(np.corrcoef([1, 2, 3], [1, 2.5, 2])[0, 1])
    assert regression["spearman"] == pytest.approx(0.5)  # ranks (1, 2, 3) vs (1, 3, 2)
    assert regression["mse"] == pytest.approx((0 + 0.25 + 1) / 3)
    with pytest.raises(ValueError, match="no examples"):
        compute_metrics(logits, labels, torch.zeros(4))
