"""The ``parity_enabler`` decision policy: the written rules that decide whether a lever's default flips.

Rules are tried in order and the first that fires is the verdict; its text is quoted verbatim in the Decision,
the record and the PR. Inputs are the evidence alone (gates, legs, statistics, fingerprint, config), so a decision
can be re-derived and audited from the evidence file.

Conventions the gates fill in (campaigns/gates/ writes them, the policy reads them):

- ``GateResult.byte_exact`` on the candidate's op and battery results: the *measured* ON-vs-OFF bitwise
  comparison. The lever is byte-exact when every such measurement says True (and at least one exists).
- ``near_tie`` passes when every divergence of the battery is a ratified tie; its ``counts['max_gap_mnats']``
  is re-checked here against the policy's ``near_tie_max_mnats``. A failed battery is excused (not a
  correctness failure) when the same arm's near_tie gate ratified it.
- ``mechanism`` on the candidate proves the lever's route ran; failed = inert lever = INVALID; skipped or absent =
  no proof = NON-BINDING.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from campaigns.config import CORRECTNESS_GATES, PolicyConfig
from campaigns.evidence import Arm, AxisStat, Decision, Evidence, GateResult
from campaigns.stats import AXIS_BY_NAME, compute_stats, planned_legs

RULES = {
    "INVALID": "1. INVALID — a self-check passed, the mechanism gate shows the lever inert, or the baseline arm "
               "fails a gate.",
    "REJECT-CORRECTNESS": "2. REJECT (correctness) — the candidate fails a correctness gate.",
    "NON-BINDING": "3. NON-BINDING — not CUDA, dirty tree, arms on different fingerprints, fewer than {min_reps} "
                   "reps, a void grid (a leg invalid or missing, a gate without a result), a rehearsal grid, or no "
                   "mechanism proof.",
    "FLIP": "4. FLIP — token-safe (measured byte-exact, or every divergence ratified by near_tie) and at least one "
            "WIN on {primary} and no LOSS on any axis. A non-byte-exact lever also needs its WINs to clear a "
            "minimum gain ({min_gain:.1%}).",
    "FLIP-CORRECTNESS": "4. FLIP (correctness fix) — a correctness fix may flip on correctness alone when its "
                        "campaign says so (flip_on_correctness: true).",
    "REJECT-PERFORMANCE": "5. REJECT (performance) — a LOSS on a primary axis and no WIN: recorded as refuted so "
                          "it is not retried.",
    "KEEP": "6. KEEP — otherwise (measured neutral); the default stays.",
}
# Several candidates: the campaign's verdict is the first of this order among the candidates' verdicts.
COMBINE_ORDER = ("INVALID", "FLIP", "NON-BINDING", "KEEP", "REJECT-PERFORMANCE", "REJECT-CORRECTNESS")


def policy_params(ev: Evidence, override: dict[str, Any] | None = None) -> PolicyConfig:
    raw = dict(ev.config.get("campaign", {}).get("policy", {}) or {})
    raw.update(override or {})
    known = set(asdict(PolicyConfig()))
    return PolicyConfig(**{k: v for k, v in raw.items() if k in known})


def rule_text(key: str, p: PolicyConfig) -> str:
    primary = " or ".join(AXIS_BY_NAME[a].label for a in p.primary_axes)
    return RULES[key].format(min_reps=p.min_reps, min_gain=p.min_gain, primary=primary)


def conclude(ev: Evidence, override: dict[str, Any] | None = None) -> Evidence:
    """Compute the statistics from the legs, decide, and mark the evidence complete (in place; returned)."""
    p = policy_params(ev, override)
    ev.stats = compute_stats(ev.legs, ev.baseline.name, [a.name for a in ev.candidates], p.primary_axes)
    ev.decision = decide(ev, override)
    ev.status = "complete"
    return ev


def decide(ev: Evidence, override: dict[str, Any] | None = None) -> Decision:
    p = policy_params(ev, override)
    per = {arm.name: _decide_candidate(ev, arm, p) for arm in ev.candidates}
    for verdict in COMBINE_ORDER:
        hits = [d for d in per.values() if d.verdict == verdict]
        if hits:
            # Among equal verdicts, the candidate with the best primary-axis ratio is the one to report.
            pick = max(hits, key=lambda d: _best_primary_ratio(ev, d.candidate, p))
            break
    pick.per_candidate = {name: d.verdict for name, d in per.items()}
    return pick


def _best_primary_ratio(ev: Evidence, cand: str | None, p: PolicyConfig) -> float:
    ratios = [s.ratio for s in ev.stats if s.candidate == cand and s.axis in p.primary_axes and s.ratio is not None]
    return max(ratios, default=0.0)


def _fmt_stat(s: AxisStat) -> str:
    ratio = "n/a" if s.ratio is None else f"{s.ratio:.3f}"
    return f"{AXIS_BY_NAME[s.axis].label if s.axis in AXIS_BY_NAME else s.axis} at c{s.concurrency}: ratio {ratio}"


def headline(ev: Evidence, cand: str, p: PolicyConfig, worst: bool = False) -> str:
    """The figure a reader quotes: the candidate's best primary-axis ratio (its worst, for a refuted lever)."""
    stats = [s for s in ev.stats if s.candidate == cand and s.axis in p.primary_axes and s.ratio is not None]
    if not stats:
        return "no grid figures"
    if not worst and any(s.separation == "WIN" for s in stats):
        stats = [s for s in stats if s.separation == "WIN"]      # quote a separated figure, not a neutral one
    best = (min if worst else max)(stats, key=lambda s: s.ratio)
    label = AXIS_BY_NAME[best.axis].label if best.axis in AXIS_BY_NAME else best.axis
    return f"{label} ×{best.ratio:.3f} at c{best.concurrency} ({best.separation})"


def _decide_candidate(ev: Evidence, cand: Arm, p: PolicyConfig) -> Decision:
    base = ev.baseline.name
    reasons: list[str] = []
    run = [g for g in ev.gates if not g.skipped]

    def gate(name: str, arm: str) -> GateResult | None:
        return ev.gate(name, arm)

    def verdict(key: str, why: list[str], **kw) -> Decision:
        return Decision(verdict="FLIP" if key == "FLIP-CORRECTNESS" else key, rule=rule_text(key, p),
                        reasons=why + reasons, candidate=cand.name, byte_exact=byte_exact, token_safe=token_safe,
                        headline=headline(ev, cand.name, p, worst=key == "REJECT-PERFORMANCE"), **kw)

    # Measured byte-exactness and token safety (reported whatever the verdict).
    measured = [g.byte_exact for g in ev.gates if g.arm == cand.name and g.byte_exact is not None and not g.skipped]
    byte_exact = all(measured) if measured else None
    near = gate("near_tie", cand.name)
    near_ran = near is not None and not near.skipped
    max_gap = near.counts.get("max_gap_mnats") if near_ran else None
    gap_ok = max_gap is None or max_gap <= p.near_tie_max_mnats
    near_ok = near_ran and near.passed and gap_ok
    token_safe = byte_exact is True or near_ok

    # 1. INVALID
    invalid = []
    for name in sorted({g.gate for g in run}):
        results = [g for g in run if g.gate == name]
        broken = [g for g in results if g.self_check is False]
        if broken:
            invalid.append(f"the self-check of gate {name} passed on arm {broken[0].arm}: its deliberate fault "
                           "went undetected, so the gate cannot fail")
        elif not any(g.self_check for g in results):
            invalid.append(f"gate {name} ran without its self-check, so it is not shown able to fail")
    mech = gate("mechanism", cand.name)
    if mech is not None and not mech.skipped and not mech.passed:
        invalid.append(f"the mechanism gate shows the lever inert on arm {cand.name}"
                       + (f": {mech.reason}" if mech.reason else ""))
    base_near = gate("near_tie", base)
    base_ratified = (base_near is not None and not base_near.skipped and base_near.passed
                     and (base_near.counts.get("max_gap_mnats") or 0) <= p.near_tie_max_mnats)
    for g in run:
        if g.arm == base and not g.passed:
            if g.gate == "battery" and base_ratified:
                reasons.append(f"battery divergences on the baseline arm {base} all ratified by near_tie (max gap "
                               f"{base_near.counts.get('max_gap_mnats')} mnats <= {p.near_tie_max_mnats:g})")
                continue
            if p.flip_on_correctness and g.gate in CORRECTNESS_GATES:
                reasons.append(f"baseline arm {base} fails {g.gate} (the bug this correctness fix addresses)")
            else:
                invalid.append(f"the baseline arm {base} fails gate {g.gate}" + (f": {g.reason}" if g.reason else ""))
    if invalid:
        return verdict("INVALID", invalid)

    # 2. REJECT (correctness)
    failures = []
    for g in run:
        if g.arm != cand.name or g.gate not in CORRECTNESS_GATES:
            continue
        if g.gate == "near_tie" and g.passed and not gap_ok:
            failures.append(f"near_tie on arm {cand.name}: max gap {max_gap} mnats exceeds the policy's "
                            f"{p.near_tie_max_mnats:g} mnats")
        elif not g.passed:
            if g.gate == "battery" and near_ok:
                reasons.append(f"battery divergences on arm {cand.name} all ratified by near_tie "
                               f"(max gap {max_gap} mnats <= {p.near_tie_max_mnats:g})")
                continue
            failures.append(f"{g.gate} fails on arm {cand.name}" + (f": {g.reason}" if g.reason else "")
                            + (f" ({_counts(g)})" if g.counts else ""))
    if failures:
        return verdict("REJECT-CORRECTNESS", failures)

    # 3. NON-BINDING
    nb = _non_binding(ev, base, cand.name, p)
    if nb:
        return verdict("NON-BINDING", nb, binding=False)

    stats = [s for s in ev.stats if s.candidate == cand.name]
    primary = [s for s in stats if s.axis in p.primary_axes]
    wins = [s for s in primary if s.separation == "WIN"]
    losses = [s for s in stats if s.separation == "LOSS"]
    all_wins = [s for s in stats if s.separation == "WIN"]

    # 4. FLIP
    if p.flip_on_correctness:
        why = ["every correctness gate passes on the candidate"]
        why += [f"note: LOSS on {_fmt_stat(s)}" for s in losses]
        return verdict("FLIP-CORRECTNESS", why, binding=True, new_default=cand.value)
    qualifying = wins if byte_exact else [s for s in wins if s.ratio is not None and s.ratio >= 1 + p.min_gain]
    if token_safe and qualifying and not losses:
        why = [f"token-safe: {'measured byte-exact' if byte_exact else 'every divergence ratified by near_tie'}"]
        why += [f"WIN on {_fmt_stat(s)}" for s in qualifying]
        return verdict("FLIP", why, binding=True, new_default=cand.value)

    # 5. REJECT (performance)
    primary_losses = [s for s in losses if s.axis in p.primary_axes]
    if primary_losses and not all_wins:
        return verdict("REJECT-PERFORMANCE", [f"LOSS on {_fmt_stat(s)}" for s in primary_losses], binding=True)

    # 6. KEEP: say why it did not flip.
    why = []
    if not token_safe:
        why.append("not token-safe: " + ("not measured byte-exact" if byte_exact is None else "not byte-exact")
                   + (" and near_tie did not ratify the divergences" if near_ran else " and near_tie did not run"))
    if not wins:
        why.append("no WIN on a primary axis (" + ", ".join(p.primary_axes) + ")")
    elif not qualifying:
        why.append(f"WINs below the minimum gain {p.min_gain:.1%} for a non-byte-exact lever: "
                   + "; ".join(_fmt_stat(s) for s in wins))
    why += [f"LOSS on {_fmt_stat(s)}" for s in losses]
    return verdict("KEEP", why, binding=True)


def _counts(g: GateResult) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(g.counts.items()))


def _non_binding(ev: Evidence, base: str, cand: str, p: PolicyConfig) -> list[str]:
    fp = ev.fingerprint
    out = []
    if fp.device_type != "cuda":
        out.append(f"device {fp.device_type} ({fp.device_name}) is not CUDA")
    if fp.dirty:
        files = ", ".join(fp.dirty_files[:5]) + (" ..." if len(fp.dirty_files) > 5 else "")
        out.append("the git tree was dirty" + (f" ({files})" if files else ""))
    arm_fps = {a: h for a, h in ev.arm_fingerprints.items() if a in (base, cand)}
    if len(set(arm_fps.values())) > 1:
        out.append(f"arms ran on different fingerprints: {arm_fps}")
    grid = ev.config.get("grid", {}) or {}
    if not grid.get("binding", True):
        out.append(f"grid {grid.get('name', '?')!r} is a rehearsal grid (binding: false)")
    reps = int(grid.get("reps", 0))
    if reps < p.min_reps:
        out.append(f"{reps} reps per point, fewer than {p.min_reps}")
    planned = planned_legs(grid.get("concurrency", []), reps, [base, cand])
    done = {leg.key for leg in ev.legs if leg.arm in (base, cand)}
    missing = sorted(planned - done)
    if missing:
        c, r, a = missing[0]
        out.append(f"void grid: {len(missing)} planned leg(s) missing (first: c{c} rep {r} arm {a})")
    bad = [leg for leg in ev.legs if leg.arm in (base, cand) and not leg.valid]
    if bad:
        leg = bad[0]
        out.append(f"void grid: {len(bad)} invalid leg(s) (first: c{leg.concurrency} rep {leg.rep} arm {leg.arm}: "
                   + "; ".join(leg.reasons) + ")")
    by_point: dict[tuple[int, int], set[str]] = {}
    for leg in ev.legs:
        if leg.arm in (base, cand):
            by_point.setdefault((leg.concurrency, leg.rep), set()).add(leg.prompts_sha256)
    unlike = sorted(k for k, shas in by_point.items() if len(shas) > 1)
    if unlike:
        out.append(f"void grid: the arms served different prompts at {len(unlike)} point(s) "
                   f"(first: c{unlike[0][0]} rep {unlike[0][1]})")
    mech = ev.gate("mechanism", cand)
    if mech is None:
        out.append("no mechanism proof: the mechanism gate has no result for the candidate")
    elif mech.skipped:
        out.append(f"no mechanism proof: the mechanism gate was skipped ({mech.reason or 'no reason given'})")
    wanted = (ev.config.get("campaign", {}) or {}).get("gates", []) or []
    absent = [f"{g}@{a}" for g in wanted for a in (base, cand)
              if ev.gate(g, a) is None and not (g == "mechanism" and a == cand)]
    if absent:
        out.append(f"gate(s) without a result: {', '.join(absent)}")
    return out
