"""Fine-tuning metrics from the gathered predictions of a whole dev set.

Classification (:func:`classification_metrics`, from predicted and gold class ids):

* ``accuracy``: the fraction predicted right;
* ``f1``: binary tasks (2 classes): F1 of the positive class, class id 1; more classes: the macro average
  of the per-class F1 over the classes that occur in the gold labels or the predictions. A class with no
  predicted and no gold example has no F1; precision or recall with a zero denominator counts as 0;
* ``mcc``: Matthews correlation coefficient, Gorodkin's multi-class form (the binary MCC for two classes)
  from the confusion matrix; 0 when a denominator is 0 (all gold or all predictions one class).

Regression (:func:`regression_metrics`, from predictions and targets):

* ``pearson``: the Pearson correlation; ``spearman``: the Pearson correlation of the ranks, tied values
  sharing their average rank. Either is NaN when one side is constant (the correlation is undefined);
  ``mse``: mean squared error.

:func:`compute_metrics` takes the model's logits (``[N, C]``; ``[N]`` for regression), the labels and the
optional eval ``weights`` (rows of weight 0 are fillers and left out) and picks the right set.
All arithmetic is float64 numpy.
"""

from __future__ import annotations

import numpy as np
import torch


def confusion_matrix(pred: np.ndarray, gold: np.ndarray, num_labels: int) -> np.ndarray:
    """``[gold, predicted]`` counts."""
    return np.bincount(gold * num_labels + pred, minlength=num_labels * num_labels).reshape(num_labels, num_labels)


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    return float(np.mean(pred == gold))


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    return np.divide(numerator, denominator, out=np.zeros(len(numerator)), where=denominator > 0)


def f1(pred: np.ndarray, gold: np.ndarray, num_labels: int) -> float:
    """Binary: F1 of class 1. More classes: macro F1 over the classes present in gold or predictions."""
    matrix = confusion_matrix(pred, gold, num_labels).astype(np.float64)
    true_pos, gold_count, pred_count = np.diag(matrix), matrix.sum(1), matrix.sum(0)
    precision, recall = _ratio(true_pos, pred_count), _ratio(true_pos, gold_count)
    per_class = _ratio(2 * precision * recall, precision + recall)
    if num_labels == 2:
        return float(per_class[1])
    return float(per_class[(gold_count + pred_count) > 0].mean())


def mcc(pred: np.ndarray, gold: np.ndarray, num_labels: int) -> float:
    """Matthews correlation (Gorodkin 2004): (c s - sum_k p_k t_k) / sqrt((s^2 - sum p_k^2)(s^2 - sum t_k^2))."""
    matrix = confusion_matrix(pred, gold, num_labels).astype(np.float64)
    correct, total = np.trace(matrix), matrix.sum()
    pred_count, gold_count = matrix.sum(0), matrix.sum(1)
    numerator = correct * total - pred_count @ gold_count
    denominator = np.sqrt((total ** 2 - pred_count @ pred_count) * (total ** 2 - gold_count @ gold_count))
    return float(numerator / denominator) if denominator > 0 else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(), y - y.mean()
    denominator = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / denominator) if denominator > 0 else float("nan")


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks; tied values share the average of the ranks they span."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.concatenate([[True], sorted_values[1:] != sorted_values[:-1]]))
    ends = np.concatenate([starts[1:], [len(values)]])
    group = np.repeat(np.arange(len(starts)), ends - starts)
    ranks = np.empty(len(values))
    ranks[order] = ((starts + 1 + ends) / 2)[group]  # mean of the ranks starts+1 .. ends
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(average_ranks(x), average_ranks(y))


def classification_metrics(pred: np.ndarray, gold: np.ndarray, num_labels: int) -> dict[str, float]:
    pred, gold = np.asarray(pred, dtype=np.int64), np.asarray(gold, dtype=np.int64)
    return {"accuracy": accuracy(pred, gold), "f1": f1(pred, gold, num_labels), "mcc": mcc(pred, gold, num_labels)}


def regression_metrics(pred: np.ndarray, gold: np.ndarray) -> dict[str, float]:
    pred, gold = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    return {"pearson": pearson(pred, gold), "spearman": spearman(pred, gold),
            "mse": float(np.mean((pred - gold) ** 2))}


def compute_metrics(logits: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor | None = None) -> dict[str, float]:
    """The task's metrics over the rows of nonzero weight; classification when ``logits`` is ``[N, C]``."""
    keep = slice(None) if weights is None else (weights > 0).cpu().numpy()
    scores = logits.detach().float().cpu().numpy()[keep]
    gold = labels.detach().cpu().numpy()[keep]
    if len(gold) == 0:
        raise ValueError("no examples to compute metrics on")
    if scores.ndim == 1:
        return regression_metrics(scores, gold)
    return classification_metrics(scores.argmax(-1), gold, scores.shape[-1])


def gather_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor's rows from every rank, concatenated in rank order (the tensor itself when not distributed).

    Every rank must pass the same shapes, as :class:`~distaff.train.finetune.labelled_batches.EvalBatches`
    guarantees (the same number of batches of the same size on every rank)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return list(tensors)
    gathered = []
    for tensor in tensors:
        parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather(parts, tensor.contiguous())
        gathered.append(torch.cat(parts))
    return gathered
