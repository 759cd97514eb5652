"""battery: fixed prompts, greedy, through the full paged engine, token-exact against the oracle's goldens.
near_tie: every divergence teacher-forced under the oracle; gap = max(0, logp(oracle argmax) - logp(our token)).

Counts (battery): ``strict`` prompts equal to the golden, ``near_tie`` prompts that diverge but whose every gap is
within the threshold, ``divergent`` the rest (must be 0 for a token-safe arm). The battery passes only when every
prompt is strict; a non-strict battery is excused by the policy when near_tie ratifies it.

Fault (both gates): the arm's engine with its lever's own kernel broken (vtengine/faults.py: the kernel's output
scaled by -0.5 inside the forward, in every layer), run through the same battery. battery must count it not strict
and see tokens other than the clean run's (an arm that is not strict when clean, as a quantized model's, would
otherwise "catch" a fault that changed nothing), and near_tie must find a divergence no near-tie explains. A gate
that took its tokens from anywhere but the engine under test (the oracle, a cache of the clean run) would miss it.
near_tie has a second fault, made without an engine run: the clean run's first completion less its last token,
which must be divergent (a lost or added token is never a near-tie; its kept tokens' gaps would say ~0).
"""
from __future__ import annotations

import math
import time

from campaigns.gates import GateContext, result
from campaigns.evidence import Arm, GateResult
from vtengine.engine.sampling_params import SamplingParams


def _greedy(ctx: GateContext) -> SamplingParams:
    return SamplingParams(max_tokens=int(ctx.gate_cfg.battery.max_tokens), temperature=0.0, ignore_eos=True)


def goldens(ctx: GateContext) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, golden completion ids) per battery prompt, from the oracle; computed once per campaign."""
    if "goldens" not in ctx.cache:
        outs = ctx.oracle().generate(ctx.battery_prompts(), _greedy(ctx))
        ctx.cache["goldens"] = [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    return ctx.cache["goldens"]


def ours(ctx: GateContext, arm: Arm, fault: bool = False) -> list[list[int]]:
    """The arm's battery completions from its engine; with ``fault``, from its engine with the lever's kernel
    broken (one run shared by battery's and near_tie's self-checks)."""
    key = f"battery:{arm.name}{'#fault' if fault else ''}"
    if key not in ctx.cache:
        if fault:
            with ctx.faulted(arm, ctx.perturb_fault()) as llm:
                outs = llm.generate(ctx.battery_prompts(), _greedy(ctx))
        else:
            outs = ctx.engine(arm).generate(ctx.battery_prompts(), _greedy(ctx))
        ctx.cache[key] = [o.outputs[0].token_ids for o in outs]
    return [list(t) for t in ctx.cache[key]]


def _fault_note(ctx: GateContext, fault: bool) -> str:
    return f"engine under test broken: {ctx.perturb_fault().describe()}" if fault else ""


def gaps_mnats(ctx: GateContext, prompt_ids: list[int], tokens: list[int]) -> list[float]:
    """Per position of our sequence: max(0, logp(oracle argmax) - logp(our token)) under the oracle, millinats
    (NaN stays NaN: a score that is no number ratifies nothing)."""
    lp = ctx.oracle().engine.score(prompt_ids, tokens)
    ours_lp = lp[range(len(tokens)), tokens]
    return [g if math.isnan(g) else max(0.0, g) * 1000.0
            for g in (float(x) for x in (lp.max(dim=-1).values - ours_lp))]


def _row(ctx: GateContext, i: int, prompt_ids: list[int], golden: list[int], toks: list[int]) -> dict:
    """Prompt i strict (our tokens equal the golden), near_tie (every one of our tokens within the threshold of the
    oracle's best, teacher-forced along ours) or divergent. A length difference is divergent whatever the gaps: a
    token lost or added at the end leaves every kept token's gap at ~0 (parity.first_divergences rules a length
    difference after an equal prefix alike; here there is no other kind: the battery runs to a fixed length)."""
    if toks == golden:
        return {"prompt": i, "status": "strict"}
    first = next((j for j, (a, b) in enumerate(zip(toks, golden)) if a != b), min(len(toks), len(golden)))
    row = {"prompt": i, "first_divergence": first}
    vocab = ctx.oracle().engine.model_config.vocab_size
    if len(toks) != len(golden):
        return {**row, "status": "divergent",
                "why": f"{len(toks)} tokens against the golden's {len(golden)}: a token lost or added, no near-tie"}
    if not all(0 <= t < vocab for t in toks):
        return {**row, "status": "divergent", "why": f"a token id outside the vocabulary [0, {vocab})"}
    gaps = gaps_mnats(ctx, prompt_ids, toks)
    worst_gap = max(gaps, key=lambda g: math.inf if math.isnan(g) else g)
    tie = not math.isnan(worst_gap) and worst_gap <= ctx.near_tie_max_mnats
    return {**row, "status": "near_tie" if tie else "divergent", "max_gap_mnats": round(worst_gap, 3),
            "gap_at_divergence_mnats": round(gaps[first], 3)}


def _classify(ctx: GateContext, arm: Arm, fault: bool):
    mine = ours(ctx, arm, fault)
    rows = [_row(ctx, i, pid, golden, toks) for i, ((pid, golden), toks) in enumerate(zip(goldens(ctx), mine))]
    return rows, _fault_note(ctx, fault)


def _lost_last_token(ctx: GateContext, arm: Arm) -> dict:
    """near_tie's second self-check fault, made from the arm's clean tokens: its first prompt's completion with
    the last token dropped (every kept token's gap stays what it was, ~0 where strict). The gate must rule it
    divergent: a gate judging a length difference by its kept tokens' gaps would ratify it."""
    (pid, golden), toks = goldens(ctx)[0], ours(ctx, arm)[0]
    return _row(ctx, 0, pid, golden, toks[:-1] if toks else [0])     # (an empty one: a token added instead)


def run_battery(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    t0 = time.perf_counter()
    gold = goldens(ctx)
    mine = ours(ctx, arm, fault)
    note = _fault_note(ctx, fault)
    strict = sum(a == b for a, b in zip(mine, (g for _, g in gold)))
    counts = {"prompts": len(gold), "strict": strict}
    details = {"fault": note}
    byte_exact = None
    if not fault:
        rows, _ = _classify(ctx, arm, False)
        counts["near_tie"] = sum(r["status"] == "near_tie" for r in rows)
        counts["divergent"] = sum(r["status"] == "divergent" for r in rows)
        details["divergences"] = [r for r in rows if r["status"] != "strict"]
        if arm.role == "candidate":
            base = ours(ctx, ctx.baseline)
            byte_exact = base == mine
            details["tokens_equal_to_baseline_arm"] = byte_exact
    passed = strict == len(gold)
    if fault:
        # a fault the tokens do not show is not caught, unless the arm's "clean" run already carries this very
        # fault (a product test's broken arm): then the two runs are one
        unchanged = mine == ours(ctx, arm, False) and ctx.standing_fault(arm) != ctx.perturb_fault()
        counts["unchanged_from_clean"] = int(unchanged)
        passed = passed or unchanged
    return result("battery", arm, passed, t0, counts=counts, details=details, byte_exact=byte_exact)


def run_near_tie(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    t0 = time.perf_counter()
    rows, note = _classify(ctx, arm, fault)
    div = [r for r in rows if r["status"] != "strict"]
    # the largest gap scored (a length or vocabulary divergence has none: its row says why, and it fails the gate)
    max_gap = max((r["max_gap_mnats"] for r in div if "max_gap_mnats" in r and not math.isnan(r["max_gap_mnats"])),
                  default=0.0)
    counts = {"divergences": len(div), "ratified": sum(r["status"] == "near_tie" for r in div),
              "max_gap_mnats": max_gap}
    unscored = sum("max_gap_mnats" not in r or math.isnan(r["max_gap_mnats"]) for r in div)
    if unscored:
        counts["unscored"] = unscored
    passed = all(r["status"] == "near_tie" for r in div)
    details = {"fault": note, "threshold_mnats": ctx.near_tie_max_mnats, "divergences": div}
    if fault:       # caught only where both faults fail the gate: the broken kernel, and a lost last token
        lost = _lost_last_token(ctx, arm)
        counts["lost_token_ratified"] = int(lost["status"] != "divergent")
        passed = passed or lost["status"] != "divergent"
        details["fault"] = f"{note}; and the clean run's first completion less its last token"
    return result("near_tie", arm, passed, t0, counts=counts, details=details)
