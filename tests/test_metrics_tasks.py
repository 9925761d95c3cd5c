"""Each task metric against values computed by hand from its definition."""
import math

import pytest

from pretrain.tasks import get_task
from pretrain.tasks.metrics import accuracy, exact_match, f1, f1_macro, matthews_corr, pearson, score, spearman
from pretrain.tasks.task import Example

PRED = [1, 1, 0, 0, 1, 0, 1, 1]
GOLD = [1, 0, 0, 1, 1, 0, 0, 1]
# TP = 3 (0, 4, 7), FP = 2 (1, 6), FN = 1 (3), TN = 2 (2, 5)


def test_accuracy_and_f1():
    assert accuracy(PRED, GOLD) == 5 / 8
    assert f1(PRED, GOLD) == 2 * 3 / (2 * 3 + 2 + 1)
    assert f1([0, 0], [0, 0]) == 0.0  # no positives anywhere


def test_matthews_binary_by_hand():
    tp, tn, fp, fn = 3, 2, 2, 1
    expected = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    assert matthews_corr(PRED, GOLD) == pytest.approx(expected, abs=1e-12)
    assert matthews_corr([1, 1, 1], [1, 0, 1]) == 0.0  # constant predictions
    assert matthews_corr([1, 0, 1], [1, 0, 1]) == pytest.approx(1.0)


def test_f1_macro_three_classes_by_hand():
    pred, gold = [0, 1, 2, 2, 1, 0], [0, 1, 2, 1, 1, 2]
    # class 0: tp 1 fp 1 fn 0 -> 2/3; class 1: tp 2 fp 0 fn 1 -> 4/5; class 2: tp 1 fp 1 fn 1 -> 1/2
    assert f1_macro(pred, gold) == pytest.approx((2 / 3 + 4 / 5 + 1 / 2) / 3)


def test_pearson_and_spearman_by_hand():
    x, y = [1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 4.0, 3.0]
    # centred: x' = (-1.5, -.5, .5, 1.5), y' = (-.5, -1.5, 1.5, .5); x'.y' = 4 * 0.75 = 3; |x'|^2 = |y'|^2 = 5
    assert pearson(x, y) == pytest.approx(0.6)
    assert spearman([10.0, 20.0, 30.0, 40.0], [1.0, 0.5, 8.0, 7.0]) == pytest.approx(0.6)  # same ranks
    # ties: ranks of (1, 2, 2, 3) are (1, 2.5, 2.5, 4); against (1, 2, 3, 4): centred (-1.5, 0, 0, 1.5)
    assert spearman([1.0, 2.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    # a constant prediction: undefined (before: 0.0, a score that reads as "uncorrelated")
    assert math.isnan(pearson([1.0, 1.0], [1.0, 2.0])) and math.isnan(spearman([3.0, 3.0, 3.0], [1.0, 2.0, 5.0]))


def test_multirc_exact_match_by_question():
    groups = ["a", "a", "b", "c", "c"]
    assert exact_match([1, 0, 1, 1, 1], [1, 0, 0, 1, 0], groups) == 1 / 3


def test_score_uses_each_tasks_official_metrics():
    ex = [Example(i, "", "", g) for i, g in enumerate(GOLD)]
    assert score(get_task("mrpc"), PRED, ex) == {"f1": 6 / 9, "accuracy": 5 / 8}
    assert set(score(get_task("cola"), PRED, ex)) == {"matthews_corr"}
    with pytest.raises(ValueError, match="3 predictions for 8 sst2 examples"):
        score(get_task("sst2"), PRED[:3], ex)
