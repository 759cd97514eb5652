"""The grid rule's own error rates: the project's policy run on thousands of simulated campaigns of a given shape.

A verdict is worth as much as the rule's error rates: how often a lever that changes nothing would FLIP (false
FLIP) or be recorded as a regression (false REJECT), and how large a real gain must be to FLIP with 80% probability
(the minimum detectable effect). These depend on the grid's shape (reps, concurrencies, candidates, axes) and on
the noise, so they are measured here, not derived by formula: synthetic evidence of exactly the campaign's shape
goes through ``policy.decide`` itself, so any change of the rule changes its measured rates.

The null noise model (never a shuffle of legs across arms, which would count a real effect as noise):

- Residuals within an arm. For every (campaign, arm, concurrency) of the pooled evidence, each valid leg's metrics
  divided by that arm's mean at that point, ``r = 1 + (v / mean - 1) * sqrt(n / (n - 1))`` (the factor undoes the
  shrinkage of deviations about a sample mean of n reps). A whole leg is one residual vector, so the axes of one
  leg (total, output and request throughput are one measurement) stay together.
- Pooled per concurrency over the evidence given (binding campaigns of the same device, A/A grids included, and
  the campaign itself). A concurrency with no residuals borrows the nearest pooled one, and the record says so.

- Between servers. Two servers of one build do not run at one speed: an A/A grid's second server was steadily
  0.4-0.7% slower on TPOT at c1 (2026-12-01/02), an offset that stays for the life of the server pair, so
  within-arm residuals never show it and five reps separate it every time. Every binding A/A grid of the pool
  (other than the campaign itself) gives one offset profile: per concurrency and metric, the log-ratio of the
  second arm's median to the first's, less one standard error of that difference (from the two arms' own spread;
  at most down to zero). The raw ratio would count the grid's noise of the median a second time: an A/A grid of
  the noisy engine of 2026-12-01 shows 1.7-2.8% between medians at c2 with ±1-3% within each arm, and read as
  offsets those lift the default grid's false-FLIP rate from ~1% to ~17%; less one standard error they shrink
  to what the grid could resolve, while a steady 0.6% offset with 0.1% spreads stays ~0.5%.

- The tail axes (P99 and max ITL) only where the policy reads them (primary, or traded: a traded axis decides
  nothing alone but a WIN there blocks a REJECT and an A/A counts its separations). Every leg measures them, their
  residuals taken in logs (``r = exp((log v - mean log v) * sqrt(n / (n - 1)))``: a stall of seconds in one leg
  would drive an additive residual of the others below zero), but their noise
  depends on the grid's prompts (on the 32k grid a prefill that stalls the other requests moves them by seconds),
  so a campaign that reads one draws whole legs that measured it from its own grid's legs (the pool's, when its
  grid has none), and its rates count that axis among the comparisons; an axis no pooled leg measured is not
  simulated, and the calibration's noise line says so.

A simulated campaign draws, for each (concurrency, rep, arm), one residual vector at that concurrency, and (when
the pool has A/A grids) one offset profile, with either sign (which server is the slower one is chance), that
multiplies every candidate leg at its concurrency (the nearest one in the profile). Under the
null both arms get the residuals as they are; for power, the candidate's throughput axes are multiplied and its
latency axes divided by (1 + gain) on every axis but TTFT (a decode lever does not move the prefill). Every gate
is marked passed and self-checked, so the rule's grid half decides; ``token_safe_as`` says whether the FLIP rule
was the byte-exact one or the near-tie-ratified one (which also needs its WINs to clear the minimum gain).
"""
from __future__ import annotations

import copy
import math
import random
import statistics
from dataclasses import dataclass, field
from typing import Iterable

from campaigns.config import settings
from campaigns.evidence import Calibration, Evidence, GateResult, LegResult
from campaigns.stats import AXES, AXIS_BY_NAME, OPTIONAL_AXES, Axis

DEFAULT_SIMS = 1000
DEFAULT_SEED = 0
POWER_GAINS = (0.02, 0.05, 0.10)
UNMOVED_AXES = ("ttft",)                # the axes a decode-side gain leaves alone in the power simulation
MDE_SEARCH = (0.0025, 0.40)             # the minimum detectable effect is searched in this range of gains
METRICS = tuple(a.metric for a in AXES)
OPTIONAL_METRICS = tuple(a.metric for a in OPTIONAL_AXES)


@dataclass
class NoiseModel:
    """Residual vectors (metric -> multiplicative residual) per concurrency, the same per grid (``by_grid``), the
    between-server offset profiles (concurrency -> metric -> factor) of A/A grids, and where they came from."""
    residuals: dict[int, list[dict[str, float]]]
    campaigns: list[str]
    offsets: list[dict[int, dict[str, float]]] = field(default_factory=list)
    offset_campaigns: list[str] = field(default_factory=list)
    by_grid: dict[str, dict[int, list[dict[str, float]]]] = field(default_factory=dict)

    def legs(self) -> dict[str, int]:
        return {str(c): len(v) for c, v in sorted(self.residuals.items())}

    def at(self, c: int) -> tuple[int, list[dict[str, float]]]:
        """The residuals of concurrency ``c``, or of the nearest pooled concurrency (and which one)."""
        return _nearest(self.residuals, c)

    def describe(self) -> str:
        n = sum(len(v) for v in self.residuals.values())
        between = (f"; between-server offsets of {len(self.offsets)} A/A grid(s), either sign" if self.offsets
                   else "; no A/A grid, so no between-server term")
        return (f"within-arm residuals of {n} legs (whole legs, per concurrency) from {len(self.campaigns)} "
                f"campaign(s){between}")


def _nearest(pool: dict[int, list[dict[str, float]]], c: int) -> tuple[int, list[dict[str, float]]]:
    if c in pool:
        return c, pool[c]
    near = min(pool, key=lambda k: (abs(math.log2(k) - math.log2(c)), k))
    return near, pool[near]


def _carrying(pool: dict[int, list[dict[str, float]]], metrics: Iterable[str]) -> dict[int, list[dict[str, float]]]:
    need = set(metrics)
    out = {c: [v for v in vecs if need <= v.keys()] for c, vecs in pool.items()}
    return {c: vecs for c, vecs in out.items() if vecs}


@dataclass(frozen=True)
class Draws:
    """What a simulated campaign of one shape draws from: the residual pool, the axes it simulates (AXES plus the
    optional axes its policy reads, where pooled legs measured them) and, in words, where the tail came from."""
    pool: dict[int, list[dict[str, float]]]
    axes: tuple[Axis, ...]
    note: str = ""


def draws_for(t: Evidence, noise: NoiseModel) -> Draws:
    """The residuals a campaign of ``t``'s shape draws. A campaign that reads only the standard axes draws from the
    whole pool. One that also reads an optional axis (P99 or max ITL: a tail over a leg's gaps, whose noise depends
    on the prompts: a 32k prefill that stalls other requests moves it by seconds) draws whole legs that measured it,
    from its own grid's legs when there are any, else from the pool's; an optional axis no pooled leg measured is
    not simulated, and the note says so (the rates then leave that axis out)."""
    from campaigns import policy
    p = policy.policy_params(t)
    read = set(p.primary_axes)              # a traded axis decides nothing, either way (policy.Facts.wins)
    wanted = [a for a in OPTIONAL_AXES if a.name in read]
    if not wanted:
        return Draws(noise.residuals, AXES)
    grid = str(settings(t).grid.name)
    axes, pool, source, missing = list(AXES), noise.residuals, "", []
    for a in wanted:
        metrics = METRICS + tuple(x.metric for x in axes[len(AXES):]) + (a.metric,)
        own = _carrying(noise.by_grid.get(grid, {}), metrics)
        found = own or _carrying(noise.residuals, metrics)
        if found:
            axes.append(a)
            pool, source = found, (f"the {grid} grid's" if own else "all grids'")
        else:
            missing.append(a.label)
    note = ""
    if len(axes) > len(AXES):
        n = sum(len(v) for v in pool.values())
        note = f"; {', '.join(a.label for a in axes[len(AXES):])} from {source} {n} legs that measured it"
    if missing:
        note += f"; {', '.join(missing)} not simulated: no pooled leg measured it"
    return Draws(pool, tuple(axes), note)


def residuals_of(ev: Evidence) -> dict[int, list[dict[str, float]]]:
    """Within-arm residual vectors of one campaign's valid legs, per concurrency (points with < 2 reps give none)."""
    out: dict[int, list[dict[str, float]]] = {}
    cells: dict[tuple[int, str], list[LegResult]] = {}
    for leg in ev.legs:
        if leg.valid:
            cells.setdefault((leg.concurrency, leg.arm), []).append(leg)
    for (c, _arm), legs in sorted(cells.items()):
        n = len(legs)
        if n < 2:
            continue
        inflate = math.sqrt(n / (n - 1))
        means = {}
        for m in METRICS:
            vals = [leg.metrics.get(m) for leg in legs]
            if all(isinstance(v, (int, float)) and v > 0 for v in vals):
                means[m] = statistics.fmean(vals)
        if set(means) != set(METRICS):
            continue
        log_means = {}
        for m in OPTIONAL_METRICS:     # measured by this cell's every leg: the tail axes some campaigns read
            vals = [leg.metrics.get(m) for leg in legs]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in vals):
                log_means[m] = statistics.fmean(math.log(v) for v in vals)
        for leg in legs:
            vec = {m: 1.0 + (leg.metrics[m] / mean - 1.0) * inflate for m, mean in means.items()}
            # a tail is heavy (one stall of seconds among gaps of ms): an additive residual about the mean would go
            # negative for the other legs, so the tail axes' residuals are taken in logs
            vec.update({m: math.exp((math.log(leg.metrics[m]) - lm) * inflate) for m, lm in log_means.items()})
            out.setdefault(c, []).append(vec)
    return out


def offsets_of(ev: Evidence) -> dict[int, dict[str, float]]:
    """An A/A grid's between-server offset profile: per concurrency where both arms have valid legs, each metric's
    median on the second arm over its median on the first. Empty for a lever campaign (its arms differ by the
    lever, so their ratio is no offset)."""
    if ev.kind != "aa" or len(ev.arms) != 2:
        return {}
    first, second = ev.arms[0].name, ev.arms[1].name
    cells: dict[tuple[int, str], list[LegResult]] = {}
    for leg in ev.legs:
        if leg.valid:
            cells.setdefault((leg.concurrency, leg.arm), []).append(leg)
    out = {}
    for c in sorted({c for c, _ in cells}):
        a, b = cells.get((c, first), []), cells.get((c, second), [])
        factors = {}
        for m in METRICS:
            va = [leg.metrics.get(m) for leg in a]
            vb = [leg.metrics.get(m) for leg in b]
            if len(va) >= 2 and len(vb) >= 2 and all(isinstance(v, (int, float)) and v > 0 for v in va + vb):
                factors[m] = _shrunk_ratio([math.log(v) for v in va], [math.log(v) for v in vb])
        if set(factors) == set(METRICS):
            out[c] = factors
    return out


def _shrunk_ratio(la: list[float], lb: list[float]) -> float:
    """exp(d') with d the difference of the medians of two samples of logs and d' = d less one standard error of
    it, toward zero and not past it (a median's standard error taken as sqrt(pi / 2) that of a mean)."""
    d = statistics.median(lb) - statistics.median(la)
    se = math.sqrt(math.pi / 2 * (statistics.variance(la) / len(la) + statistics.variance(lb) / len(lb)))
    return math.exp(math.copysign(max(0.0, abs(d) - se), d))


def noise_model(evidences: Iterable[Evidence], exclude_offsets: Iterable[str] = ()) -> NoiseModel:
    """The pooled residuals of ``evidences`` and the offset profiles of their A/A grids (except the campaign ids in
    ``exclude_offsets``: an A/A grid is not its own null)."""
    pool: dict[int, list[dict[str, float]]] = {}
    by_grid: dict[str, dict[int, list[dict[str, float]]]] = {}
    used, offsets, offset_ids = [], [], []
    skip = set(exclude_offsets)
    for ev in evidences:
        res = residuals_of(ev)
        if res:
            used.append(ev.campaign_id)
        grid = str((ev.config.get("grid") or {}).get("name", ""))
        for c, vecs in res.items():
            pool.setdefault(c, []).extend(vecs)
            by_grid.setdefault(grid, {}).setdefault(c, []).extend(vecs)
        prof = offsets_of(ev) if ev.campaign_id not in skip else {}
        if prof:
            offsets.append(prof)
            offset_ids.append(ev.campaign_id)
    return NoiseModel(pool, used, offsets, offset_ids, by_grid)


def pool_for(ev: Evidence, others: Iterable[Evidence]) -> NoiseModel:
    """The noise model for ``ev``: its own legs, plus the complete binding campaigns of the same device (lever
    campaigns and A/A grids alike); the offsets of those A/A grids, never of ``ev`` itself."""
    same = [o for o in others if o.campaign_id != ev.campaign_id and o.status == "complete"
            and o.decision is not None and o.decision.binding
            and o.fingerprint.device_name == ev.fingerprint.device_name]
    return noise_model([ev] + sorted(same, key=lambda o: o.campaign_id), exclude_offsets=[ev.campaign_id])


# ----------------------------------------------------------------------------------------------- simulation


def template(ev: Evidence, byte_exact: bool) -> Evidence:
    """A complete, binding copy of ``ev``'s shape (arms, grid, policy) whose every listed gate passed and was
    self-checked; its legs are replaced per simulation."""
    from campaigns.gates import GATE_NAMES
    t = copy.deepcopy(ev)
    t.kind = "lever"
    cfg = t.config
    camp = cfg.setdefault("campaign", {})
    gates = list(camp.get("gates") or GATE_NAMES)
    camp["gates"] = gates
    pol = camp.setdefault("policy", {})
    pol["flip_on_correctness"] = False
    pol["fix_gates"] = []
    grid = cfg.setdefault("grid", {})
    grid["binding"] = True
    # the rule's grid half is what is measured: a rehearsal's few reps are simulated as if they were enough
    pol["min_reps"] = min(int(pol.get("min_reps", 5)), int(grid.get("reps", 0)))
    camp["inapplicable"] = {}
    t.fingerprint.device_type, t.fingerprint.dirty, t.fingerprint.dirty_files = "cuda", False, []
    t.arm_fingerprints = {}
    t.gates = []
    for g in gates:
        for a in t.arms:
            r = GateResult(gate=g, arm=a.name, passed=True, self_check=True)
            if g in ("op", "battery") and a.role == "candidate":
                r.byte_exact = byte_exact
            if g == "near_tie":
                r.counts = {"divergences": 0, "max_gap_mnats": 0.0}
            t.gates.append(r)
    t.decision, t.stats, t.pooled, t.calibration = None, [], [], None
    t.__dict__.pop("_settings", None)          # its config was edited above: no stale typed view
    return t


def _gain(axis_name: str, metric_value: float, gain: float) -> float:
    axis = AXIS_BY_NAME[axis_name]
    if gain == 0.0 or axis_name in UNMOVED_AXES:
        return metric_value
    return metric_value * (1 + gain) if axis.higher_is_better else metric_value / (1 + gain)


def simulate(t: Evidence, noise: NoiseModel, rng: random.Random, gain: float = 0.0,
             draws: Draws | None = None) -> Evidence:
    """One simulated campaign of ``t``'s shape: legs drawn from the noise model (``draws``: draws_for(t, noise)
    unless given), the candidates ``gain`` better."""
    draws = draws or draws_for(t, noise)
    grid = settings(t).grid
    reps = int(grid.reps)
    legs, order = [], 0
    profile, sign = (rng.choice(noise.offsets), rng.choice((1, -1))) if noise.offsets else ({}, 1)
    for c in grid.concurrency:
        _, pool = _nearest(draws.pool, int(c))
        shift = profile[min(profile, key=lambda k: (abs(math.log2(k) - math.log2(int(c))), k))] if profile else {}
        for r in range(reps):
            for arm in t.arms:
                res = rng.choice(pool)
                metrics = {}
                for axis in draws.axes:
                    v = res[axis.metric]
                    if arm.role == "candidate":
                        v = _gain(axis.name, v * shift.get(axis.metric, 1.0) ** sign, gain)
                    metrics[axis.metric] = v
                legs.append(LegResult(concurrency=int(c), rep=r, arm=arm.name, order_index=order,
                                      prompts_sha256=f"{c}-{r}", num_prompts=1, metrics=metrics))
                order += 1
    sim = copy.copy(t)
    sim.legs = legs
    return sim


def verdicts(t: Evidence, noise: NoiseModel, sims: int, seed: int, gain: float = 0.0) -> tuple[list[str], list[int]]:
    """The policy's verdict on ``sims`` simulated campaigns, and the separated points (WIN or LOSS) of each."""
    from campaigns import policy
    from campaigns.stats import compute_stats
    p = policy.policy_params(t)
    # the same draws for every gain (common random numbers): the power curve rises smoothly with the gain
    rng = random.Random(seed)
    draws = draws_for(t, noise)
    out, seps = [], []
    for _ in range(sims):
        sim = simulate(t, noise, rng, gain, draws)
        sim.stats = compute_stats(sim.legs, sim.baseline.name, [a.name for a in sim.candidates], p.primary_axes,
                                  with_effects=False, also=p.traded_axes)
        out.append(policy.decide(sim).verdict)
        seps.append(sum(policy.counts(s, p) for s in sim.stats))
    return out, seps


def flip_rate(t: Evidence, noise: NoiseModel, sims: int, seed: int, gain: float) -> float:
    v, _ = verdicts(t, noise, sims, seed, gain)
    return v.count("FLIP") / len(v)


def minimum_detectable(t: Evidence, noise: NoiseModel, sims: int, seed: int, power: float = 0.8,
                       known: dict[float, float] | None = None) -> float | None:
    """The smallest gain FLIPped with probability >= ``power`` (bisection on the gain, to 0.25%). ``known``: FLIP
    rates already measured at some gains (same sims and seed), which bracket the search: the calibration's power
    points at 2/5/10% leave about four bisection steps instead of eight, a third of a campaign's conclusion on the
    GPU host."""
    lo, hi = MDE_SEARCH
    for gain, rate in sorted((known or {}).items()):
        if not lo < gain < hi:
            continue
        if rate >= power:
            hi = gain
            break
        lo = gain
    if hi == MDE_SEARCH[1] and flip_rate(t, noise, sims, seed, hi) < power:
        return None
    while hi - lo > 0.0025:
        mid = (lo + hi) / 2
        if flip_rate(t, noise, sims, seed, mid) >= power:
            hi = mid
        else:
            lo = mid
    return round(hi, 4)


def calibrate(ev: Evidence, noise: NoiseModel, sims: int = DEFAULT_SIMS, seed: int = DEFAULT_SEED,
              byte_exact: bool | None = None) -> Calibration | None:
    """The rates of ``ev``'s grid shape under ``noise``. ``byte_exact`` picks the FLIP rule simulated; None takes
    the campaign's measured byte-exactness (not byte-exact when unknown: the stricter rule). None when the noise
    model is empty."""
    if not noise.residuals or not ev.candidates:
        return None
    if byte_exact is None:
        byte_exact = bool(ev.decision and ev.decision.byte_exact)
    t = template(ev, byte_exact)
    null, seps = verdicts(t, noise, sims, seed)
    seps_sorted = sorted(seps)
    rates = {g: flip_rate(t, noise, sims, seed, g) for g in POWER_GAINS}
    power = {f"{g:.2f}": r for g, r in rates.items()}
    draws = draws_for(t, noise)
    stats_shape = len(t.candidates) * len(draws.axes) * len(settings(t).grid.concurrency)
    return Calibration(
        false_flip=null.count("FLIP") / sims, false_reject=null.count("REJECT-PERFORMANCE") / sims,
        power=power, mde_80=minimum_detectable(t, noise, sims, seed, known=rates),
        separations_mean=round(statistics.fmean(seps), 3),
        separations_q95=seps_sorted[min(len(seps_sorted) - 1, math.ceil(0.95 * len(seps_sorted)) - 1)],
        comparisons=stats_shape, sims=sims, seed=seed,
        token_safe_as="byte-exact" if byte_exact else "near-tie ratified",
        noise=noise.describe() + _borrowed(t, draws) + draws.note, noise_campaigns=list(noise.campaigns),
        noise_legs=noise.legs())


def _borrowed(t: Evidence, draws: Draws) -> str:
    notes = []
    for c in settings(t).grid.concurrency:
        near, _ = _nearest(draws.pool, int(c))
        if near != int(c):
            notes.append(f"c{c} from c{near}")
    return f"; no residuals at {', '.join(notes)} (nearest concurrency used)" if notes else ""


def sentence(cal: Calibration | None) -> str:
    """The figures every binding record and PR text states."""
    if cal is None:
        return "not calibrated (no legs to build a noise model from)"
    detects = (f"detects a gain >= {cal.mde_80:.1%} with 80% power" if cal.mde_80 is not None
               else f"detects no gain up to {MDE_SEARCH[1]:.0%} with 80% power")
    return (f"this grid: false FLIP {cal.false_flip:.1%}, false REJECT {cal.false_reject:.1%}, {detects} "
            f"({cal.comparisons} comparisons, {cal.sims} simulated campaigns, FLIP rule {cal.token_safe_as})")
