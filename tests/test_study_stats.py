"""The study's statistics against a hand-worked example and scipy's own paired t-test, and each verdict rule on
both sides of its bound. `hand_rows()` is the small study these numbers come from (also used by
tests/test_study_report.py, which writes it as cell files)."""
from __future__ import annotations

import math

import pytest
from scipy import stats

from pretrain.experiments.stats import (
    CONTRADICTS,
    SUPPORTS,
    UNKNOWN,
    Interval,
    above,
    below,
    outside,
    paired,
    ratio,
    t_interval,
    verdicts,
    within,
)

T_975_2 = 4.302652729749462  # Student's t, 97.5 % quantile, 2 degrees of freedom (tables: 4.303)


def _row(variant: str, encoder: str, seed: int, **values: float) -> dict:
    return {"variant": variant, "encoder": encoder, "decoder": encoder, "seed": seed, "status": "ok", **values}


def hand_rows() -> list[dict]:
    """vanilla, random and random+vanilla over seeds 1-3, plus a failed vanilla seed 4 that must not pair."""
    v = {"eval_loss": [5.0, 5.2, 4.9], "eval_accuracy": [0.30, 0.31, 0.29], "tokens_per_s": [100.0, 100.0, 100.0],
         "polarity/accuracy": [0.60, 0.62, 0.58], "pair/accuracy": [0.70, 0.72, 0.71],
         "scratch/polarity/accuracy": [0.50, 0.52, 0.55]}
    r = {"eval_loss": [5.1, 5.5, 5.1], "eval_accuracy": [0.28, 0.30, 0.29], "tokens_per_s": [110.0, 120.0, 115.0],
         "polarity/accuracy": [0.55, 0.57, 0.50], "pair/accuracy": [0.55, 0.60, 0.56], "moved/random": [0.30, 0.35, 0.32]}
    rv = {"eval_loss": [4.8, 4.95, 4.6], "eval_accuracy": [0.31, 0.32, 0.30], "tokens_per_s": [90.0, 95.0, 85.0],
          "polarity/accuracy": [0.61, 0.62, 0.58], "pair/accuracy": [0.70, 0.71, 0.72],
          "moved/random": [0.05, 0.06, 0.04], "moved/mixture": [0.010, 0.020, 0.015]}
    rows = []
    for variant, encoder, values in (("vanilla", "vanilla", v), ("random", "random", r),
                                     ("random+vanilla", "random+vanilla", rv)):
        rows += [_row(variant, encoder, s + 1, **{k: vals[s] for k, vals in values.items()}) for s in range(3)]
    rows.append({"variant": "vanilla", "encoder": "vanilla", "decoder": "vanilla", "seed": 4, "status": "failed at pretrain"})
    return rows


def test_paired_interval_by_hand_and_by_scipy() -> None:
    rows = hand_rows()
    iv = paired(rows, "random", "vanilla", "eval_loss")
    # differences 5.1-5.0, 5.5-5.2, 5.1-4.9 = 0.1, 0.3, 0.2: mean 0.2; sample sd sqrt((0.01 + 0.01 + 0) / 2) = 0.1;
    # standard error 0.1 / sqrt(3) = 0.057735; half width 4.302653 * 0.057735 = 0.248414
    assert (iv.mean, iv.n) == (pytest.approx(0.2), 3)
    assert (iv.lo, iv.hi) == (pytest.approx(0.2 - 0.248414, abs=1e-6), pytest.approx(0.2 + 0.248414, abs=1e-6))
    assert T_975_2 * 0.1 / math.sqrt(3) == pytest.approx(0.248414, abs=1e-6)
    test = stats.ttest_rel([5.1, 5.5, 5.1], [5.0, 5.2, 4.9])  # scipy's paired t-test on the same numbers
    assert (iv.lo, iv.hi) == pytest.approx(tuple(test.confidence_interval(0.95)), rel=1e-12)
    assert iv.text() == "0.200 [-0.048, 0.448]"
    # the ratio of tokens/s: 1.10, 1.20, 1.15 -> mean 1.15, sd 0.05, half width 4.302653 * 0.05 / sqrt(3) = 0.124207
    speed = paired(rows, "random", "vanilla", "tokens_per_s", op=ratio)
    assert (speed.mean, speed.lo, speed.hi) == pytest.approx((1.15, 1.15 - 0.124207, 1.15 + 0.124207), abs=1e-6)


def test_only_seeds_where_both_finished_pair() -> None:
    rows = hand_rows()
    rows.append(_row("random", "random", 4, eval_loss=1.0))  # vanilla seed 4 failed: no partner
    rows[1]["eval_loss"] = float("nan")  # vanilla seed 2 without a finite value: seed 2 drops out too
    iv = paired(rows, "random", "vanilla", "eval_loss")
    assert iv.n == 2 and iv.mean == pytest.approx(0.15)  # seeds 1 and 3: 0.1, 0.2
    one = paired([r for r in rows if r["seed"] != 3], "random", "vanilla", "eval_loss")
    assert (one.n, one.mean, math.isnan(one.lo), one.known) == (1, pytest.approx(0.1), True, False)
    assert one.text() == "0.100 (n=1)"
    assert below(one, 100.0) == above(one, -100.0) == within(one, 100.0) == UNKNOWN  # n < 2: no interval
    assert t_interval([]).text() == "-"
    assert t_interval([0.3, 0.3]) == Interval(0.3, 0.3, 0.3, 2)  # no spread: the point (scipy wants scale > 0)


@pytest.mark.parametrize("lo, hi, below_0, above_0, within_1", [
    (-3.0, -2.0, SUPPORTS, CONTRADICTS, CONTRADICTS),
    (-0.5, 0.5, UNKNOWN, UNKNOWN, SUPPORTS),
    (-1.0, 1.0, UNKNOWN, UNKNOWN, SUPPORTS),  # the margin's edges are inside
    (0.5, 1.5, CONTRADICTS, SUPPORTS, UNKNOWN),
    (2.0, 3.0, CONTRADICTS, SUPPORTS, CONTRADICTS),
])
def test_verdict_rules(lo: float, hi: float, below_0: str, above_0: str, within_1: str) -> None:
    iv = Interval((lo + hi) / 2, lo, hi, 3)
    assert (below(iv, 0.0), above(iv, 0.0), within(iv, 1.0)) == (below_0, above_0, within_1)
    assert outside(iv, 1.0) == {SUPPORTS: CONTRADICTS, CONTRADICTS: SUPPORTS, UNKNOWN: UNKNOWN}[within_1]


def _no_bias_rows(differences: list[float], to_random: list[float]) -> list[dict]:
    """The hand study plus random(position_bias=none) at vanilla's eval loss + `differences` (seeds 1-3); random's
    own losses are then set to the ablation's + `to_random`."""
    rows = hand_rows()
    vanilla = {r["seed"]: r["eval_loss"] for r in rows if r["variant"] == "vanilla" and r["status"] == "ok"}
    ablation = [{**_row("random(position_bias=none)", "random", s, eval_loss=vanilla[s] + d),
                 "settings": "position_bias=none"} for s, d in zip((1, 2, 3), differences)]
    for r in rows:
        if r["variant"] == "random":
            r["eval_loss"] = ablation[r["seed"] - 1]["eval_loss"] + to_random[r["seed"] - 1]
    return rows + ablation


@pytest.mark.parametrize("differences, to_random, explains, lowers, decided", [
    # without the bias 0.50, 0.55, 0.60 above vanilla (5.0333): mean 0.55, half width 0.124 -> [0.426, 0.674],
    # wholly outside +-0.302; random (with it) 0.3 lower each seed: below 0, a point interval
    ([0.50, 0.55, 0.60], [-0.3, -0.3, -0.3], SUPPORTS, SUPPORTS, (True, True)),
    # 0.00, 0.01, 0.02: [-0.015, 0.035] wholly inside the margin: Random is close without the bias as well; the bias
    # changes Random by +0.01, -0.01, 0: [-0.025, 0.025] is a cannot tell, but no wider than +-0.05: decided
    ([0.00, 0.01, 0.02], [0.01, -0.01, 0.0], CONTRADICTS, UNKNOWN, (True, True)),
    # 0.1, 0.3, 0.5: [-0.097, 0.797] straddles the margin; random - ablation -0.1, 0.1, 0.0 -> [-0.248, 0.248]:
    # both cannot tell, wider than +-0.05: not decided
    ([0.1, 0.3, 0.5], [-0.1, 0.1, 0.0], UNKNOWN, UNKNOWN, (False, False)),
])
def test_the_position_bias_question(differences, to_random, explains, lowers, decided) -> None:
    rows = _no_bias_rows(differences, to_random)
    found = {v.claim: v for v in verdicts(rows) if v.question == "Q1 position bias"}
    explain = found["the position bias explains Random's closeness to vanilla: without it (random(position_bias=none)) "
                    "Random is not within 6% of vanilla"]
    lower = found["the position bias lowers Random's eval loss"]
    assert (explain.verdict, lower.verdict) == (explains, lowers)
    assert explain.evidence.startswith("eval_loss(random(position_bias=none)) - eval_loss(vanilla) = ")
    assert explain.evidence.endswith("(n=3); rule: outside ±0.302")
    assert (explain.decided, lower.decided) == decided
    # the default Random is the variant without settings, never the ablation, whatever the order of the rows
    claims = {v.claim: v for v in verdicts(rows[::-1])}
    assert claims["Random is close to vanilla (eval loss within 6% of vanilla's)"].evidence.startswith(
        "eval_loss(random) - eval_loss(vanilla)")
    # without the ablation in the grid, no such question
    assert not [v for v in verdicts(hand_rows()) if v.question == "Q1 position bias"]


def test_verdicts_of_the_hand_study() -> None:
    found = {v.claim: v for v in verdicts(hand_rows(), {"unigram_loss": 6.0, "unigram_accuracy": 0.1})}
    expected = {
        # vanilla 5.0, 5.2, 4.9: mean 5.0333, sd 0.15275, half width 4.302653 * 0.15275 / sqrt(3) = 0.37946 -> hi 5.413 < 6
        "vanilla ends below the unigram loss": SUPPORTS,
        # [-0.048, 0.448] against the margin 0.06 * 5.0333 = 0.302: neither inside nor wholly outside
        "Random is close to vanilla (eval loss within 6% of vanilla's)": UNKNOWN,
        # -0.2, -0.25, -0.3: mean -0.25, sd 0.05, half width 0.124207 -> [-0.374, -0.126] < 0
        "random+vanilla beats vanilla (lower eval loss)": SUPPORTS,
        # pretrained - scratch 0.10, 0.10, 0.03: mean 0.0767, sd 0.0404, half width 0.1004 -> [-0.024, 0.177]
        "pretraining helps vanilla on polarity/accuracy": UNKNOWN,
        # -0.05, -0.05, -0.08: mean -0.06, sd 0.01732, half width 0.04303 -> [-0.103, -0.017] < 0
        "random transfers worse than vanilla on polarity/accuracy": SUPPORTS,
        # 0.01, 0, 0: mean 0.00333, sd 0.005774, half width 0.01434 -> [-0.011, 0.018] inside +-0.02
        "random+vanilla matches vanilla on polarity/accuracy": SUPPORTS,
        # -0.15, -0.12, -0.15: mean -0.14, sd 0.01732, half width 0.04303 -> [-0.183, -0.097] < 0
        "random transfers worse than vanilla on pair/accuracy": SUPPORTS,
        # 0, -0.01, 0.01 -> mean 0, sd 0.01, half width 0.02484 -> [-0.025, 0.025]: not inside +-0.02, not outside
        "random+vanilla matches vanilla on pair/accuracy": UNKNOWN,
        # gap on pair - gap on polarity: -0.10, -0.07, -0.07: mean -0.08, sd 0.01732 -> [-0.123, -0.037] < 0
        "random loses more to vanilla on pair/accuracy than on polarity/accuracy": SUPPORTS,
        # 0.30, 0.35, 0.32: mean 0.3233, sd 0.02517, half width 0.06252 -> [0.261, 0.386] > 0.10
        "random's Random matrices moved beyond noise": SUPPORTS,
        # 0.05, 0.06, 0.04: mean 0.05, sd 0.01, half width 0.02484 -> [0.025, 0.075] < 0.10
        "random+vanilla's Random matrices moved beyond noise": CONTRADICTS,
        # 0.010, 0.020, 0.015: mean 0.015, sd 0.005, half width 0.01242 -> [0.003, 0.027] < 0.05
        "random+vanilla's mixture weights moved beyond noise": CONTRADICTS,
        # 1.10, 1.20, 1.15 -> [1.026, 1.274] > 1
        "Random trains faster than vanilla (tokens/s ratio above 1)": SUPPORTS,
    }
    assert {claim: v.verdict for claim, v in found.items()} == expected
    assert found["random+vanilla beats vanilla (lower eval loss)"].evidence == (
        "eval_loss(random+vanilla) - eval_loss(vanilla) = -0.250 [-0.374, -0.126] (n=3); rule: below 0")
    # no vanilla in the grid: nothing to compare with, no verdicts
    assert verdicts([r for r in hand_rows() if r["variant"] != "vanilla"]) == []
