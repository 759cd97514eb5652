"""`vtcampaign recheck` on a temporary repository: the plan lists the stale binding verdicts only (each with the
overrides that re-run its campaign on today's defaults), a saved plan is brought up to date with the verdicts when
it is loaded (a lever measured FRESH outside the plan is done, one gone STALE since joins), and a run works through
the plan, resuming a campaign it was interrupted in."""
from __future__ import annotations

import subprocess
from pathlib import Path

import git
import pytest

from campaigns import context as lever_context
from campaigns import policy, recheck
from campaigns.evidence import load_evidence, save_evidence
from helpers import TPUT_WIN, lever_repo, make_evidence, plain_defaults
from vtengine import levers

LIVE = ("fast_math", "gqa_swap", "nsplits_cap", "pdl", "triton_gemv")


@pytest.fixture
def proj(tmp_path, monkeypatch):
    """A repository with the project's lever files, stand-ins for their sources, and an empty records dir; the
    project's registry at its plain defaults, as the repository's lever files are."""
    plain_defaults(monkeypatch)
    root = lever_repo(tmp_path)
    (root / "records").mkdir()
    return root


def verdict(root: Path, lever: str, created: str, aa: bool = False, grid: str | None = None, values=None,
            quant: str = "bf16", **context) -> str:
    """A binding FLIP of ``lever`` measured at HEAD with today's defaults except ``context`` (lever -> value, in
    both arms), the bf16 levers live; saved under records/. ``aa``: an A/A grid instead, both arms at the lever's
    default; ``grid``: the binding grid's name. Returns its campaign id."""
    reg = levers.registry()
    ev = make_evidence(values or TPUT_WIN, lever=lever, created=created,
                       campaign_id=(f"{created[:10]}-{lever}-aa-abc1234" if aa else
                                    f"{created[:10]}-{lever}-{quant}-abc1234" if quant != "bf16" else None))
    if aa:
        ev.kind = "aa"
        for arm in ev.arms:
            arm.value = reg[lever].default
    if grid:
        ev.config["grid"]["name"] = grid
    ev.config["model"]["quant"] = quant
    ev.__dict__.pop("_settings", None)
    save_evidence(measured_here(ev, root, **context), root / "records" / ev.campaign_id)
    return ev.campaign_id


def measured_here(ev, root: Path, **context):
    """``ev`` as measured at ``root``'s HEAD with today's defaults except ``context``, the bf16 levers live."""
    reg = levers.registry()
    sha = git.Repo(root).head.commit.hexsha
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = sha, sha[:7]
    for arm in ev.arms:
        ev.context[arm.name] = {**{n: lv.default for n, lv in reg.items()}, **context, ev.lever: arm.value}
        ev.live_levers[arm.name] = sorted(set(LIVE) | {ev.lever})
    ev.lever_digests = lever_context.tree_digests(reg, root)
    return ev


def test_the_plan_lists_the_stale_verdicts_with_their_overrides(proj):
    stale = verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)      # pdl is off now, and it was live
    verdict(proj, "fast_math", "2026-11-30T11:00:00Z")
    state = recheck.plan(proj / "records", root=proj)
    (entry,) = state["entries"]
    assert (entry["lever"], entry["stale"], entry["status"]) == ("gqa_swap", stale, "pending")
    assert entry["why"] == ["pdl's default is now off; the campaign ran with on and pdl's kernels ran there"]
    # its candidate (on) is today's default: none left, so the campaign file's own arms (the flip of today's)
    assert entry["overrides"] == ["campaign=gqa_swap", "model=qwen3-8b", "model.quant=bf16"]
    assert recheck.load_state(proj / "records") == state
    assert entry["took_s"] == 5.0               # created 10:00:00, its last leg ended 10:00:05


def test_a_lever_decided_on_two_models_holds_two_verdicts(proj):
    """A later bf16 campaign neither hides nor freshens the MXFP4 verdict of the same lever: each is keyed by its
    model, and the plan rechecks the stale one on its own model."""
    old = verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", quant="mxfp4", pdl=True)     # stale (pdl is off now)
    verdict(proj, "gqa_swap", "2026-11-30T11:00:00Z")                                    # later, bf16, fresh
    (entry,) = recheck.plan(proj / "records", root=proj)["entries"]
    assert (entry["key"], entry["lever"], entry["stale"]) == ("gqa_swap on qwen3-8b (mxfp4), H200", "gqa_swap", old)
    assert "model.quant=mxfp4" in entry["overrides"]


def test_a_saved_plan_drops_what_is_fresh_now_and_adds_what_went_stale(proj):
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    verdict(proj, "fast_math", "2026-11-30T11:00:00Z", pdl=True)
    first = recheck.plan(out, root=proj)
    assert sorted(e["lever"] for e in first["entries"]) == ["fast_math", "gqa_swap"]
    # outside the plan: gqa_swap measured again on today's defaults (FRESH), triton_gemv's verdict goes stale
    # fast_math measured again, still with pdl on: still stale, from its latest campaign
    verdict(proj, "gqa_swap", "2026-12-01T10:00:00Z")
    verdict(proj, "triton_gemv", "2026-12-01T11:00:00Z", pdl=True)
    later = verdict(proj, "fast_math", "2026-12-01T12:00:00Z", pdl=True, nsplits_cap=8)
    state = recheck.plan(out, root=proj)
    by = {e["lever"]: e for e in state["entries"]}
    assert by["gqa_swap"]["status"] == "done" and "FRESH" in by["gqa_swap"]["verdict"]
    assert by["fast_math"]["status"] == "pending" and by["triton_gemv"]["status"] == "pending"
    assert by["fast_math"]["stale"] == later and len(by["fast_math"]["why"]) == 2        # pdl and nsplits_cap
    assert [e["lever"] for e in state["entries"]] == ["gqa_swap", "fast_math", "triton_gemv"]   # done first
    # --restart plans anew: only what is stale now
    assert sorted(e["lever"] for e in recheck.plan(out, restart=True, root=proj)["entries"]) == ["fast_math",
                                                                                                  "triton_gemv"]


def test_a_verdict_that_joins_a_saved_plan_takes_its_place_in_todays_order(proj):
    """A flip during a plan (fast_math's, on 2026-12-02) re-stales verdicts that other levers depend on; they join
    the open plan in the order a new plan would give them, not after everything already waiting."""
    out = proj / "records"
    verdict(proj, "nsplits_cap", "2026-11-30T10:00:00Z", pdl=True)
    assert [e["lever"] for e in recheck.plan(out, root=proj)["entries"]] == ["nsplits_cap"]
    verdict(proj, "gqa_swap", "2026-11-30T11:00:00Z", pdl=True)
    state = recheck.plan(out, root=proj)
    fresh = recheck.plan(out, restart=True, root=proj)
    assert [e["lever"] for e in state["entries"]] == [e["lever"] for e in fresh["entries"]] == ["gqa_swap",
                                                                                              "nsplits_cap"]


def test_a_keep_that_won_goes_before_an_equal_flip_and_new_levers_count_where_their_kernels_ran(proj):
    """decode_wave_grid (added after most verdicts) was KEEP with WINs, vetoed by one LOSS: its re-run may flip it,
    and its kernel (decode attention) ran in every decode verdict, so it goes before gqa_swap's FLIP."""
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    keep_that_won = {**TPUT_WIN, "median_ttft_ms": {"off": [10.0, 10.1, 10.2], "on": [12.0, 12.1, 12.2]}}
    cid = verdict(proj, "decode_wave_grid", "2026-11-30T11:00:00Z", values=keep_that_won, pdl=True)
    ev = next(e for e in recheck.stale_verdicts(out, root=proj) if e[0].campaign_id == cid)[0]
    assert ev.decision.verdict == "KEEP"
    assert [e["lever"] for e in recheck.plan(out, root=proj)["entries"]] == ["decode_wave_grid", "gqa_swap"]


def test_a_stale_aa_grid_is_rechecked_last_and_a_wide_grid_verdict_keeps_its_grid(proj):
    """Each model's latest A/A goes stale like a verdict and is re-run after the verdicts (on the engine as the plan
    leaves it); an A/A on today's defaults stays out. A verdict is re-run on the grid it was decided on: named
    when it is not the one its campaign's file takes by default (nsplits_cap's is online_wide, fast_math's online)."""
    from campaigns.config import compose
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T09:00:00Z", aa=True, pdl=True)        # pdl was on, and live
    verdict(proj, "nsplits_cap", "2026-11-30T10:00:00Z", pdl=True, grid="online_wide")
    verdict(proj, "fast_math", "2026-11-30T10:30:00Z", pdl=True, grid="online_wide")
    entries = recheck.plan(out, root=proj)["entries"]
    assert entries[-1]["lever"] == "A/A qwen3-8b (bf16), H200"
    by_lever = {e["lever"]: e for e in entries}
    assert sorted(by_lever) == ["A/A qwen3-8b (bf16), H200", "fast_math", "nsplits_cap"]
    wide, fast, aa = by_lever["nsplits_cap"], by_lever["fast_math"], entries[-1]
    assert aa["overrides"] == ["campaign=gqa_swap", "aa=true", "model=qwen3-8b", "model.quant=bf16"]
    assert aa["why"] == ["pdl's default is now off; the campaign ran with on and pdl's kernels ran there"]
    assert not any(o.startswith("grid=") for o in wide["overrides"])
    assert "grid=online_wide" in fast["overrides"]
    assert compose(fast["overrides"], cuda=True).grid.name == "online_wide"
    assert compose(["campaign=nsplits_cap"], cuda=True).grid.name == "online_wide"     # its file's grid
    cid = verdict(proj, "nsplits_cap", "2026-11-30T11:00:00Z", pdl=True, grid="online")    # the 4-point grid
    on_online = next(e for e in recheck.plan(out, restart=True, root=proj)["entries"] if e["stale"] == cid)
    assert "grid=online" in on_online["overrides"]
    # an A/A measured on today's defaults since: the model's latest, fresh, so the plan drops the old one
    verdict(proj, "gqa_swap", "2026-12-01T09:00:00Z", aa=True)
    assert sorted(e["lever"] for e in recheck.plan(out, restart=True, root=proj)["entries"]) == [
        "fast_math", "nsplits_cap"]


def test_a_run_works_through_the_plan_and_resumes_the_campaign_it_was_stopped_in(proj):
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    verdict(proj, "fast_math", "2026-11-30T11:00:00Z", pdl=True)
    calls = []

    def interrupted(overrides, started):
        cid = "2026-12-01-" + overrides[0].split("=")[1] + "-new"
        ev = make_evidence(TPUT_WIN, lever=overrides[0].split("=")[1], campaign_id=cid)
        ev.status = "in-progress"
        save_evidence(ev, out / cid)
        started(cid)
        calls.append(overrides)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recheck.run(out, ["tracking=off"], interrupted, root=proj, echo=lambda s: None)
    first = calls[0][0].split("=")[1]
    running = [e for e in recheck.load_state(out)["entries"] if e["status"] == "running"]
    assert [e["lever"] for e in running] == [first]

    def finishing(overrides, started):
        lever = overrides[0].split("=")[1]
        calls.append(overrides)
        return make_evidence(TPUT_WIN, lever=lever, campaign_id=f"2026-12-01-{lever}-new")

    state = recheck.run(out, ["tracking=off"], finishing, root=proj, echo=lambda s: None)
    assert calls[1][-2:] == ["tracking=off", f"resume=2026-12-01-{first}-new"]     # the interrupted one resumed
    assert all(e["status"] == "done" and e["verdict"] == "FLIP" for e in state["entries"])
    assert len(calls) == 3


def test_a_campaign_begun_where_the_plans_progress_was_lost_is_resumed_by_config(proj):
    """A GPU host saves the plan's progress in its own copy of the plan file; when that copy does not come back, the
    plan here names no campaign for the entry, and the next call must not start the same campaign afresh (on
    2026-12-07 it did: 14 legs measured twice). Every entry without a campaign of its own runs with resume=auto."""
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    recheck.plan(out, root=proj)
    planned = (out / recheck.STATE_FILE).read_text()
    calls = []

    def interrupted(overrides, started):
        started("2026-12-01-gqa_swap-new")
        calls.append(overrides)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recheck.run(out, ["tracking=off"], interrupted, root=proj, echo=lambda s: None)
    assert calls[0][-1] == "resume=auto"
    (out / recheck.STATE_FILE).write_text(planned)          # the host's progress lost
    recheck.run(out, ["tracking=off"], lambda o, s: calls.append(o) or make_evidence(TPUT_WIN, lever="gqa_swap"),
                root=proj, echo=lambda s: None)
    assert calls[1][-2:] == ["tracking=off", "resume=auto"]
    assert sum(o.startswith("resume=") for o in calls[1]) == 1
    # a resume= of the user's would override the plan's (Hydra keeps the last): refused, saying why
    with pytest.raises(recheck.RecheckError, match=r"resume=x: recheck picks what each campaign resumes"):
        recheck.run(out, ["tracking=off", "resume=x"], lambda o, s: calls.append(o), root=proj, echo=lambda s: None)
    assert len(calls) == 2


def test_a_campaign_concluded_where_the_plans_progress_was_lost_renews_its_entry(proj, capsys, monkeypatch):
    """A device call concludes an entry's campaign but its plan file does not come back: the next call's plan names
    no campaign for the entry, and resume=auto finds none unfinished. It must not run the campaign again (on
    2026-12-07 a third call did: 15 legs measured twice): a complete campaign of the entry's config, measured on
    this code and setup after the stale verdict, with a binding verdict, is its renewal. One of other code, one whose
    verdict binds nothing, or the stale verdict itself, is not."""
    import dataclasses

    from campaigns import runner
    from campaigns.cli import main
    from campaigns.config import compose, config_hash
    from campaigns.fingerprint import collect
    from campaigns.runner import concluded_here, not_dirt
    out = proj / "records"
    stale = verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    old = load_evidence(out / stale)
    old.fingerprint.device_name = "x86_64"          # measured on this host's kind: `recheck` here runs its entry
    save_evidence(old, out / stale)
    [entry] = recheck.plan(out, root=proj)["entries"]
    planned = (out / recheck.STATE_FILE).read_text()

    def concluded(overrides):
        return concluded_here(compose(overrides + [f"out_dir={out}"], cuda=False), proj)

    cfg = compose(entry["overrides"] + ["tracking=off", f"out_dir={out}"], cuda=False)
    ev = make_evidence(TPUT_WIN, lever="gqa_swap", campaign_id="2026-12-01-gqa_swap-renewed",
                       created="2026-12-01T10:00:00Z")
    here = collect(proj, "cpu", levers.get("gqa_swap").env, ev.arms, config_hash(cfg),
                   ignore_dirty=not_dirt(proj, out))
    ev.fingerprint = dataclasses.replace(here, git_sha="f" * 40, code_digest="0" * 16)     # other code
    save_evidence(ev, out / ev.campaign_id)
    calls = []
    ran = make_evidence(TPUT_WIN, lever="gqa_swap", campaign_id="2026-12-02-gqa_swap-run")
    recheck.run(out, ["tracking=off"], lambda o, s: calls.append(o) or ran, root=proj, echo=lambda s: None,
                frozen=True, concluded=concluded)
    assert [o for c in calls for o in c if o.startswith("resume=")] == ["resume=auto"]    # run: not its renewal

    (out / recheck.STATE_FILE).write_text(planned)          # this code, but a verdict that binds nothing
    ev.fingerprint = here
    ev.decision.binding = False
    save_evidence(ev, out / ev.campaign_id)
    recheck.run(out, ["tracking=off"], lambda o, s: calls.append(o) or ran, root=proj, echo=lambda s: None,
                frozen=True, concluded=concluded)
    assert len(calls) == 2                                  # run again: a void campaign renews nothing

    (out / recheck.STATE_FILE).write_text(planned)          # the call's progress lost; this code, binding
    ev.decision.binding = True
    save_evidence(ev, out / ev.campaign_id)
    monkeypatch.chdir(proj)                        # `vtcampaign recheck --frozen` as a device call runs it
    monkeypatch.setattr(runner, "run_campaign", lambda cfg, **kw: calls.append(cfg) or ran)
    assert main(["recheck", "--frozen", "--out-dir", str(out), "tracking=off"]) == 0
    assert len(calls) == 2
    [done] = recheck.load_state(out)["entries"]
    assert (done["status"], done["new"], done["verdict"]) == ("done", "2026-12-01-gqa_swap-renewed", "FLIP")
    assert (f"2026-12-01-gqa_swap-renewed renews it already (complete, of this config, code and setup, begun after "
            f"{stale}): not run again") in capsys.readouterr().out.replace("\n", " ")

    # the stale verdict itself, of this code (a default's change made it stale), renews nothing
    (out / recheck.STATE_FILE).write_text(planned)
    (out / ev.campaign_id / "evidence.json").unlink()
    old.fingerprint = here
    save_evidence(old, out / stale)
    assert concluded(entry["overrides"] + ["tracking=off"]).campaign_id == stale
    recheck.run(out, ["tracking=off"], lambda o, s: calls.append(o) or ran, root=proj, echo=lambda s: None,
                frozen=True, concluded=concluded)
    assert len(calls) == 3


def test_a_campaign_abandoned_since_it_began_is_not_resumed_by_id(proj):
    """The plan names the campaign begun for an entry; once `vtcampaign abandon` gives it up, resuming it by id
    would be refused in every call: the entry runs with resume=auto instead (which passes abandoned ones by)."""
    from campaigns.runner import abandon
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    calls, said = [], []

    def interrupted(overrides, started):
        ev = make_evidence(TPUT_WIN, lever="gqa_swap", campaign_id="2026-12-01-gqa_swap-new")
        ev.status, ev.decision, ev.legs = "in-progress", None, ev.legs[:3]
        save_evidence(ev, out / ev.campaign_id)
        started(ev.campaign_id)
        calls.append(overrides)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recheck.run(out, ["tracking=off"], interrupted, root=proj, echo=lambda s: None)
    abandon(["2026-12-01-gqa_swap-new"], out, "cut before a code change")
    recheck.run(out, ["tracking=off"], lambda o, s: calls.append(o) or make_evidence(TPUT_WIN, lever="gqa_swap"),
                root=proj, echo=said.append)
    assert calls[1][-2:] == ["tracking=off", "resume=auto"]
    assert any("2026-12-01-gqa_swap-new was abandoned (cut before a code change)" in line for line in said)


def test_an_entry_whose_campaign_was_abandoned_is_planned_again_on_todays_defaults(proj, capsys, monkeypatch):
    """A running entry keeps the overrides it was planned with, for its campaign's resume. Once that campaign is
    abandoned (here: refused on resume after a code change, which the refusal says how to do), nothing of it is left
    to resume: the next plan treats the entry as pending, so a verdict measured FRESH meanwhile ends it instead of
    a campaign on the overrides of a default since replaced."""
    from campaigns import runner
    from campaigns.cli import main
    from campaigns.runner import CampaignError, abandon
    out = proj / "records"
    stale = verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    old = load_evidence(out / stale)
    old.fingerprint.device_name = "x86_64"          # measured on this host's kind: `recheck` here runs its entry
    save_evidence(old, out / stale)

    def interrupted(overrides, started):
        ev = make_evidence(TPUT_WIN, lever="gqa_swap", campaign_id="2026-12-01-gqa_swap-new")
        ev.status, ev.decision = "in-progress", None
        save_evidence(ev, out / ev.campaign_id)
        started(ev.campaign_id)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recheck.run(out, ["tracking=off"], interrupted, root=proj, echo=lambda s: None)

    def refused(cfg, **kw):
        raise CampaignError(f"resume={cfg.resume!r}: the campaign ran at abc1234, the checkout is now at def5678 "
                            "and the commits between them change code; legs from two codes would not compare")
    monkeypatch.chdir(proj)
    monkeypatch.setattr(runner, "run_campaign", refused)
    assert main(["recheck", "--frozen", "--out-dir", str(out), "tracking=off"]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert "to run this entry afresh, `vtcampaign abandon 2026-12-01-gqa_swap-new --why" in err
    abandon(["2026-12-01-gqa_swap-new"], out, "cut before a code change")
    fresh = load_evidence(out / verdict(proj, "gqa_swap", "2026-12-01T12:00:00Z"))    # FRESH, outside the plan
    fresh.fingerprint.device_name = "x86_64"
    save_evidence(fresh, out / fresh.campaign_id)
    [entry] = recheck.plan(out, root=proj)["entries"]
    assert (entry["status"], entry["new"]) == ("done", None)
    assert "FRESH without it" in entry["verdict"]
    assert entry["abandoned"] == "2026-12-01-gqa_swap-new was abandoned (cut before a code change)"


def test_a_saved_plan_that_is_no_json_is_an_error_naming_the_file(proj):
    out = proj / "records"
    (out / recheck.STATE_FILE).write_text('{"entries": [{"lever": "gqa_')      # cut short on its way back
    with pytest.raises(recheck.RecheckError, match=r"the saved plan .*\.recheck\.json is not readable JSON"):
        recheck.plan(out, root=proj)
    (out / recheck.STATE_FILE).write_text('["gqa_swap"]')
    with pytest.raises(recheck.RecheckError, match="holds no object with a list of entries"):
        recheck.plan(out, frozen=True)


def test_a_verdict_of_another_gpu_is_left_pending_for_a_host_with_it(proj):
    """The lender may give an H100 to a session that asked for an H200: a recheck there would file H100 verdicts
    beside the stale H200 ones and renew none, so it leaves them pending, says so, and runs the ones of its GPU."""
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    ev = verdict(proj, "fast_math", "2026-11-30T11:00:00Z", pdl=True)
    h100 = load_evidence(out / ev)
    h100.fingerprint.device_name = "NVIDIA H100 80GB HBM3"
    save_evidence(h100, out / ev)
    calls, said = [], []

    def runs(overrides, started):
        lever = overrides[0].split("=")[1]
        calls.append(lever)
        new = make_evidence(TPUT_WIN, lever=lever, campaign_id=f"2026-12-05-{lever}-new")
        new.fingerprint.device_name = "NVIDIA H100 80GB HBM3"
        return new

    state = recheck.run(out, [], runs, root=proj, echo=said.append, gpu="NVIDIA H100 80GB HBM3")
    assert calls == ["fast_math"]
    by_lever = {e["lever"]: e["status"] for e in state["entries"]}
    assert by_lever == {"gqa_swap": "pending", "fast_math": "done"}
    assert "recheck gqa_swap on qwen3-8b (bf16), H200: measured on H200, this host has H100 80GB HBM3: left for a " \
           "host with that GPU" in said
    assert said[-1] == "recheck: 1 stale verdict(s) of other GPUs left pending (H200); run recheck on those GPUs"
    state = recheck.run(out, [], runs, root=proj, echo=said.append, gpu="NVIDIA H200")
    assert calls == ["fast_math", "gqa_swap"]
    assert [e["status"] for e in state["entries"] if e["lever"] == "gqa_swap"] == ["done"]


@pytest.mark.parametrize("pins", [{}, {"nsplits_cap": 8}], ids=["at-defaults", "pinned-off-default"])
def test_a_flip_that_moves_a_default_stops_the_run(proj, pins):
    """pdl (off by default) FLIPs on its recheck: the entries after it would run on the default the flip replaces,
    so the run stops there and says what to do; FLIPs that keep today's defaults (the others') do not stop it.
    Measured with a pin off today's default (a recheck re-runs a campaign in its own context, pins included), the
    FLIP moves no default (`vtcampaign flip` refuses it), so the run goes on, saying so and what would decide the
    default (2026-12-07, H100: prefill_splits FLIPped with chunked_prefill=256 pinned and the recheck stopped)."""
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    verdict(proj, "nsplits_cap", "2026-11-30T11:00:00Z", pdl=True)
    verdict(proj, "pdl", "2026-11-30T12:00:00Z", nsplits_cap=8)
    verdict(proj, "triton_gemv", "2026-11-30T13:00:00Z", pdl=True)
    said, ran = [], []

    def flips(overrides, started):
        lever = overrides[0].split("=")[1]
        ran.append(lever)
        ev = make_evidence(TPUT_WIN, lever=lever, campaign_id=f"2026-12-01-{lever}-new", created="2026-12-01T09:00:00Z")
        ev.arms[1].value = True if lever == "pdl" else levers.registry()[lever].default
        if lever == "pdl" and pins:
            ev.config["campaign"]["with_levers"] = pins
            ev.__dict__.pop("_settings", None)
        return policy.conclude(measured_here(ev, proj, **pins))

    order = [e["lever"] for e in recheck.plan(out, root=proj)["entries"]]
    state = recheck.run(out, [], flips, root=proj, echo=said.append)
    stop = len(order) if pins else order.index("pdl") + 1
    assert ran == order[:stop] and order.index("pdl") + 1 < len(order)
    assert [e["status"] for e in state["entries"]] == ["done"] * stop + ["pending"] * (len(order) - stop)
    if not pins:
        assert said[-1].startswith("recheck stops: 2026-12-01-pdl-new FLIPs pdl to true. Commit it (vtcampaign flip "
                                   "2026-12-01-pdl-new), merge")
        # under --within, an entry left for want of time before the stop gets no "run recheck again": the stop's
        # advice (flip, merge, then recheck) is the last word
        state = recheck.plan(out, root=proj, restart=True)
        assert state["entries"][0]["lever"] != "pdl", order
        state["entries"][0]["took_s"] = None
        recheck.save_state(out, state)
        said[:] = []
        recheck.run(out, [], flips, root=proj, echo=said.append, within=300.0, frozen=True)
        assert "left pending for a command with room" in said[0] and said[-1].startswith("recheck stops:"), said
        return
    line = next(s for s in said if "FLIPs pdl" in s)
    assert ("2026-12-01-pdl-new FLIPs pdl to true but moves no default, so the recheck goes on: `vtcampaign flip` "
            "refuses it: its FLIP was measured with nsplits_cap=8 (its default: off) pinned") in line, line
    assert "nsplits_cap:off" in line and not any(s.startswith("recheck stops") for s in said)


def test_a_flip_concluded_in_a_call_whose_verdict_did_not_come_back_stops_the_run(proj):
    """The plan names the campaign begun for an entry (its progress came back) but the campaign concluded later, in a
    call whose plan did not: that verdict is taken as a run's is, so a FLIP that moves a default stops the run
    there, before the entries that would run on the default it replaces."""
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    verdict(proj, "pdl", "2026-11-30T12:00:00Z", nsplits_cap=8)
    verdict(proj, "triton_gemv", "2026-11-30T13:00:00Z", pdl=True)
    state = recheck.plan(out, root=proj)
    flip = make_evidence(TPUT_WIN, lever="pdl", campaign_id="2026-12-01-pdl-new", created="2026-12-01T10:00:00Z")
    flip.arms[1].value = True
    save_evidence(policy.conclude(measured_here(flip, proj)), out / flip.campaign_id)
    entry = next(e for e in state["entries"] if e["lever"] == "pdl")
    entry["new"], entry["status"] = flip.campaign_id, "running"
    recheck.save_state(out, state)
    said, ran = [], []

    def runs(overrides, started):
        lever = overrides[0].split("=")[1]
        ran.append(lever)
        return make_evidence(TPUT_WIN, lever=lever, campaign_id=f"2026-12-01-{lever}-run")

    state = recheck.run(out, [], runs, root=proj, echo=said.append)
    assert ran == []                    # pdl (a begun campaign goes first) not run again, and nothing after it
    assert {e["lever"]: (e["status"], e.get("verdict")) for e in state["entries"]} == {
        "pdl": ("done", "FLIP"), "gqa_swap": ("pending", None), "triton_gemv": ("pending", None)}
    assert said[-1].startswith("recheck stops: 2026-12-01-pdl-new FLIPs pdl to true"), said


def test_frozen_works_through_the_saved_plan_as_it_is(proj, capsys):
    """--frozen (a GPU host's copy has no git history, so every verdict there would read STALE): the saved plan
    runs as it is, even a lever FRESH now; with no plan left it is a one-line error that says what to do."""
    from campaigns.cli import main
    out = proj / "records"
    with pytest.raises(recheck.RecheckError, match="no saved plan with work left"):
        recheck.plan(out, frozen=True)
    assert main(["recheck", "--frozen", "--out-dir", str(out)]) == 2
    assert "no saved plan with work left" in capsys.readouterr().err
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    saved = recheck.plan(out, root=proj)
    verdict(proj, "gqa_swap", "2026-12-01T10:00:00Z")                # FRESH now: an up-to-date plan drops it
    assert recheck.plan(out, frozen=True) == saved
    with pytest.raises(recheck.RecheckError, match="cannot be combined with --restart"):
        recheck.plan(out, restart=True, frozen=True)


def test_a_plan_saved_before_verdicts_were_keyed_by_model_keeps_its_entries(proj):
    """Entries of a plan saved with the lever as their only name, or keyed without the GPU (before 2026-12-05), are
    keyed again from their stale campaign, so they stay pending (not marked done as 'FRESH without it') and are not
    planned twice."""
    stale = verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    out = proj / "records"
    for old in (None, "gqa_swap on qwen3-8b (bf16)"):
        state = recheck.plan(out, root=proj, restart=True)
        for e in state["entries"]:
            del e["key"]
            if old:
                e["key"] = old
        recheck.save_state(out, state)
        (entry,) = recheck.plan(out, root=proj)["entries"]
        assert (entry["key"], entry["stale"], entry["status"]) == ("gqa_swap on qwen3-8b (bf16), H200", stale,
                                                                   "pending")


def test_a_campaign_resumed_in_a_later_command_is_timed_without_the_pause():
    """pdl_stack on the H200 ran 300 s, was cut after 29 legs, and finished in a command 7 minutes later: from its
    start to its last leg it took 15 minutes, which the plan quoted as what a re-run costs. Pauses of more than
    RESUME_GAP_S between legs are left out; the gaps between legs that follow each other stay in."""
    from campaigns.evidence import LegResult

    def leg(start: str, end: str) -> LegResult:
        return LegResult(concurrency=1, rep=0, arm="on", order_index=0, prompts_sha256="", num_prompts=6,
                         started=f"2026-12-04T{start}Z", ended=f"2026-12-04T{end}Z")
    ev = make_evidence(TPUT_WIN, created="2026-12-04T09:00:00Z")
    ev.legs = [leg("09:02:00", "09:02:04"), leg("09:02:05", "09:02:09"),      # gates 120 s, then two legs
               leg("09:10:00", "09:10:04"), leg("09:10:06", "09:10:10")]      # resumed 8 minutes later
    assert recheck.took_s(ev) == 120 + 9 + 4 + 2 + 4
    ev.legs = ev.legs[:2]
    assert recheck.took_s(ev) == 129


def test_a_campaign_cut_before_its_first_leg_is_timed_by_its_gates():
    """Cut during its gates and resumed an hour later, a campaign's span to its first leg is mostly the wait: it
    counts at most the gates' recorded time plus RESUME_GAP_S (without gate timings, the whole span)."""
    from campaigns.evidence import GateResult, LegResult
    ev = make_evidence(TPUT_WIN, created="2026-12-04T09:00:00Z")
    ev.legs = [LegResult(concurrency=1, rep=0, arm="on", order_index=0, prompts_sha256="", num_prompts=6,
                         started="2026-12-04T10:00:00Z", ended="2026-12-04T10:00:10Z")]
    ev.gates = []
    assert recheck.took_s(ev) == 3600 + 10
    ev.gates = [GateResult(gate="op", arm="on", passed=True, duration_s=25.0),
                GateResult(gate="battery", arm="on", passed=True, duration_s=26.0)]
    assert recheck.took_s(ev) == 25 + 26 + recheck.RESUME_GAP_S + 10
    ev.created = "2026-12-04T09:59:00Z"                         # not cut: the span itself, under the bound
    assert recheck.took_s(ev) == 60 + 10


def test_the_overrides_of_a_pinned_campaign_are_words_that_compose_back_to_its_pins():
    """A recheck's overrides go into `scripts/h200_session.sh` steps, which split on spaces: a pin written
    `{pdl: true}` broke a device call on 2026-12-04. Each override is one word, and composing them gives the pins."""
    from campaigns.config import compose
    ev = make_evidence(TPUT_WIN, lever="pdl_prefetch")
    ev.config["campaign"]["with_levers"] = {"pdl": True, "gqa_swap": False}
    ev.__dict__.pop("_settings", None)
    words = recheck.overrides_for(ev, levers.registry())
    assert all(" " not in w for w in words), words
    assert "+campaign.with_levers={gqa_swap:false,pdl:true}" in words
    cfg = compose(words + ["tracking=off"], cuda=False)
    assert dict(cfg.campaign.with_levers) == {"pdl": True, "gqa_swap": False}


def test_a_campaign_stopped_short_of_its_verdict_alone_is_concluded_not_resumed(proj):
    """A recheck's campaign whose device command ran out between its last leg and its verdict: the next
    `vtcampaign recheck` (here, off the device) concludes it instead of resuming it where it ran; one leg short,
    it is resumed."""
    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)
    verdict(proj, "fast_math", "2026-11-30T11:00:00Z", pdl=True)
    calls, concluded = [], []

    def stopped_after_the_grid(overrides, started, drop_legs=0):
        lever = overrides[0].split("=")[1]
        cid = f"2026-12-01-{lever}-new"
        ev = make_evidence(TPUT_WIN, lever=lever, campaign_id=cid)
        ev.status, ev.decision = "in-progress", None
        ev.legs = ev.legs[drop_legs:]
        ev.peak_memory_gib = {a.name: 1.0 for a in ev.arms}
        ev.context = {a.name: {lever: a.value} for a in ev.arms}
        save_evidence(ev, out / cid)
        started(cid)
        calls.append(overrides)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        recheck.run(out, [], stopped_after_the_grid, root=proj, echo=lambda s: None)
    first = calls[0][0].split("=")[1]

    def conclude(cid):
        concluded.append(cid)
        return make_evidence(TPUT_WIN, lever=first, campaign_id=cid)

    def second(overrides, started):                     # the other verdict's campaign: one leg short this time
        return stopped_after_the_grid(overrides, started, drop_legs=1)

    with pytest.raises(KeyboardInterrupt):
        recheck.run(out, [], second, root=proj, echo=lambda s: None, conclude_one=conclude)
    assert concluded == [f"2026-12-01-{first}-new"] and len(calls) == 2
    assert [o for o in calls[1] if o.startswith("resume=")] == ["resume=auto"]     # none of its own begun yet
    state = recheck.load_state(out)
    assert [(e["status"], e.get("verdict")) for e in state["entries"]][:1] == [("done", "FLIP")]
    # the one a leg short is resumed, not concluded
    recheck.run(out, [], lambda o, s: calls.append(o) or make_evidence(TPUT_WIN, lever=o[0].split("=")[1]),
                root=proj, echo=lambda s: None, conclude_one=conclude)
    assert len(concluded) == 1 and calls[2][-1].startswith("resume=2026-12-01-")


def test_a_plan_entry_gives_the_device_step_that_reruns_it_and_the_seconds_it_needs(proj, capsys):
    """The device step of a plan entry is what `scripts/h200_session.sh` takes: SECONDS@campaign:NAME:OVERRIDES.
    Split as the script splits it, its overrides compose back to the campaign's pins; its seconds are the last
    run's gates and legs plus STEP_OVERHEAD_S (on 2026-12-04 a campaign given its took_s + 18 s on the H200 stopped
    before its verdict), rounded up to 5 s and cut at one call's DEVICE_CALL_S. `recheck --dry-run` prints them."""
    import re

    from campaigns.cli import main
    from campaigns.config import compose
    ev = make_evidence(TPUT_WIN, lever="pdl_prefetch")
    ev.config["campaign"]["with_levers"] = {"pdl": True}
    ev.__dict__.pop("_settings", None)
    entry = {"overrides": recheck.overrides_for(ev, levers.registry()), "took_s": 267.2}
    step, need = recheck.device_step(entry)
    assert need == 330 and need > 267.2 + recheck.STEP_OVERHEAD_S - 5
    seconds, rest = step.split("@", 1)
    kind, name, words = rest.split(":", 2)          # the script: ${step%%:*}, then ${rest%%:*} and ${rest#*:}
    assert (seconds, kind, name) == ("330", "campaign", "pdl_prefetch")
    cfg = compose([f"campaign={name}", *words.split(" "), "tracking=off"], cuda=False)
    assert dict(cfg.campaign.with_levers) == {"pdl": True}
    long_step, long_need = recheck.device_step({**entry, "took_s": 900.0})
    assert long_need == 960 and long_step.startswith(f"{recheck.DEVICE_CALL_S}@campaign:pdl_prefetch:")
    assert recheck.device_step({**entry, "took_s": None}) is None

    out = proj / "records"
    verdict(proj, "gqa_swap", "2026-11-30T10:00:00Z", pdl=True)     # stale; took 5 s
    recheck.plan(out, root=proj)
    assert main(["recheck", "--dry-run", "--frozen", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r'^  1: bash scripts/h200_session\.sh "65@campaign:gqa_swap:model=qwen3-8b model\.quant=bf16"$',
                     printed, re.M), printed
    assert "1 to run: ~1 min of device steps" in printed
    # each entry names the GPU its last run measured on (its time is that GPU's; the re-run may get another)
    assert re.search(r"^pending .*gqa_swap.* \(~0\.1 min on H200 last time\)", printed, re.M), printed
    # a verdict of another GPU: its own list of calls (a recheck renews a verdict on its own GPU only)
    h100 = verdict(proj, "fast_math", "2026-11-30T11:00:00Z", pdl=True)
    ev = load_evidence(out / h100)
    ev.fingerprint.device_name = "NVIDIA H100 80GB HBM3"
    ev.config["campaign"]["with_levers"] = {"fast_math": True, "nsplits_cap": 8}  # two pins: a brace bash expands
    save_evidence(ev, out / h100)
    recheck.plan(out, root=proj)
    assert main(["recheck", "--dry-run", "--frozen", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    lists = re.findall(r"^on (.+): (\d+) call\(s\)[^\n]*\n((?:  \d+: [^\n]*\n)+)", printed, re.M)
    calls = {gpu: (n, text) for gpu, n, text in lists}           # in the plan's order (fast_math's first here)
    assert sorted(calls) == ["H100 80GB HBM3", "H200"] and {n for n, _ in calls.values()} == {"1"}, printed
    assert "campaign:gqa_swap:" in calls["H200"][1] and "campaign:fast_math:" not in calls["H200"][1]
    h100_calls = calls["H100 80GB HBM3"][1]
    assert "campaign:fast_math:" in h100_calls and "campaign:gqa_swap:" not in h100_calls
    assert "2 to run: ~2 min of device steps" in printed
    # the entry's command, pasted into bash, passes the pins as one word
    command = re.search(r"^pending .*fast_math.*->  vtcampaign run (.+?)  \(", printed, re.M).group(1)
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {command}"], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    assert "+campaign.with_levers={fast_math:true,nsplits_cap:8}" in words, words
    # a verdict without timed legs: no step to pack, and its GPU's list says so
    state = recheck.load_state(out)
    next(e for e in state["entries"] if e["lever"] == "fast_math")["took_s"] = None
    recheck.save_state(out, state)
    assert main(["recheck", "--dry-run", "--frozen", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    assert re.search(r"^on H100 80GB HBM3: 0 call\(s\), ~0 min; 1 without a timing", printed, re.M), printed
    assert "1 to run" not in printed and "2 to run: ~1 min of device steps at their last durations (1 unknown)" in \
        printed, printed
    # the command's own overrides reach the device steps too; the entry's own keys and typos are refused up front
    assert main(["recheck", "--dry-run", "--frozen", "--out-dir", str(out), "tracking=off"]) == 0
    printed = capsys.readouterr().out
    assert re.search(r'"65@campaign:gqa_swap:model=qwen3-8b model\.quant=bf16 tracking=off"', printed), printed
    assert '"540@recheck:tracking=off" steps' in printed
    for bad, says in (("model.quant=mxfp4", "are the entry's own"), ("resume=auto", "recheck picks what each"),
                      ("trackin=off", "trackin")):
        assert main(["recheck", "--dry-run", "--out-dir", str(out), bad]) == 2
        assert says in capsys.readouterr().err


def test_device_steps_are_packed_into_calls_and_a_long_one_resumes_in_a_later_call():
    """First-fit in the plan's order into calls of DEVICE_CALL_S: no call holds more, every step is placed once, the
    plan's first step is in the first call, and a campaign longer than one call is cut there and resumed in a later
    call, never in an earlier one (its first part must have run before a resume can find it), even where an earlier
    call has room for the rest."""
    cap, left = recheck.DEVICE_CALL_S, recheck.DEVICE_CALL_S - recheck.STEP_OVERHEAD_S
    steps = [("200@campaign:a", 200), ("900@campaign:long", 900), ("700@campaign:long2", 700),
             ("300@campaign:b", 300), ("120@campaign:d", 120)]
    calls = recheck.device_calls(steps)
    seconds = [[int(step.split("@")[0]) for step in call] for call in calls]
    assert all(sum(call) <= cap for call in seconds), seconds
    placed = sorted(step.split("@")[1] for call in calls for step in call)
    assert placed == ["campaign:a", "campaign:b", "campaign:d"] + ["campaign:long"] * 2 + ["campaign:long2"] * 2
    for name, need in (("long", 900), ("long2", 700)):
        (first, s1), (second, s2) = [(i, step) for i, call in enumerate(calls) for step in call
                                     if step.endswith(f"@campaign:{name}")]
        assert s1 == f"{cap}@campaign:{name}" and calls[first] == [s1] and second > first, calls
        assert int(s2.split("@")[0]) == -(-(need - left) // 5) * 5
    # 200 a + 300 b | 540 long | 420 long + 120 d | 540 long2 | 220 long2: a first (the plan's first verdict), b
    # fills the room a left; d fits neither the first call (620 s) nor the second (full), so the third
    assert calls == [["200@campaign:a", "300@campaign:b"], [f"{cap}@campaign:long"],
                     [f"{int(-(-(900 - left) // 5) * 5)}@campaign:long", "120@campaign:d"], [f"{cap}@campaign:long2"],
                     [f"{int(-(-(700 - left) // 5) * 5)}@campaign:long2"]], calls


def test_a_run_within_a_time_budget_starts_only_what_should_end_in_it(proj):
    """`recheck --within SECONDS` (a device call's step passes its limit): an entry starts only where its last run's
    time plus STEP_OVERHEAD_S, less the share of legs its resumed campaign holds, fits in what is left; a later
    entry that fits runs in place of one that does not (2026-12-07: a recheck step started a 745 s campaign with
    540 s left where the printed calls had packed a 310 s one). Only a command of a whole call opens with one that
    will not end in it (one longer than any call is cut and resumes); a shorter, last call starts none."""
    out = proj / "records"
    for i, lever in enumerate(("gqa_swap", "fast_math", "fuse_norm", "triton_gemv")):
        verdict(proj, lever, f"2026-11-30T1{i}:00:00Z", pdl=True)
    state = recheck.plan(out, root=proj)
    order = [e["lever"] for e in state["entries"]]
    for e, took in zip(state["entries"], (200.0, 400.0, 150.0, 900.0)):     # needs 260, 460, 210, 960
        e["took_s"] = took
    recheck.save_state(out, state)
    now, share, calls, said = [0.0], [0.0], [], []          # the clock; the share of legs a resumed run holds

    def runs(overrides, started):
        lever = overrides[0].split("=")[1]
        calls.append(lever)
        entry = next(e for e in recheck.load_state(out)["entries"] if e["lever"] == lever and e["status"] != "done")
        now[0] += recheck.need_s(entry, share[0])
        return make_evidence(TPUT_WIN, lever=lever, campaign_id=f"2026-12-07-{lever}-new")

    def within(seconds, measured=None):
        return recheck.run(out, [], runs, root=proj, echo=said.append, within=seconds, clock=lambda: now[0],
                           measured=measured, frozen=True)             # the saved plan, with the times set here
    state = within(540.0)
    assert calls == [order[0], order[2]]                    # 260 s, then 210 s in the 280 s left; not 460 or 960
    assert [e["status"] for e in state["entries"] if e["lever"] in calls] == ["done", "done"]
    assert f"recheck {order[1]}: needs ~460 s, 280 s left of 540: left pending for a command with room" in \
        [s.replace(" on qwen3-8b (bf16), H200", "") for s in said], said
    assert said[-1] == "recheck: 2 stale verdict(s) left pending for want of time (540 s); run recheck again"
    within(540.0)                                           # 460 s; the 960 s one is not first in this command
    assert calls[2:] == [order[1]]
    state = within(540.0)                                   # first in its command: runs, to be cut and resumed
    assert calls[3:] == [order[3]] and all(e["status"] == "done" for e in state["entries"])
    # a resumed campaign needs the share of its legs left: 900 s with three quarters measured fits in 300 s
    assert recheck.need_s({"took_s": 900.0}, 0.75) == 285.0 and recheck.need_s({"took_s": None}) is None
    state = recheck.plan(out, root=proj)                    # all done: planned anew (the runs filed no evidence)
    for e in state["entries"]:
        e["took_s"] = 900.0
    recheck.save_state(out, state)
    seen, ran, share[0] = [], len(calls), 0.75
    within(600.0, lambda overrides: seen.append(overrides[-1]) or share[0])
    assert calls[ran:] == [e["lever"] for e in state["entries"][:2]] and seen[0] == "resume=auto"    # 285 s twice
    # a call shorter than a whole one (a session's last): nothing starts that should not end in it, first or not,
    # nor an entry without a timing; a campaign begun already is timed by its own legs, resumed by id
    state = recheck.plan(out, root=proj, restart=True)
    first, untimed, begun = state["entries"][:3]
    first["took_s"], untimed["took_s"], begun["took_s"] = 400.0, None, 900.0
    ev = make_evidence(TPUT_WIN, lever=begun["lever"], campaign_id=f"2026-12-07-{begun['lever']}-begun")
    ev.status = "in-progress"
    save_evidence(ev, out / ev.campaign_id)
    begun["new"], begun["status"] = ev.campaign_id, "running"
    recheck.save_state(out, state)
    seen, ran, said[:] = [], len(calls), []
    within(300.0, lambda overrides: seen.append(overrides[-1]) or (share[0] if overrides[-1].endswith("-begun") else 0))
    assert calls[ran:] == [begun["lever"]] and f"resume={ev.campaign_id}" in seen, (calls[ran:], seen)
    said = [s.replace(" on qwen3-8b (bf16), H200", "") for s in said]
    assert f"recheck {first['lever']}: needs ~460 s, 300 s left of 300: left pending for a command with room" in said
    assert f"recheck {untimed['lever']}: needs a time not known, 300 s left of 300: left pending for a command " \
        "with room" in said


def test_the_share_a_resumed_campaign_measured_counts_its_grids_legs(proj, capsys):
    """runner.share_measured, what `recheck --within` takes off a resumed entry's time: the legs of the composed
    grid its campaign holds (legs of another grid do not count), 0.0 for a campaign it would start anew; a budget
    that is not a positive number of seconds is refused naming the value."""
    from campaigns.cli import main
    from campaigns.config import compose
    from campaigns.runner import share_measured
    out = proj / "records"
    ev = make_evidence(TPUT_WIN, lever="gqa_swap", campaign_id="2026-12-07-gqa_swap-new")    # c 1/2/4/8 x 3 reps
    ev.status, ev.legs = "in-progress", ev.legs[:6]
    save_evidence(ev, out / ev.campaign_id)

    def share(resume):
        return share_measured(compose(["campaign=gqa_swap", "tracking=off", f"out_dir={out}", f"resume={resume}"],
                                      cuda=False), proj)
    assert {leg.key for leg in ev.legs} == {(1, r, a) for r in range(3) for a in ("off", "on")}
    assert share(ev.campaign_id) == 0.5         # the CPU grid: c 1/2 x 2 reps, its 4 legs at c1 measured of 8
    assert share("2026-12-07-gqa_swap-other") == 0.0
    for bad in ("0", "-5", "ten", "nan"):
        with pytest.raises(SystemExit):
            main(["recheck", "--within", bad, "--out-dir", str(out)])
        assert f"argument --within: '{bad}' is not a number of seconds; accepted: a positive number" in \
            capsys.readouterr().err


def test_an_unknown_option_names_every_option_recheck_accepts(capsys):
    from campaigns.cli import main
    assert main(["recheck", "--widthin", "540"]) == 2
    err = capsys.readouterr().err
    assert "unknown option(s) ['--widthin'] for recheck" in err
    assert all(flag in err for flag in ("--dry-run", "--restart", "--frozen", "--within", "--out-dir"))
