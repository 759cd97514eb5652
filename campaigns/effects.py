"""Effect sizes with exact, distribution-free, rank-based confidence intervals: candidate arm vs baseline arm.

A grid point has few reps per arm (5 on the GPU, 2 in CPU rehearsals, up to ~10), too few to trust a normal
approximation or a bootstrap. So we use the rank method whose coverage is exact for any continuous noise:

Per point (`point_effect`), on log values, so that a multiplicative effect is a shift:

    d_ij = log(c_i) - log(b_j)                       all m*n pairwise differences, candidate minus baseline
    estimate  = median(d_ij)                         Hodges-Lehmann shift estimate
    interval  = [d_(k), d_(mn+1-k)]                  Moses interval, from the sorted differences
    k         = largest integer with P(U <= k-1) <= alpha/2, alpha = 1 - confidence
    achieved  = 1 - 2 * P(U <= k-1)

where U is the Mann-Whitney statistic, whose null distribution for sizes (m, n) is counted exactly (a small
integer DP, `mann_whitney_counts`). U takes few values at these sizes, so the nominal confidence is rarely hit
exactly; we report the ACHIEVED one (5 vs 5 at nominal 95% gives 1 - 2*4/252 = 0.968). When even k = 1 is
too wide for the nominal level (2 vs 2: P(U <= 0) = 1/6; 3 vs 3: 1/20), the widest interval
[min d, max d] is returned with its achieved confidence (0.667 and 0.900), never dressed up as 95%.

Across points (`pooled_effect`), e.g. concurrencies 1, 2, 4, 8, assuming one common multiplicative shift:
pairwise differences are taken within each stratum only (a concurrency-8 throughput is never compared with a
concurrency-1 one), the estimate is the median of the pooled differences (stratified Hodges-Lehmann), and the
interval is [D_(k), D_(N+1-k)], N = sum m_s*n_s, with k from the exact null distribution of W = sum_s U_s, the
convolution of the per-stratum Mann-Whitney null distributions (strata may differ in size).

Orientation: every Effect reads > 1 in favour of the candidate. Throughput (higher is better): cand/base;
latency (lower is better): base/cand, i.e. the log differences are negated. Ends are exponentiated last.

Assumptions: within a stratum both arms share the noise shape up to a shift on the log scale (the usual
location-shift model), and there are no ties; tied reps (rounded metrics) make the achieved confidence
approximate rather than exact.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

POINT_METHOD = "Hodges-Lehmann, exact Mann-Whitney (Moses) interval"
POOLED_METHOD = "stratified Hodges-Lehmann, exact interval from the sum of per-stratum Mann-Whitney U"


@dataclass(frozen=True)
class Effect:
    ratio: float          # point estimate of the multiplicative effect, oriented so > 1 favours the candidate
    lo: float             # lower end of the confidence interval (same orientation)
    hi: float             # upper end
    confidence: float     # the ACHIEVED confidence of the interval (exact; e.g. 0.968 for 5 vs 5), not the nominal
    n_pairs: int          # number of pairwise comparisons it rests on
    method: str           # one line naming the method


@lru_cache(maxsize=None)
def mann_whitney_counts(m: int, n: int) -> tuple[int, ...]:
    """counts[u] = number of the C(m+n, m) equally likely rank arrangements (no ties) with U = u, where U counts
    the (x, y) pairs, x from the sample of size m and y from the one of size n, with x > y.

    Recursion on the largest observation: if it is an x it beats all n y's (U gains n, sizes (m-1, n)); if it is
    a y it beats nothing (sizes (m, n-1)).
    """
    if m < 0 or n < 0:
        raise ValueError(f"sample sizes must be >= 0, got ({m}, {n})")
    if m == 0 or n == 0:
        return (1,)
    from_x = mann_whitney_counts(m - 1, n)
    from_y = mann_whitney_counts(m, n - 1)
    counts = [0] * (m * n + 1)
    for u, c in enumerate(from_x):
        counts[u + n] += c
    for u, c in enumerate(from_y):
        counts[u] += c
    return tuple(counts)


def mann_whitney_null(m: int, n: int) -> list[float]:
    """P(U = u) for u = 0 .. m*n under the null (no shift, no ties)."""
    counts = mann_whitney_counts(m, n)
    total = math.comb(m + n, m)
    return [c / total for c in counts]


def _convolve(a: list[int], b: tuple[int, ...]) -> list[int]:
    out = [0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                out[i + j] += x * y
    return out


@lru_cache(maxsize=256)
def _stratified_counts(sizes: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], int]:
    """Counts of W = sum_s U_s over all joint rank arrangements, and their total (product of C(m+n, m))."""
    counts, total = [1], 1
    for m, n in sizes:
        counts = _convolve(counts, mann_whitney_counts(m, n))
        total *= math.comb(m + n, m)
    return tuple(counts), total


def _interval_rank(counts: tuple[int, ...], total: int, confidence: float) -> tuple[int, float]:
    """(k, achieved confidence): k is the largest integer with P(W <= k-1) <= alpha/2, found in exact integer
    arithmetic; k = 1 when none qualifies, i.e. the widest interval, with its achieved confidence."""
    # alpha as the exact fraction of the decimal the level was written as (1 - 0.8 is 0.19999999999999996 in
    # floats, so an exactly attainable level lost its k to rounding and took the next wider interval)
    alpha = 1 - Fraction(str(confidence))
    k, tail = 0, 0                       # tail = count of W <= k-1
    while k < len(counts) and 2 * (tail + counts[k]) <= alpha * total:
        tail += counts[k]
        k += 1
    if k == 0:                           # the nominal level is out of reach: the full range [min, max]
        return 1, 1.0 - 2 * counts[0] / total
    return k, 1.0 - 2 * tail / total


def _log_differences(cand: list[float], base: list[float], higher_is_better: bool, where: str) -> list[float]:
    log_c = _logs(cand, f"{where}candidate")
    log_b = _logs(base, f"{where}baseline")
    sign = 1.0 if higher_is_better else -1.0
    return [sign * (c - b) for c in log_c for b in log_b]


def _logs(values: list[float], arm: str) -> list[float]:
    if len(values) == 0:
        raise ValueError(f"{arm} has no values; need at least one rep per arm")
    logs = []
    for v in values:
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        if not (math.isfinite(x) and x > 0):
            raise ValueError(f"{arm} value {v!r} is not a finite positive number; "
                             f"effects are ratios of positive metrics (throughput, latency)")
        logs.append(math.log(x))
    return logs


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence!r} must lie strictly between 0 and 1 (e.g. 0.95)")


def _effect(diffs: list[float], counts: tuple[int, ...], total: int, confidence: float, method: str) -> Effect:
    diffs = sorted(diffs)
    k, achieved = _interval_rank(counts, total, confidence)
    n_pairs = len(diffs)
    return Effect(ratio=math.exp(statistics.median(diffs)), lo=math.exp(diffs[k - 1]),
                  hi=math.exp(diffs[n_pairs - k]), confidence=achieved, n_pairs=n_pairs, method=method)


def point_effect(cand: list[float], base: list[float], higher_is_better: bool, confidence: float = 0.95) -> Effect:
    """One grid point: Hodges-Lehmann ratio with the exact Moses interval (see the module docstring)."""
    _check_confidence(confidence)
    diffs = _log_differences(cand, base, higher_is_better, "")
    m, n = len(cand), len(base)
    return _effect(diffs, mann_whitney_counts(m, n), math.comb(m + n, m), confidence, POINT_METHOD)


def pooled_effect(strata: list[tuple[list[float], list[float]]], higher_is_better: bool,
                  confidence: float = 0.95) -> Effect:
    """Several grid points sharing one multiplicative effect: stratified Hodges-Lehmann with the exact interval
    from W = sum of per-stratum U (see the module docstring). Each stratum is (candidate reps, baseline reps)."""
    _check_confidence(confidence)
    if len(strata) == 0:
        raise ValueError("strata is empty; need at least one (candidate, baseline) pair of rep lists")
    diffs: list[float] = []
    for s, (cand, base) in enumerate(strata):
        diffs += _log_differences(cand, base, higher_is_better, f"stratum {s}: ")
    counts, total = _stratified_counts(tuple((len(c), len(b)) for c, b in strata))
    return _effect(diffs, counts, total, confidence, POOLED_METHOD)


def within(effect: Effect, margin: float) -> bool:
    """True when the whole interval lies inside the equivalence band [1/(1+margin), 1+margin]: the effect is shown
    to be smaller than `margin` either way. The band is symmetric on the log scale (a 5% margin admits x0.952
    to x1.05), matching the ratios being log differences."""
    if not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"margin {margin!r} must be a finite positive fraction (e.g. 0.02 for 2%)")
    return 1.0 / (1.0 + margin) <= effect.lo and effect.hi <= 1.0 + margin


def describe(effect: Effect) -> str:
    """e.g. 'x1.042 [0.998, 1.087] (97%)': ratio, interval, achieved confidence."""
    return f"x{effect.ratio:.3f} [{effect.lo:.3f}, {effect.hi:.3f}] ({effect.confidence:.0%})"
