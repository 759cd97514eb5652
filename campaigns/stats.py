"""Grid statistics: per axis and concurrency, candidate vs baseline, with complete-separation classification.

An axis reads one per-leg metric (the `vllm bench serve` name campaigns/loadgen.py emits). Per point we keep every
rep's value per arm, their median/mean/min/max/CV, the median ratio oriented so that > 1 favours the candidate
(throughput: ON/OFF; latency: OFF/ON), and the separation:

    WIN      the worst candidate rep beats the best baseline rep   (bands do not overlap, candidate ahead)
    LOSS     the best candidate rep is worse than the worst baseline rep
    NEUTRAL  otherwise: the bands touch or overlap, which is noise, not a measurement

"Beats" is strict, so a tie between the worst ON rep and the best OFF rep is NEUTRAL.

Beyond the separation, each point carries an effect size (the Hodges-Lehmann ratio with its exact rank-based
interval, campaigns/effects.py), and ``pooled_effects`` gives each axis pooled over the concurrencies: what a KEEP
quotes to say whether the lever is measured neutral or the grid could not tell.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable

from campaigns import effects
from campaigns.evidence import ArmSummary, AxisStat, EffectSize, LegResult, PooledEffect


@dataclass(frozen=True)
class Axis:
    name: str
    metric: str                 # per-leg metric key (vllm bench serve name)
    higher_is_better: bool
    label: str                  # for tables and plots
    unit: str


AXES: tuple[Axis, ...] = (
    Axis("total_token_throughput", "total_token_throughput", True, "total tok/s", "tok/s"),
    Axis("tpot", "median_tpot_ms", False, "TPOT", "ms"),
    Axis("ttft", "median_ttft_ms", False, "TTFT", "ms"),
    Axis("itl", "median_itl_ms", False, "ITL", "ms"),
    Axis("e2el", "median_e2el_ms", False, "E2EL", "ms"),
    Axis("output_throughput", "output_throughput", True, "output tok/s", "tok/s"),
    Axis("request_throughput", "request_throughput", True, "req/s", "req/s"),
)
# Axes a campaign reads only when its policy names them primary: the long-prompt grid's tail latency (a P99 over a
# leg's tokens is noisier than a median, so it gates only the campaigns that are about it)
OPTIONAL_AXES: tuple[Axis, ...] = (
    Axis("p99_itl", "p99_itl_ms", False, "P99 ITL", "ms"),
    # the longest gap of the leg, any request's: the stall a user watches. One stall a request at c2 of the 32k grid
    # is under 1% of its gaps, so it never reaches the P99 (the mixed_prefill KEEP of 2026-12-05: prefill first's
    # P99 ITL 20.9 ms beside a 132 ms ITL standard deviation)
    Axis("max_itl", "max_itl_ms", False, "max ITL", "ms"),
)
AXIS_BY_NAME = {a.name: a for a in AXES + OPTIONAL_AXES}
PRIMARY_AXES = ("total_token_throughput", "tpot")


def _stdev(values: list[float], mean: float) -> float:
    """The sample standard deviation in floats (two passes, the squares summed by fsum). statistics.stdev sums in
    Fractions: it was three quarters of a campaign's verdict, whose calibration summarizes every point of thousands
    of simulated grids (2026-12-07: 18.4 s for a 40-leg campaign on a CPU host, 4.4 s in floats)."""
    if min(values) == max(values):     # fmean may round off the common value: no spread is exactly 0
        return 0.0
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def summarize(values: list[float]) -> ArmSummary:
    mean = statistics.fmean(values)
    sd = _stdev(values, mean) if len(values) > 1 else 0.0
    return ArmSummary(median=float(statistics.median(values)), mean=float(mean), min=float(min(values)),
                      max=float(max(values)), cv=float(sd / mean) if mean else 0.0, n=len(values))


def oriented_ratio(on: float, off: float, higher_is_better: bool) -> float | None:
    """> 1 favours the candidate (ON). None when the denominator is 0."""
    num, den = (on, off) if higher_is_better else (off, on)
    return num / den if den else None


def separation(on: list[float], off: list[float], higher_is_better: bool) -> str:
    if higher_is_better:
        if min(on) > max(off):
            return "WIN"
        if max(on) < min(off):
            return "LOSS"
    else:
        if max(on) < min(off):
            return "WIN"
        if min(on) > max(off):
            return "LOSS"
    return "NEUTRAL"


def _value(leg: LegResult, metric: str) -> float | None:
    v = leg.metrics.get(metric)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def effect_size(e: effects.Effect) -> EffectSize:
    return EffectSize(ratio=e.ratio, lo=e.lo, hi=e.hi, confidence=round(e.confidence, 4), method=e.method)


def _effect(cand: list[float], base: list[float], higher_is_better: bool) -> EffectSize | None:
    if min(cand + base) <= 0 or not all(map(math.isfinite, cand + base)):   # a log ratio needs finite values > 0
        return None
    return effect_size(effects.point_effect(cand, base, higher_is_better))


def compute_stats(legs: Iterable[LegResult], baseline: str, candidates: list[str],
                  primary_axes: Iterable[str] = PRIMARY_AXES, axes: Iterable[Axis] | None = None,
                  with_effects: bool = True, also: Iterable[str] = ()) -> list[AxisStat]:
    """Statistics over the valid legs, one AxisStat per (candidate, axis, concurrency) that has data on both arms.
    ``axes`` None: AXES plus the OPTIONAL_AXES named primary or in ``also`` (the axes a campaign declares traded:
    reported, never deciding). ``with_effects=False`` skips the effect sizes (the calibration's thousands of
    simulated grids need only the separations).

    Sorted by candidate order, axis order, concurrency: the views rely on that order being stable."""
    primary = set(primary_axes)
    if axes is None:
        axes = AXES + tuple(a for a in OPTIONAL_AXES if a.name in primary or a.name in set(also))
    valid = sorted((leg for leg in legs if leg.valid), key=lambda leg: (leg.concurrency, leg.rep, leg.order_index))
    concurrencies = sorted({leg.concurrency for leg in valid})
    out: list[AxisStat] = []
    for cand in candidates:
        for axis in axes:
            for c in concurrencies:
                reps: dict[str, list[float]] = {}
                for arm in (baseline, cand):
                    reps[arm] = [v for leg in valid if leg.concurrency == c and leg.arm == arm
                                 if (v := _value(leg, axis.metric)) is not None]
                if not reps[baseline] or not reps[cand]:
                    continue
                summary = {arm: summarize(vals) for arm, vals in reps.items()}
                out.append(AxisStat(
                    axis=axis.name, metric=axis.metric, concurrency=c, baseline=baseline, candidate=cand,
                    higher_is_better=axis.higher_is_better, reps=reps, summary=summary,
                    ratio=oriented_ratio(summary[cand].median, summary[baseline].median, axis.higher_is_better),
                    separation=separation(reps[cand], reps[baseline], axis.higher_is_better),
                    primary=axis.name in primary,
                    effect=_effect(reps[cand], reps[baseline], axis.higher_is_better) if with_effects else None))
    return out


def pooled_effects(stats: list[AxisStat]) -> list[PooledEffect]:
    """Per (candidate, axis): the effect pooled over the concurrencies (a common multiplicative shift), with its
    exact interval; what a KEEP quotes."""
    out = []
    keys = list(dict.fromkeys((s.candidate, s.axis) for s in stats))
    for cand, axis in keys:
        points = [s for s in stats if s.candidate == cand and s.axis == axis]
        strata = [(s.reps[cand], s.reps[s.baseline]) for s in points]
        if any(min(c + b) <= 0 or not all(map(math.isfinite, c + b)) for c, b in strata):
            continue
        e = effects.pooled_effect(strata, points[0].higher_is_better)
        out.append(PooledEffect(candidate=cand, axis=axis, effect=effect_size(e), primary=points[0].primary))
    return out


def rep_ratios(stat: AxisStat) -> list[float]:
    """Each candidate rep against the baseline median, oriented (> 1 better): the spread a plot shows."""
    off = stat.summary[stat.baseline].median
    return [r for v in stat.reps[stat.candidate]
            if (r := oriented_ratio(v, off, stat.higher_is_better)) is not None]


def planned_legs(concurrency: list[int], reps: int, arms: list[str]) -> set[tuple[int, int, str]]:
    """The (concurrency, rep, arm) keys a complete grid has; a missing one voids the grid."""
    return {(int(c), r, a) for c in concurrency for r in range(reps) for a in arms}
