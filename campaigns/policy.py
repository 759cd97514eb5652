"""The ``parity_enabler`` decision policy: the written rules that decide whether a lever's default flips.

Rules are tried in order and the first that fires is the verdict; its text is quoted verbatim in the Decision,
the record and the PR. Inputs are the evidence alone (gates, legs, statistics, calibration, fingerprint, config),
so a decision can be re-derived and audited from the evidence file.

Conventions the gates fill in (campaigns/gates/ writes them, the policy reads them):

- ``GateResult.byte_exact`` on the candidate's op results: the *measured* ON-vs-OFF bitwise comparison of each
  kernel's outputs. The lever is byte-exact when every such measurement says True (and at least one exists) and
  the battery saw no token differ (its equal greedy tokens alone prove no bitwise equality: BITWISE_GATES).
- ``near_tie`` passes when every divergence of the battery is a ratified tie; its ``counts['max_gap_mnats']``
  is re-checked here against the policy's ``near_tie_max_mnats``. A failed battery is excused (not a
  correctness failure) when the same arm's near_tie gate ratified it.
- ``mechanism`` on the candidate proves the lever's route ran; failed = inert lever = INVALID.
- Every gate the campaign lists must have run on every arm for a binding verdict; a gate the campaign or the lever
  declares inapplicable (``campaign.inapplicable: {gate: reason}``) is exempt, and the record quotes the reason.

A separation must also be large enough to count (``min_effect``, 1%): a point whose reps separate completely is
a WIN or LOSS only when its ratio is at least 1 + min_effect (at most 1 - min_effect). Five reps of a quiet engine
(TPOT's spread at c1 is 0.1%) separate any steady shift, and two servers of one engine differ by such shifts:
the A/A grids of 2026-12-01 put the second server 0.4-0.6% slower on TPOT at c1, and decode_wave_grid-65b2738
recorded a LOSS of x0.993 at c1, where both arms launch the same kernels. Smaller separations are listed in the
reasons, not counted.

What the rules' numbers mean (how often a lever that does nothing FLIPs, how large a gain FLIPs reliably) is
measured for each campaign's own grid shape by campaigns/calibrate.py and quoted beside the verdict.

An A/A campaign (``kind == "aa"``: two servers at the same value) is the grid's own self-check and has its own
rules (AA-PASS / AA-FAIL): it must not show more separations than its calibration expects by chance.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from campaigns.config import PolicyConfig, settings
from campaigns.gates import CORRECTNESS_GATES
from campaigns.evidence import Arm, AxisStat, Decision, Evidence, Fingerprint, GateResult, PooledEffect
from campaigns.gitops import code_dirt
from campaigns.stats import AXES, AXIS_BY_NAME, OPTIONAL_AXES, compute_stats, planned_legs, pooled_effects

RULES = {
    "INVALID": "1. INVALID — a self-check passed, the mechanism gate shows the lever inert, the baseline arm "
               "fails a gate, or a correctness fix's baseline passes the gate meant to prove the fix.",
    "REJECT-CORRECTNESS": "2. REJECT (correctness) — the candidate fails a correctness gate.",
    "NON-BINDING": "3. NON-BINDING — not CUDA, dirty tree, arms on different fingerprints, fewer than {min_reps} "
                   "reps, a void grid (a leg invalid or missing), a listed gate that did not run on every arm "
                   "(unless the campaign or the lever declares it inapplicable, with the reason), a rehearsal "
                   "grid, or no mechanism proof.",
    "FLIP": "4. FLIP — token-safe (measured byte-exact, or every divergence ratified by near_tie) and at least one "
            "WIN on {primary} and no LOSS on any axis; a separated point is a WIN or LOSS only when its ratio "
            "clears 1 ± {min_effect:.1%} (smaller steady shifts are within what two servers of one engine differ "
            "by). A non-byte-exact lever also needs its WINs to clear a minimum gain ({min_gain:.1%}). A grid of "
            "more than 4 concurrencies needs WINs at one concurrency per 4 of its points (rounded up), so its "
            "extra points do not add chances to flip by luck.",
    "FLIP-CORRECTNESS": "4. FLIP (correctness fix) — RED first: the gate(s) the campaign names as proving the fix "
                        "({fix_gates}) FAIL on the baseline and PASS on the candidate (a battery whose every "
                        "divergence near_tie ratifies counts as passing), and every other correctness gate passes "
                        "on the candidate.",
    "REJECT-PERFORMANCE": "5. REJECT (performance) — a LOSS on a primary axis (a ratio at most 1 - "
                          "{min_effect:.1%}) and no WIN (a declared traded axis decides neither way): recorded as "
                          "refuted so it is not retried. A grid of more than 4 concurrencies needs LOSSes at one "
                          "concurrency per 4 of its points (rounded up).",
    "KEEP": "6. KEEP — otherwise; the default stays. Neutral when the pooled effect's interval on every primary "
            "axis lies within ±{neutral_margin:.0%}, else underpowered: the grid could not tell.",
    "AA-PASS": "A/A PASS — the grid's self-check: two servers at the same value show no more separated points "
               "(WIN or LOSS, any axis, clearing 1 ± {min_effect:.1%}) than an A/A grid of this shape shows by "
               "chance in 95% of simulated campaigns.",
    "AA-FAIL": "A/A FAIL — more separated points than an A/A grid of this shape shows by chance in 95% of "
               "simulated campaigns: the grid invents effects, so verdicts measured on it are suspect.",
    "AA-NON-BINDING": "A/A NON-BINDING — the A/A grid is void or not calibrated, or ran where no verdict binds (not "
                      "CUDA, dirty tree, a rehearsal grid, fewer than {min_reps} reps).",
}
# Several candidates: the campaign's verdict is the first of this order among the candidates' verdicts.
# The gates whose byte_exact is a bitwise comparison of outputs (op: each kernel ON vs OFF). The battery's equal
# greedy tokens on a few prompts are weaker (logits may differ under equal argmaxes): they do not make a lever
# byte-exact, which would exempt its WINs from min_gain; its tokens differing still shows a lever is not.
BITWISE_GATES = ("op",)

COMBINE_ORDER = ("INVALID", "FLIP", "NON-BINDING", "KEEP", "REJECT-PERFORMANCE", "REJECT-CORRECTNESS")


def policy_params(ev: Evidence, override: dict[str, Any] | None = None) -> PolicyConfig:
    p = settings(ev).campaign.policy
    if not override:
        return p
    unknown = sorted(set(override) - set(asdict(PolicyConfig())))
    if unknown:
        raise ValueError(f"unknown policy parameter(s) {unknown}; accepted: {sorted(asdict(PolicyConfig()))}")
    return replace(p, **override)


def rule_text(key: str, p: PolicyConfig) -> str:
    primary = " or ".join(AXIS_BY_NAME[a].label for a in p.primary_axes)
    text = RULES[key].format(min_reps=p.min_reps, min_gain=p.min_gain, min_effect=p.min_effect, primary=primary,
                             fix_gates=", ".join(p.fix_gates) or "none named",
                             neutral_margin=p.neutral_margin)
    if p.traded_axes and key in ("FLIP", "KEEP"):
        text += (" This campaign declares " + ", ".join(_label(a) for a in p.traded_axes) + " traded by design, so "
                 "a LOSS there is reported and vetoes nothing: " + "; ".join(
                     f"{_label(a)}: {why.strip()}" for a, why in p.traded_axes.items()))
    return text


def conclude(ev: Evidence, override: dict[str, Any] | None = None, noise=None) -> Evidence:
    """Compute the statistics, effect sizes and (given a noise model, campaigns/calibrate.py) the grid's error
    rates from the legs, decide, and mark the evidence complete (in place; returned)."""
    p = policy_params(ev, override)
    ev.stats = compute_stats(ev.legs, ev.baseline.name, [a.name for a in ev.candidates], p.primary_axes,
                             also=p.traded_axes)
    ev.pooled = pooled_effects(ev.stats)
    if noise is not None and ev.stats:
        from campaigns.calibrate import calibrate
        ev.calibration = calibrate(ev, noise, byte_exact=_measured_byte_exact(ev) if ev.kind == "lever" else True)
    ev.decision = decide(ev, override)
    ev.status = "complete"
    return ev


def decide(ev: Evidence, override: dict[str, Any] | None = None) -> Decision:
    p = policy_params(ev, override)
    if ev.kind == "aa":
        return decide_aa(ev, p)
    per = {arm.name: _decide_candidate(ev, arm, p) for arm in ev.candidates}
    for verdict in COMBINE_ORDER:
        hits = [d for d in per.values() if d.verdict == verdict]
        if hits:
            # Among equal verdicts, the candidate with the best primary-axis ratio is the one to report.
            pick = max(hits, key=lambda d: (_best_primary_ratio(ev, d.candidate, p, counted_wins=verdict == "FLIP"),
                                            _best_primary_ratio(ev, d.candidate, p)))
            break
    pick.per_candidate = {name: d.verdict for name, d in per.items()}
    return pick


def _best_primary_ratio(ev: Evidence, cand: str | None, p: PolicyConfig, counted_wins: bool = False) -> float:
    """The candidate's best primary-axis median ratio; of FLIPs, its best WIN the rules counted (a NEUTRAL point's
    ratio, its bands overlapping, must not make a candidate the new default)."""
    ratios = [s.ratio for s in ev.stats if s.candidate == cand and s.axis in p.primary_axes and s.ratio is not None
              and (not counted_wins or (s.separation == "WIN" and counts(s, p)))]
    return max(ratios, default=0.0)


def _label(axis: str) -> str:
    return AXIS_BY_NAME[axis].label if axis in AXIS_BY_NAME else axis


def _ratio(s: AxisStat) -> str:
    return "n/a" if s.ratio is None else f"{s.ratio:.3f}"


def _fmt_stat(s: AxisStat) -> str:
    return f"{_label(s.axis)} at c{s.concurrency}: ratio {_ratio(s)}"


def fmt_effect(pe: PooledEffect) -> str:
    e = pe.effect
    return f"{_label(pe.axis)} ×{e.ratio:.3f} [{e.lo:.3f}, {e.hi:.3f}] pooled ({e.confidence:.0%})"


def headline(ev: Evidence, cand: str, p: PolicyConfig, verdict: str = "") -> str:
    """The figure a reader quotes: a FLIP's separated WIN, a refuted lever's worst LOSS, a KEEP's pooled effect
    with its interval (never a NEUTRAL point ratio, which reads like a gain)."""
    stats = [s for s in ev.stats if s.candidate == cand and s.axis in p.primary_axes and s.ratio is not None]
    if not stats:
        return "no grid figures"
    counted = [s for s in stats if s.separation in ("WIN", "LOSS") and counts(s, p)]
    if verdict == "KEEP" and {s.separation for s in counted} == {"WIN", "LOSS"}:
        # a mixed KEEP: its primary axes separated both ways, so no pooled interval summarises it (one straddling
        # 1 would read as "could not tell"); quote the worst LOSS and the best WIN the rules counted
        loss = min((s for s in counted if s.separation == "LOSS"), key=lambda s: s.ratio)
        win = max((s for s in counted if s.separation == "WIN"), key=lambda s: s.ratio)
        return "; ".join(f"{_label(s.axis)} ×{s.ratio:.3f} at c{s.concurrency} ({separation_label(s, p)})"
                         for s in (loss, win))
    if verdict in ("KEEP", "NON-BINDING", "AA-PASS", "AA-FAIL", "INVALID", "REJECT-CORRECTNESS"):
        pooled = _widest_pooled(ev, cand, p)
        if pooled is not None:
            return fmt_effect(pooled)
    worst = verdict == "REJECT-PERFORMANCE"
    wanted = "LOSS" if worst else "WIN"
    if any(s.separation == wanted and counts(s, p) for s in stats):
        # quote a separated figure the rules counted, not a neutral one
        stats = [s for s in stats if s.separation == wanted and counts(s, p)]
    best = (min if worst else max)(stats, key=lambda s: s.ratio)
    return f"{_label(best.axis)} ×{best.ratio:.3f} at c{best.concurrency} ({separation_label(best, p)})"


def fix_headline(ev: Evidence, cand: str, p: PolicyConfig, gates: list[str]) -> str:
    """A correctness fix's figure: the gates that went RED -> GREEN, then its speed as a pooled interval (a fix
    flips on correctness, so a point ratio, most often NEUTRAL, would read as the reason)."""
    head = "RED → GREEN on " + ", ".join(gates)
    pooled = _widest_pooled(ev, cand, p)
    return head + (f"; speed {fmt_effect(pooled)}" if pooled is not None else "")


def _widest_pooled(ev: Evidence, cand: str, p: PolicyConfig) -> PooledEffect | None:
    """The primary axis whose pooled interval reaches furthest from 1 (the one that decides neutral or not)."""
    mine = [pe for pe in ev.pooled if pe.candidate == cand and pe.axis in p.primary_axes]
    if not mine:
        return None
    return max(mine, key=lambda pe: max(pe.effect.hi - 1, 1 / pe.effect.lo - 1))


def effect_note(ev: Evidence, cand: str, p: PolicyConfig) -> str:
    """What a KEEP measured, from the pooled interval of the primary axis that reaches furthest from 1:
    'neutral' (every primary interval within ±neutral_margin), 'trade' (one primary interval above 1 and another
    below: "faster" on the one that reached furthest hid a loss on total tok/s), 'slower'/'faster' (the interval
    excludes 1),
    'mixed' (it straddles 1 while primary axes separated both ways: a KEEP can hold LOSSes beside WINs), else
    'underpowered' (the grid cannot tell); then the concurrencies where a primary axis separated, or that none
    did."""
    pe = _widest_pooled(ev, cand, p)
    if pe is None:
        return ""
    e, axes = pe.effect, " and ".join(map(_label, p.primary_axes))
    where = f"{_label(pe.axis)} ({e.confidence:.0%}, pooled over concurrencies)"
    seps = separated_points(ev, cand, p)
    if all(1 / (1 + p.neutral_margin) <= x.effect.lo and x.effect.hi <= 1 + p.neutral_margin
           for x in ev.pooled if x.candidate == cand and x.axis in p.primary_axes):
        z = max(e.hi - 1, 1 / e.lo - 1)
        return (f"neutral: the effect is within ±{z:.1%} on {axes} ({e.confidence:.0%}, pooled over "
                f"concurrencies)" + (f"; {seps}" if seps else ""))
    none = ", though no point separated" + (f" by the minimum effect {p.min_effect:.1%}" if p.min_effect else "")
    primary = [x for x in ev.pooled if x.candidate == cand and x.axis in p.primary_axes and x.effect is not None]
    up = [x for x in primary if x.effect.lo > 1]
    down = [x for x in primary if x.effect.hi < 1]
    if up and down:     # one primary axis gained and another lost: neither 'faster' nor 'slower' says it
        gain, cost = max(up, key=lambda x: x.effect.lo), min(down, key=lambda x: x.effect.hi)
        return (f"trade: the candidate gains {gain.effect.lo - 1:.1%} to {gain.effect.hi - 1:.1%} on "
                f"{_label(gain.axis)} and costs {1 - cost.effect.hi:.1%} to {1 - cost.effect.lo:.1%} on "
                f"{_label(cost.axis)} ({e.confidence:.0%}, pooled over concurrencies)" + (f"; {seps}" if seps else ""))
    if e.hi < 1:
        return (f"slower: the candidate costs {1 - e.hi:.1%} to {1 - e.lo:.1%} on {where}"
                + (f"; {seps}" if seps else none))
    if e.lo > 1:
        why = ("the LOSSes keep the rule from flipping it" if "LOSS" in seps else "too few for the rule to flip it")
        return (f"faster: the candidate gains {e.lo - 1:.1%} to {e.hi - 1:.1%} on {where}"
                + (f"; {seps}: {why}" if seps else none + ", so the rule does not flip it"))
    if seps.startswith("mixed: "):      # separated both ways: decided points, not a grid that could not tell
        return (f"{seps}: the effect changes direction across the grid, so no pooled interval summarises it "
                f"({_label(pe.axis)}'s, pooled over concurrencies, spans {e.lo - 1:+.1%} to {e.hi - 1:+.1%})")
    return (f"underpowered: the effect could be anywhere from {e.lo - 1:+.1%} to {e.hi - 1:+.1%} on {where}; "
            f"the grid cannot call it neutral within ±{p.neutral_margin:.0%}" + (f"; {seps}" if seps else ""))


def separated_points(ev: Evidence, cand: str, p: PolicyConfig) -> str:
    """The concurrencies at which a primary axis separated by at least the minimum effect, by direction:
    'mixed: LOSSes at c1, c2 and a WIN at c32', 'LOSSes at c1, c2', or '' when none did."""
    stats = [s for s in ev.stats if s.candidate == cand and s.axis in p.primary_axes and counts(s, p)]
    both = {s.concurrency for s in stats if s.separation == "LOSS"} & {s.concurrency for s in stats
                                                                        if s.separation == "WIN"}
    parts = []
    for sep in ("LOSS", "WIN"):
        mine = sorted({(s.concurrency, s.axis) for s in stats if s.separation == sep})
        # a concurrency that separated both ways (one primary axis each) names its axis
        points = list(dict.fromkeys(f"c{c} ({_label(a)})" if c in both else f"c{c}" for c, a in mine))
        if points:
            many = {"LOSS": "LOSSes", "WIN": "WINs"}[sep]
            parts.append(f"{'a ' + sep if len(points) == 1 else many} at " + ", ".join(points))
    if not parts:
        return ""
    return ("mixed: " if len(parts) == 2 else "") + " and ".join(parts)


def _measured_byte_exact(ev: Evidence, cand: str | None = None) -> bool | None:
    """True where every bitwise comparison (BITWISE_GATES) of the candidate says equal and no gate saw its outputs
    differ (the battery's tokens differing is proof enough against); None where nothing bitwise was measured."""
    cands = [cand] if cand else [a.name for a in ev.candidates]
    measured = [g for g in ev.gates if g.arm in cands and g.byte_exact is not None and not g.skipped]
    if any(g.byte_exact is False for g in measured):
        return False
    bitwise = [g.byte_exact for g in measured if g.gate in BITWISE_GATES]
    return all(bitwise) if bitwise else None


@dataclass
class Facts:
    """What the rules read about one candidate, computed once: its gates, its token safety, and the notes every
    verdict carries (divergences near_tie ratified; a correctness fix's RED -> GREEN)."""
    ev: Evidence
    cand: Arm
    p: PolicyConfig
    base: str
    run: list[GateResult]                   # the gate results that ran (not skipped)
    byte_exact: bool | None                 # measured candidate-vs-baseline bitwise equality
    near_ran: bool
    max_gap: float | None
    gap_ok: bool
    near_ok: bool                           # near_tie ran, passed, and its largest gap is within the policy's
    fix: set[str]                           # a correctness fix's gates (RED on the baseline, GREEN on the fix)
    points_needed: int = 1                  # concurrencies a FLIP needs WINs at (a REJECT LOSSes at)
    notes: list[str] = field(default_factory=list)

    @property
    def token_safe(self) -> bool:
        return self.byte_exact is True or self.near_ok

    def gate(self, name: str, arm: str) -> GateResult | None:
        return self.ev.gate(name, arm)

    @property
    def stats(self) -> list[AxisStat]:
        return [s for s in self.ev.stats if s.candidate == self.cand.name]

    def wins(self, primary_only: bool = True) -> list[AxisStat]:
        """The counted WINs; never on an axis the campaign declares traded (reported, never deciding: a traded
        axis's WIN once kept a REJECT from a candidate that lost on every primary axis at every concurrency)."""
        return [s for s in self.stats if s.separation == "WIN" and counts(s, self.p)
                and s.axis not in self.p.traded_axes and (s.axis in self.p.primary_axes or not primary_only)]

    def losses(self, primary_only: bool = False) -> list[AxisStat]:
        """The LOSSes that veto a FLIP: every counted LOSS but those on an axis the campaign declares traded."""
        return [s for s in self.stats if s.separation == "LOSS" and counts(s, self.p)
                and s.axis not in self.p.traded_axes and (s.axis in self.p.primary_axes or not primary_only)]

    def traded_losses(self) -> list[str]:
        """The reasons' lines for LOSSes on traded axes: shown, never a veto."""
        return [f"traded LOSS on {_fmt_stat(s)} (declared traded: not a veto)" for s in self.stats
                if s.separation == "LOSS" and counts(s, self.p) and s.axis in self.p.traded_axes]


def counts(s: AxisStat, p: PolicyConfig) -> bool:
    """A separated point counts as a WIN or LOSS when its ratio clears 1 ± min_effect (NEUTRAL points never do)."""
    if s.separation == "NEUTRAL" or s.ratio is None:
        return False
    return s.ratio >= 1 + p.min_effect if s.separation == "WIN" else s.ratio <= 1 - p.min_effect


def separation_label(s: AxisStat, p: PolicyConfig) -> str:
    """The point's separation as the rules read it: "small LOSS" for one that separated below min_effect."""
    return s.separation if s.separation == "NEUTRAL" or counts(s, p) else f"small {s.separation}"


def small_separations(stats: list[AxisStat], p: PolicyConfig) -> list[str]:
    """The reasons' line for points that separated below min_effect (listed, not counted)."""
    small = [s for s in stats if s.separation != "NEUTRAL" and not counts(s, p)]
    if not small:
        return []
    listed = "; ".join(f"{_label(s.axis)} at c{s.concurrency} {s.separation} ×{_ratio(s)}" for s in small)
    return [f"separated below the minimum effect {p.min_effect:.1%}, not counted: {listed}"]


def facts(ev: Evidence, cand: Arm, p: PolicyConfig) -> Facts:
    base = ev.baseline.name
    near = ev.gate("near_tie", cand.name)
    near_ran = near is not None and not near.skipped
    max_gap = near.counts.get("max_gap_mnats") if near_ran else None
    gap_ok = max_gap is None or max_gap <= p.near_tie_max_mnats
    f = Facts(ev=ev, cand=cand, p=p, base=base, run=[g for g in ev.gates if not g.skipped],
              byte_exact=_measured_byte_exact(ev, cand.name), near_ran=near_ran, max_gap=max_gap, gap_ok=gap_ok,
              near_ok=near_ran and near.passed and gap_ok,
              fix=set(p.fix_gates) if p.flip_on_correctness else set(),
              points_needed=points_needed(ev, p))
    for arm, ok, gap in ((base, ratified(ev, base, p), None), (cand.name, f.near_ok, max_gap)):
        bat = ev.gate("battery", arm)
        if bat is not None and not bat.skipped and not bat.passed and ok and "battery" not in f.fix:
            gap = ev.gate("near_tie", arm).counts.get("max_gap_mnats") if gap is None else gap
            who = f"the baseline arm {arm}" if arm == base else f"arm {arm}"
            f.notes.append(f"battery divergences on {who} all ratified by near_tie "
                           f"(max gap {gap} mnats <= {p.near_tie_max_mnats:g})")
    for name in sorted(f.fix):
        b, c = ev.gate(name, base), ev.gate(name, cand.name)
        if b is not None and not b.skipped and not b.passed:
            if c is not None and c.passed:
                after = f" → GREEN on {cand.name} ({_counts(c)})"
            elif c is not None and name == "battery" and f.near_ok:
                after = f" → near-ties only on {cand.name} ({_counts(c)}), all ratified by near_tie"
            else:
                after = ""
            f.notes.append(f"{name}: RED on {base} ({_counts(b)}){after}")
    fp = ev.fingerprint
    if fp.dirty and measured_dirt(fp) is None:
        f.notes.append("changed files under run output paths only, not counted as a dirty tree: "
                       + ", ".join(fp.dirty_files))
    return f


POINTS_PER_WIN = 4


def points_needed(ev: Evidence, p: PolicyConfig) -> int:
    """Concurrencies at which a FLIP needs WINs (a REJECT-PERFORMANCE LOSSes): the policy's min_win_points, or one
    per POINTS_PER_WIN of the grid's concurrencies, rounded up. Each added point is another chance of a separation
    by luck (an 8-point grid at one WIN: 5.8% false FLIPs on the H200 noise, 3.0% at 4 points)."""
    if p.min_win_points > 0:
        return p.min_win_points
    return max(1, -(-len(settings(ev).grid.concurrency) // POINTS_PER_WIN))


def _points(stats: list[AxisStat]) -> int:
    return len({s.concurrency for s in stats})


def ratified(ev: Evidence, arm: str, p: PolicyConfig) -> bool:
    """Whether the arm's battery divergences are near-ties by the policy's threshold: near_tie passed and its
    largest gap is within ``near_tie_max_mnats`` (the gate's own threshold may be looser)."""
    near = ev.gate("near_tie", arm)
    return (near is not None and not near.skipped and near.passed
            and (near.counts.get("max_gap_mnats") or 0) <= p.near_tie_max_mnats)


# Each rule reads the facts and returns its reasons when it fires (with the Decision fields it sets), else None.
Fired = tuple[list[str], dict[str, Any]] | None


def rule_invalid(f: Facts) -> Fired:
    """1. A gate that cannot fail, an inert lever, a failing baseline, a fix that nothing shows broken."""
    why = []
    for name in sorted({g.gate for g in f.run}):
        results = [g for g in f.run if g.gate == name]
        broken = [g for g in results if g.self_check is False]
        if broken:
            why.append(f"the self-check of gate {name} passed on arm {broken[0].arm}: its deliberate fault "
                       "went undetected, so the gate cannot fail")
        elif not any(g.self_check for g in results):
            why.append(f"gate {name} ran without its self-check, so it is not shown able to fail")
        elif any(g.self_check is None for g in results):    # each arm's run of a gate needs its own proof
            arms = ", ".join(g.arm for g in results if g.self_check is None)
            why.append(f"gate {name} ran without its self-check on arm {arms}, so it is not shown able to fail there")
    mech = f.gate("mechanism", f.cand.name)
    if mech is not None and not mech.skipped and not mech.passed:
        detail = mech.reason or mech.details.get("why", "")
        why.append(f"the mechanism gate shows the lever inert on arm {f.cand.name}" + (f": {detail}" if detail else ""))
    for g in f.run:
        if g.arm != f.base or g.passed or g.gate in f.fix:
            continue
        if g.gate == "battery" and ratified(f.ev, f.base, f.p):
            continue                        # bf16 near-ties of the baseline itself, ratified: a note, not a failure
        why.append(f"the baseline arm {f.base} fails gate {g.gate}" + (f": {g.reason}" if g.reason else ""))
    for name in sorted(f.fix):
        b = f.gate(name, f.base)
        if b is None or b.skipped:
            why.append(f"correctness fix: gate {name} did not run on the baseline {f.base}, so nothing shows the bug "
                       "it fixes")
        elif b.passed or (name == "battery" and ratified(f.ev, f.base, f.p)):
            excused = "" if b.passed else ", every divergence ratified by near_tie, which counts as passing"
            why.append(f"correctness fix: the baseline {f.base} passes {name} ({_counts(b)}{excused}), so the "
                       "gate cannot prove the fix (RED first: it must fail before the fix)")
    return (why, {}) if why else None


def rule_reject_correctness(f: Facts) -> Fired:
    """2. The candidate fails a correctness gate (a battery ratified by near_tie is not a failure)."""
    why = []
    for g in f.run:
        if g.arm != f.cand.name or g.gate not in CORRECTNESS_GATES:
            continue
        if g.gate == "near_tie" and g.passed and not f.gap_ok:
            why.append(f"near_tie on arm {f.cand.name}: max gap {f.max_gap} mnats exceeds the policy's "
                       f"{f.p.near_tie_max_mnats:g} mnats")
        elif not g.passed and not (g.gate == "battery" and f.near_ok):
            why.append(f"{g.gate} fails on arm {f.cand.name}" + (f": {g.reason}" if g.reason else "")
                       + (f" ({_counts(g)})" if g.counts else ""))
    return (why, {}) if why else None


def rule_non_binding(f: Facts) -> Fired:
    """3. Nothing measured here may bind (host, tree, fingerprints, reps, void grid, gates that did not run; a
    correctness fix's gate that did not run on the candidate shows no fix, and no failure either)."""
    why = _non_binding(f.ev, f.base, f.cand.name, f.p)
    why += [f"correctness fix: gate {n} did not run on the candidate {f.cand.name}, so nothing shows the fix"
            for n in sorted(f.fix) if f.gate(n, f.cand.name) is None or f.gate(n, f.cand.name).skipped]
    return (why, {"binding": False}) if why else None


def rule_flip_correctness(f: Facts) -> Fired:
    """4. A correctness fix that got here (RED on the baseline, GREEN on the candidate) flips."""
    if not f.fix:
        return None
    return ([f"note: LOSS on {_fmt_stat(s)}" for s in f.losses()] + f.traded_losses(),
            {"binding": True, "new_default": f.cand.value})


def rule_flip(f: Facts) -> Fired:
    """4. Token-safe, a (large enough) WIN on a primary axis, no LOSS anywhere."""
    wins = f.wins()
    qualifying = wins if f.byte_exact else [s for s in wins if s.ratio is not None and s.ratio >= 1 + f.p.min_gain]
    if not (f.token_safe and qualifying and _points(qualifying) >= f.points_needed and not f.losses()):
        return None
    why = [f"token-safe: {'measured byte-exact' if f.byte_exact else 'every divergence ratified by near_tie'}"]
    return (why + [f"WIN on {_fmt_stat(s)}" for s in qualifying] + f.traded_losses(),
            {"binding": True, "new_default": f.cand.value})


def rule_reject_performance(f: Facts) -> Fired:
    """5. A LOSS on a primary axis and no WIN anywhere (traded axes aside): refuted."""
    primary_losses = f.losses(primary_only=True)
    if not primary_losses or _points(primary_losses) < f.points_needed or f.wins(primary_only=False):
        return None
    return [f"LOSS on {_fmt_stat(s)}" for s in primary_losses], {"binding": True}


def rule_keep(f: Facts) -> Fired:
    """6. Otherwise, saying why it did not flip."""
    why = []
    if not f.token_safe:
        why.append("not token-safe: " + ("not measured byte-exact" if f.byte_exact is None else "not byte-exact")
                   + (" and near_tie did not ratify the divergences" if f.near_ran else " and near_tie did not run"))
    wins = f.wins()
    qualifying = wins if f.byte_exact else [s for s in wins if s.ratio is not None and s.ratio >= 1 + f.p.min_gain]
    if not wins:
        why.append("no WIN on a primary axis (" + ", ".join(f.p.primary_axes) + ")")
    elif not qualifying:
        why.append(f"WINs below the minimum gain {f.p.min_gain:.1%} for a non-byte-exact lever: "
                   + "; ".join(_fmt_stat(s) for s in wins))
    elif _points(qualifying) < f.points_needed:
        why.append(f"WINs at {_points(qualifying)} concurrency, fewer than the {f.points_needed} this grid's "
                   f"{len(settings(f.ev).grid.concurrency)} points need: " + "; ".join(_fmt_stat(s) for s in wins))
    return why + [f"LOSS on {_fmt_stat(s)}" for s in f.losses()] + f.traded_losses(), {"binding": True}


# The written rules, tried in order; the first that fires is the verdict (its text: RULES[key]).
RULE_ORDER = (("INVALID", rule_invalid), ("REJECT-CORRECTNESS", rule_reject_correctness),
              ("NON-BINDING", rule_non_binding), ("FLIP-CORRECTNESS", rule_flip_correctness),
              ("FLIP", rule_flip), ("REJECT-PERFORMANCE", rule_reject_performance), ("KEEP", rule_keep))


def _decide_candidate(ev: Evidence, cand: Arm, p: PolicyConfig) -> Decision:
    f = facts(ev, cand, p)
    for key, rule in RULE_ORDER:
        fired = rule(f)
        if fired is None:
            continue
        why, fields = fired
        verdict = "FLIP" if key == "FLIP-CORRECTNESS" else key
        # a fix's RED -> GREEN leads its reasons; the ratification notes follow every verdict's own
        red_green = [n for n in f.notes if ": RED on " in n]
        notes = [n for n in f.notes if n not in red_green] + small_separations(f.stats, p)
        lead = red_green if key in ("NON-BINDING", "FLIP-CORRECTNESS") else []
        return Decision(verdict=verdict, rule=rule_text(key, p), reasons=lead + why + notes, candidate=cand.name,
                        byte_exact=f.byte_exact, token_safe=f.token_safe,
                        headline=(fix_headline(ev, cand.name, p, sorted(f.fix)) if key == "FLIP-CORRECTNESS"
                                  else headline(ev, cand.name, p, verdict)),
                        effect_note=effect_note(ev, cand.name, p) if verdict == "KEEP" else "", **fields)
    raise AssertionError("rule_keep always fires")


def _counts(g: GateResult) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(g.counts.items())) or ("pass" if g.passed else "fail")


def inapplicable(ev: Evidence) -> dict[str, str]:
    """Gates the campaign (or its lever) declares inapplicable, with the reason: exempt from 'every listed gate
    ran'."""
    return dict(settings(ev).campaign.inapplicable)


def measured_dirt(fp: Fingerprint) -> list[str] | None:
    """The changed files that make the tree dirty, read again at decision time: a file under a run output path
    (records/, bench/results/, ...) is output, not code, even where an older runner listed it. None: clean. An
    older fingerprint that says dirty without listing files stays dirty."""
    if not fp.dirty:
        return None
    if not fp.dirty_files:
        return []
    return code_dirt(fp.dirty_files) or None


def _measured(v: Any) -> bool:
    """A leg's metric as the rules can read it: a finite number above zero (a throughput or a latency)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _binding_conditions(ev: Evidence, arms: tuple[str, ...], p: PolicyConfig) -> list[str]:
    """Reasons no verdict on these arms can bind: host, tree, fingerprints, reps, void grid."""
    fp = ev.fingerprint
    out = []
    if fp.device_type != "cuda":
        out.append(f"device {fp.device_type} ({fp.device_name}) is not CUDA")
    dirt = measured_dirt(fp)
    if dirt is not None:
        files = ", ".join(dirt[:5]) + (" ..." if len(dirt) > 5 else "")
        out.append("the git tree was dirty" + (f" ({files})" if files else ""))
    arm_fps = {a: h for a, h in ev.arm_fingerprints.items() if a in arms}
    if len(set(arm_fps.values())) > 1:
        out.append(f"arms ran on different fingerprints: {arm_fps}")
    grid = settings(ev).grid
    if not grid.binding:
        out.append(f"grid {grid.name!r} is a rehearsal grid (binding: false)")
    reps = int(grid.reps)
    if reps < p.min_reps:
        out.append(f"{reps} reps per point, fewer than {p.min_reps}")
    planned = planned_legs(grid.concurrency, reps, list(arms))
    done = {leg.key for leg in ev.legs if leg.arm in arms}
    missing = sorted(planned - done)
    if missing:
        c, r, a = missing[0]
        out.append(f"void grid: {len(missing)} planned leg(s) missing (first: c{c} rep {r} arm {a})")
    # the standard axes always; an optional one where the grid measured it (calibration leaves out, and says so,
    # an optional axis no pooled leg measured: its simulated legs carry none)
    carried = {k for leg in ev.legs if leg.arm in arms for k in leg.metrics}
    read = AXES + tuple(a for a in OPTIONAL_AXES
                        if a.name in set(p.primary_axes) | set(p.traded_axes) and a.metric in carried)
    unread = [(leg, a) for leg in ev.legs if leg.arm in arms and leg.valid for a in read
              if not _measured(leg.metrics.get(a.metric))]
    if unread:      # dropped from the statistics, it would leave a point fewer reps (or none to veto with)
        leg, a = unread[0]
        out.append(f"void grid: {len(unread)} value(s) missing or not a finite positive number in valid legs "
                   f"(first: {a.metric} = {leg.metrics.get(a.metric)!r} at c{leg.concurrency} rep {leg.rep} arm "
                   f"{leg.arm})")
    bad = [leg for leg in ev.legs if leg.arm in arms and not leg.valid]
    if bad:
        leg = bad[0]
        out.append(f"void grid: {len(bad)} invalid leg(s) (first: c{leg.concurrency} rep {leg.rep} arm {leg.arm}: "
                   + "; ".join(leg.reasons) + ")")
    by_point: dict[tuple[int, int], set[str]] = {}
    for leg in ev.legs:
        if leg.arm in arms:
            by_point.setdefault((leg.concurrency, leg.rep), set()).add(leg.prompts_sha256)
    unlike = sorted(k for k, shas in by_point.items() if len(shas) > 1)
    if unlike:
        out.append(f"void grid: the arms served different prompts at {len(unlike)} point(s) "
                   f"(first: c{unlike[0][0]} rep {unlike[0][1]})")
    return out


def _non_binding(ev: Evidence, base: str, cand: str, p: PolicyConfig) -> list[str]:
    out = _binding_conditions(ev, (base, cand), p)
    exempt = inapplicable(ev)
    mech = ev.gate("mechanism", cand)
    if mech is None:
        out.append("no mechanism proof: the mechanism gate has no result for the candidate")
    elif mech.skipped and "mechanism" not in exempt:
        out.append(f"no mechanism proof: the mechanism gate was skipped ({mech.reason or 'no reason given'})")
    wanted = settings(ev).campaign.gates
    absent, skipped = [], []
    for g in wanted:
        if g in exempt:
            continue
        for a in (base, cand):
            r = ev.gate(g, a)
            if r is None:
                absent.append(f"{g}@{a}")
            elif r.skipped and not (g == "mechanism" and a == cand):
                skipped.append(f"{g}@{a} ({r.reason or 'no reason given'})")
    if absent:
        out.append(f"gate(s) without a result: {', '.join(absent)}")
    if skipped:
        out.append(f"listed gate(s) that did not run, so the verdict does not rest on them: {'; '.join(skipped)}")
    return out


# ----------------------------------------------------------------------------------------------- A/A


def aa_separations(ev: Evidence, p: PolicyConfig) -> list[AxisStat]:
    """The separated points the lever rule would count (those clearing min_effect)."""
    return [s for s in ev.stats if counts(s, p)]


def decide_aa(ev: Evidence, p: PolicyConfig) -> Decision:
    """The grid's self-check: separations seen against those an A/A grid of this shape shows by chance."""
    a, b = ev.baseline.name, (ev.candidates[0].name if ev.candidates else "?")
    cal = ev.calibration
    seen = aa_separations(ev, p)
    conditions = _binding_conditions(ev, (a, b), p)
    void = [r for r in conditions if r.startswith("void grid")]
    bias = [f"server-instance bias (above 1 favours {b}): {fmt_effect(pe)}" for pe in ev.pooled if pe.primary]
    listed = "; ".join(f"{_label(s.axis)} at c{s.concurrency} {s.separation} ×{_ratio(s)}" for s in seen)
    observed = f"{len(seen)} separated point(s)" + (f" ({listed})" if seen else "")

    def decision(key: str, why: list[str], binding: bool) -> Decision:
        verdict = "NON-BINDING" if key == "AA-NON-BINDING" else key
        head = f"{len(seen)} separations" + (f", chance ≤ {cal.separations_q95} (95%)" if cal else "")
        return Decision(verdict=verdict, rule=rule_text(key, p), reasons=why, candidate=b, binding=binding,
                        byte_exact=None, token_safe=False, headline=head)

    if void or cal is None or not ev.stats:
        why = void + ([] if cal is not None else ["no calibration: no noise model to say what chance shows"])
        return decision("AA-NON-BINDING", why or ["no grid statistics"], False)
    expect = (f"an A/A grid of this shape shows {cal.separations_mean:.2f} on average and at most "
              f"{cal.separations_q95} in 95% of {cal.sims} simulated campaigns")
    as_lever = _decide_candidate_grid_only(ev, p)
    why = ([f"{observed}; {expect}", f"as a lever campaign the rule would say {as_lever}"] + bias
           + small_separations(ev.stats, p))
    key = "AA-PASS" if len(seen) <= cal.separations_q95 else "AA-FAIL"
    if conditions:      # the rule text: not CUDA, a dirty tree, a rehearsal grid, too few reps bind nothing
        return decision("AA-NON-BINDING", why + [f"on a binding grid this would be {key}"]
                        + [f"non-binding: {r}" for r in conditions], False)
    return decision(key, why, True)


def _decide_candidate_grid_only(ev: Evidence, p: PolicyConfig) -> str:
    """What the lever rule's grid half would conclude on these legs (A/A: it should be KEEP)."""
    cand = ev.candidates[0].name
    stats = [s for s in ev.stats if s.candidate == cand]
    wins = [s for s in stats if s.axis in p.primary_axes and s.separation == "WIN" and counts(s, p)]
    losses = [s for s in stats if s.separation == "LOSS" and counts(s, p) and s.axis not in p.traded_axes]
    need = points_needed(ev, p)
    if wins and _points(wins) >= need and not losses:
        return "FLIP (a false FLIP)"
    primary_losses = [s for s in losses if s.axis in p.primary_axes]
    if (primary_losses and _points(primary_losses) >= need
            and not [s for s in stats if s.separation == "WIN" and counts(s, p)]):
        return "REJECT-PERFORMANCE (a false REJECT)"
    return "KEEP"
