"""Mutation audit: plant each known fault in a scratch copy of the repository, then run the tests that must catch it
and, for a gate's fault, the gate itself with its self-check; write the table of what caught what.

    python scripts/mutation_audit.py [--out bench/results/mutation-audit-<date>.md] [--only NAME ...]

A mutation is an exact text replacement in one file (the audit stops with an error when the text is gone, so the
list cannot silently go stale). "Caught by a test" means the named tests fail on the mutant; "caught by the gate's
own run" means that a CPU campaign's gate on `tiny` either fails or reports its self-check NOT caught, so the
campaign is INVALID rather than trusting the gate. First, as a control, the named tests run on an unplanted copy: a
test that fails there shows nothing when it fails on a mutant, and its mutations count as not caught. CPU only:
graph_parity and memcheck need CUDA, and their faults are checked on the GPU by `pytest -m gpu
tests/test_gates_faults.py` and every binding campaign's self-checks.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    name: str
    what: str                       # the fault, in words
    path: str
    old: str
    new: str
    tests: list[str]                # pytest node ids that must fail
    gate: str | None = None         # a gate whose own run (with its self-check) must not pass it
    gate_note: str = ""             # where no separate gate run applies, why
    lever: str = "gqa_swap"
    extra: list[tuple[str, str, str]] = field(default_factory=list)   # more (path, old, new) of the same fault


MUTATIONS = [
    Mutation("battery-oracle-tokens", "battery takes its 'engine' tokens from the oracle (the engine never runs)",
             "campaigns/gates/battery.py",
             '    key = f"battery:{arm.name}{\'#fault\' if fault else \'\'}"\n',
             '    return [list(g) for _, g in goldens(ctx)]\n    key = f"battery:{arm.name}{\'#fault\' if fault else \'\'}"\n',
             ["tests/test_gates_faults.py::test_the_battery_fault_runs_the_engine_under_test",
              "tests/test_gates_faults.py::test_battery_and_near_tie_fail_on_a_broken_candidate_and_pass_the_clean_baseline"],
             gate="battery"),
    Mutation("decode-scaled-1.001", "gqa_swap's decode output scaled by 1.001 (under the interpreter)",
             "vtengine/kernels/attention.py",
             '    counters.record("decode_attention", route, grid=grid, splits=num_splits, variant=_variant(fast_math))\n',
             '    counters.record("decode_attention", route, grid=grid, splits=num_splits, variant=_variant(fast_math))\n'
             '    out.mul_(1.001)\n',
             ["tests/test_kernels_attention.py", "tests/test_gates_faults.py::test_op_gate_catches_a_kernel_off_by_a_tenth_of_a_percent"],
             gate="op"),
    Mutation("async-batch1-ignored", "async_parity's batch-1 (exact) leg ignored",
             "campaigns/gates/parity.py",
             "    return counts, details, not b1_mism, not divergent\n",
             "    return counts, details, True, not divergent\n",
             ["tests/test_gates_parity.py"],
             gate_note="the test is the gate's own run, against a real server on loopback"),
    Mutation("preemption-forgets-tokens", "preemption forgets the generated tokens",
             "vtengine/engine/scheduler.py",
             "        seq.status = SequenceStatus.WAITING\n",
             "        seq.status = SequenceStatus.WAITING\n        seq.token_ids = list(seq.prompt_token_ids)\n",
             ["tests/test_preemption.py"]),
    Mutation("latency-tie-wins", "a latency-axis tie counted as a WIN",
             "campaigns/stats.py",
             "        if max(on) < min(off):\n            return \"WIN\"\n        if min(on) > max(off):",
             "        if max(on) <= min(off):\n            return \"WIN\"\n        if min(on) > max(off):",
             ["tests/test_policy.py::test_separation_table", "tests/test_policy.py::test_a_latency_tie_is_not_a_win"]),
    Mutation("save-drops-fields", "evidence save drops legs[].reasons, fingerprint.dirty_files and flip",
             "campaigns/evidence.py",
             "    def to_dict(self) -> dict[str, Any]:\n        return dataclasses.asdict(self)\n",
             "    def to_dict(self) -> dict[str, Any]:\n        d = dataclasses.asdict(self)\n"
             "        d['flip'] = {}\n        d['fingerprint']['dirty_files'] = []\n"
             "        for leg in d['legs']:\n            leg['reasons'] = []\n        return d\n",
             ["tests/test_evidence_roundtrip.py"]),
    Mutation("leg-valid-missing-result", "a leg stays valid when a request is missing",
             "campaigns/loadgen.py",
             "    missing = [None] * (len(prompts) - len(results))",
             "    missing = []",
             ["tests/test_loadgen.py"]),
    Mutation("leg-valid-chunk-mismatch", "a leg stays valid when chunk and token counts disagree",
             "campaigns/loadgen.py",
             "def _validate(r: RequestResult, output_len: int) -> str:\n",
             "def _validate(r: RequestResult, output_len: int) -> str:\n    return ''\n",
             ["tests/test_loadgen.py"]),
    Mutation("skipped-gate-binds", "a binding verdict rests on a listed gate that was skipped",
             "campaigns/policy.py",
             "            elif r.skipped and not (g == \"mechanism\" and a == cand):",
             "            elif False:",
             ["tests/test_policy.py::test_a_listed_gate_that_did_not_run_makes_the_verdict_non_binding"]),
    # one per gate (graph_parity and memcheck: GPU, see the module docstring)
    Mutation("op-compares-ref-with-itself", "op: the kernel's output is never compared (reference against itself)",
             "campaigns/gates/op.py",
             "        out = launch(run_case, setting, False, name)\n        err = rel_l2(out, expected)\n",
             "        out = launch(run_case, setting, False, name)\n        err = rel_l2(expected, expected)\n",
             ["tests/test_gates_faults.py::test_op_gate_catches_a_kernel_off_by_a_tenth_of_a_percent"],
             gate="op",
             extra=[("campaigns/gates/op.py",
                     "            wrong = rel_l2(launch(run_case, setting, True, name), expected)\n"
                     "            off = rel_l2(launch(run_case, setting, False, name) * (1 + size), expected)\n",
                     "            wrong = rel_l2(expected, expected)\n            off = rel_l2(expected, expected)\n")]),
    Mutation("near-tie-gap-zero", "near_tie: every gap measured as 0 (every divergence 'ratified')",
             "campaigns/gates/battery.py",
             "    return [g if math.isnan(g) else max(0.0, g) * 1000.0\n",
             "    return [0.0\n",
             ["tests/test_gates_faults.py::test_battery_and_near_tie_fail_on_a_broken_candidate_and_pass_the_clean_baseline"],
             gate="near_tie"),
    Mutation("near-tie-length-ratified", "near_tie: a token lost or added at the end judged by its kept tokens' gaps",
             "campaigns/gates/battery.py",
             "    if len(toks) != len(golden):\n",
             "    if False:\n",
             ["tests/test_gates_faults.py::test_a_lost_last_token_or_a_token_outside_the_vocabulary_is_no_near_tie"],
             gate="near_tie",        # as the gate was: the divergence "at 0" where the lengths differ
             extra=[("campaigns/gates/battery.py", "enumerate(zip(toks, golden)) if a != b), min(len(toks), len(golden)))",
                     "enumerate(zip(toks, golden)) if a != b), 0)")]),
    Mutation("mechanism-nsplits-always", "mechanism: any nsplits_cap value passes (the audit's non-integer case)",
             "campaigns/gates/mechanism.py",
             "        pairs = [tuple(int(x) for x in p.split(\"/\")) for p in pr[\"split_vs_uncapped\"]]\n",
             "        return True, \"anything goes\"\n",
             ["tests/test_gates_faults.py::test_nsplits_cap_expectation_can_fail_for_every_value_type"],
             gate="mechanism", lever="nsplits_cap"),
    Mutation("profile-growth-reversed", "profile: the attribution reads a slowdown as a speed-up (delta reversed)",
             "campaigns/attribution.py",
             "        delta = c - b\n",
             "        delta = b - c\n",
             ["tests/test_attribution.py"]),
    Mutation("profile-selfcheck-reversed", "profile: its self-check compares the clean window against the slowed one",
             "campaigns/gates/profile.py",
             'growth = {k: after.get(k, 0.0) - before.get(k, 0.0)',
             'growth = {k: before.get(k, 0.0) - after.get(k, 0.0)',
             ["tests/test_attribution.py::test_the_profile_gates_self_check_names_its_planted_slowdown"],
             gate="profile"),
    Mutation("profile-selfcheck-absolute", "profile: its self-check names the kernel of the largest absolute growth "
             "(a large kernel's drift outgrows a small one's planted doubling)",
             "campaigns/gates/profile.py",
             "    named = max(growth, key=lambda k: growth[k] / max(before.get(k, 0.0), floor, 1e-9))\n",
             "    named = max(growth, key=growth.get)\n",
             ["tests/test_attribution.py::test_the_profile_self_check_names_the_planted_kernel_by_its_own_growth_not_"
              "in_microseconds"],
             gate_note="the H200's window drift does not occur on the CPU rehearsal: caught by the replayed window"),
    Mutation("mechanism-chunk-label-only", "mechanism: chunked_prefill passes on the step label, no prompt cut",
             "campaigns/gates/mechanism.py",
             '        full = value in OFF_VALUES or str(value) in pr["tokens"]\n',
             "        full = True\n",
             ["tests/test_gates_faults.py::test_chunked_prefill_expectation_can_fail"],
             gate_note="the label moves with the setting, so the gate's own inert/stuck faults pass either way: "
                       "caught by the expectation test's 'setting but no cut' case"),
    Mutation("chunk-graph-decode-lens", "chunk_graphs: a replay leaves the decode rows' context lengths stale",
             "vtengine/engine/model_runner.py",
             "            cg.decode_lens[:n_dec].copy_(ctx.decode.context_lens)\n",
             "            pass\n",
             ["tests/test_chunked_prefill.py::test_chunk_graphs_run_full_chunks_from_static_buffers_and_keep_every_token"],
             gate_note="an engine fault, not a gate's: caught by token equality with the unconstrained engine"),
    Mutation("op-mid-m-dropped", "op gate: the W4A16 cases run without w4a16_mid_m (both arms compare one tile)",
             "campaigns/gates/op.py",
             ', "mid": on("w4a16_mid_m")}',
             '}',
             ["tests/test_gates_faults.py::test_w4a16_mid_m_mechanism_gate_sees_decode_tiles_past_16_tokens"],
             gate_note="the test runs the gate on the lever's ON arm and counts the decode-tile launches"),
    Mutation("async-fault-ignored", "async_parity: the server ignores the deliberate fault (its self-check breaks nothing)",
             "vtengine/server.py",
             "        await self.engine.call(lambda eng: set_fault(eng, fault))\n",
             "        pass\n",
             ["tests/test_gates_parity.py::test_async_parity_passes_and_its_fault_fails"],
             gate_note="the test is the gate's own run (and its self-check), against a real server on loopback"),
    # -- added 2026-12-02: what came in after ef67bae ------------------------------------------------------------
    Mutation("policy-min-effect-ignored", "policy: a separated point below 1 + min_effect (x1.001) counted as a WIN",
             "campaigns/policy.py",
             '    return s.ratio >= 1 + p.min_effect if s.separation == "WIN" else s.ratio <= 1 - p.min_effect\n',
             '    return s.ratio >= 1 if s.separation == "WIN" else s.ratio <= 1 - p.min_effect\n',
             ["tests/test_policy.py::test_a_byte_exact_lever_needs_only_the_minimum_effect"]),
    Mutation("policy-aa-counts-small", "policy: an A/A grid counts separations below min_effect (a 0.5% offset fails it)",
             "campaigns/policy.py",
             "    return [s for s in ev.stats if counts(s, p)]\n",
             '    return [s for s in ev.stats if s.separation != "NEUTRAL"]\n',
             ["tests/test_policy.py::test_aa_counts_separations_the_lever_rule_would_count"]),
    Mutation("calibrate-offset-dropped", "calibration: the A/A grids' between-server offset never applied in the "
             "simulated campaigns", "campaigns/calibrate.py",
             "                        v = _gain(axis.name, v * shift.get(axis.metric, 1.0) ** sign, gain)\n",
             "                        v = _gain(axis.name, v, gain)\n",
             ["tests/test_calibrate.py::test_server_offsets_raise_the_false_verdict_rates"]),
    Mutation("calibrate-offset-unshrunk", "calibration: an A/A offset taken as the raw ratio of medians (not shrunk "
             "by one standard error)", "campaigns/calibrate.py",
             "    return math.exp(math.copysign(max(0.0, abs(d) - se), d))\n",
             "    return math.exp(d)\n",
             ["tests/test_calibrate.py::test_an_aa_grid_gives_its_server_offset_less_its_noise"]),
    Mutation("calibrate-aa-own-null", "calibration: an A/A grid's own offset is part of its null",
             "campaigns/calibrate.py",
             "    return noise_model([ev] + sorted(same, key=lambda o: o.campaign_id), exclude_offsets=[ev.campaign_id])\n",
             "    return noise_model([ev] + sorted(same, key=lambda o: o.campaign_id), exclude_offsets=[])\n",
             ["tests/test_calibrate.py::test_server_offsets_raise_the_false_verdict_rates"]),
    Mutation("calibrate-mde-bracket-swapped", "calibration: the power points bracket the MDE search the wrong way "
             "round (a 2% point below 80% power read as enough)", "campaigns/calibrate.py",
             "        if rate >= power:\n            hi = gain\n",
             "        if rate < power:\n            hi = gain\n",
             ["tests/test_calibrate.py::test_the_mde_is_the_smallest_gain_that_flips_with_80_percent_power"]),
    Mutation("stale-live-default-ignored", "staleness: a live kernel lever's new default leaves the verdict FRESH "
             "(only engine-loop levers stale it)", "campaigns/context.py",
             "        if drift and name in live_anywhere:\n",
             "        if drift and name in live_anywhere and not lever.affects:\n",
             ["tests/test_context.py::test_fresh_until_a_live_lever_changes_its_default"]),
    Mutation("stale-inert-lever-counts", "staleness: an inert lever's new default (marlin_dense on bf16) stales the "
             "verdict", "campaigns/context.py",
             "        if drift and name in live_anywhere:\n",
             "        if drift:\n",
             ["tests/test_context.py::test_an_inert_lever_changing_its_default_leaves_the_verdict_fresh"]),
    Mutation("preset-sets-taken-as-context", "staleness: the levers a preset under test sets are compared with "
             "today's defaults in both arms (its own flip stales its verdict; its ON arm is stale from the start)",
             "campaigns/context.py",
             "        if name not in own_sets:\n            return defaults[name]\n",
             "        if True:\n            return defaults[name]\n",
             ["tests/test_context.py::test_a_presets_own_flip_does_not_stale_its_verdict",
              "tests/test_context.py::test_a_presets_own_levers_are_the_lever_not_its_context"]),
    Mutation("quant-scoped-sources-ignored", "staleness: a bf16 verdict goes STALE when a source that runs only "
             "on quantized weights (w4a16.py) changes", "campaigns/context.py",
             "    return [p for p in lever.paths\n"
             "            if quant is None or quant in QUANT_SOURCES.get(split_entry(p)[0], (quant,))]\n",
             "    return list(lever.paths)\n",
             ["tests/test_context.py::test_a_source_that_runs_on_other_quantizations_alone_does_not_stale_a_bf16_"
              "verdict"]),
    Mutation("sources-reach-skips-instance-state", "staleness: a lever's method reading self.x does not count the "
             "methods that set it (a changed __init__ leaves the verdict FRESH)", "campaigns/sources.py",
             "                for j in {*(mod.members[cname].get(n.attr) or ()), *_assigners(cls, n.attr)}:\n",
             "                for j in mod.members[cname].get(n.attr) or []:\n",
             ["tests/test_sources.py::test_what_the_definition_reaches_counts"]),
    Mutation("sources-cross-file-imports-ignored", "staleness: a helper of a file listed by its definitions, which "
             "another listed file imports, does not count (fused._qkv_head changing leaves fuse_rope FRESH)",
             "campaigns/sources.py",
             "                new = _imported(part, g, module_name(f)) - seeds[f]\n",
             "                new = set()\n",
             ["tests/test_sources.py::test_a_helper_another_listed_file_imports_counts"]),
    Mutation("liveness-ignores-counters", "staleness: the recorded live levers ignore the kernel counters (every "
             "lever live, so marlin_dense on bf16 stales)", "campaigns/context.py",
             "    return sorted(name for name, lv in levers.items() if not lv.affects or set(lv.affects) & ran)\n",
             "    return sorted(levers)\n",
             ["tests/test_context.py::test_live_levers_are_the_ones_whose_kernels_ran"]),
    Mutation("flip-stale-not-refused", "flip: a STALE FLIP is committed (check_flippable's refusal removed)",
             "campaigns/runner.py",
             "    if not fresh.fresh:\n        raise CampaignError(f\"{ev.campaign_id}: its FLIP is STALE",
             "    if False:\n        raise CampaignError(f\"{ev.campaign_id}: its FLIP is STALE",
             ["tests/test_context.py::test_a_stale_flip_is_refused"]),
    Mutation("flip-scope-dropped", "flip: a FLIP refuted only on another quantization flips the default of every "
             "quantization (pdl_stack: bf16's gain traded for MXFP4's loss)", "campaigns/runner.py",
             "            scope = quant       # refuted on another quantization only",
             "            scope = None        # refuted on another quantization only",
             ["tests/test_context.py::test_a_flip_refuted_on_another_quantization_flips_its_own_quantization_alone"]),
    Mutation("default-by-quant-ignored", "levers: an engine on a quantization with its own default runs the plain "
             "default", "vtengine/levers.py",
             "        return self.default_by_quant.get(quant, self.default)",
             "        return self.default",
             ["tests/test_levers.py::test_a_quantizations_own_default_resolves_and_flips_alone",
              "tests/test_context.py::test_a_flip_of_one_quantizations_default_stales_only_its_verdicts"]),
    Mutation("recheck-flip-no-stop", "recheck: a FLIP that moves a default does not stop the run (the rest runs on "
             "the default it replaces)", "campaigns/recheck.py",
             '                 "on the new default")\n            stopped = True\n            break\n',
             '                 "on the new default")\n',
             ["tests/test_recheck.py::test_a_flip_that_moves_a_default_stops_the_run"]),
    Mutation("recheck-wide-grid-dropped", "recheck: a verdict decided on online_wide is re-run on the default grid",
             "campaigns/recheck.py",
             '        out.append(f"grid={cfg.grid.name}")',
             '        pass',
             ["tests/test_recheck.py::test_a_stale_aa_grid_is_rechecked_last_and_a_wide_grid_verdict_keeps_its_grid"]),
    Mutation("server-order-baseline-first", "servers: the baseline's server always starts first (no order drawn "
             "from the campaign id)", "campaigns/runner.py",
             "    random.Random(ev.campaign_id).shuffle(arms)\n",
             "",
             ["tests/test_campaign_e2e.py::test_server_start_order_is_drawn_from_the_campaign_id"]),
    Mutation("signal-mid-record", "runner: Ctrl-C or SIGTERM raised between a leg's save and its MLflow log",
             "campaigns/runner.py",
             "    if _held and _held[0] is None:\n        _held[0] = e\n        return\n",
             "",
             ["tests/test_campaign_e2e.py::test_a_signal_while_a_result_is_recorded_waits_until_it_is_logged"]),
    Mutation("signal-second-held", "runner: a second Ctrl-C while one is held waits too (a stuck record keeps the "
             "campaign from stopping)", "campaigns/runner.py",
             "    if _held and _held[0] is None:\n        _held[0] = e\n",
             "    if _held:\n        _held[0] = _held[0] or e\n",
             ["tests/test_campaign_e2e.py::test_a_signal_while_a_result_is_recorded_waits_until_it_is_logged"]),
    Mutation("resume-auto-any-config", "resume=auto: resumes an unfinished campaign of another composed config",
             "campaigns/runner.py",
             "            if ev.status == status and ev.lever == cfg.campaign.lever and ev.fingerprint.config_hash == want]",
             "            if ev.status == status and ev.lever == cfg.campaign.lever]",
             ["tests/test_campaign_e2e.py::test_resume_auto_finds_the_newest_unfinished_campaign_of_its_config_at_its_commit"]),
    Mutation("resume-auto-any-commit", "resume=auto: resumes an unfinished campaign of another commit",
             "campaigns/runner.py",
             "    mine = [ev for ev in mine if same_code(ev.fingerprint, now.git_sha, now.code_digest)\n",
             "    mine = [ev for ev in mine if True\n",
             ["tests/test_campaign_e2e.py::test_resume_auto_finds_the_newest_unfinished_campaign_of_its_config_at_its_commit"]),
    Mutation("resume-auto-any-gpu", "resume=auto: resumes an unfinished campaign of another GPU or torch",
             "campaigns/runner.py",
             "            and all(getattr(ev.fingerprint, k) == getattr(now, k) for k, _ in SAME_ON_RESUME)]",
             "            ]",
             ["tests/test_campaign_e2e.py::test_resume_auto_finds_the_newest_unfinished_campaign_of_its_config_at_its_commit"]),
    Mutation("status-resume-any-tree", "status: offers a resume on a tree dirty in other files than the campaign's",
             "campaigns/cli.py",
             "    change = tree_change(f, tree) if tree is not None else None\n",
             "    change = None\n",
             ["tests/test_campaign_cli.py::test_status_lists_unfinished_campaigns_and_what_can_finish_each"]),
    Mutation("status-resume-any-gpu", "status: says 'resume here' for a campaign of another GPU or torch",
             "campaigns/cli.py",
             "             if getattr(f, k) != setup[k]] if setup is not None else None\n",
             "             if False] if setup is not None else None\n",
             ["tests/test_campaign_cli.py::test_status_lists_unfinished_campaigns_and_what_can_finish_each"]),
    Mutation("abandoned-still-listed", "status: an abandoned campaign is still listed as unfinished",
             "campaigns/cli.py",
             "    unfinished = [e for evs in by.values() for e in evs if e.status == \"in-progress\"]\n",
             "    unfinished = [e for evs in by.values() for e in evs if e.status != \"complete\"]\n",
             ["tests/test_campaign_cli.py::test_abandon_gives_up_unfinished_campaigns_keeping_their_evidence"]),
    Mutation("abandoned-resumable", "resume or conclude takes an abandoned campaign",
             "campaigns/runner.py",
             "    if ev.status == \"abandoned\":\n",
             "    if False:\n",
             ["tests/test_campaign_cli.py::test_abandon_gives_up_unfinished_campaigns_keeping_their_evidence"]),
    Mutation("abandon-partial", "abandon: a bad id among good ones leaves the good ones abandoned",
             "campaigns/runner.py",
             "    evs = [_abandonable(cid, Path(out_dir)) for cid in dict.fromkeys(campaign_ids)]\n    for ev in evs:\n",
             "    for ev in (_abandonable(cid, Path(out_dir)) for cid in dict.fromkeys(campaign_ids)):\n",
             ["tests/test_campaign_cli.py::test_abandon_gives_up_unfinished_campaigns_keeping_their_evidence"]),
    Mutation("abandoned-auto-resumed", "resume=auto: takes an abandoned campaign of its config and code",
             "campaigns/runner.py",
             "    mine = _of_this_run(cfg, repo, out_dir, \"in-progress\")\n",
             "    mine = sorted(_of_this_run(cfg, repo, out_dir, \"in-progress\") + _of_this_run(cfg, repo, out_dir, "
             "\"abandoned\"),\n                  key=lambda ev: (ev.created, ev.campaign_id))\n",
             ["tests/test_campaign_cli.py::test_abandon_gives_up_unfinished_campaigns_keeping_their_evidence"]),
    Mutation("abandon-running", "abandon: gives up a campaign while its process still runs (its next save undoes it)",
             "campaigns/runner.py",
             "    if pid is not None:     # its next save would write in-progress over the abandon\n",
             "    if False:\n",
             ["tests/test_campaign_cli.py::test_abandon_gives_up_unfinished_campaigns_keeping_their_evidence"]),
    Mutation("absorb-undoes-abandon", "absorb: a call's in-progress copy replaces a campaign abandoned here",
             "scripts/absorb_results.py",
             "    return ({\"complete\": 2, \"abandoned\": 1}.get(data.get(\"status\"), 0), *size)\n",
             "    return ({\"complete\": 2}.get(data.get(\"status\"), 0), *size)\n",
             ["tests/test_absorb_results.py::test_an_older_copy_of_a_campaign_never_replaces_the_checkouts"]),
    Mutation("recheck-resumes-abandoned", "recheck: asks resume=<id> of a campaign abandoned since it began",
             "campaigns/recheck.py",
             "                begun = entry[\"new\"] = None\n",
             "                pass\n",
             ["tests/test_recheck.py::test_a_campaign_abandoned_since_it_began_is_not_resumed_by_id"]),
    Mutation("recheck-reruns-concluded", "recheck: runs again an entry whose campaign concluded in a lost call",
             "campaigns/recheck.py",
             "            ev = _renewal(concluded(overrides), entry, out_dir) if concluded is not None else None\n",
             "            ev = None\n",
             ["tests/test_recheck.py::test_a_campaign_concluded_where_the_plans_progress_was_lost_renews_its_entry"]),
    Mutation("recheck-stale-renews-itself", "recheck: the stale verdict itself counts as its own renewal",
             "campaigns/recheck.py",
             "    if ev is None or not stale.is_file() or parse_utc(ev.created) <= "
             "parse_utc(load_evidence(stale.parent).created):\n",
             "    if ev is None or not stale.is_file() or parse_utc(ev.created) < "
             "parse_utc(load_evidence(stale.parent).created):\n",
             ["tests/test_recheck.py::test_a_campaign_concluded_where_the_plans_progress_was_lost_renews_its_entry"]),
    Mutation("recheck-void-renewal", "recheck: a complete campaign whose verdict binds nothing renews its entry",
             "campaigns/runner.py",
             "            if ev.kind == kind and ev.decision is not None and ev.decision.binding]\n",
             "            if ev.kind == kind]\n",
             ["tests/test_recheck.py::test_a_campaign_concluded_where_the_plans_progress_was_lost_renews_its_entry"]),
    Mutation("recheck-named-flip-unstopped", "recheck: a FLIP concluded in a lost call passes by, the run goes on",
             "campaigns/recheck.py",
             "                ev, begun = begun, None         # its verdict as a run's: a FLIP that moves a default "
             "stops here too\n",
             "                entry[\"status\"] = \"done\"\n                continue\n",
             ["tests/test_recheck.py::test_a_flip_concluded_in_a_call_whose_verdict_did_not_come_back_stops_the_run"]),
    Mutation("recheck-within-ignores-resumed-legs", "recheck --within: a resumed campaign timed as if begun anew",
             "campaigns/recheck.py",
             "            need = need_s(entry, measured(overrides) if measured is not None else 0.0)\n",
             "            need = need_s(entry, 0.0)\n",
             ["tests/test_recheck.py::test_a_run_within_a_time_budget_starts_only_what_should_end_in_it"]),
    Mutation("recheck-within-starts-long-later", "recheck --within: a short call opens with one too long",
             "campaigns/recheck.py",
             "            if (need is None or need > within - spent) and not opening:\n",
             "            if need is not None and need > within - spent:\n",
             ["tests/test_recheck.py::test_a_run_within_a_time_budget_starts_only_what_should_end_in_it"]),
    Mutation("recheck-pinned-flip-silent", "recheck: a FLIP that `vtcampaign flip` refuses passes unremarked",
             "campaigns/recheck.py",
             "        refused = _flip_refused(ev, out_dir, root)\n",
             "        refused = \"\"\n",
             ["tests/test_recheck.py::test_a_flip_that_moves_a_default_stops_the_run"]),
    Mutation("recheck-fresh-start", "recheck: an entry without a begun campaign starts one afresh, not resume=auto",
             "campaigns/recheck.py",
             "            overrides.append(\"resume=auto\")",
             "            pass",
             ["tests/test_recheck.py::test_a_campaign_begun_where_the_plans_progress_was_lost_is_resumed_by_config"]),
    Mutation("status-unfinished-conclude", "vtcampaign status: a campaign with only its verdict left reads as a resume",
             "campaigns/cli.py",
             "    if not left_to_measure(ev):",
             "    if False:",
             ["tests/test_campaign_cli.py::test_status_lists_unfinished_campaigns_and_what_can_finish_each"]),
    Mutation("own-time-is-duration", "decode profile: a kernel's own time counts its PDL wait",
             "vtengine/bench/decode/kernel_profile.py",
             "        own[i] = max(0.0, end - max(start, reached))",
             "        own[i] = end - start",
             ["tests/test_bench_decode.py::test_own_time_charges_a_pdl_wait_to_the_kernel_still_running"]),
    Mutation("resume-any-code", "resume: goes on at a later commit whose code changed",
             "campaigns/runner.py",
             "    return then.git_sha == sha or (then.code_digest is not None and then.code_digest == digest)",
             "    return True",
             ["tests/test_campaign_e2e.py::test_a_resume_crosses_commits_of_records_and_prose_but_not_of_code"]),
    Mutation("decide-keeps-stored", "vtcampaign decide: re-reads the stored decision instead of applying the policy",
             "campaigns/cli.py",
             "    after = policy.decide(ev)\n",
             "    after = ev.decision\n",
             ["tests/test_campaign_cli.py::test_decide_applies_the_policy_again_and_keeps_the_earlier_verdict"]),
    Mutation("dirt-all-output", "policy: every changed file read as a run output (a dirty source tree binds)",
             "campaigns/gitops.py",
             "    return [f for f in files if not under(f, outputs)]\n",
             "    return []\n",
             ["tests/test_policy.py::test_only_run_outputs_changed_is_not_a_dirty_tree"]),
    Mutation("walk-softmax-no-reset", "decode attention: a walking program's softmax state runs on across slices "
             "(no reset at a slice's first tile)", "vtengine/kernels/attention.py",
             '        m_i = tl.where(first, float("-inf"), m_i)\n        l_i = tl.where(first, 0.0, l_i)\n'
             '        acc = tl.where(first, 0.0, acc)\n',
             "",
             ["tests/test_kernels_attention.py::test_decode_wave_grid_launches_fewer_programs_for_the_same_bits"],
             gate_note="the op gate's CPU cases never walk (b <= 3, ctx <= 40: as many programs as slots), so its "
             "CPU run passes this fault; its CUDA cases walk at batch 8 (per_q_head 1 program for 4 slots, gqa_swap "
             "3 for 15)"),
    Mutation("fuse-norm-residual-dropped", "fuse_norm: the GEMV epilogue stores x W^T without the residual",
             "vtengine/kernels/epilogue.py",
             "        out = (acc + res.to(tl.float32)).to(y_ptrs.dtype.element_ty)\n",
             "        out = acc.to(y_ptrs.dtype.element_ty)\n",
             ["tests/test_kernels_gemv.py::test_residual_add_then_rmsnorm_across_two_gemvs"],
             gate="op", lever="fuse_norm"),
    Mutation("fuse-norm-wrong-tile-ss", "fuse_norm: the norm prologue reads the first tile's sums of squares for "
             "every tile", "vtengine/kernels/epilogue.py",
             "        return tl.load(ss_in_ptr + t[:, None] * BLOCK_M + offs_m[None, :], mask=(t < n_ss_in)[:, None], "
             "other=0.0)\n",
             "        return tl.load(ss_in_ptr + 0 * t[:, None] * BLOCK_M + offs_m[None, :], mask=(t < n_ss_in)[:, None], "
             "other=0.0)\n",
             ["tests/test_kernels_gemv.py::test_residual_add_then_rmsnorm_across_two_gemvs"],
             gate="op", lever="fuse_norm"),
    Mutation("fuse-norm-decoder-norm-weight", "fuse_norm: the o GEMV hands the gate_up GEMV its residual times the "
             "layer's input norm, not its post-attention norm", "vtengine/models/decoder.py",
             "                residual, ss, gained = be.linear_add(attn.reshape(t, hq * d), layer.o, residual, "
             "layer.post_norm)\n",
             "                residual, ss, gained = be.linear_add(attn.reshape(t, hq * d), layer.o, residual, "
             "layer.input_norm)\n",
             ["tests/test_engine.py::test_fuse_norm_keeps_the_tokens_and_launches_no_add_rms_norm_at_decode"],
             gate_note="an engine fault, not a kernel's: caught by token equality with the torch oracle"),
    Mutation("fuse-norm-mechanism-always", "mechanism: fuse_norm's probe passes whatever the counters say",
             "campaigns/gates/mechanism.py",
             '        return _some_or_none(pr["fused_gemvs"], value, "GEMVs added the residual or applied RMSNorm "\n',
             '        return True, "anything goes"\n        return _some_or_none(pr["fused_gemvs"], value, "GEMVs '
             'added the residual or applied RMSNorm "\n',
             ["tests/test_gates_faults.py::test_fuse_norm_op_and_mechanism_gates"],
             gate="mechanism", lever="fuse_norm"),
    Mutation("op-fuse-norm-unfused", "op gate: fuse_norm's ON arm runs the unfused kernels (the fused pair is never "
             "compared)", "campaigns/gates/op.py",
             '        return out | ({"fused_norm": on("fuse_norm"), "fast_math": on("fast_math"), "rot": on("w4a16_rot")}\n',
             '        return out | ({"fused_norm": False, "fast_math": on("fast_math"), "rot": on("w4a16_rot")}\n',
             ["tests/test_gates_faults.py::test_fuse_norm_op_and_mechanism_gates"],
             gate_note="the test runs the gate on both arms and counts the fused launches"),
    Mutation("op-fuse-silu-unfused", "op gate: fuse_silu's ON arm runs the GEMM then silu_mul (the fused epilogue is "
             "never compared)", "campaigns/gates/op.py",
             '        return {"pdl": on("pdl"), "fused": on("fuse_silu"), "rot": on("w4a16_rot"), "prefetch": on("pdl_prefetch")}\n',
             '        return {"pdl": on("pdl"), "fused": False, "rot": on("w4a16_rot"), "prefetch": on("pdl_prefetch")}\n',
             ["tests/test_gates_faults.py::test_fuse_silu_op_and_mechanism_gates"],
             gate_note="the test runs the gate on both arms and counts the fused launches"),
    Mutation("fault-kernel-ignores-quant", "self-checks: the deliberate fault breaks the lever's first kernel even "
             "where the model never runs it (w4a16_gemm on bf16: fuse_silu's fault breaks nothing)",
             "vtengine/faults.py",
             '    if quant == "bf16":\n        order = [k for k in order if k != "w4a16_gemm"]\n',
             '    if False:\n        order = [k for k in order if k != "w4a16_gemm"]\n',
             ["tests/test_gates_faults.py::test_the_perturbed_kernel_is_one_the_model_runs"],
             gate="battery", lever="fuse_silu"),
    Mutation("fuse-silu-halves-swapped", "fuse_silu: the epilogue pairs the halves as silu(up) * gate",
             "vtengine/kernels/epilogue.py",
             "        gate, up = tl.split(halves)\n",
             "        up, gate = tl.split(halves)\n",
             ["tests/test_kernels_gemv.py::test_gate_up_with_silu_mul_in_the_gemv_epilogue"],
             gate="op", lever="fuse_silu"),
    Mutation("verdict-key-no-gpu", "verdicts filed per lever and model only: an H100 campaign supersedes the H200's",
             "campaigns/recheck.py",
             '    name = f"{measured_on(ev, key=True)}, {gpu_label(ev)}"\n',
             "    name = measured_on(ev, key=True)\n",
             ["tests/test_evidence_records.py::test_status_and_benchmarks_are_keyed_and_updated_in_place",
              "tests/test_context.py::test_a_flip_refuted_on_another_workload_is_refused"]),
    Mutation("recheck-any-gpu", "recheck: re-runs a verdict of another GPU on this host's",
             "campaigns/recheck.py",
             '        if gpu and entry.get("gpu") and short_gpu(entry["gpu"]) != short_gpu(gpu):\n',
             "        if False:\n",
             ["tests/test_recheck.py::test_a_verdict_of_another_gpu_is_left_pending_for_a_host_with_it"]),
    Mutation("merge-stale-flip", "vtcampaign merge: merges a flip branch without checking its FLIP is still fresh",
             "campaigns/cli.py",
             "            check_flippable(ev, out_dir)\n",
             "            pass\n",
             ["tests/test_context.py::test_vtcampaign_merge_refuses_a_stale_flip_branch_and_merges_a_fresh_one"]),
    Mutation("merge-no-render", "vtcampaign merge: settles a summary's conflict with HEAD's side, rendering nothing",
             "campaigns/gitops.py",
             "        written = list(render(conflicted))\n",
             "        written = []\n",
             ["tests/test_gitops.py::test_merge_flip_renders_the_summaries_two_flips_of_one_base_conflict_on"]),
    Mutation("digest-counts-templates", "code digest: a record template's change stops a grid's resume",
             "campaigns/gitops.py",
             '    return lower.endswith(".md") or (under(path, (TEMPLATES,)) and lower.endswith(".j2"))\n',
             '    return lower.endswith(".md")\n',
             ["tests/test_campaign_e2e.py::test_a_resume_crosses_commits_of_records_and_prose_but_not_of_code"]),
    Mutation("stall-in-step", "profile gate: a device stall inside the window is spread over every step again",
             "campaigns/attribution.py",
             "        device_us -= sum(stalls) / len(marks)\n",
             "        pass\n",
             ["tests/test_attribution.py::test_a_device_stall_inside_the_window_is_left_out_of_the_step_and_named"]),
    Mutation("status-at-here", "status --at: the other commit judged by this checkout's files (nothing can differ)",
             "campaigns/recheck.py",
             "        rows = [(ev, here[ev.campaign_id], lever_context.freshness(ev, tree, registry_at, digests_at))\n",
             "        rows = [(ev, here[ev.campaign_id], here[ev.campaign_id])\n",
             ["tests/test_context.py::test_status_at_a_commit_names_the_verdicts_it_would_stale"]),
    Mutation("resume-dirty-contents", "resume: a tree dirty in the same files resumes after a further edit of them",
             "campaigns/runner.py",
             "    if not then.dirty_files or then.dirty_digest == now.dirty_digest:\n",
             "    if True:\n",
             ["tests/test_campaign_e2e.py::test_a_resume_refuses_another_tree_device_or_versions"]),
    Mutation("op-split-rule-dropped", "op gate: decode attention launched without the arm's split_rule",
             "campaigns/gates/op.py",
             "                \"split_rule\": values.get(\"split_rule\", \"off\") or \"off\", \"fast_math\": on(\"fast_math\"),\n",
             "                \"fast_math\": on(\"fast_math\"),\n",
             ["tests/test_gates_faults.py::test_the_op_gate_launches_every_levers_values_through_its_kernels",
              "tests/test_gates_faults.py::test_the_split_rule_op_gate_runs_the_candidates_slices"]),
    Mutation("op-poison-off", "op gate: allocations inside a launcher not NaN-filled (an unwritten row passes on "
             "stale memory)",
             "campaigns/gates/op.py",
             "        with poisoned_allocations(ctx.device, poison):\n",
             "        with poisoned_allocations(ctx.device, False):\n",
             ["tests/test_gates_faults.py::test_op_gate_catches_a_launcher_output_row_never_written"]),
    Mutation("op-launch-unchecked", "op gate: a case whose lever kernel never launched still compared (and caught)",
             "campaigns/gates/op.py",
             "        if launched() == before:",
             "        if False:",
             ["tests/test_gates_faults.py::test_op_gate_fails_where_the_levers_kernel_never_launched"]),
    Mutation("memcheck-hang-caught", "memcheck: a faulted run that timed out counts as its fault caught",
             "campaigns/gates/memcheck.py",
             "        return result(\"memcheck\", arm, bool(fault), t0,",
             "        return result(\"memcheck\", arm, False, t0,",
             ["tests/test_gates_faults.py::test_a_memcheck_fault_run_that_times_out_caught_nothing"]),
    Mutation("graphs-mend-standing", "graph_parity self-check: the arm's standing fault mended to clean after capture",
             "campaigns/gates/__init__.py",
             "            set_fault(llm.engine, self.standing_fault(arm))     # only the captured graphs carry the fault\n",
             "            set_fault(llm.engine, None)\n",
             ["tests/test_gates_faults.py::test_graphs_captured_over_a_fault_leave_the_arms_standing_fault_in_place"]),
    Mutation("sources-no-dunders", "sources: a class's dunders other than its constructors do not count",
             "campaigns/sources.py",
             "        if any(map(_dunder, _binds(s))):\n",
             "        if _binds(s) & {\"__init__\", \"__post_init__\", \"__new__\"}:\n",
             ["tests/test_sources.py::test_what_the_language_calls_implicitly_counts"]),
    Mutation("sources-through-links", "context: a commit's linked source read as its link's blob (never equal)",
             "campaigns/context.py",
             "    if blob.mode == SYMLINK_MODE and hops > 0:\n",
             "    if False:\n",
             ["tests/test_context.py::test_sources_compare_as_git_stores_them_links_and_line_endings_too"]),
]

GATE_PROBE = r'''
import json, sys
from omegaconf import OmegaConf
from campaigns.evidence import Arm
from campaigns.gates import GateContext, run_gate
lever, gate = sys.argv[1], sys.argv[2]
values = {"nsplits_cap": ("off", "auto")}.get(lever, (False, True))
arms = [Arm(str(values[0]).lower() if values[0] is not False else "off", values[0], "baseline"),
        Arm("on" if values[1] is True else str(values[1]), values[1], "candidate")]
from vtengine import levers
ctx = GateContext(lever=lever, arms=arms, model="tiny", quant="bf16", device="cpu", near_tie_max_mnats=500.0,
                  gate_cfg=OmegaConf.create({"self_check": True, "op": {"seed": 0, "shapes": 2, "poison": True},
                                             "battery": {"prompts": 4, "max_tokens": 8}}))
out = []
for arm in arms:
    r = run_gate(gate, ctx, arm)
    out.append({"arm": arm.name, "passed": r.passed, "self_check": r.self_check})
print("GATE_PROBE " + json.dumps(out))
'''


def scratch_copy(dest: Path) -> None:
    """The tracked files of HEAD plus the working tree's changes (what is being audited), in a clone that shares
    this repository's history (tests that judge freshness against the campaigns' commits and the engine epochs read
    it: without it they fail whether or not a fault is planted)."""
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(ROOT), str(dest)], check=True)
    subprocess.run(["git", "reset", "-q", sha], cwd=dest, check=True)     # index = HEAD; the files come next
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for f in filter(None, (x.decode() for x in files)):
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def apply(dest: Path, path: str, old: str, new: str) -> None:
    p = dest / path
    text = p.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutation text not found exactly once in {path} ({text.count(old)} times): the audit's "
                         f"list is out of date:\n{old}")
    p.write_text(text.replace(old, new))


def run_tests(dest: Path, tests: list[str]) -> tuple[bool, str]:
    env = dict(os.environ, PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], cwd=dest,
                       env=env, capture_output=True, text=True, timeout=1200)
    last = (r.stdout.strip().splitlines() or ["?"])[-1]
    return r.returncode == 1, last


def control(tests: list[str]) -> tuple[list[str], str]:
    """The named tests on an unplanted scratch copy: they must pass there, or their failing on a mutant proves
    nothing. Returns the node ids that failed (or errored) and pytest's last line."""
    with tempfile.TemporaryDirectory(prefix="mut-control-") as tmp:
        dest = Path(tmp)
        scratch_copy(dest)
        env = dict(os.environ, PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *tests],
                           cwd=dest, env=env, capture_output=True, text=True, timeout=3600)
    lines = r.stdout.strip().splitlines()
    failed = [ln.split()[1] for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    if r.returncode not in (0, 1) and not failed:         # collection or usage error: nothing is shown to pass
        failed = list(tests)
    return failed, (lines or ["?"])[-1]


def _covers(test: str, failed: str) -> bool:
    """Whether node id ``failed`` (a test, maybe parametrized) is among what ``test`` (a file or node id) runs."""
    return failed == test or failed.startswith(test + "[") or failed.startswith(test + "::")


def run_gate(dest: Path, lever: str, gate: str) -> tuple[bool, str]:
    """Caught when the gate fails, or reports its self-check NOT caught (the campaign is then INVALID)."""
    import json
    env = dict(os.environ, PYTHONPATH=str(dest), PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-c", GATE_PROBE, lever, gate], cwd=dest, env=env, capture_output=True,
                       text=True, timeout=900)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("GATE_PROBE ")), None)
    if line is None:                # an error proves nothing either way: counted as not caught
        return False, f"the gate raised ({(r.stderr.strip().splitlines() or ['?'])[-1][:120]})"
    rows = json.loads(line[len("GATE_PROBE "):])
    caught = any(not x["passed"] or x["self_check"] is not True for x in rows)
    return caught, "; ".join(f"{x['arm']}: {'PASS' if x['passed'] else 'FAIL'}, self-check "
                             f"{'caught' if x['self_check'] else 'NOT caught'}" for x in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=f"bench/results/mutation-audit-{datetime.date.today().isoformat()}.md")
    ap.add_argument("--only", nargs="*", help="mutation names to run (default: all)")
    args = ap.parse_args(argv)
    todo = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = sorted(set(args.only or []) - {m.name for m in MUTATIONS})
    if unknown:
        raise SystemExit(f"unknown mutation(s) {unknown}; known: {[m.name for m in MUTATIONS]}")
    t_all = time.time()
    named = list(dict.fromkeys(t for m in todo for t in m.tests))
    failing, control_out = control(named)
    print(f"{'control (no fault planted)':<28} {control_out}" + (f"; failing: {failing}" if failing else ""),
          flush=True)
    rows = []
    for m in todo:
        t0 = time.time()
        spoilt = [f for f in failing if any(_covers(t, f) for t in m.tests)]
        with tempfile.TemporaryDirectory(prefix=f"mut-{m.name}-") as tmp:
            dest = Path(tmp)
            scratch_copy(dest)
            for path, old, new in [(m.path, m.old, m.new)] + m.extra:
                apply(dest, path, old, new)
            by_test, test_out = run_tests(dest, m.tests)
            if spoilt:                  # they fail without the fault too: their failing here shows nothing
                by_test, test_out = False, f"{test_out}; but failing without the fault too: {', '.join(spoilt)}"
            by_gate, gate_out = run_gate(dest, m.lever, m.gate) if m.gate else (None, "")
        rows.append((m, by_test, test_out, by_gate, gate_out, time.time() - t0))
        print(f"{m.name:<28} test {'CAUGHT' if by_test else 'MISSED'}"
              + ("" if by_gate is None else f", gate {'CAUGHT' if by_gate else 'MISSED'}")
              + f" ({time.time() - t0:.0f} s)", flush=True)
    lines = [f"# Mutation audit ({datetime.date.today().isoformat()}, `python scripts/mutation_audit.py`, CPU)", "",
             "Each fault planted in a scratch copy; the named tests must fail, and a gate's own run on `tiny` must "
             "fail or report its self-check not caught (the campaign is then INVALID). Control: the named tests on "
             f"an unplanted copy: {control_out}" + (f", failing {', '.join(failing)}" if failing else "")
             + f". {len(rows)} faults in {(time.time() - t_all) / 60:.0f} min on {len(os.sched_getaffinity(0))} CPU(s).", "",
             "| fault | file | caught by a test | caught by the gate's own run |", "|---|---|---|---|"]
    for m, by_test, test_out, by_gate, gate_out, _ in rows:
        gate_cell = (f"— ({m.gate_note})" if m.gate_note else "—") if by_gate is None else \
            f"{'yes' if by_gate else 'NO'} ({m.gate}: {gate_out})"
        lines.append(f"| {m.what} | `{m.path}` | {'yes' if by_test else 'NO'} ({test_out}) | {gate_cell} |")
    lines += ["", "graph_parity and memcheck need CUDA: their faults (graphs captured over a broken kernel; decode "
              "reading past the engine's tensors) are checked by `pytest -m gpu tests/test_gates_faults.py` and by "
              "every binding campaign's self-checks on the H200."]
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")
    missed = [m.name for m, by_test, _, by_gate, _, _ in rows if not by_test or by_gate is False]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
