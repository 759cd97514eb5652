"""Rank-based effect sizes: the exact Mann-Whitney null matches brute-force enumeration, the intervals cover the
true ratio at their achieved confidence (simulated), orientation favours the candidate, pooling across strata
narrows the interval, tiny samples report their real confidence, and bad input names the bad value."""
import dataclasses
import itertools
import math
import random
from fractions import Fraction

import pytest

from campaigns import effects
from campaigns.effects import describe, point_effect, pooled_effect, within


def _brute_force_counts(m: int, n: int) -> list[int]:
    """Counts of U over every way of giving m of the ranks 0..m+n-1 to the first sample."""
    counts = [0] * (m * n + 1)
    for x_ranks in itertools.combinations(range(m + n), m):
        u = sum(r - i for i, r in enumerate(x_ranks))      # y's below the i-th smallest x: r minus the i x's below
        counts[u] += 1
    return counts


def _brute_force_counts_by_pairs(m: int, n: int) -> list[int]:
    counts = [0] * (m * n + 1)
    for x_ranks in itertools.combinations(range(m + n), m):
        y_ranks = set(range(m + n)) - set(x_ranks)
        counts[sum(1 for x in x_ranks for y in y_ranks if x > y)] += 1
    return counts


@pytest.mark.parametrize("m,n", [(1, 1), (2, 2), (2, 3), (3, 4), (4, 3), (5, 5), (2, 6)])
def test_mann_whitney_null_equals_enumeration(m, n):
    brute = _brute_force_counts_by_pairs(m, n)
    assert brute == _brute_force_counts(m, n)
    assert list(effects.mann_whitney_counts(m, n)) == brute
    probs = effects.mann_whitney_null(m, n)
    assert math.fsum(probs) == pytest.approx(1.0, abs=1e-12)
    assert probs == pytest.approx([c / math.comb(m + n, m) for c in brute])


def _largest_k(m: int, n: int, alpha: float) -> tuple[int, Fraction]:
    """(k, P(U <= k-1)) by enumeration, straight from the definition."""
    counts = _brute_force_counts_by_pairs(m, n)
    total = sum(counts)
    k = 0
    while Fraction(sum(counts[:k + 1]), total) <= Fraction(str(alpha)) / 2:    # alpha as written, exactly
        k += 1
    return k, Fraction(sum(counts[:k]), total)


def test_five_vs_five_interval_ranks_and_achieved_confidence_match_enumeration():
    k, tail = _largest_k(5, 5, 0.05)
    assert (k, tail) == (3, Fraction(4, 252))                # P(U <= 2) = 4/252; P(U <= 3) = 7/252 > 0.025
    cand = [103.1, 104.9, 101.7, 106.2, 105.0]
    base = [100.4, 99.1, 101.2, 98.8, 100.9]
    e = point_effect(cand, base, higher_is_better=True)
    assert e.confidence == pytest.approx(float(1 - 2 * tail))  # 0.9683
    d = sorted(math.log(c) - math.log(b) for c in cand for b in base)
    assert e.n_pairs == 25
    assert e.lo == pytest.approx(math.exp(d[k - 1]))
    assert e.hi == pytest.approx(math.exp(d[25 - k]))
    assert e.ratio == pytest.approx(math.exp(d[12]))


def test_an_exactly_attainable_level_takes_its_own_interval_not_the_next_wider():
    """4 vs 4 at 80%: P(U <= 3) = 7/70 is exactly alpha/2, so k = 4 at exactly 0.800. In floats 1 - 0.8 is
    0.19999999999999996 and the comparison lost k = 4 to rounding (k = 3, 0.886)."""
    e = point_effect([1.1, 1.2, 1.3, 1.4], [1.0, 1.05, 1.15, 1.25], True, 0.8)
    assert e.confidence == pytest.approx(0.8, abs=1e-12)
    diffs = sorted(math.log(c) - math.log(b) for c in [1.1, 1.2, 1.3, 1.4] for b in [1.0, 1.05, 1.15, 1.25])
    assert (e.lo, e.hi) == pytest.approx((math.exp(diffs[3]), math.exp(diffs[-4])))


def test_three_vs_three_falls_back_to_the_full_range_at_ninety_percent():
    k, tail = _largest_k(3, 3, 0.05)
    assert k == 0                                             # P(U <= 0) = 1/20 > 0.025: 95% is out of reach
    e = point_effect([1.1, 1.2, 1.15], [1.0, 1.05, 0.97], higher_is_better=True)
    assert e.confidence == pytest.approx(1 - 2 / 20)
    assert e.lo == pytest.approx(1.1 / 1.05) and e.hi == pytest.approx(1.2 / 0.97)


def test_two_vs_two_returns_min_max_with_two_thirds_confidence():
    cand, base = [1.10, 1.20], [1.00, 1.05]
    e = point_effect(cand, base, higher_is_better=True)
    assert e.confidence == pytest.approx(2 / 3)
    assert e.lo == pytest.approx(1.10 / 1.05)
    assert e.hi == pytest.approx(1.20 / 1.00)
    assert e.n_pairs == 4
    assert describe(e).endswith("(67%)")


def _lognormal_arm(rng: random.Random, level: float, n: int, sigma: float) -> list[float]:
    return [level * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


def test_point_interval_covers_the_true_ratio_at_its_achieved_confidence():
    rng = random.Random(20261201)
    true_ratio, trials, covered = 1.05, 2000, 0
    for _ in range(trials):
        e = point_effect(_lognormal_arm(rng, 100.0 * true_ratio, 5, 0.03), _lognormal_arm(rng, 100.0, 5, 0.03),
                         higher_is_better=True)
        covered += e.lo <= true_ratio <= e.hi
    coverage = covered / trials
    # exact for continuous noise: within ~4 binomial SE (0.004) of 0.968 either way (not merely conservative)
    assert e.confidence - 0.015 <= coverage <= e.confidence + 0.015, (coverage, e.confidence)


def test_pooled_interval_covers_the_true_ratio_at_its_achieved_confidence():
    rng = random.Random(7)
    true_ratio, trials, covered = 1.05, 2000, 0
    levels, sizes = (100.0, 180.0, 310.0, 420.0), ((5, 5), (5, 4), (4, 5), (5, 5))   # concurrency 1, 2, 4, 8
    for _ in range(trials):
        strata = [(_lognormal_arm(rng, lvl * true_ratio, m, sigma), _lognormal_arm(rng, lvl, n, sigma))
                  for lvl, (m, n), sigma in zip(levels, sizes, (0.02, 0.04, 0.06, 0.08))]
        e = pooled_effect(strata, higher_is_better=True)
        covered += e.lo <= true_ratio <= e.hi
    coverage = covered / trials
    assert e.n_pairs == 25 + 20 + 20 + 25
    assert 0.95 <= e.confidence < 0.96
    assert e.confidence - 0.015 <= coverage <= e.confidence + 0.015, (coverage, e.confidence)


def test_latency_with_a_faster_candidate_reads_above_one():
    rng = random.Random(3)
    base = _lognormal_arm(rng, 20.0, 5, 0.01)                 # TPOT ms
    cand = _lognormal_arm(rng, 20.0 / 1.1, 5, 0.01)           # 10% faster: base/cand = 1.1
    e = point_effect(cand, base, higher_is_better=False)
    assert e.ratio == pytest.approx(1.1, rel=0.02)
    assert 1.0 < e.lo <= e.ratio <= e.hi
    flipped = point_effect(cand, base, higher_is_better=True)  # the same numbers read as throughput: a loss
    assert flipped.ratio == pytest.approx(1 / e.ratio)
    assert flipped.hi < 1.0


def test_pooling_strata_narrows_the_interval():
    rng = random.Random(11)
    strata = [(_lognormal_arm(rng, lvl * 1.03, 5, 0.02), _lognormal_arm(rng, lvl, 5, 0.02))
              for lvl in (100.0, 180.0, 310.0, 420.0)]
    pooled = pooled_effect(strata, higher_is_better=True)
    singles = [point_effect(c, b, higher_is_better=True) for c, b in strata]
    width = lambda e: math.log(e.hi / e.lo)                   # noqa: E731
    assert all(width(pooled) < width(s) for s in singles), (describe(pooled), [describe(s) for s in singles])
    assert pooled.lo <= pooled.ratio <= pooled.hi
    assert pooled.n_pairs == 100


def test_pooled_differences_stay_within_strata():
    # per stratum the candidate is exactly 2% ahead; across strata the levels differ 4x, so a cross-stratum pair
    # would drag the interval far from 1.02
    strata = [([lvl * 1.02 * f for f in (1.0, 1.001, 0.999)], [lvl * f for f in (1.0005, 0.9995, 1.0)])
              for lvl in (100.0, 400.0)]
    e = pooled_effect(strata, higher_is_better=True)
    assert 1.015 < e.lo <= e.ratio <= e.hi < 1.025


def test_single_stratum_pool_equals_the_point_effect():
    cand, base = [5.1, 5.3, 5.0, 5.4], [5.0, 4.9, 5.05, 5.2, 4.95]
    pooled = pooled_effect([(cand, base)], higher_is_better=False)
    assert dataclasses.replace(pooled, method=effects.POINT_METHOD) == point_effect(cand, base, higher_is_better=False)


def test_within_and_describe():
    e = effects.Effect(ratio=1.042, lo=0.998, hi=1.087, confidence=0.968, n_pairs=25, method=effects.POINT_METHOD)
    assert describe(e) == "x1.042 [0.998, 1.087] (97%)"
    assert within(e, 0.10) and not within(e, 0.05)
    low = effects.Effect(ratio=0.97, lo=0.951, hi=0.99, confidence=0.968, n_pairs=25, method=effects.POINT_METHOD)
    assert within(low, 0.06) and not within(low, 0.05)      # 1/1.05 = 0.95238 > 0.951


@pytest.mark.parametrize("cand,base,bad", [
    ([], [1.0], "candidate has no values"),
    ([1.0], [], "baseline has no values"),
    ([1.0, 0.0], [1.0], "candidate value 0.0"),
    ([1.0], [1.0, -3.5], "baseline value -3.5"),
    ([1.0, float("nan")], [1.0], "candidate value nan"),
    ([1.0], [float("inf")], "baseline value inf"),
    ([1.0, "fast"], [1.0], "candidate value 'fast'"),
])
def test_bad_values_are_named(cand, base, bad):
    with pytest.raises(ValueError, match=bad):
        point_effect(cand, base, higher_is_better=True)


def test_bad_pooled_and_confidence_inputs_are_named():
    with pytest.raises(ValueError, match="strata is empty"):
        pooled_effect([], higher_is_better=True)
    with pytest.raises(ValueError, match="stratum 1: baseline value 0"):
        pooled_effect([([1.0], [1.0]), ([1.0], [0])], higher_is_better=True)
    with pytest.raises(ValueError, match="confidence 95"):
        point_effect([1.0], [1.0], higher_is_better=True, confidence=95)
    with pytest.raises(ValueError, match="margin -0.1"):
        within(point_effect([1.0], [1.0], higher_is_better=True), -0.1)
