"""The parity_enabler decision table: every verdict reached from constructed gate and leg data (the builders are in
tests/helpers.py: a complete, binding campaign whose grid values each test chooses, then breaks one thing)."""
from __future__ import annotations

import math
import statistics

import pytest

from campaigns import policy
from campaigns.evidence import Evidence
from campaigns.gates import GATE_NAMES
from campaigns.stats import compute_stats, oriented_ratio, separation, summarize
from helpers import TPUT_WIN, gates, legs, make_evidence


def verdict(ev: Evidence) -> str:
    return ev.decision.verdict


# ----------------------------------------------------------------------------------------------- statistics


def test_ratio_is_oriented_so_above_one_is_better():
    assert oriented_ratio(110.0, 100.0, higher_is_better=True) == pytest.approx(1.1)
    assert oriented_ratio(8.0, 10.0, higher_is_better=False) == pytest.approx(1.25)   # latency: OFF/ON
    assert oriented_ratio(5.0, 0.0, higher_is_better=True) is None


@pytest.mark.parametrize("on,off,higher,expected", [
    ([110, 111, 112], [100, 101, 102], True, "WIN"),
    ([90, 91, 92], [100, 101, 102], True, "LOSS"),
    ([102, 103, 104], [100, 101, 102], True, "NEUTRAL"),     # worst ON == best OFF: a tie is not separation
    ([98, 99, 100], [100, 101, 102], True, "NEUTRAL"),       # best ON == worst OFF
    ([9.0, 9.1, 9.2], [10.0, 10.1, 10.2], False, "WIN"),     # latency: lower is better
    ([9.0, 10.1, 9.2], [10.0, 10.1, 10.2], False, "NEUTRAL"),
    ([9.0, 9.5, 10.0], [10.0, 10.5, 11.0], False, "NEUTRAL"),   # latency: worst ON == best OFF is a tie, no WIN
    ([11.0, 11.5, 12.0], [10.0, 10.5, 11.0], False, "NEUTRAL"),  # latency: best ON == worst OFF is a tie, no LOSS
    ([11.0], [10.0], False, "LOSS"),                         # a single rep separates trivially
    ([5, 5, 5], [5, 5, 5], True, "NEUTRAL"),                 # all reps equal
])
def test_separation_table(on, off, higher, expected):
    assert separation(on, off, higher) == expected


def test_stats_medians_cv_and_primary_flags():
    ev = make_evidence(TPUT_WIN)
    s = next(s for s in ev.stats if s.axis == "total_token_throughput" and s.concurrency == 4)
    assert s.reps == {"off": [100.0, 101.0, 102.0], "on": [110.0, 111.0, 112.0]}
    assert s.summary["on"].median == 111.0 and s.summary["off"].mean == 101.0
    assert s.summary["on"].cv == pytest.approx(1.0 / 111.0)
    assert s.ratio == pytest.approx(111.0 / 101.0) and s.separation == "WIN" and s.primary
    assert {st.axis for st in ev.stats if st.primary} == {"total_token_throughput", "tpot"}
    assert len(ev.stats) == 7 * 4


@pytest.mark.parametrize("values", [[100.0, 101.0, 102.0], [1e9 + 1, 1e9 + 2, 1e9 + 4, 1e9 + 8],
                                    [0.031, 0.029, 0.0305, 0.0298, 0.0302], [5.0, 5.0], [3.3333] * 26])
def test_the_float_spread_equals_the_exact_one(values):
    """The CV's standard deviation is summed in floats for speed: it must agree with statistics.stdev (exact
    Fractions) to rounding, also where the values sit far from zero and one pass would cancel."""
    cv = summarize(values).cv
    assert cv == pytest.approx(statistics.stdev(values) / statistics.fmean(values), rel=1e-12, abs=1e-300)


def test_invalid_legs_are_left_out_of_statistics():
    lg = legs(TPUT_WIN)
    lg[0].valid = False
    lg[0].metrics["total_token_throughput"] = 1e9       # would dominate any statistic it entered
    stats = compute_stats(lg, "off", ["on"])
    s = next(s for s in stats if s.axis == "total_token_throughput" and s.concurrency == 1)
    assert max(s.reps["off"] + s.reps["on"]) == 112.0 and sum(len(v) for v in s.reps.values()) == 5


def test_arms_that_served_different_prompts_void_the_grid():
    from campaigns import policy
    ev = make_evidence(TPUT_WIN)
    assert ev.decision.verdict == "FLIP"
    next(leg for leg in ev.legs if leg.arm == "on" and leg.concurrency == 4).prompts_sha256 = "something-else"
    d = policy.decide(ev)
    assert d.verdict == "NON-BINDING" and any("different prompts" in r and "c4" in r for r in d.reasons)


# ----------------------------------------------------------------------------------------------- verdicts


def test_flip_byte_exact_win():
    ev = make_evidence(TPUT_WIN)
    d = ev.decision
    assert d.verdict == "FLIP" and d.new_default is True and d.binding and d.byte_exact is True and d.token_safe
    assert d.rule == policy.rule_text("FLIP", policy.policy_params(ev)) and d.rule.startswith("4. FLIP")
    assert "total tok/s ×1.099 at c1 (WIN)" == d.headline


def test_flip_on_latency_axis_win():
    ev = make_evidence({"median_tpot_ms": {"off": [10.0, 10.1, 10.2], "on": [9.0, 9.1, 9.2]}})
    assert verdict(ev) == "FLIP"
    assert any("TPOT" in r for r in ev.decision.reasons)


def test_keep_when_reps_overlap():
    ev = make_evidence({"total_token_throughput": {"off": [101.0, 102.0, 104.0], "on": [100.0, 103.0, 106.0]}})
    assert verdict(ev) == "KEEP" and ev.decision.rule.startswith("6. KEEP")
    assert any("no WIN on a primary axis" in r for r in ev.decision.reasons)
    # 3 reps that overlap this much cannot call the lever neutral within 2%: the KEEP says so
    assert ev.decision.effect_note.startswith("underpowered: the effect could be anywhere from")
    assert ev.decision.headline.split(" ×")[0] in ("total tok/s", "TPOT") and "pooled" in ev.decision.headline


def test_keep_says_neutral_when_the_pooled_interval_is_narrow():
    tight = {"total_token_throughput": {"off": [1000.0, 1001.0, 1002.0], "on": [1000.5, 1001.5, 1002.5]},
             "median_tpot_ms": {"off": [10.0, 10.01, 10.02], "on": [10.005, 10.015, 10.025]}}
    ev = make_evidence(tight, reps=3)
    assert verdict(ev) == "KEEP"
    assert ev.decision.effect_note.startswith("neutral: the effect is within ±"), ev.decision.effect_note
    pooled = next(pe for pe in ev.pooled if pe.axis == "total_token_throughput")
    assert pooled.effect.lo <= 1.0005 <= pooled.effect.hi and pooled.effect.hi - pooled.effect.lo < 0.01


def test_tie_between_worst_on_and_best_off_is_not_a_win():
    ev = make_evidence({"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [102.0, 103.0, 104.0]}})
    assert verdict(ev) == "KEEP"
    assert all(s.separation == "NEUTRAL" for s in ev.stats)


def test_a_latency_tie_is_not_a_win():
    ev = make_evidence({"median_tpot_ms": {"off": [10.0, 10.5, 11.0], "on": [9.0, 9.5, 10.0]}})
    assert verdict(ev) == "KEEP"
    assert all(s.separation == "NEUTRAL" for s in ev.stats if s.axis == "tpot")


def test_all_reps_equal_is_neutral_keep():
    ev = make_evidence({})
    assert verdict(ev) == "KEEP"
    assert all(s.ratio == 1.0 and s.separation == "NEUTRAL" for s in ev.stats)


def test_single_rep_wins_in_statistics_but_does_not_bind():
    ev = make_evidence({"total_token_throughput": {"off": [100.0], "on": [110.0]}}, reps=1)
    assert any(s.separation == "WIN" for s in ev.stats)
    assert verdict(ev) == "NON-BINDING" and not ev.decision.binding
    assert any("1 reps per point, fewer than 3" in r for r in ev.decision.reasons)


def test_loss_on_a_non_primary_axis_blocks_the_flip():
    ev = make_evidence({**TPUT_WIN, "median_ttft_ms": {"off": [10.0, 10.1, 10.2], "on": [12.0, 12.1, 12.2]}})
    assert verdict(ev) == "KEEP"
    assert any(r.startswith("LOSS on TTFT") for r in ev.decision.reasons)


ITL_UP = {"median_itl_ms": {"off": [10.0, 10.1, 10.2], "on": [30.0, 30.1, 30.2]}}
TRADED = {"traded_axes": {"itl": "each decode token shares its step with a prefill chunk"}}


def test_a_loss_on_a_declared_traded_axis_is_reported_and_vetoes_nothing():
    vetoed = make_evidence({**TPUT_WIN, **ITL_UP})
    assert verdict(vetoed) == "KEEP" and any(r.startswith("LOSS on ITL") for r in vetoed.decision.reasons)
    ev = make_evidence({**TPUT_WIN, **ITL_UP}, policy_cfg=TRADED)
    d = ev.decision
    assert d.verdict == "FLIP", d.reasons
    assert any(r.startswith("traded LOSS on ITL at c1: ratio 0.336") for r in d.reasons), d.reasons
    assert "ITL traded by design" in d.rule and "shares its step with a prefill chunk" in d.rule
    # trading one axis leaves the others' veto in place
    ev = make_evidence({**TPUT_WIN, **ITL_UP, "median_ttft_ms": {"off": [10.0, 10.1, 10.2], "on": [12.0, 12.1, 12.2]}},
                       policy_cfg=TRADED)
    assert verdict(ev) == "KEEP" and any(r.startswith("LOSS on TTFT") for r in ev.decision.reasons)
    assert any(r.startswith("traded LOSS on ITL") for r in ev.decision.reasons)


def test_a_traded_axis_without_a_win_elsewhere_does_not_flip():
    ev = make_evidence(ITL_UP, policy_cfg=TRADED)
    assert verdict(ev) == "KEEP" and any("no WIN on a primary axis" in r for r in ev.decision.reasons)


def test_a_win_on_a_traded_axis_does_not_save_a_refuted_candidate():
    """A traded axis is reported, never deciding, either way: a candidate that loses on a primary axis is refuted
    even where it wins on the traded one (mixed_prefill off lost total tok/s x0.85-0.91 at every concurrency, and
    a WIN on traded ITL kept it KEEP). An untraded secondary WIN still stops the REJECT."""
    itl_down = {"median_itl_ms": {"off": [30.0, 30.1, 30.2], "on": [10.0, 10.1, 10.2]}}
    loss = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]}}
    ev = make_evidence({**loss, **itl_down}, policy_cfg=TRADED)
    assert verdict(ev) == "REJECT-PERFORMANCE", ev.decision.reasons
    assert verdict(make_evidence({**loss, **itl_down})) == "KEEP"


def test_reject_performance_on_primary_loss_without_win():
    ev = make_evidence({"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]}})
    d = ev.decision
    assert d.verdict == "REJECT-PERFORMANCE" and d.rule.startswith("5. REJECT (performance)") and d.new_default is None
    assert d.headline == "total tok/s ×0.901 at c1 (LOSS)"


def test_primary_loss_with_a_win_elsewhere_is_keep_not_refuted():
    ev = make_evidence({"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]},
                        "median_ttft_ms": {"off": [10.0, 10.1, 10.2], "on": [8.0, 8.1, 8.2]}})
    assert verdict(ev) == "KEEP"


@pytest.mark.parametrize("on_value,expected", [(1019.9, "KEEP"), (1020.1, "FLIP")])
def test_min_gain_for_a_non_byte_exact_lever(on_value, expected):
    # Not byte-exact, divergences ratified by near_tie: the WIN must clear 1 + min_gain (2% here, above min_effect).
    g = gates(byte_exact=False, **{"battery@on": {"passed": False, "counts": {"strict": 14, "divergent": 2}},
                                    "near_tie@on": {"counts": {"divergences": 2, "max_gap_mnats": 120.0}}})
    ev = make_evidence({"total_token_throughput": {"off": [1000.0] * 3, "on": [on_value] * 3}}, gate_results=g,
                       policy_cfg={"min_gain": 0.02})
    assert all(s.separation == "WIN" for s in ev.stats if s.axis == "total_token_throughput")
    assert verdict(ev) == expected
    assert ev.decision.byte_exact is False and ev.decision.token_safe
    if expected == "KEEP":
        assert any("below the minimum gain 2.0%" in r for r in ev.decision.reasons)


@pytest.mark.parametrize("on_value,min_effect,expected", [(1001.0, 0.01, "KEEP"), (1011.0, 0.01, "FLIP"),
                                                          (1001.0, 0.0, "FLIP")])
def test_a_byte_exact_lever_needs_only_the_minimum_effect(on_value, min_effect, expected):
    ev = make_evidence({"total_token_throughput": {"off": [1000.0] * 3, "on": [on_value] * 3}},
                       policy_cfg={"min_effect": min_effect})
    assert verdict(ev) == expected
    if expected == "KEEP":
        assert "no WIN on a primary axis (total_token_throughput, tpot)" in ev.decision.reasons
        small = "; ".join(f"total tok/s at c{c} WIN ×1.001" for c in (1, 2, 4, 8))
        assert f"separated below the minimum effect 1.0%, not counted: {small}" in ev.decision.reasons


@pytest.mark.parametrize("op_exact,battery_equal,expected", [
    (None, True, None),        # op inapplicable: equal greedy tokens alone prove no bitwise equality
    (True, True, True),
    (True, False, False),      # the kernels compare equal, yet the engine's tokens differ: not byte-exact
    (None, False, False),
])
def test_byte_exactness_is_the_op_gates_bitwise_comparison(op_exact, battery_equal, expected):
    """The policy reads byte-exactness from the op gate's bitwise comparison: the battery's equal tokens on a few
    prompts once made an engine-loop lever (op inapplicable) "measured byte-exact", which exempts its WINs from
    min_gain; its tokens differing still shows it is not. A +1.1% WIN (above min_effect, below min_gain 2%) FLIPs
    only a byte-exact lever."""
    g = gates(byte_exact=battery_equal, **{"op@on": {"byte_exact": op_exact}})
    if op_exact is None:
        g = [x for x in g if x.gate != "op"]
    ev = make_evidence({"total_token_throughput": {"off": [1000.0] * 3, "on": [1011.0] * 3}}, gate_results=g,
                       policy_cfg={"min_gain": 0.02},
                       inapplicable={"op": "an engine-loop lever"} if op_exact is None else None)
    assert ev.decision.byte_exact is expected
    assert verdict(ev) == ("FLIP" if expected else "KEEP")


def _steady_shift_at_c1(tpot_c1_ratio: float, min_effect: float) -> Evidence:
    """A +5% total tok/s WIN at every concurrency, and at c1 a steady TPOT shift of the candidate (every rep)."""
    quiet = [4.79, 4.78, 4.79]                         # TPOT's spread at c1 on the H200: 0.1%
    ev = make_evidence({**TPUT_WIN, "median_tpot_ms": {"off": quiet, "on": quiet}},
                       policy_cfg={"min_effect": min_effect})
    for leg in ev.legs:
        if leg.concurrency == 1 and leg.arm == "on":
            leg.metrics["median_tpot_ms"] = leg.metrics["median_tpot_ms"] / tpot_c1_ratio
    return policy.conclude(ev)


def test_a_steady_shift_below_the_minimum_effect_does_not_veto_a_flip():
    # decode_wave_grid-65b2738: both arms launch the same kernels at c1, yet every candidate rep was 0.7% slower
    # on TPOT (the second server of a pair; the A/A grids saw 0.4-0.6%). Five quiet reps separate such a shift.
    ev = _steady_shift_at_c1(0.993, 0.01)
    tpot_c1 = next(s for s in ev.stats if s.axis == "tpot" and s.concurrency == 1)
    assert tpot_c1.separation == "LOSS" and not policy.counts(tpot_c1, policy.policy_params(ev))
    assert policy.separation_label(tpot_c1, policy.policy_params(ev)) == "small LOSS"
    assert verdict(ev) == "FLIP"
    assert "separated below the minimum effect 1.0%, not counted: TPOT at c1 LOSS ×0.993" in ev.decision.reasons
    assert "1 ± 1.0%" in ev.decision.rule
    # the rule before min_effect (0) counted it, and kept the default
    old = _steady_shift_at_c1(0.993, 0.0)
    assert verdict(old) == "KEEP" and "LOSS on TPOT at c1: ratio 0.993" in old.decision.reasons


def test_a_loss_past_the_minimum_effect_still_vetoes_the_flip():
    ev = _steady_shift_at_c1(0.985, 0.01)
    assert verdict(ev) == "KEEP" and "LOSS on TPOT at c1: ratio 0.985" in ev.decision.reasons


def test_evidence_decided_before_min_effect_counts_every_separation():
    """Evidence whose config predates min_effect reads 0, the rule it was decided by (records stay as decided)."""
    ev = make_evidence({"total_token_throughput": {"off": [1000.0] * 3, "on": [1001.0] * 3}})
    del ev.config["campaign"]["policy"]["min_effect"]
    ev.__dict__.pop("_settings", None)
    assert policy.policy_params(ev).min_effect == 0.0
    assert verdict(policy.conclude(ev)) == "FLIP"


def test_min_gain_is_a_policy_parameter():
    g = gates(byte_exact=False)
    ev = make_evidence({"total_token_throughput": {"off": [1000.0] * 3, "on": [1030.0] * 3}}, gate_results=g,
                       policy_cfg={"min_gain": 0.05})
    assert verdict(ev) == "KEEP"


def test_not_token_safe_without_ratification_keeps():
    # a campaign that does not list near_tie: nothing ratifies the divergences of a non-byte-exact lever
    g = [x for x in gates(byte_exact=False) if x.gate != "near_tie"]
    ev = make_evidence(TPUT_WIN, gate_results=g, campaign_gates=[n for n in GATE_NAMES if n != "near_tie"])
    assert verdict(ev) == "KEEP" and not ev.decision.token_safe
    assert any(r.startswith("not token-safe") and "near_tie did not run" in r for r in ev.decision.reasons)


def test_unmeasured_byte_exactness_is_not_token_safe():
    g = [x for x in gates(byte_exact=None) if x.gate != "near_tie"]
    ev = make_evidence(TPUT_WIN, gate_results=g, campaign_gates=[n for n in GATE_NAMES if n != "near_tie"])
    assert ev.decision.byte_exact is None and verdict(ev) == "KEEP"


@pytest.mark.parametrize("gate", ["op", "battery", "graph_parity", "async_parity", "memcheck"])
def test_a_listed_gate_that_did_not_run_makes_the_verdict_non_binding(gate):
    # the binding pdl FLIP evidence shape: one listed gate skipped on the CUDA run must void the FLIP
    g = gates(**{f"{gate}@on": {"skipped": True, "reason": "compute-sanitizer is not installed on this host"}})
    ev = make_evidence(TPUT_WIN, gate_results=g)
    assert verdict(ev) == "NON-BINDING" and not ev.decision.binding
    assert any(f"{gate}@on (compute-sanitizer is not installed" in r for r in ev.decision.reasons), ev.decision.reasons
    # declared inapplicable by the campaign (with the reason), the same skip does not void it
    ev = make_evidence(TPUT_WIN, gate_results=g, inapplicable={gate: "the lever launches no kernel it covers"})
    assert verdict(ev) == "FLIP" and ev.decision.binding


# --- rule 1: INVALID


def test_invalid_when_a_self_check_passes():
    g = gates(**{"op@on": {"self_check": False}})
    ev = make_evidence(TPUT_WIN, gate_results=g)
    assert verdict(ev) == "INVALID" and ev.decision.rule.startswith("1. INVALID")
    assert any("self-check of gate op passed" in r for r in ev.decision.reasons)


def test_invalid_when_a_gate_never_self_checked():
    g = gates(**{"battery@off": {"self_check": None}, "battery@on": {"self_check": None}})
    assert verdict(make_evidence(TPUT_WIN, gate_results=g)) == "INVALID"
    # one arm's run without its self-check is not covered by the other arm's: each run needs its own proof
    ev = make_evidence(TPUT_WIN, gate_results=gates(**{"op@on": {"self_check": None}}))
    assert verdict(ev) == "INVALID"
    assert "gate op ran without its self-check on arm on, so it is not shown able to fail there" in ev.decision.reasons


def test_invalid_when_the_lever_is_inert():
    g = gates(**{"mechanism@on": {"passed": False, "reason": "gqa_swap route launches 0"}})
    ev = make_evidence(TPUT_WIN, gate_results=g)
    assert verdict(ev) == "INVALID" and any("inert" in r and "launches 0" in r for r in ev.decision.reasons)


def test_invalid_when_the_baseline_fails_a_gate():
    g = gates(**{"battery@off": {"passed": False}, "near_tie@off": {"passed": False}})
    assert verdict(make_evidence(TPUT_WIN, gate_results=g)) == "INVALID"


def test_baseline_battery_near_ties_ratified_are_not_a_failure():
    # bf16 kernels vs the oracle: the baseline diverges only at near-ties, all ratified -> not INVALID
    g = gates(**{"battery@off": {"passed": False}, "near_tie@off": {"counts": {"divergences": 3,
                                                                                "max_gap_mnats": 420.0}}})
    ev = make_evidence(TPUT_WIN, gate_results=g)
    assert verdict(ev) == "FLIP" and any("baseline arm off all ratified" in r for r in ev.decision.reasons)
    g = gates(**{"battery@off": {"passed": False}, "near_tie@off": {"counts": {"divergences": 3,
                                                                                "max_gap_mnats": 520.0}}})
    assert verdict(make_evidence(TPUT_WIN, gate_results=g)) == "INVALID"      # a gap over the policy's 500


def test_invalid_comes_before_everything_even_on_cpu():
    g = gates(**{"op@on": {"self_check": False, "passed": False}})
    assert verdict(make_evidence(TPUT_WIN, gate_results=g, device_type="cpu")) == "INVALID"


# --- rule 2: REJECT (correctness)


def test_reject_when_the_candidate_fails_a_correctness_gate():
    g = gates(**{"graph_parity@on": {"passed": False, "reason": "token 17 differs"}})
    ev = make_evidence(TPUT_WIN, gate_results=g, device_type="cpu")   # rule 2 fires before NON-BINDING
    assert verdict(ev) == "REJECT-CORRECTNESS" and ev.decision.rule.startswith("2. REJECT (correctness)")
    assert any("graph_parity fails on arm on: token 17 differs" in r for r in ev.decision.reasons)


def test_battery_divergence_without_ratification_is_rejected():
    g = gates(byte_exact=False, **{"battery@on": {"passed": False}, "near_tie@on": {"passed": False}})
    assert verdict(make_evidence(TPUT_WIN, gate_results=g)) == "REJECT-CORRECTNESS"


def test_near_tie_gap_above_the_policy_threshold_is_rejected():
    g = gates(byte_exact=False, **{"battery@on": {"passed": False},
                                    "near_tie@on": {"counts": {"divergences": 1, "max_gap_mnats": 700.0}}})
    ev = make_evidence(TPUT_WIN, gate_results=g)
    assert verdict(ev) == "REJECT-CORRECTNESS"
    assert any("700.0 mnats exceeds the policy's 500 mnats" in r for r in ev.decision.reasons)


def test_ratified_battery_divergence_can_flip():
    g = gates(byte_exact=False, **{"battery@on": {"passed": False},
                                    "near_tie@on": {"counts": {"divergences": 1, "max_gap_mnats": 0.0}}})
    ev = make_evidence(TPUT_WIN, gate_results=g)
    assert verdict(ev) == "FLIP" and any("ratified by near_tie" in r for r in ev.decision.reasons)


# --- rule 3: NON-BINDING


@pytest.mark.parametrize("kwargs,reason", [
    ({"device_type": "cpu"}, "is not CUDA"),
    ({"dirty": True}, "dirty"),
    ({"binding": False}, "rehearsal grid"),
    ({"reps": 2}, "2 reps per point, fewer than 3"),
])
def test_non_binding_conditions(kwargs, reason):
    ev = make_evidence(TPUT_WIN, **kwargs)
    assert verdict(ev) == "NON-BINDING" and ev.decision.rule.startswith("3. NON-BINDING")
    assert any(reason in r for r in ev.decision.reasons), ev.decision.reasons


def test_only_run_outputs_changed_is_not_a_dirty_tree():
    """A bench result written beside the checkout (bench/results/) is output, not code: the verdict binds and says
    which files it set aside; one changed source file among them keeps the tree dirty, named alone."""
    ev = make_evidence(TPUT_WIN, dirty=True)
    ev.fingerprint.dirty_files = ["bench/results/decode-1.json", "records/campaigns/x/evidence.json"]
    policy.conclude(ev)
    assert verdict(ev) == "FLIP"
    assert any("run output paths only" in r and "bench/results/decode-1.json" in r for r in ev.decision.reasons)
    ev.fingerprint.dirty_files.append("vtengine/kernels/attention.py")
    policy.conclude(ev)
    assert verdict(ev) == "NON-BINDING"
    assert "the git tree was dirty (vtengine/kernels/attention.py)" in ev.decision.reasons


def test_an_invalid_leg_voids_the_grid():
    ev = make_evidence(TPUT_WIN)
    ev.legs[5].valid, ev.legs[5].reasons = False, ["request 3 returned 127 tokens, expected 128"]
    policy.conclude(ev)
    assert verdict(ev) == "NON-BINDING" and any("127 tokens" in r for r in ev.decision.reasons)


def test_a_missing_leg_voids_the_grid():
    ev = make_evidence(TPUT_WIN)
    del ev.legs[-1]
    policy.conclude(ev)
    assert verdict(ev) == "NON-BINDING" and any("1 planned leg(s) missing" in r for r in ev.decision.reasons)


def test_arms_on_different_fingerprints_do_not_bind():
    ev = make_evidence(TPUT_WIN)
    ev.arm_fingerprints["on"] = "fp1"
    policy.conclude(ev)
    assert verdict(ev) == "NON-BINDING"


def test_skipped_mechanism_gate_is_no_proof():
    g = gates(**{"mechanism@on": {"skipped": True, "passed": False, "reason": "torch backend has no routes"}})
    ev = make_evidence(TPUT_WIN, gate_results=g)
    assert verdict(ev) == "NON-BINDING" and any("no mechanism proof" in r for r in ev.decision.reasons)


# --- correctness fixes and several candidates


def test_correctness_fix_is_red_first():
    fix = {"flip_on_correctness": True, "fix_gates": ["battery", "near_tie"]}
    g = gates(byte_exact=False, **{"battery@off": {"passed": False, "counts": {"prompts": 16, "strict": 9}},
                                   "near_tie@off": {"passed": False, "counts": {"divergences": 7}}})
    ev = make_evidence({}, gate_results=g, policy_cfg=fix)
    d = ev.decision
    assert d.verdict == "FLIP" and d.rule.startswith("4. FLIP (correctness fix)") and d.new_default is True
    assert "battery, near_tie" in d.rule
    assert any(r.startswith("battery: RED on off (prompts 16, strict 9) → GREEN on on") for r in d.reasons)
    # the gates lead, the speed follows as a pooled interval, never a point ratio (the first H200 recheck's title
    # read "TPOT ×0.999 at c4 (NEUTRAL)", as if that were why it flipped), also where the grid has a WIN
    assert d.headline.startswith("RED → GREEN on battery, near_tie; speed ") and " at c" not in d.headline
    d = make_evidence(TPUT_WIN, gate_results=g, policy_cfg=fix).decision
    assert d.verdict == "FLIP" and d.headline.startswith("RED → GREEN on battery, near_tie; speed total tok/s ×1.0")
    assert "pooled (" in d.headline and " at c" not in d.headline
    # bf16 on the H200: the fixed battery still has near-ties, every one ratified; it counts as passing, and says so
    g = gates(byte_exact=False, **{"battery@off": {"passed": False, "counts": {"divergent": 16}},
                                   "near_tie@off": {"passed": False, "counts": {"divergences": 16}},
                                   "battery@on": {"passed": False, "counts": {"near_tie": 13, "strict": 3}}})
    d = make_evidence({}, gate_results=g, policy_cfg=fix).decision
    assert d.verdict == "FLIP" and "(a battery whose every divergence near_tie ratifies counts as passing)" in d.rule
    assert any(r == "battery: RED on off (divergent 16) → near-ties only on on (near_tie 13, strict 3), all ratified "
               "by near_tie" for r in d.reasons), d.reasons
    # Without the campaign's say-so the same evidence is INVALID (the baseline fails a gate).
    g = gates(byte_exact=False, **{"battery@off": {"passed": False, "counts": {"prompts": 16, "strict": 9}},
                                   "near_tie@off": {"passed": False, "counts": {"divergences": 7}}})
    assert verdict(make_evidence({}, gate_results=g)) == "INVALID"
    # A baseline that passes the fix gates cannot prove the fix: INVALID, saying so.
    ev = make_evidence({}, gate_results=gates(byte_exact=False), policy_cfg=fix)
    assert verdict(ev) == "INVALID"
    assert any("baseline off passes battery" in r and "cannot prove the fix" in r for r in ev.decision.reasons)
    # A candidate that still fails a fix gate is rejected, whatever the baseline did.
    g = gates(byte_exact=False, **{"battery@off": {"passed": False}, "near_tie@off": {"passed": False},
                                   "battery@on": {"passed": False}, "near_tie@on": {"passed": False}})
    assert verdict(make_evidence({}, gate_results=g, policy_cfg=fix)) == "REJECT-CORRECTNESS"


def test_a_fix_is_red_first_on_both_arms_alike_and_a_fix_gate_that_did_not_run_shows_nothing():
    """A battery whose every divergence near_tie ratifies counts as passing, on the baseline as on the candidate:
    two arms that diverge alike (the same near-ties) show no fix, so INVALID, not a FLIP. A fix gate that did not
    run on the candidate (a crashed server) is no failure: NON-BINDING, never REJECT (which refutes the lever)."""
    fix = {"flip_on_correctness": True, "fix_gates": ["battery"]}
    near = {"counts": {"divergences": 3, "max_gap_mnats": 100.0}}
    g = gates(byte_exact=False, **{"battery@off": {"passed": False, "counts": {"divergent": 3}},
                                   "battery@on": {"passed": False, "counts": {"divergent": 3}},
                                   "near_tie@off": near, "near_tie@on": near})
    d = make_evidence({}, gate_results=g, policy_cfg=fix).decision
    assert d.verdict == "INVALID" and d.new_default is None
    assert any("baseline off passes battery (divergent 3, every divergence ratified by near_tie" in r
               and "cannot prove the fix" in r for r in d.reasons), d.reasons
    g = gates(byte_exact=False, **{"battery@off": {"passed": False, "counts": {"divergent": 3}},
                                   "near_tie@off": {"passed": False},
                                   "battery@on": {"skipped": True, "passed": False, "reason": "server crashed"}})
    d = make_evidence({}, gate_results=g, policy_cfg={**fix, "fix_gates": ["battery", "near_tie"]}).decision
    assert d.verdict == "NON-BINDING" and not d.binding
    assert "correctness fix: gate battery did not run on the candidate on, so nothing shows the fix" in d.reasons


@pytest.mark.parametrize("bad", [float("nan"), None, 0.0, float("inf")])
def test_a_valid_leg_without_a_readable_value_voids_the_grid(bad):
    """A value the statistics cannot read (missing, NaN, zero, infinite) would drop that rep from its point: a
    TPOT missing in every candidate leg leaves no TPOT point to veto a throughput WIN, and one rep of three would
    "separate" alone. Either way the grid is void (NON-BINDING), never a FLIP, and nothing crashes."""
    values = {**TPUT_WIN, "median_tpot_ms": {"off": [10.0, 10.1, 10.2], "on": [12.0, 12.1, 12.2]}}   # a TPOT LOSS
    assert verdict(make_evidence(values)) == "KEEP"
    ev = make_evidence(values)
    for leg in ev.legs:
        if leg.arm == "on":
            leg.metrics["median_tpot_ms"] = bad
    policy.conclude(ev)
    assert verdict(ev) == "NON-BINDING", ev.decision.reasons
    assert ev.decision.reasons[0].startswith(f"void grid: 12 value(s) missing or not a finite positive number in "
                                             f"valid legs (first: median_tpot_ms = {bad!r} at c1 rep 0 arm on)")
    ev = make_evidence(values)
    one = [leg for leg in ev.legs if leg.arm == "on" and leg.concurrency == 1][0]
    one.metrics["median_tpot_ms"] = bad
    policy.conclude(ev)
    assert verdict(ev) == "NON-BINDING" and ev.decision.reasons[0].startswith("void grid: 1 value(s)")


def test_an_optional_axis_no_leg_measured_is_left_out_not_a_void_grid():
    """P99 ITL primary on a grid none of whose legs measured it: the statistics have no such point (calibration
    leaves it out the same way, and its simulated legs carry none), so the grid decides on the axes it has; a void
    grid there would make every simulated campaign NON-BINDING and the error rates 0."""
    ev = make_evidence(TPUT_WIN, policy_cfg={"primary_axes": ["total_token_throughput", "tpot", "p99_itl"]})
    assert not any("p99_itl_ms" in leg.metrics for leg in ev.legs)
    assert verdict(ev) == "FLIP", ev.decision.reasons


def test_a_flip_among_candidates_goes_to_the_best_counted_win_not_a_neutral_ratio():
    """Both candidates FLIP; b's best primary ratio (x1.386) is a NEUTRAL point (its reps 95/140/141 overlap the
    baseline's), a's is a counted WIN at every point: a is the new default."""
    values = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "a": [110.0, 111.0, 112.0],
                                         "b": [95.0, 140.0, 141.0]},
              "median_tpot_ms": {"off": [10.0, 10.1, 10.2], "a": [10.0, 10.1, 10.2], "b": [9.8, 9.85, 9.9]}}
    d = make_evidence(values, gate_results=gates(arms=("off", "a", "b")), candidates=("a", "b")).decision
    assert d.per_candidate == {"a": "FLIP", "b": "FLIP"}
    assert d.verdict == "FLIP" and d.candidate == "a" and d.new_default == "a"
    # correctness fixes both, no WIN counted anywhere: the best plain ratio decides (not the first candidate, a
    # 10% LOSS)
    fix = {"flip_on_correctness": True, "fix_gates": ["battery", "near_tie"]}
    g = gates(arms=("off", "a", "b"), byte_exact=False,
              **{"battery@off": {"passed": False}, "near_tie@off": {"passed": False}})
    values = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "a": [90.0, 91.0, 92.0],
                                         "b": [101.0, 102.0, 103.0]}}
    d = make_evidence(values, gate_results=g, candidates=("a", "b"), policy_cfg=fix).decision
    assert d.per_candidate == {"a": "FLIP", "b": "FLIP"} and d.candidate == "b", (d.per_candidate, d.candidate)


def test_several_candidates_report_the_flipping_one():
    values = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "auto": [100.5, 101.0, 101.5],
                                         "8": [110.0, 111.0, 112.0]}}
    g = gates(arms=("off", "auto", "8"))
    ev = make_evidence(values, gate_results=g, candidates=("auto", 8), lever="nsplits_cap")
    d = ev.decision
    assert d.verdict == "FLIP" and d.candidate == "8" and d.new_default == 8
    assert d.per_candidate == {"auto": "KEEP", "8": "FLIP"}


def test_headline_is_finite_and_rule_is_quoted_for_every_verdict():
    for ev in (make_evidence(TPUT_WIN), make_evidence({}), make_evidence(TPUT_WIN, device_type="cpu")):
        assert ev.decision.rule in {policy.rule_text(k, policy.policy_params(ev)) for k in policy.RULES}
        assert "×" in ev.decision.headline and not math.isnan(float(ev.decision.headline.split("×")[1][:5]))


WIDE = (1, 2, 4, 8, 16, 32, 64, 128)


def _separated_only_at(ev: Evidence, keep: set[int]) -> Evidence:
    """The evidence with both arms' throughput equal (no separation) except at the concurrencies in ``keep``."""
    for leg in ev.legs:
        if leg.concurrency not in keep and leg.arm == "on":
            twin = next(x for x in ev.legs if x.arm == "off" and (x.concurrency, x.rep) == (leg.concurrency, leg.rep))
            leg.metrics = dict(twin.metrics)
    return policy.conclude(ev)


@pytest.mark.parametrize("values,separated", [
    (TPUT_WIN, "FLIP"),
    ({"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]}}, "REJECT-PERFORMANCE"),
])
def test_a_wide_grid_needs_separations_at_one_concurrency_per_four_points(values, separated):
    # 8 concurrencies: one separated point is what luck gives a lever that does nothing (the wide grid's false FLIP
    # was 5.8% at one WIN on the H200 noise); two are needed. The 4-point grid still needs one.
    assert verdict(_separated_only_at(make_evidence(values), {8})) == separated
    one = _separated_only_at(make_evidence(values, concurrency=WIDE), {64})
    assert verdict(one) == "KEEP" and "one concurrency per 4 of its points" in policy.rule_text(
        "FLIP", policy.policy_params(one))
    if separated == "FLIP":
        assert any("WINs at 1 concurrency, fewer than the 2 this grid's 8 points need" in r
                   for r in one.decision.reasons), one.decision.reasons
    assert verdict(_separated_only_at(make_evidence(values, concurrency=WIDE), {64, 128})) == separated
    # an explicit policy setting overrides the rule of thumb
    assert verdict(_separated_only_at(make_evidence(values, policy_cfg={"min_win_points": 3}), {4, 8})) == "KEEP"


@pytest.mark.parametrize("shift,expected", [(1.005, "AA-PASS"), (1.02, "AA-FAIL")])
def test_aa_counts_separations_the_lever_rule_would_count(shift, expected):
    """An A/A grid whose second server is steadily slower on TPOT at every concurrency: below min_effect that is
    listed as a small instance offset (the lever rule would not count it either); past it, the grid fails."""
    from campaigns import calibrate
    quiet = [4.79, 4.78, 4.80, 4.79, 4.78]
    ev = make_evidence({"median_tpot_ms": {"off": quiet, "on": [v * shift for v in quiet]}}, reps=5)
    ev.kind = "aa"
    ev.calibration = calibrate.calibrate(ev, calibrate.pool_for(ev, []), sims=60, seed=0, byte_exact=True)
    d = ev.decision = policy.decide(ev)
    assert d.verdict == expected
    if expected == "AA-PASS":
        assert d.reasons[0].startswith("0 separated point(s)")
        assert any(r.startswith("separated below the minimum effect 1.0%, not counted: TPOT at c1 LOSS ×0.995")
                   for r in d.reasons)
    else:
        assert d.reasons[0].startswith("4 separated point(s) (TPOT at c1 LOSS ×0.980")


def test_an_aa_grid_where_nothing_binds_is_aa_non_binding_as_its_rule_says():
    """The A/A rule text: a grid not on CUDA (a dirty tree, a rehearsal grid, too few reps) binds nothing; the
    verdict says so (NON-BINDING under the AA-NON-BINDING rule) and what a binding grid would have said."""
    from campaigns import calibrate
    quiet = [4.79, 4.78, 4.80, 4.79, 4.78]
    ev = make_evidence({"median_tpot_ms": {"off": quiet, "on": quiet}}, reps=5, device_type="cpu")
    ev.kind = "aa"
    ev.calibration = calibrate.calibrate(ev, calibrate.pool_for(ev, []), sims=60, seed=0, byte_exact=True)
    d = policy.decide(ev)
    assert d.verdict == "NON-BINDING" and not d.binding
    assert d.rule == policy.rule_text("AA-NON-BINDING", policy.policy_params(ev))
    assert "on a binding grid this would be AA-PASS" in d.reasons
    assert any(r.startswith("non-binding: device cpu") for r in d.reasons)


def test_the_aa_note_counts_wins_as_the_lever_rule_does():
    """'as a lever campaign the rule would say' applies the lever rule's points: on an 8-concurrency grid one
    separated concurrency is a KEEP there, so the note must not call it a false FLIP."""
    from campaigns import calibrate
    wide = (1, 2, 4, 8, 16, 32, 64, 128)
    quiet = [100.0, 100.5, 101.0, 100.2, 100.7]
    ev = make_evidence({"total_token_throughput": {"off": quiet, "on": quiet}}, reps=5, concurrency=wide)
    for leg in ev.legs:
        if leg.arm == "on" and leg.concurrency == 1:
            leg.metrics["total_token_throughput"] *= 1.2
    ev.kind = "lever"
    assert verdict(policy.conclude(ev)) == "KEEP"
    ev.kind = "aa"
    ev.calibration = calibrate.calibrate(ev, calibrate.pool_for(ev, []), sims=20, seed=0, byte_exact=True)
    d = policy.decide(ev)
    assert "as a lever campaign the rule would say KEEP" in d.reasons, d.reasons


def keep_note_with_a_tpot_win_at_c8(values: dict) -> str:
    """Evidence from ``values`` with the candidate's TPOT 10% better at c8 alone, concluded: it must be a KEEP;
    its effect note."""
    ev = make_evidence(values)
    for leg in ev.legs:
        if leg.concurrency == 8:
            leg.metrics["median_tpot_ms"] = {"off": 10.0, "on": 9.0}[leg.arm] + 0.1 * leg.rep
    ev = policy.conclude(ev)
    assert verdict(ev) == "KEEP", ev.decision.reasons
    return ev.decision.effect_note


def test_keep_of_a_mixed_lever_names_where_it_separated():
    """A WIN at one concurrency beside LOSSes at the others is a KEEP (rule 5 needs no WIN): its note must say
    where each separated, never that no point did (the split_rule record of 2026-12-02 read so)."""
    note = keep_note_with_a_tpot_win_at_c8({"median_tpot_ms": {"off": [10.0, 10.1, 10.2], "on": [11.0, 11.1, 11.2]}})
    assert note.startswith("mixed: LOSSes at c1, c2, c4 and a WIN at c8: the effect changes direction"), note
    # its pooled interval straddles 1 because the points disagree, not because the grid could not tell
    assert "no point separated" not in note and "underpowered" not in note


def test_a_mixed_keep_quotes_its_worst_loss_and_best_win():
    """The headline of a KEEP whose primary axes separated both ways quotes both points, not a pooled interval
    that straddles 1 (the long-prompt mixed_prefill KEEP of 2026-12-05 read 'P99 ITL ×1.045 [0.578, 1.086]
    pooled' over a LOSS ×0.532 at c2 and WINs up to ×1.457)."""
    ev = make_evidence({"median_tpot_ms": {"off": [10.0, 10.1, 10.2], "on": [11.0, 11.1, 11.2]}})
    for leg in ev.legs:
        if leg.concurrency == 8:
            leg.metrics["median_tpot_ms"] = {"off": 10.0, "on": 9.0}[leg.arm] + 0.1 * leg.rep
    d = policy.conclude(ev).decision
    assert d.verdict == "KEEP" and "pooled" not in d.headline, d.headline
    loss, win = d.headline.split("; ")
    assert loss.startswith("TPOT ×0.9") and loss.endswith("(LOSS)") and "at c8" not in loss
    assert win.startswith("TPOT ×1.1") and win.endswith("at c8 (WIN)"), d.headline


def test_a_concurrency_that_separated_both_ways_names_its_axes():
    """Total tok/s LOSSes everywhere and a TPOT WIN at c8: c8 is listed on both sides, each with its axis."""
    note = keep_note_with_a_tpot_win_at_c8(
        {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]}})
    assert note.endswith("mixed: LOSSes at c1, c2, c4, c8 (total tok/s) and a WIN at c8 (TPOT)"), note


STALL = {**TPUT_WIN, "p99_itl_ms": {"off": [20.0, 21.0, 22.0], "on": [43.0, 44.0, 45.0]},
         "max_itl_ms": {"off": [1860.0, 1865.0, 1870.0], "on": [44.0, 45.0, 46.0]}}


def test_the_max_itl_reads_the_stall_a_p99_cannot_see():
    """One multi-second stall a request sits past the P99 of its gaps; chunk steps of 44 ms sit inside it. With the
    P99 primary the chunked schedule's LOSS there keeps the default; with the max ITL primary and the P99 traded it
    flips, the P99's LOSS reported; a campaign that names neither tail axis computes neither."""
    ev = make_evidence(STALL, policy_cfg={"primary_axes": ["total_token_throughput", "tpot", "p99_itl"]})
    assert verdict(ev) == "KEEP" and any(r.startswith("LOSS on P99 ITL") for r in ev.decision.reasons)
    ev = make_evidence(STALL, policy_cfg={"primary_axes": ["total_token_throughput", "tpot", "max_itl"],
                                          "traded_axes": {"p99_itl": "chunk steps sit inside the P99"}})
    assert verdict(ev) == "FLIP", ev.decision.reasons
    assert any(r.startswith("WIN on max ITL at c1: ratio 41.") for r in ev.decision.reasons), ev.decision.reasons
    assert any(r.startswith("traded LOSS on P99 ITL") for r in ev.decision.reasons), ev.decision.reasons
    assert {s.axis for s in ev.stats} >= {"max_itl", "p99_itl"}
    assert not [s for s in ev.stats if s.axis == "p99_itl" and s.primary]
    plain = make_evidence(STALL)
    assert not {s.axis for s in plain.stats} & {"max_itl", "p99_itl"}


def test_a_keep_that_trades_one_primary_axis_for_another_says_so():
    """TPOT better by 10% and total tok/s worse by 10% at every concurrency: a KEEP whose note names both
    (chunked_prefill-ac29d06's read "faster: gains 1.1% to 60.7% on P99 ITL" over total tok/s x0.87 everywhere)."""
    ev = make_evidence({"median_tpot_ms": {"off": [10.0, 10.1, 10.2], "on": [9.0, 9.1, 9.2]},
                        "total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]}})
    assert verdict(ev) == "KEEP", ev.decision.reasons
    note = ev.decision.effect_note
    assert note.startswith("trade: the candidate gains ") and " on TPOT and costs " in note, note
    assert " on total tok/s (" in note and "faster" not in note and "slower" not in note
    assert records_what_changed(ev) == "keep default off (on trades one primary axis for another)"


def records_what_changed(ev) -> str:
    from campaigns import records
    return records.what_changed(ev)
