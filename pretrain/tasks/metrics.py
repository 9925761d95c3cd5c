"""The official GLUE/SuperGLUE metrics, written out from their definitions (numpy only, no scipy/sklearn).

Predictions are class ids (-1 for a generated answer that is none of the label words: always wrong, as in T5's
postprocessors) or floats for STS-B. Scores are fractions in [0, 1] (correlations in [-1, 1]). Pearson's and
Spearman's correlation of a constant series (a model that predicts one score for every pair) is undefined: NaN,
which results.json writes as `NaN`, results.md and the evaluation's log as undefined (scipy's answer too), never a
score of 0.0 that reads as "uncorrelated". Matthews correlation keeps scikit-learn's 0.0 for one class.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from pretrain.tasks.task import Example, Task

# beside each split's scores in results.json: how many examples they are of, and how many its file holds (an
# evaluation limit scores the first ones only); counts, not metrics
COVERAGE = ("examples", "examples_in_file")


def accuracy(pred: Sequence, gold: Sequence) -> float:
    return float(np.mean(np.asarray(pred) == np.asarray(gold)))


def f1(pred: Sequence[int], gold: Sequence[int], positive: int = 1) -> float:
    """Binary F1 of the positive class: 2 TP / (2 TP + FP + FN)."""
    p, g = np.asarray(pred) == positive, np.asarray(gold) == positive
    tp, fp, fn = np.sum(p & g), np.sum(p & ~g), np.sum(~p & g)
    return float(2 * tp / (2 * tp + fp + fn)) if tp + fp + fn else 0.0


def f1_macro(pred: Sequence[int], gold: Sequence[int]) -> float:
    """F1 averaged over the classes seen in gold or predictions (SuperGLUE's CB; scikit-learn's "macro")."""
    classes = sorted(set(int(x) for x in gold) | set(int(x) for x in pred if x >= 0))
    return float(np.mean([f1(pred, gold, c) for c in classes]))


def matthews_corr(pred: Sequence[int], gold: Sequence[int]) -> float:
    """Matthews correlation, multi-class form (Gorodkin 2004): binary MCC when there are two classes."""
    classes = sorted(set(int(x) for x in pred) | set(int(x) for x in gold))
    index = {c: i for i, c in enumerate(classes)}
    confusion = np.zeros((len(classes), len(classes)))
    for p, g in zip(pred, gold):
        confusion[index[int(g)], index[int(p)]] += 1
    t, p = confusion.sum(axis=1), confusion.sum(axis=0)  # gold and predicted counts per class
    c, s = np.trace(confusion), confusion.sum()
    denom = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return float((c * s - t @ p) / denom) if denom else 0.0


def pearson(pred: Sequence[float], gold: Sequence[float]) -> float:
    x, y = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    x, y = x - x.mean(), y - y.mean()
    denom = np.sqrt((x @ x) * (y @ y))
    return float(x @ y / denom) if denom else float("nan")


def _ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their average rank."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ranks[order] = np.arange(1, len(values) + 1)
    for v in np.unique(values):
        tied = values == v
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(pred: Sequence[float], gold: Sequence[float]) -> float:
    """Pearson correlation of the (tie-averaged) ranks."""
    return pearson(_ranks(np.asarray(pred, dtype=np.float64)), _ranks(np.asarray(gold, dtype=np.float64)))


def f1a(pred: Sequence[int], gold: Sequence[int]) -> float:
    """MultiRC's F1a: binary F1 over all answer options."""
    return f1(pred, gold)


def exact_match(pred: Sequence[int], gold: Sequence[int], groups: Sequence) -> float:
    """MultiRC's EM: the fraction of questions whose answer options are all classified right."""
    right: dict = {}
    for p, g, q in zip(pred, gold, groups):
        right[q] = right.get(q, True) and p == g
    return float(np.mean(list(right.values())))


METRICS: dict[str, Callable[..., float]] = {
    "accuracy": accuracy,
    "f1": f1,
    "f1_macro": f1_macro,
    "matthews_corr": matthews_corr,
    "pearson": pearson,
    "spearman": spearman,
    "f1a": f1a,
}


def score(task: Task, predictions: Sequence, examples: Sequence[Example]) -> dict[str, float]:
    """The task's official metrics of `predictions` (class ids or floats) against the examples' labels."""
    gold = [e.label for e in examples]
    if len(predictions) != len(gold):
        raise ValueError(f"{len(predictions)} predictions for {len(gold)} {task.name} examples")
    out = {}
    for name in task.metrics:
        if name == "exact_match":
            out[name] = exact_match(predictions, gold, [e.group for e in examples])
        else:
            out[name] = METRICS[name](predictions, gold)
    return out
