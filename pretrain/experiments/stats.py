"""The study's statistics: paired differences to vanilla over seeds with 95% t-intervals (scipy), and the
verdict on each of the paper's claims computed from those intervals, never written by hand.

Pairing: seed s of a variant is compared with seed s of vanilla (the same data order and shared-parameter
initialisation), over the seeds where both cells finished with a finite value. The interval is Student's t
over those n paired differences (n - 1 degrees of freedom); with n < 2 there is no interval and every rule
that needs one answers "cannot tell".

A verdict rule compares an interval with a bound (documented in docs/study.md, "Output"):
- `below(iv, b)`: supports when the whole interval is below b, contradicts when it is wholly above, else cannot tell;
- `above(iv, b)`: the mirror image;
- `within(iv, m)`: supports when the interval lies inside [-m, m], contradicts when it lies wholly outside
  (entirely above m or below -m), else cannot tell;
- `outside(iv, m)`: the mirror image of `within`.
A pretraining (Q1) verdict is decided when it is supports or contradicts, or cannot tell with an interval no wider
than ±DECIDED_HALF_WIDTH nats (`decided`): then the question has an answer at the resolution asked of it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

from scipy import stats

CONFIDENCE = 0.95
# "Random is close to vanilla": |eval_loss difference| within 6 % of vanilla's eval loss. The paper's own C4 gap,
# Random 1.965 vs vanilla 1.865 log-ppl (5.4 %), is what it calls close; 6 % keeps the paper's numbers "close".
CLOSE_LOSS = 0.06
# "The mixtures match vanilla" downstream: the score difference (a fraction) within 0.02 (two points of accuracy,
# about the spread of fine-tuning seeds on SST-2-sized dev sets).
MATCH_SCORE = 0.02
# "Moved beyond noise": the learned Random matrices' relative Frobenius change from their initialisation above
# 10 %, and the mixture weights' mean total-variation distance from uniform above 0.05.
MOVED = {"random": 0.10, "mixture": 0.05}

# A Q1 "cannot tell" counts as an answer (no effect larger than this) when its interval is no wider than ±0.05 nats:
# about a third of the paper's Random gap (0.10) and three times its Random+Vanilla gap (0.016).
DECIDED_HALF_WIDTH = 0.05
# The ablation the position-bias question compares (a variant's own model settings, grid.Variant.settings)
NO_BIAS = "position_bias=none"

SUPPORTS, CONTRADICTS, UNKNOWN = "supports", "contradicts", "cannot tell"


@dataclass(frozen=True)
class Interval:
    """The mean of n values with its two-sided t-interval (lo, hi NaN when n < 2)."""
    mean: float
    lo: float
    hi: float
    n: int

    @property
    def known(self) -> bool:
        return self.n >= 2

    def text(self, digits: int = 3) -> str:
        if not self.n:
            return "-"
        if not self.known:
            return f"{self.mean:.{digits}f} (n=1)"
        return f"{self.mean:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and Student-t interval of `values` (a sample of per-seed numbers or paired differences)."""
    n = len(values)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, math.nan, math.nan, 1)
    sem = statistics.stdev(values) / math.sqrt(n)
    if sem == 0:  # identical values: scipy's scale must be > 0, and the interval is the point
        return Interval(mean, mean, mean, n)
    lo, hi = stats.t.interval(confidence, n - 1, loc=mean, scale=sem)
    return Interval(mean, float(lo), float(hi), n)


def per_seed(rows: list[dict], variant: str, key: str) -> dict[int, float]:
    """{seed: value} of `key` over the variant's finished cells with a finite value."""
    out = {}
    for r in rows:
        if r["variant"] == variant and r["status"] == "ok" and r.get(key) not in (None, ""):
            value = float(r[key])
            if math.isfinite(value):
                out[int(r["seed"])] = value
    return out


def paired(rows: list[dict], variant: str, base: str, key: str, base_key: str | None = None,
           op: Callable[[float, float], float] = lambda a, b: a - b) -> Interval:
    """t-interval of op(variant's value, base's value) over the seeds both have (default: the difference);
    `base_key` compares with another column of the base (e.g. the same variant's scratch row)."""
    a, b = per_seed(rows, variant, key), per_seed(rows, base, base_key or key)
    return t_interval([op(a[s], b[s]) for s in sorted(a.keys() & b.keys())])


def ratio(a: float, b: float) -> float:
    return a / b


# --------------------------------------------------------------------------------------------------------
# Verdict rules
# --------------------------------------------------------------------------------------------------------
def below(iv: Interval, bound: float) -> str:
    if not iv.known:
        return UNKNOWN
    return SUPPORTS if iv.hi < bound else CONTRADICTS if iv.lo > bound else UNKNOWN


def above(iv: Interval, bound: float) -> str:
    if not iv.known:
        return UNKNOWN
    return SUPPORTS if iv.lo > bound else CONTRADICTS if iv.hi < bound else UNKNOWN


def within(iv: Interval, margin: float) -> str:
    if not iv.known or not math.isfinite(margin):
        return UNKNOWN
    if -margin <= iv.lo and iv.hi <= margin:
        return SUPPORTS
    return CONTRADICTS if iv.lo > margin or iv.hi < -margin else UNKNOWN


def outside(iv: Interval, margin: float) -> str:
    return {SUPPORTS: CONTRADICTS, CONTRADICTS: SUPPORTS}.get(within(iv, margin), UNKNOWN)


@dataclass(frozen=True)
class Verdict:
    question: str  # "Q1 pretraining", ...
    claim: str  # the paper's claim as tested here
    verdict: str  # supports / contradicts / cannot tell
    evidence: str  # the interval and the rule it was held against
    interval: Interval | None = None  # the interval behind the verdict

    @property
    def decided(self) -> bool:
        """Supports or contradicts, or cannot tell with an interval no wider than ±DECIDED_HALF_WIDTH."""
        iv = self.interval
        narrow = iv is not None and iv.known and (iv.hi - iv.lo) / 2 <= DECIDED_HALF_WIDTH
        return self.verdict != UNKNOWN or narrow


def find_variant(rows: list[dict], mixers: str, settings: str = "") -> str | None:
    """The label of the variant whose encoder and decoder are both the mixture `mixers` ("random+vanilla"
    matches "vanilla+random" too) and whose own model settings are `settings` ("": the study's defaults), or None
    when the grid has none."""
    want = set(mixers.split("+"))
    for r in rows:
        if (set(r["encoder"].split("+")) == want and set(r["decoder"].split("+")) == want
                and r.get("settings", "") == settings):
            return r["variant"]
    return None


def task_keys(rows: list[dict]) -> list[str]:
    """The pretrained models' downstream columns TASK/METRIC (not scratch/..., not moved/...)."""
    keys = [k for r in rows for k in r if "/" in k and not k.startswith(("scratch/", "moved/"))]
    return list(dict.fromkeys(keys))


def verdicts(rows: list[dict], baseline: dict | None = None) -> list[Verdict]:
    """Every claim of the issue's four questions whose variants are in the grid, judged by the rules above."""
    base = find_variant(rows, "vanilla")
    if base is None:
        return []
    out: list[Verdict] = []
    names = {m: find_variant(rows, m) for m in ("random", "dense", "random+vanilla", "dense+vanilla")}
    vanilla_loss = t_interval(list(per_seed(rows, base, "eval_loss").values()))

    def judge(question: str, claim: str, iv: Interval, rule: str, bound: float, what: str) -> None:
        verdict = {"below": below, "above": above, "within": within, "outside": outside}[rule](iv, bound)
        bound_text = f"{rule} ±{bound:.3g}" if rule in ("within", "outside") else f"{rule} {bound:.3g}"
        out.append(Verdict(question, claim, verdict, f"{what} = {iv.text()} (n={iv.n}); rule: {bound_text}", iv))

    # Q0: did vanilla get past token frequencies (the unigram baseline)?
    if baseline and "unigram_loss" in baseline:
        judge("Q0 baseline", "vanilla ends below the unigram loss", vanilla_loss, "below",
              float(baseline["unigram_loss"]), "eval_loss(vanilla)")
    # Q1 pretraining
    q1 = "Q1 pretraining"
    if names["random"]:
        margin = CLOSE_LOSS * vanilla_loss.mean if vanilla_loss.n else math.nan
        judge(q1, f"Random is close to vanilla (eval loss within {CLOSE_LOSS:.0%} of vanilla's)",
              paired(rows, names["random"], base, "eval_loss"), "within", margin, "eval_loss(random) - eval_loss(vanilla)")
    for mix in ("random+vanilla", "dense+vanilla"):
        if names[mix]:
            judge(q1, f"{names[mix]} beats vanilla (lower eval loss)", paired(rows, names[mix], base, "eval_loss"),
                  "below", 0.0, f"eval_loss({names[mix]}) - eval_loss(vanilla)")
    # ... and is that closeness T5's relative bias, which reaches Random's layers under position_bias=all?
    no_bias = find_variant(rows, "random", NO_BIAS)
    if no_bias:
        margin = CLOSE_LOSS * vanilla_loss.mean if vanilla_loss.n else math.nan
        judge("Q1 position bias", f"the position bias explains Random's closeness to vanilla: without it ({no_bias}) "
              f"Random is not within {CLOSE_LOSS:.0%} of vanilla", paired(rows, no_bias, base, "eval_loss"), "outside",
              margin, f"eval_loss({no_bias}) - eval_loss(vanilla)")
        if names["random"]:
            judge("Q1 position bias", "the position bias lowers Random's eval loss",
                  paired(rows, names["random"], no_bias, "eval_loss"), "below", 0.0,
                  f"eval_loss({names['random']}) - eval_loss({no_bias})")
    # Q2 transfer, per task metric
    q2 = "Q2 transfer"
    keys = task_keys(rows)
    for key in keys:
        if per_seed(rows, base, f"scratch/{key}"):
            judge(q2, f"pretraining helps vanilla on {key}", paired(rows, base, base, key, f"scratch/{key}"),
                  "above", 0.0, f"{key}(vanilla) - scratch/{key}(vanilla)")
        for pure in ("random", "dense"):
            if names[pure]:
                judge(q2, f"{names[pure]} transfers worse than vanilla on {key}", paired(rows, names[pure], base, key),
                      "below", 0.0, f"{key}({names[pure]}) - {key}(vanilla)")
        for mix in ("random+vanilla", "dense+vanilla"):
            if names[mix]:
                judge(q2, f"{names[mix]} matches vanilla on {key}", paired(rows, names[mix], base, key),
                      "within", MATCH_SCORE, f"{key}({names[mix]}) - {key}(vanilla)")
    # ... most on the token-matching pair task: the pure synthesizer's gap to vanilla is larger on "pair"
    for pair_key in (k for k in keys if k.startswith("pair/")):
        metric = pair_key.split("/")[-1]
        for other in (k for k in keys if not k.startswith("pair/") and k.split("/")[-1] == metric):
            for pure in ("random", "dense"):
                if names[pure]:
                    judge(q2, f"{names[pure]} loses more to vanilla on {pair_key} than on {other}",
                          _gap_difference(rows, names[pure], base, pair_key, other), "below", 0.0,
                          f"gap on {pair_key} - gap on {other} (gap: {names[pure]} - vanilla)")
    # Q3 learned matrices and mixture weights (moved/*: written by the report per cell)
    for kind, bound in MOVED.items():
        for variant in dict.fromkeys(r["variant"] for r in rows):
            values = per_seed(rows, variant, f"moved/{kind}")
            if values:
                what = ("relative Frobenius change of the Random matrices" if kind == "random"
                        else "total-variation distance of the mixture weights from uniform")
                judge("Q3 learned weights", f"{variant}'s {'Random matrices' if kind == 'random' else 'mixture weights'}"
                      f" moved beyond noise", t_interval(list(values.values())), "above", bound, what)
    # Q4 speed (the paper: Random 4.26 vs vanilla 3.90 steps/s, 1.09x)
    if names["random"]:
        judge("Q4 speed", "Random trains faster than vanilla (tokens/s ratio above 1)",
              paired(rows, names["random"], base, "tokens_per_s", op=ratio), "above", 1.0,
              "tokens_per_s(random) / tokens_per_s(vanilla)")
    return out


def _gap_difference(rows: list[dict], variant: str, base: str, key_a: str, key_b: str) -> Interval:
    """Per seed: (variant - base on key_a) - (variant - base on key_b)."""
    va, vb = per_seed(rows, variant, key_a), per_seed(rows, variant, key_b)
    ba, bb = per_seed(rows, base, key_a), per_seed(rows, base, key_b)
    seeds = sorted(va.keys() & vb.keys() & ba.keys() & bb.keys())
    return t_interval([(va[s] - ba[s]) - (vb[s] - bb[s]) for s in seeds])
