"""Records: record.md, pr.md, records/STATUS.md and records/BENCHMARKS.md, rendered from evidence files only.

Every view is a pure function of evidence (plus the lever files and sources for the current defaults and the
FRESH/STALE marks): no clock, no host, sorted inputs, so ``vtcampaign render`` reproduces the committed records
byte for byte, and records can never drift from data. Templates live in templates/*.md.j2; this module builds the
plain values they print.

Arms are labelled by role and value everywhere ("candidate (off)", "baseline (on)"): since defaults flip, the
candidate is not always the "on" arm.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any, Iterable

import jinja2

from campaigns import attribution, calibrate
from campaigns import context as lever_context
from campaigns.gates import GATE_NAMES
from campaigns.config import settings
from campaigns.evidence import EffectSize, Evidence, GateResult, find_evidence, load_evidence, write_atomic
from campaigns.policy import (effect_note, fmt_effect, inapplicable, measured_dirt, policy_params, ratified,
                             separation_label)
from campaigns.stats import AXES, AXIS_BY_NAME, OPTIONAL_AXES
from vtengine import confdirs

_HERE = Path(__file__).resolve().parent
# a wheel carries the templates as campaigns/templates; a source checkout has them beside the package
TEMPLATE_DIR = _HERE / "templates" if (_HERE / "templates").is_dir() else _HERE.parent / "templates"
RECORD_FILES = ("record.md", "pr.md")
REFUTED = ("REJECT-PERFORMANCE", "REJECT-CORRECTNESS")


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    return env


def render_template(name: str, **values: Any) -> str:
    return _env().get_template(name).render(**values)


# ----------------------------------------------------------------------------------------------- formatting


def fmt_value(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "ms":
        return f"{v:.2f}"
    if unit == "req/s":
        return f"{v:.3f}"
    return f"{v:,.1f}"


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.3f}"


def fmt_lever_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return "—" if v is None else str(v)


def mechanism_proof(g: GateResult, kernels: list[str]) -> str:
    """What the mechanism gate saw on one arm, as a reader checks it: its finding, the probe's routes and grids,
    then per kernel the lever affects, each route's launches and its most frequent grids ("decode_attention
    gqa_swap: 180 launches, grids 4x8x17 x180"). '' when the gate recorded none of these."""
    det = g.details or {}
    probe, counters = det.get("probe") or {}, det.get("counters") or {}
    parts = [str(det["why"])] if det.get("why") else []
    if probe.get("routes"):
        parts.append("probe route " + ", ".join(map(str, probe["routes"]))
                     + (", grid " + ", ".join(map(str, probe["grids"])) if probe.get("grids") else ""))
    for kernel in kernels:
        for route, c in sorted((counters.get(kernel) or {}).items()):
            grids = sorted((c.get("grids") or {}).items(), key=lambda kv: (-kv[1], kv[0]))[:3]
            parts.append(f"{kernel} {route}: {c.get('launches', 0)} launches"
                         + (", grids " + ", ".join(f"{k} x{n}" for k, n in grids) if grids else ""))
    return "; ".join(parts)


def _env_value(ev: Evidence, arm, env_name: str) -> str:
    """The value of ``env_name`` that gives ``arm``'s setting: what its server ran with, else the value spelled for
    the env (a bool as 1/0)."""
    ran = ev.fingerprint.arms_env.get(arm.name, {}).get(env_name)
    if ran is not None:
        return ran
    return ("1" if arm.value else "0") if isinstance(arm.value, bool) else str(arm.value)


def _preset_note(ev: Evidence, arm: str) -> str:
    """For a preset lever's arm, what its levers ran at there (from the arm's recorded context): a reader of
    ``VT_MIXED_PREFILL=on`` learns the chunk size without opening the lever file. A lever the preset sets now that
    the context does not hold did not exist then, and is left out."""
    from vtengine import levers
    lever = levers.registry().get(ev.lever)
    values = ev.context.get(arm, {})
    names = sorted(n for n in (lever.sets if lever is not None else {}) if n in values)
    if not names:
        return ""
    return " (a preset; its levers here: " + ", ".join(f"{n}={fmt_lever_value(values[n])}" for n in names) + ")"


def output_lens_text(grid, mean: bool = True) -> str:
    """The grid's requested output length, or with ``output_len_range`` the range each request's was drawn from
    ("64-192, mean 128"; "64-192" without ``mean``)."""
    ratio = float(getattr(grid, "output_len_range", 0.0) or 0.0)
    if not ratio:
        return str(grid.output_len)
    n = int(grid.output_len)
    return f"{round(n * (1 - ratio))}-{round(n * (1 + ratio))}" + (f", mean {n}" if mean else "")


def fmt_interval(e: EffectSize | None) -> str:
    return "—" if e is None else f"×{e.ratio:.3f} [{e.lo:.3f}, {e.hi:.3f}]"


def arm_label(ev: Evidence, name: str) -> str:
    """'candidate (off)', 'baseline (on)': the role and the lever value, never a bare ON/OFF."""
    try:
        arm = ev.arm(name)
    except KeyError:
        return name
    if ev.kind == "aa":
        return f"arm {arm.name} ({fmt_lever_value(arm.value)})"
    return f"{arm.role} ({arm.name})"


def gate_result(ev: Evidence | None, g: GateResult) -> str:
    if g.skipped:
        return "SKIP"
    if g.passed:
        return "PASS"
    if ev is not None and g.gate == "battery" and ratified(ev, g.arm, policy_params(ev)):
        return "RATIFIED"           # every divergence a near-tie the razor ratified, as the policy reads it
    return "FAIL"


def _gate_cell(g: GateResult, ev: Evidence | None = None) -> dict[str, str]:
    return {
        "gate": g.gate, "arm": g.arm, "arm_label": arm_label(ev, g.arm) if ev is not None else g.arm,
        "result": gate_result(ev, g),
        "counts": ", ".join(f"{k} {_num(v)}" for k, v in sorted(g.counts.items())) or "—",
        "self_check": {True: "caught", False: "NOT caught", None: "—"}[g.self_check],
        "byte_exact": {True: "yes", False: "no", None: "—"}[g.byte_exact],
        "duration": f"{g.duration_s:.1f} s" + (f" ({g.details['self_check_s']:.1f} s self-check)"
                                               if "self_check_s" in g.details else ""),
        "note": (g.reason or "").replace("|", "/").replace("\n", " "),
    }


def _rank(order: list[str], name: str) -> int:
    return order.index(name) if name in order else len(order)


def _gate_rank(name: str) -> int:
    return _rank(list(GATE_NAMES), name)


def _num(v: Any) -> str:
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.4g}"
    return str(int(v)) if isinstance(v, float) else str(v)


# ----------------------------------------------------------------------------------------------- one campaign


def default_then(ev: Evidence) -> Any:
    """The lever's effective default (for the campaign's quantization, presets applied) at the campaign's commit,
    None where unknown: a campaign file may pin its baseline off the default (a RED-first campaign, a rerun after
    the flip), and then a FLIP to the candidate confirms the default rather than moving it."""
    from vtengine import levers as lever_registry
    lever = lever_registry.registry().get(ev.lever)
    if lever is None:
        return None
    root = confdirs.SOURCE_ROOT
    return lever_context.default_at(root, lever_context.campaign_commit(ev, root), lever,
                                    lever_context.quant_of(ev))


def _confirms_default(ev: Evidence, then: Any) -> bool:
    """Whether ``ev``'s FLIP goes to the default its commit already had (``then``: default_then) from a baseline
    the campaign pinned off it."""
    d = ev.decision
    return (d is not None and d.verdict == "FLIP" and then is not None and then == d.new_default
            and then != ev.baseline.value)


def what_changed(ev: Evidence) -> str:
    d = ev.decision
    base = ev.baseline.name
    if d is None:
        return f"campaign abandoned {ev.abandoned.get('at', '')[:10]}" if ev.status == "abandoned" else \
            "campaign in progress"
    cand = d.candidate or "?"
    if ev.kind == "aa":
        return f"A/A self-check of the grid, {ev.lever}={fmt_lever_value(ev.baseline.value)} on both arms"
    confirms = d.verdict == "FLIP" and _confirms_default(ev, default_then(ev))
    moved = f"confirms default {cand} (against {base})" if confirms else f"default {base} → {cand}"
    if d.verdict == "FLIP" and policy_params(ev).flip_on_correctness:
        return f"{moved} (correctness fix)"
    note = _effect_note(ev)
    keep = {"neutral": "measured neutral", "slower": "measured slower",
            "trade": "trades one primary axis for another"}.get(note.split(":")[0], "not shown better")
    if "mixed: " in note and not note.startswith("trade:"):  # a pooled direction hides WINs beside LOSSes
        keep = "mixed: WINs and LOSSes at separate points"
    return {
        "FLIP": moved,
        "KEEP": f"keep default {base} ({cand} {keep})",
        "REJECT-PERFORMANCE": f"refute {cand} (measured regression; do not retry)",
        "REJECT-CORRECTNESS": f"reject {cand} (fails correctness)",
        "NON-BINDING": f"{cand} vs {base}, non-binding",
        "INVALID": "invalid campaign (gates cannot be trusted)",
    }.get(d.verdict, d.verdict)


def _effect_note(ev: Evidence) -> str:
    """A KEEP's neutral/slower/faster/underpowered note, derived from the evidence's pooled effects at render
    time (a view, so every record reads by today's wording)."""
    d = ev.decision
    if d is None or d.verdict != "KEEP" or ev.kind != "lever" or not d.candidate:
        return ""
    return effect_note(ev, d.candidate, policy_params(ev))


def verdict_headline(ev: Evidence) -> str:
    d = ev.decision
    if d is None:
        return "IN PROGRESS"
    return f"{d.verdict}: {what_changed(ev)}, {d.headline}"


def _tpot_ms(ev: Evidence, cand: str, c: int) -> tuple[float | None, float | None]:
    hit = [s for s in ev.stats if s.candidate == cand and s.axis == "tpot" and s.concurrency == c]
    if not hit:
        return None, None
    s = hit[0]
    return s.summary[s.baseline].median, s.summary[cand].median


def attribution_view(ev: Evidence) -> list[dict[str, Any]]:
    """Per candidate and profiled concurrency: the Attribution table (campaigns/attribution.py) from the profile
    gate's windows and the grid's TPOT, its summary line, and the generated residual."""
    base = ev.gate("profile", ev.baseline.name)
    if base is None or base.skipped or "windows" not in base.details:
        return []
    out = []
    for arm in ev.candidates:
        cand = ev.gate("profile", arm.name)
        if cand is None or cand.skipped or "windows" not in cand.details:
            continue
        for c in sorted(set(base.details["windows"]) & set(cand.details["windows"]), key=int):
            bw, cw = base.details["windows"][c], cand.details["windows"][c]
            tb, tc = _tpot_ms(ev, arm.name, int(c))
            floors = (cand.details.get("floor_bytes") or {}).get(c)
            rows, summary = attribution.table(bw, cw, tb, tc, floors, cand.details.get("copy_gbs"))
            measured = summary["measured_delta_us"]
            idle = attribution.window_disturbance(summary, bw, cw)
            out.append({
                "arm": arm.name, "candidate": arm_label(ev, arm.name), "c": c, "activity": cw["activity"],
                "rows": [{"kernel": r.kernel, "base": f"{r.base_us:,.1f}", "cand": f"{r.cand_us:,.1f}",
                          "delta": f"{r.delta_us:+,.1f}",
                          "share": "—" if r.share is None else f"{round(100 * r.share):+d}%",
                          "floor": "—" if r.floor is None else f"{r.floor:.0%}"} for r in rows],
                "summary": (f"profiled step {bw['step_us']:,.0f} → {cw['step_us']:,.0f} µs; grid TPOT delta "
                            + ("—" if measured is None else f"{measured:+,.1f} µs")
                            + f", kernels {summary['kernels_delta_us']:+,.1f} µs"
                            + ("" if summary["unattributed_us"] is None
                               else f", unattributed (host time, gaps) {summary['unattributed_us']:+,.1f} µs")
                            + ("" if idle is None else
                               f"; the windows' device idle time moved {idle:+,.0f} µs a step, which the grid does "
                               "not show (its TPOT delta is about the kernels'): most likely a disturbance of a "
                               "profiler window, not the lever" + _longest_gaps(bw, cw))
                            + "".join(f"; device idle {sum(w['stalls_us']) / 1e3:,.1f} ms inside the {role}'s window "
                                      "(a stall, left out of its step)"
                                      for role, w in (("baseline", bw), ("candidate", cw)) if w.get("stalls_us"))),
                "residual": attribution.residual(cw, rows),
            })
    return out


def _longest_gaps(base: dict, cand: dict) -> str:
    """' (longest device-idle gap: baseline 0.3 ms, candidate 17.1 ms)' where the windows recorded theirs (one long
    gap is a disturbance of the window; many short ones would be the steps' own)."""
    gaps = [f"{role} {w['longest_gaps_us'][0] / 1e3:,.1f} ms" for role, w in (("baseline", base), ("candidate", cand))
            if w.get("longest_gaps_us")]
    return f" (longest device-idle gap: {', '.join(gaps)})" if gaps else ""


def lever_summary(ev: Evidence, lever=None) -> str:
    """What the lever did when the campaign ran: the summary recorded in its evidence, else the lever file's at the
    campaign's commit (git), else today's, said so. A PR text must not describe a value's meaning of a later day (the
    rule behind prefill_splits' "auto" was rewritten twice after campaigns that measured it)."""
    if ev.lever_summary:
        return ev.lever_summary
    then = lever_context.summary_at(confdirs.SOURCE_ROOT, lever_context.campaign_commit(ev, confdirs.SOURCE_ROOT),
                                   ev.lever)
    if then is not None:
        return then
    where = f"no lever file {ev.lever} at commit {ev.fingerprint.git_short_sha} in this repository"
    if lever is None:
        return f"({where})"
    return " ".join(lever.summary.split()) + f" (today's lever file: {where})"


def campaign_view(ev: Evidence) -> dict[str, Any]:
    """Every value record.md.j2 and pr.md.j2 print, already formatted."""
    from vtengine import levers as lever_registry

    cfg = settings(ev)
    camp, grid = cfg.campaign, cfg.grid
    fp = ev.fingerprint
    d = ev.decision
    p = policy_params(ev)
    registry = lever_registry.registry()
    lever = registry.get(ev.lever)
    env_name = lever.env if lever else "VT_?"
    cand_names = [a.name for a in ev.candidates]
    arm_order = [a.name for a in ev.arms]

    binding_rows = []
    for s in ev.stats:
        if not s.primary:
            continue
        axis = AXIS_BY_NAME.get(s.axis)
        unit = axis.unit if axis else ""
        binding_rows.append({
            "c": s.concurrency, "candidate": s.candidate, "axis": axis.label if axis else s.axis, "unit": unit,
            "effect": fmt_interval(s.effect),
            "confidence": f"{s.effect.confidence:.0%}" if s.effect else "—",
            "on": fmt_value(s.summary[s.candidate].median, unit), "off": fmt_value(s.summary[s.baseline].median, unit),
            "ratio": fmt_ratio(s.ratio), "separation": separation_label(s, p),
            "on_reps": " / ".join(fmt_value(v, unit) for v in s.reps[s.candidate]),
            "off_reps": " / ".join(fmt_value(v, unit) for v in s.reps[s.baseline]),
            "cv": f"{s.summary[s.candidate].cv:.1%} / {s.summary[s.baseline].cv:.1%}",
        })
    axis_order = [a.label for a in AXES + OPTIONAL_AXES]
    binding_rows.sort(key=lambda r: (_rank(cand_names, r["candidate"]), r["c"], _rank(axis_order, r["axis"])))

    # All axes at a glance: ratio and separation per (candidate, concurrency) x axis, the optional ones (P99 and
    # max ITL) wherever the campaign measured them: they may be primary and decide the verdict
    axes_present = [a for a in AXES + OPTIONAL_AXES if any(s.axis == a.name for s in ev.stats)]
    glance = []
    for cand in cand_names:
        for c in sorted({s.concurrency for s in ev.stats if s.candidate == cand}):
            cells = []
            for a in axes_present:
                hit = [s for s in ev.stats if s.candidate == cand and s.concurrency == c and s.axis == a.name]
                cells.append(f"{fmt_ratio(hit[0].ratio)} {separation_label(hit[0], p)}" if hit else "—")
            glance.append({"candidate": arm_label(ev, cand), "c": c, "cells": cells})

    mech = [g for g in ev.gates if g.gate == "mechanism"]
    mechanism = [{"arm": arm_label(ev, g.arm), "result": _gate_cell(g, ev)["result"],
                  "counts": mechanism_proof(g, lever.affects if lever else []) or _gate_cell(g, ev)["counts"],
                  "details": json.dumps(g.details, sort_keys=True) if g.details else "",
                  "reason": g.reason} for g in mech]

    invalid_legs = [f"c{leg.concurrency} rep {leg.rep} arm {leg.arm}: {'; '.join(leg.reasons)}"
                    for leg in ev.legs if not leg.valid]

    then = default_then(ev) if ev.kind == "lever" else None
    if then is None:
        baseline_note = ""
    elif then == ev.baseline.value:
        baseline_note = " (the file default)"
    else:
        baseline_note = f" (pinned by the campaign; the default was {fmt_lever_value(then)})"
    if ev.kind == "aa":
        default_line = "An A/A campaign changes no default; it measures the grid (and its noise feeds calibration)."
    elif d is None:
        default_line = (f"`{ev.lever}` stays {fmt_lever_value(ev.baseline.value)}"
                        + (": the campaign decided nothing." if ev.status == "abandoned"
                           else " while the campaign runs."))
    elif _confirms_default(ev, then):
        default_line = (f"`{ev.lever}` was {fmt_lever_value(then)} already at {fp.git_short_sha}: the campaign "
                        f"measured the {fmt_lever_value(ev.baseline.value)} it pinned against it, and the default "
                        f"stays (conf/lever/{ev.lever}.yaml unchanged).")
    elif d.verdict == "FLIP":
        default_line = (f"`{ev.lever}` flips {fmt_lever_value(ev.baseline.value)} → "
                        f"{fmt_lever_value(d.new_default)} in conf/lever/{ev.lever}.yaml; "
                        f"roll back with `{env_name}={_env_value(ev, ev.baseline, env_name)}`.")
    else:
        # the candidate the verdict is about (a campaign of several candidates: not necessarily the first)
        about = next((a for a in ev.candidates if a.name == d.candidate), ev.candidates[0] if ev.candidates else None)
        default_line = (f"`{ev.lever}` stays {fmt_lever_value(ev.baseline.value)} "
                        f"(conf/lever/{ev.lever}.yaml unchanged); try the candidate with "
                        f"`{env_name}={_env_value(ev, about, env_name) if about else '?'}`.")

    arms_env = {arm_label(ev, arm): " ".join(f"{k}={v}" for k, v in sorted(env.items()))
                for arm, env in fp.arms_env.items()}
    arms_note = {arm_label(ev, arm): _preset_note(ev, arm) for arm in fp.arms_env}
    pinned = dict(camp.with_levers)
    with_text = (" with " + ", ".join(f"{k}={fmt_lever_value(v)}" for k, v in sorted(pinned.items()))) if pinned else ""
    title = f"row/{ev.lever}{with_text}: {what_changed(ev)} — {d.headline if d else ev.status.replace('-', ' ')}"
    base_label = arm_label(ev, ev.baseline.name)
    cand_labels = {a.name: arm_label(ev, a.name) for a in ev.candidates}
    for r in binding_rows:
        r["candidate_label"] = cand_labels.get(r["candidate"], r["candidate"])
    pooled = [{"candidate": cand_labels.get(pe.candidate, pe.candidate), "text": fmt_effect(pe),
               "primary": pe.primary} for pe in ev.pooled]
    context_rows = []
    for arm in ev.arms:
        vals = ev.context.get(arm.name, {})
        # engine-loop levers (no kernels) are live whatever their counters say (campaigns/context.py)
        live = set(ev.live_levers.get(arm.name, [])) | {n for n, lv in registry.items() if not lv.affects}
        if vals:
            context_rows.append({"arm": arm_label(ev, arm.name),
                                 "levers": ", ".join(f"{k}={fmt_lever_value(v)}{'' if k in live else ' (inert)'}"
                                                     for k, v in sorted(vals.items()))})
    exempt = [{"gate": g, "why": why} for g, why in sorted(inapplicable(ev).items())]
    attrib = attribution_view(ev)
    return {
        "attribution": attrib,
        # the verdict's candidate's residual at its last profiled concurrency (not whichever candidate came last)
        "residual_generated": next((a["residual"] for a in reversed(attrib) if d is None or a["arm"] == d.candidate),
                                   attrib[-1]["residual"] if attrib else ""),
        "baseline_label": base_label, "baseline_note": baseline_note, "pooled": pooled, "context_rows": context_rows,
        "inapplicable": exempt,
        "calibration": calibrate.sentence(ev.calibration) if ev.stats else "",
        "noise": ev.calibration.noise if ev.calibration else "",
        "with_levers": with_text.strip(), "kind": ev.kind,
        "effect_note": _effect_note(ev),
        "ev": ev, "d": d, "fp": fp, "row_id": f"row/{ev.lever}", "campaign_id": ev.campaign_id,
        "headline": verdict_headline(ev), "title": title, "date": ev.date,
        "branch": fp.branch, "base_sha": fp.git_short_sha + ("" if measured_dirt(fp) is None else "-dirty")
        + (f" (resumed at {', '.join(ev.resumed_at)}: the same code)" if ev.resumed_at else ""),
        "device": fp.device_name, "lever": ev.lever, "env": env_name,
        "summary": lever_summary(ev, lever),
        "baseline": ev.baseline.name, "baseline_value": fmt_lever_value(ev.baseline.value),
        "candidates": ", ".join(f"{a.name} ({fmt_lever_value(a.value)})" for a in ev.candidates),
        "candidate_label": ", ".join(cand_labels.values()),
        "arms_env": arms_env, "arms_note": arms_note,
        "hypothesis": (camp.hypothesis or "").strip(), "residual": (camp.residual or "").strip(),
        "model": _model(ev),
        "grid": {"name": grid.name, "concurrency": ", ".join(map(str, grid.concurrency)), "reps": grid.reps,
                 "prompts": ", ".join(map(str, grid.prompts_per_leg)), "input_len": grid.input_len,
                 "output_len": output_lens_text(grid), "residency": grid.residency},
        "versions": f"torch {fp.torch_version}, triton {fp.triton_version or '—'}, "
                    f"CUDA {fp.cuda_version or '—'}, Python {fp.python_version}",
        "gates": [_gate_cell(g, ev) for g in sorted(ev.gates, key=lambda g: (_gate_rank(g.gate), g.gate,
                                                                              _rank(arm_order, g.arm)))],
        "mechanism": mechanism, "binding_rows": binding_rows, "clocks": clock_rows(ev),
        "glance_axes": [a.label for a in axes_present], "glance": glance,
        "itl_tail_heads": [label for _, label in ITL_TAIL], "itl_tail": itl_tail_rows(ev),
        "legs_total": len(ev.legs), "legs_valid": sum(leg.valid for leg in ev.legs), "invalid_legs": invalid_legs,
        "memory": {arm_label(ev, arm): f"{gib:.2f} GiB" for arm, gib in sorted(ev.peak_memory_gib.items())},
        "default_line": default_line, 
        "byte_exact": {True: "yes (measured)", False: "no (measured)", None: "not measured"}[
            d.byte_exact if d else None],
        "min_gain": f"{p.min_gain:.1%}", "near_tie_max_mnats": f"{p.near_tie_max_mnats:g}",
    }


CLOCK_GAP = 0.05                        # arms' median SM clocks further apart than this at a point: said so


def clock_rows(ev: Evidence) -> list[dict]:
    """Per concurrency: each arm's median SM clock over its legs (each leg's median sample) with the range, and a
    note where the arms ran at clocks more than CLOCK_GAP apart. On the H200 high concurrencies hit the power
    limit: the arm that does more work per second clocks lower (async scheduling at c64: 1,590 against 1,965
    MHz), so its ratio there understates its kernels' gain. A reader should see that, not infer it; the grid does
    not void such a point (the power limit is the regime users run in)."""
    by: dict[int, dict[str, list[float]]] = {}
    for leg in ev.legs:
        clocks = [x["sm_clock_mhz"] for x in leg.gpu_samples if "sm_clock_mhz" in x]
        if leg.valid and clocks:
            by.setdefault(leg.concurrency, {}).setdefault(leg.arm, []).append(statistics.median(clocks))
    rows = []
    for c, arms in sorted(by.items()):
        med = {a: statistics.median(v) for a, v in arms.items()}
        cells = [f"{arm_label(ev, a.name)} {med[a.name]:,.0f} [{min(arms[a.name]):,.0f}–{max(arms[a.name]):,.0f}]"
                 for a in ev.arms if a.name in arms]
        gap = (max(med.values()) - min(med.values())) / max(med.values()) if len(med) > 1 else 0.0
        note = ""
        if gap > CLOCK_GAP:
            low = min(med, key=med.get)
            note = (f"arms {gap:.0%} apart: {arm_label(ev, low)} ran slower clocks (power-limited; the ratio here "
                    "includes the clock difference)")
        rows.append({"c": c, "arms": "; ".join(cells), "note": note})
    return rows


ITL_TAIL = (("median_itl_ms", "median ITL"), ("p99_itl_ms", "P99 ITL"), ("max_itl_ms", "max ITL"),
            ("std_itl_ms", "ITL std"), ("median_tpot_ms", "TPOT"))


def itl_tail_rows(ev: Evidence) -> list[dict]:
    """Where the policy reads the ITL's tail (P99 or max ITL, primary or traded): per concurrency and arm, the
    medians over its valid legs of the ITL's median, P99, max and standard deviation and of the TPOT (ms). A stall
    in fewer than 1% of the gaps (one a request at c2 of the 32k grid) is past the P99 and shows in the max, the std
    and the TPOT alone. Legs recorded before the max was (2026-12-05) show "—" there."""
    p = policy_params(ev)
    if not {"p99_itl", "max_itl"} & (set(p.primary_axes) | set(p.traded_axes)):
        return []
    rows = []
    for c in sorted({leg.concurrency for leg in ev.legs}):
        for arm in ev.arms:
            legs = [leg for leg in ev.legs if leg.valid and leg.concurrency == c and leg.arm == arm.name]
            if not legs:
                continue
            cells = []
            for key, _ in ITL_TAIL:
                vals = [leg.metrics[key] for leg in legs if leg.metrics.get(key) is not None]
                cells.append(fmt_value(statistics.median(vals), "ms") if vals else "—")
            rows.append({"c": c, "arm": arm_label(ev, arm.name), "cells": cells})
    return rows


def render_record(ev: Evidence) -> str:
    return render_template("record.md.j2", **campaign_view(ev))


def render_pr(ev: Evidence) -> str:
    return render_template("pr.md.j2", **campaign_view(ev))


def write_campaign(ev: Evidence, campaign_dir: Path | str, plot: bool = True) -> list[Path]:
    """record.md, pr.md (and grid.png when there are statistics) next to the evidence file."""
    campaign_dir = Path(campaign_dir)
    out = [write_atomic(campaign_dir / "record.md", render_record(ev)),
           write_atomic(campaign_dir / "pr.md", render_pr(ev))]
    if plot and ev.stats:
        from campaigns.plots import grid_png
        out.append(write_atomic(campaign_dir / "grid.png", grid_png(ev)))
    return out


# ----------------------------------------------------------------------------------------------- indexes


def _chronological(evs: list[Evidence]) -> list[Evidence]:
    return sorted(evs, key=lambda e: (e.created, e.campaign_id))


def _link(ev: Evidence, campaign_dirs: dict[str, Path], records_dir: Path, name: str = "record.md") -> str:
    rel = os.path.relpath(campaign_dirs[ev.campaign_id] / name, records_dir)
    return Path(rel).as_posix()


def _superseded(ev: Evidence, done: list[Evidence]) -> bool:
    """A refutation stops being listed once a later binding campaign of the same lever, model and arm reaches
    another verdict (e.g. the bug behind a REJECT was fixed and the lever re-ran); its record stays in
    records/campaigns/. A rehearsal, or a campaign voided by its own legs or gates, never displaces a binding
    verdict (a later NON-BINDING run on a dirty tree took a binding REJECT off the list)."""
    from campaigns.recheck import plan_key
    later = [e for e in done if plan_key(e) == plan_key(ev) and e.decision.candidate == ev.decision.candidate
             and e.decision.binding and (e.created, e.campaign_id) > (ev.created, ev.campaign_id)]
    return any(e.decision.verdict != ev.decision.verdict for e in later)


class _Freshness:
    """FRESH/STALE of each evidence against the lever files and sources now, computed once per render."""

    def __init__(self, root: Path | None = None, lever_dir: Path | None = None):
        from vtengine import levers as lever_registry
        self.root = Path(root) if root is not None else confdirs.SOURCE_ROOT
        self.levers = lever_registry.registry(lever_dir) if lever_dir else lever_registry.registry()
        self.digests = lever_context.tree_digests(self.levers, self.root)
        self._seen: dict[str, lever_context.Freshness] = {}

    def __call__(self, ev: Evidence) -> lever_context.Freshness:
        if ev.campaign_id not in self._seen:
            self._seen[ev.campaign_id] = lever_context.freshness(ev, self.root, self.levers, self.digests)
        return self._seen[ev.campaign_id]


def _fresh_cell(f: lever_context.Freshness) -> str:
    return f.short().replace("|", "/")


def render_status(evs: list[Evidence], campaign_dirs: dict[str, Path], records_dir: Path,
                  lever_dir: Path | None = None, fresh: _Freshness | None = None) -> str:
    fresh = fresh or _Freshness(lever_dir=lever_dir)
    levers = fresh.levers
    done = [e for e in _chronological(evs) if e.status == "complete" and e.decision is not None]
    lever_runs = [e for e in done if e.kind == "lever"]
    from campaigns.recheck import latest_aa, latest_binding, measured_on, plan_key
    from vtengine.levers import effective_defaults
    defaults = effective_defaults(levers)        # what an engine that sets nothing runs (an on preset's values)
    rows = []
    for name in sorted(set(levers) | {e.lever for e in lever_runs}):
        lever = levers.get(name)
        mine = [e for e in lever_runs if e.lever == name]
        # a rehearsal (non-binding) never displaces a binding verdict: the latest binding campaign of each model
        # (and pinned levers) the lever was decided on, else its latest rehearsal
        binding = sorted(latest_binding(mine).items())
        for _key, last in binding or [("", mine[-1] if mine else None)]:
            quant = lever_context.quant_of(last) if last is not None else None
            default = effective_defaults(levers, quant).get(name) if quant else defaults.get(name)
            rows.append(_status_row(name, lever, default, last, fresh, campaign_dirs, records_dir, levers))
    # the latest refutation of each lever, arm and model (with its pins): a re-run that refuted it again replaces
    # the row (gqa_swap off was listed three times), one that reached another verdict removes it
    latest_refuted: dict[tuple[str, str], Evidence] = {}
    for e in lever_runs:
        if e.decision.verdict in REFUTED and not _superseded(e, lever_runs):
            latest_refuted[(plan_key(e), e.decision.candidate or "?")] = e
    refuted = [{
        "lever": e.lever, "on": measured_on(e), "arm": e.decision.candidate or "?",
        "verdict": e.decision.verdict, "campaign": f"[{e.campaign_id}]({_link(e, campaign_dirs, records_dir)})",
        "why": "; ".join(e.decision.reasons[:2]).replace("|", "/"), "fresh": _fresh_cell(fresh(e)),
    } for _key, e in sorted(latest_refuted.items())]
    latest = latest_aa(done)
    aa = [{
        "campaign": f"[{e.campaign_id}]({_link(e, campaign_dirs, records_dir)})",
        "model": _model(e), "gpu": gpu_label(e), "value": f"{e.lever}={fmt_lever_value(e.baseline.value)}",
        "verdict": e.decision.verdict,
        "binding": "binding" if e.decision.binding else "non-binding", "headline": e.decision.headline,
        "bias": "; ".join(fmt_effect(pe) for pe in e.pooled if pe.primary).replace("|", "/") or "—",
        "fresh": (_fresh_cell(fresh(e)) if latest.get(plan_key(e)) is e
                  else f"superseded by {latest[plan_key(e)].campaign_id}" if plan_key(e) in latest else "—"),
        "stale_why": ([r.replace("|", "/") for r in fresh(e).reasons]
                      if latest.get(plan_key(e)) is e and not fresh(e).fresh else []),
    } for e in done if e.kind == "aa"]
    return render_template("STATUS.md.j2", rows=rows, refuted=refuted, aa=aa)


def _status_row(name: str, lever, default: Any, last: Evidence | None, fresh, campaign_dirs: dict[str, Path],
                records_dir: Path, registry: dict) -> dict[str, Any]:
    from campaigns.recheck import measured_on
    return {
        "lever": name,
        "on": measured_on(last) if last else "—",
        "gpu": gpu_label(last) if last else "—",
        "default": (fmt_lever_value(default) + _by_quant_note(lever)) if lever else "(no lever file)",
        "env": lever.env if lever else "—",
        "byte_exact": {True: "yes", False: "no", None: "—"}[last.decision.byte_exact] if last else "—",
        "last": f"[{last.campaign_id}]({_link(last, campaign_dirs, records_dir)})" if last else "—",
        "verdict": (last.decision.verdict + _unapplied_flip(last, lever, default, registry, fresh(last).fresh)
                    if last else "—"),
        "fresh": _fresh_cell(fresh(last)) if last else "—",
        "stale_why": [] if not last or fresh(last).fresh else [r.replace("|", "/") for r in fresh(last).reasons],
        "headline": (f"{arm_label(last, last.decision.candidate)}: {last.decision.headline}"
                     + (f"; {_effect_note(last)}" if _effect_note(last) else "")
                     if last else "—").replace("|", "/"),
        "calibration": (calibrate.sentence(last.calibration) if last and last.calibration else "—"),
    }


def _unapplied_flip(ev: Evidence, lever, default: Any, registry: dict, fresh: bool) -> str:
    """Why a FLIP's new default is not the lever's default, for its STATUS verdict cell: pinned levers off their
    defaults (it is about the engine with them so: `vtcampaign flip` refuses it), a default that has left its
    baseline since, or, for a FRESH one, not flipped yet. "" where the default is the FLIP's, for a STALE one (its
    freshness cell says why; recheck re-runs it), or where its values no longer parse (a value dropped since)."""
    if ev.decision.verdict != "FLIP" or lever is None:
        return ""
    try:
        new, base = lever.parse(ev.decision.new_default), lever.parse(ev.baseline.value)
    except ValueError:
        return ""
    if new == default:
        return ""
    pins = lever_context.off_default_pins(ev, registry)
    if pins:
        from vtengine.levers import effective_defaults
        now = effective_defaults(registry, lever_context.quant_of(ev))
        return " (not flippable: " + ", ".join(f"{n}={fmt_lever_value(v)} pinned, its default "
                                                f"{fmt_lever_value(now[n])}" for n, v in sorted(pins.items())) + ")"
    if not fresh:
        return ""
    if base != default:
        return f" (measured against {fmt_lever_value(base)}; the default is {fmt_lever_value(default)} now)"
    return f" (not flipped yet: `vtcampaign flip {ev.campaign_id}`)"


def gpu_label(ev: Evidence) -> str:
    """The device a campaign measured on, short: "H200", "H100 80GB HBM3", "cpu". A verdict holds on its GPU: the
    lender may run a session on another kind than the last (an H100 for an H200 call), so a verdict is filed per
    GPU (recheck.plan_key) and the tables name it."""
    return "cpu" if ev.fingerprint.device_type == "cpu" else short_gpu(ev.fingerprint.device_name)


def short_gpu(device_name: str | None) -> str:
    """A device name without the vendor: "NVIDIA H100 80GB HBM3" -> "H100 80GB HBM3"."""
    return (device_name or "?").removeprefix("NVIDIA ").strip()


def _by_quant_note(lever) -> str:
    """' (bf16: on; else off)' for a lever whose default differs by quantization (``default_by_quant``)."""
    if not lever.default_by_quant:
        return ""
    own = "; ".join(f"{q}: {fmt_lever_value(v)}" for q, v in sorted(lever.default_by_quant.items()))
    return f" ({own}; else {fmt_lever_value(lever.default)})"


def _model(ev: Evidence) -> str:
    model = settings(ev).model
    return f"{model.get('name', '?')} ({model.get('quant', '?')})"


def _grid_rows(ev: Evidence) -> list[dict[str, Any]]:
    rows, pol = [], settings(ev).campaign.policy
    for cand in [a.name for a in ev.candidates]:
        for c in sorted({s.concurrency for s in ev.stats if s.candidate == cand}):
            at = {s.axis: s for s in ev.stats if s.candidate == cand and s.concurrency == c}
            tput, tpot = at.get("total_token_throughput"), at.get("tpot")
            seps = [separation_label(s, pol) for s in at.values()]
            rows.append({
                "c": c, "candidate": arm_label(ev, cand),
                "tput_on": fmt_value(tput.summary[cand].median, "tok/s") if tput else "—",
                "tput_off": fmt_value(tput.summary[tput.baseline].median, "tok/s") if tput else "—",
                "tput_ratio": f"{fmt_ratio(tput.ratio)} {separation_label(tput, pol)}" if tput else "—",
                "tput_effect": fmt_interval(tput.effect) if tput else "—",
                "tpot_on": fmt_value(tpot.summary[cand].median, "ms") if tpot else "—",
                "tpot_off": fmt_value(tpot.summary[tpot.baseline].median, "ms") if tpot else "—",
                "tpot_ratio": f"{fmt_ratio(tpot.ratio)} {separation_label(tpot, pol)}" if tpot else "—",
                "tpot_effect": fmt_interval(tpot.effect) if tpot else "—",
                "axes": f"{seps.count('WIN')} W / {len(seps) - seps.count('WIN') - seps.count('LOSS')} N / "
                        f"{seps.count('LOSS')} L",
            })
    return rows


def render_benchmarks(evs: list[Evidence], campaign_dirs: dict[str, Path], records_dir: Path,
                      fresh: _Freshness | None = None) -> str:
    fresh = fresh or _Freshness()
    done = [e for e in _chronological(evs) if e.status == "complete" and e.decision is not None and e.stats
            and e.kind == "lever"]
    from campaigns.recheck import latest_binding
    sections = []
    for lever in sorted({e.lever for e in done}):
        mine = [e for e in done if e.lever == lever]
        # the latest binding grid per model (and pinned levers), else the latest non-binding one
        picks = sorted(latest_binding(mine).items()) or [("", mine[-1])]
        for key, ev in picks:
            sections.append(_bench_section(lever, key, ev, fresh, campaign_dirs, records_dir))
    return render_template("BENCHMARKS.md.j2", sections=sections)


def _bench_section(lever: str, key: str, ev: Evidence, fresh, campaign_dirs: dict[str, Path],
                   records_dir: Path) -> dict[str, Any]:
    return {
        "lever": key or lever, "binding": bool(key), "campaign_id": ev.campaign_id,
        "link": _link(ev, campaign_dirs, records_dir), "verdict": ev.decision.verdict,
        "model": _model(ev), "fresh": _fresh_cell(fresh(ev)),
        "device": ev.fingerprint.device_name, "date": ev.date, "baseline": arm_label(ev, ev.baseline.name),
        "calibration": calibrate.sentence(ev.calibration) if ev.calibration else "not calibrated",
        "rows": _grid_rows(ev),
    }


def render_all(out_dir: Path | str, records_dir: Path | str | None = None, lever_dir: Path | None = None,
               plots: bool = True, only: Iterable[str] | None = None) -> list[Path]:
    """Rebuild every campaign's record.md/pr.md/grid.png and records/STATUS.md + BENCHMARKS.md from evidence.
    ``only``: the campaign ids whose own files to rebuild (a campaign's files depend on its evidence alone; the
    summaries always read every campaign): a concluding campaign rebuilds its own, not every plot of the tree."""
    out_dir = Path(out_dir)
    records_dir = Path(records_dir) if records_dir is not None else out_dir.parent
    evs, dirs = _load_all(out_dir)
    written = []
    keep = None if only is None else set(only)
    for ev in evs:
        if keep is None or ev.campaign_id in keep:
            written += write_campaign(ev, dirs[ev.campaign_id], plot=plots)
    for path, text in _summaries(evs, dirs, records_dir, lever_dir).items():
        written.append(write_atomic(path, text))
    return written


def render_summaries(out_dir: Path | str, records_dir: Path | str, lever_dir: Path | None = None) -> dict[Path, str]:
    """STATUS.md and BENCHMARKS.md (path -> text) of every campaign in ``out_dir``, against the lever files in
    ``lever_dir`` (None: the ones in use), written nowhere: a flip commits them as they read once it is merged."""
    evs, dirs = _load_all(Path(out_dir))
    return _summaries(evs, dirs, Path(records_dir), lever_dir)


def render_summaries_flipped(out_dir: Path | str, records_dir: Path | str, lever: str,
                             edited_dir: Path) -> dict[Path, str]:
    """render_summaries against the lever files in use with ``lever``'s replaced by the one in ``edited_dir`` (a
    flip's copy holding the new default): a project's conf/lever/ may hold that lever alone."""
    import shutil
    import tempfile
    from vtengine import levers as lever_registry
    with tempfile.TemporaryDirectory() as tmp:
        for name, lv in lever_registry.registry().items():
            shutil.copyfile(lv.path, Path(tmp) / f"{name}.yaml")
        shutil.copyfile(Path(edited_dir) / f"{lever}.yaml", Path(tmp) / f"{lever}.yaml")
        return render_summaries(out_dir, records_dir, Path(tmp))


def _load_all(out_dir: Path) -> tuple[list[Evidence], dict[str, Path]]:
    evs, dirs = [], {}
    for path in find_evidence(out_dir):
        ev = load_evidence(path)
        evs.append(ev)
        dirs[ev.campaign_id] = path.parent
    return evs, dirs


def _summaries(evs: list[Evidence], dirs: dict[str, Path], records_dir: Path,
               lever_dir: Path | None) -> dict[Path, str]:
    fresh = _Freshness(lever_dir=lever_dir)
    return {records_dir / "STATUS.md": render_status(evs, dirs, records_dir, lever_dir, fresh),
            records_dir / "BENCHMARKS.md": render_benchmarks(evs, dirs, records_dir, fresh)}
