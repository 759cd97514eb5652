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

A simulated campaign draws, for each (concurrency, rep, arm), one residual vector at that concurrency. Under the
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
from dataclasses import dataclass
from typing import Iterable

from campaigns.config import settings
from campaigns.evidence import Calibration, Evidence, GateResult, LegResult
from campaigns.stats import AXES, AXIS_BY_NAME

DEFAULT_SIMS = 1000
DEFAULT_SEED = 0
POWER_GAINS = (0.02, 0.05, 0.10)
UNMOVED_AXES = ("ttft",)                # the axes a decode-side gain leaves alone in the power simulation
MDE_SEARCH = (0.0025, 0.40)             # the minimum detectable effect is searched in this range of gains
METRICS = tuple(a.metric for a in AXES)


@dataclass
class NoiseModel:
    """Residual vectors (metric -> multiplicative residual) per concurrency, and where they came from."""
    residuals: dict[int, list[dict[str, float]]]
    campaigns: list[str]

    def legs(self) -> dict[str, int]:
        return {str(c): len(v) for c, v in sorted(self.residuals.items())}

    def at(self, c: int) -> tuple[int, list[dict[str, float]]]:
        """The residuals of concurrency ``c``, or of the nearest pooled concurrency (and which one)."""
        if c in self.residuals:
            return c, self.residuals[c]
        near = min(self.residuals, key=lambda k: (abs(math.log2(k) - math.log2(c)), k))
        return near, self.residuals[near]

    def describe(self) -> str:
        n = sum(len(v) for v in self.residuals.values())
        return (f"within-arm residuals of {n} legs (whole legs, per concurrency) from {len(self.campaigns)} "
                f"campaign(s)")


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
        for leg in legs:
            out.setdefault(c, []).append({m: 1.0 + (leg.metrics[m] / means[m] - 1.0) * inflate for m in METRICS})
    return out


def noise_model(evidences: Iterable[Evidence]) -> NoiseModel:
    pool: dict[int, list[dict[str, float]]] = {}
    used = []
    for ev in evidences:
        res = residuals_of(ev)
        if res:
            used.append(ev.campaign_id)
        for c, vecs in res.items():
            pool.setdefault(c, []).extend(vecs)
    return NoiseModel(pool, used)


def pool_for(ev: Evidence, others: Iterable[Evidence]) -> NoiseModel:
    """The noise model for ``ev``: its own legs, plus the complete binding campaigns of the same device (lever
    campaigns and A/A grids alike)."""
    same = [o for o in others if o.campaign_id != ev.campaign_id and o.status == "complete"
            and o.decision is not None and o.decision.binding
            and o.fingerprint.device_name == ev.fingerprint.device_name]
    return noise_model([ev] + sorted(same, key=lambda o: o.campaign_id))


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


def simulate(t: Evidence, noise: NoiseModel, rng: random.Random, gain: float = 0.0) -> Evidence:
    """One simulated campaign of ``t``'s shape: legs drawn from the noise model, the candidates ``gain`` better."""
    grid = settings(t).grid
    reps = int(grid.reps)
    legs, order = [], 0
    for c in grid.concurrency:
        _, pool = noise.at(int(c))
        for r in range(reps):
            for arm in t.arms:
                res = rng.choice(pool)
                metrics = {}
                for axis in AXES:
                    v = res[axis.metric]
                    metrics[axis.metric] = _gain(axis.name, v, gain) if arm.role == "candidate" else v
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
    out, seps = [], []
    for _ in range(sims):
        sim = simulate(t, noise, rng, gain)
        sim.stats = compute_stats(sim.legs, sim.baseline.name, [a.name for a in sim.candidates], p.primary_axes,
                                  with_effects=False)
        out.append(policy.decide(sim).verdict)
        seps.append(sum(policy.counts(s, p) for s in sim.stats))
    return out, seps


def flip_rate(t: Evidence, noise: NoiseModel, sims: int, seed: int, gain: float) -> float:
    v, _ = verdicts(t, noise, sims, seed, gain)
    return v.count("FLIP") / len(v)


def minimum_detectable(t: Evidence, noise: NoiseModel, sims: int, seed: int, power: float = 0.8) -> float | None:
    """The smallest gain FLIPped with probability >= ``power`` (bisection on the gain, to 0.25%)."""
    lo, hi = MDE_SEARCH
    if flip_rate(t, noise, sims, seed, hi) < power:
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
    power = {f"{g:.2f}": flip_rate(t, noise, sims, seed, g) for g in POWER_GAINS}
    stats_shape = len(t.candidates) * len(AXES) * len(settings(t).grid.concurrency)
    return Calibration(
        false_flip=null.count("FLIP") / sims, false_reject=null.count("REJECT-PERFORMANCE") / sims,
        power=power, mde_80=minimum_detectable(t, noise, sims, seed),
        separations_mean=round(statistics.fmean(seps), 3),
        separations_q95=seps_sorted[min(len(seps_sorted) - 1, math.ceil(0.95 * len(seps_sorted)) - 1)],
        comparisons=stats_shape, sims=sims, seed=seed,
        token_safe_as="byte-exact" if byte_exact else "near-tie ratified",
        noise=noise.describe() + _borrowed(t, noise), noise_campaigns=list(noise.campaigns),
        noise_legs=noise.legs())


def _borrowed(t: Evidence, noise: NoiseModel) -> str:
    notes = []
    for c in settings(t).grid.concurrency:
        near, _ = noise.at(int(c))
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
