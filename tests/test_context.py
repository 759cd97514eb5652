"""Lever context and staleness on a temporary git repository: a verdict is STALE when a lever live in its context
changes its default or its own sources change, FRESH otherwise; evidence from before context was recorded is
reconstructed from git; a stale FLIP is never committed."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import git
import pytest

from campaigns import context as lever_context
from campaigns.config import compose
from campaigns.evidence import save_evidence
import helpers
from helpers import TPUT_WIN, lever_repo, make_evidence
from vtengine import levers

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo(tmp_path):
    """A repository with the project's lever files and stand-ins for their source files."""
    return lever_repo(tmp_path)


@pytest.fixture
def plain_defaults(monkeypatch):
    helpers.plain_defaults(monkeypatch)


def now(root: Path):
    levers.reload()
    reg = levers.registry(root / "conf" / "lever")
    return reg, lever_context.tree_digests(reg, root)


def recorded(root: Path, live=("fast_math", "gqa_swap", "nsplits_cap", "pdl", "triton_gemv")):
    """A bf16 gqa_swap FLIP whose context was recorded (marlin_dense inert there: no W4A16 kernel ran)."""
    reg, digests = now(root)
    ev = make_evidence(TPUT_WIN)
    for arm in ev.arms:
        ev.context[arm.name] = {**{n: lv.default for n, lv in reg.items()}, "gqa_swap": arm.value}
        ev.live_levers[arm.name] = sorted(live)
    ev.lever_digests = digests
    sha = git.Repo(root).head.commit.hexsha             # measured at the repository's commit
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = sha, sha[:7]
    return ev


def set_default(root: Path, name: str, value, quant: str | None = None):
    levers.set_default_in_file(name, value, lever_dir=root / "conf" / "lever", quant=quant)


def commit_all(root: Path, msg: str) -> str:
    r = git.Repo(root)
    r.git.add(A=True)
    return r.index.commit(msg, author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t")).hexsha


def test_fresh_until_a_live_lever_changes_its_default(repo):
    ev = recorded(repo)
    assert lever_context.freshness(ev, repo, *now(repo)).fresh
    set_default(repo, "pdl", True)                               # pdl's kernels ran in this context
    f = lever_context.freshness(ev, repo, *now(repo))
    assert not f.fresh and f.label == "STALE"
    assert f.reasons == ["pdl's default is now on; the campaign ran with off and pdl's kernels ran there"]
    assert f.short() == "STALE (defaults: pdl)"
    (repo / "vtengine" / "kernels" / "attention.py").write_text("SPLITS = 8\n")
    assert lever_context.freshness(ev, repo, *now(repo)).short() == "STALE (defaults: pdl; own sources)"


def test_a_flip_of_one_quantizations_default_stales_only_its_verdicts(repo):
    """pdl's bf16 default moves (default_by_quant): the bf16 verdict where pdl ran goes STALE; the same verdict on
    MXFP4 compares with MXFP4's default, unchanged, and stays FRESH."""
    bf16, mx = recorded(repo), recorded(repo)
    mx.config["model"]["quant"] = "mxfp4"
    mx.__dict__.pop("_settings", None)
    assert lever_context.quant_of(bf16) == "bf16" and lever_context.quant_of(mx) == "mxfp4"
    levers.set_default_in_file("pdl", True, lever_dir=repo / "conf" / "lever", quant="bf16")
    f = lever_context.freshness(bf16, repo, *now(repo))
    assert f.reasons == ["pdl's default is now on; the campaign ran with off and pdl's kernels ran there"]
    assert lever_context.freshness(mx, repo, *now(repo)).fresh


def test_an_inert_lever_changing_its_default_leaves_the_verdict_fresh(repo):
    ev = recorded(repo)
    set_default(repo, "marlin_dense", False)                     # W4A16 never ran on this bf16 model
    assert lever_context.freshness(ev, repo, *now(repo)).fresh


def test_an_engine_loop_lever_is_live_whatever_the_counters_listed(repo):
    """async_scheduling has no kernels (affects: []); evidence that listed it inert (no counter can show it ran)
    still goes STALE when its default changes: every step of the measured engine ran through it."""
    ev = recorded(repo)
    assert "async_scheduling" not in ev.live_levers["on"]
    set_default(repo, "async_scheduling", not ev.context["on"]["async_scheduling"])
    f = lever_context.freshness(ev, repo, *now(repo))
    assert not f.fresh and f.reasons[0].startswith("async_scheduling's default is now"), f.reasons
    reg = levers.registry(repo / "conf" / "lever")
    assert {"async_scheduling", "chunked_prefill", "mixed_steps"} <= set(lever_context.live_levers(reg, set()))


def test_live_levers_are_the_ones_whose_kernels_ran(repo):
    """The live list a server's kernel counters give (what the runner records): a bf16 decode launches no W4A16
    GEMM, so the W4A16-only levers (marlin_dense...) are inert there and their defaults moving leaves the verdict
    FRESH, while a lever one of whose kernels ran (fuse_silu: silu_mul) stales it."""
    reg = levers.registry(repo / "conf" / "lever")
    ran = ("decode_attention", "prefill_attention", "rms_norm", "qkv_epilogue", "silu_mul", "dense_linear", "argmax")
    snap = {k: {"route": {"launches": 3}} for k in ran} | {"w4a16_gemm": {"dense": {"launches": 0}}}
    live = lever_context.live_levers(reg, lever_context.kernels_ran(snap))
    w4a16_only = {n for n, lv in reg.items() if lv.affects and set(lv.affects) <= {"w4a16_gemm"}}
    assert {"marlin_dense", "w4a16_rot"} <= w4a16_only
    assert not w4a16_only & set(live), live
    assert {"gqa_swap", "triton_gemv", "pdl", "fuse_silu", "async_scheduling"} <= set(live)
    assert set(live) == set(reg) - w4a16_only
    ev = recorded(repo, live=live)
    set_default(repo, "marlin_dense", not reg["marlin_dense"].default)
    assert lever_context.freshness(ev, repo, *now(repo)).fresh
    set_default(repo, "fuse_silu", not reg["fuse_silu"].default)
    assert lever_context.freshness(ev, repo, *now(repo)).short() == "STALE (defaults: fuse_silu)"


def test_the_levers_own_source_change_stales_it(repo):
    ev = recorded(repo)
    (repo / "vtengine" / "kernels" / "attention.py").write_text("SPLITS = 8\n")
    f = lever_context.freshness(ev, repo, *now(repo))
    assert not f.fresh
    assert "gqa_swap's source files (vtengine/kernels/attention.py::decode_attention) changed" in f.reasons[0]
    # another lever's file changing is not this verdict's business
    ev = recorded(repo)
    (repo / "vtengine" / "kernels" / "gemv.py").write_text("# another GEMV\n")
    assert lever_context.freshness(ev, repo, *now(repo)).fresh


def test_comments_docstrings_and_formatting_do_not_stale_but_code_does(repo):
    """Python sources are compared as parsed at the campaign's commit: a new comment, docstring or line break keeps
    the verdict FRESH; a changed constant, an added argument or a non-Python source's bytes stale it. A commit the
    repository does not have cannot be compared: STALE."""
    src = repo / "vtengine" / "kernels" / "attention.py"
    src.write_text('"""Decode attention."""\nBLOCK = 64\n\n\ndef launch(q, k):\n    """Launch it."""\n'
                   '    return q + k  # fused\n')
    sha = commit_all(repo, "a kernel")
    ev = recorded(repo)
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = sha, sha[:7]
    src.write_text('"""Decode attention, split-KV.\n\nMore words."""\n# tiles\nBLOCK = (64)\n\n\n'
                   'def launch(q,\n           k):\n    """Launch the kernel."""\n    return q + k\n')
    f = lever_context.freshness(ev, repo, *now(repo))
    assert f.fresh, f.reasons
    for code in ("BLOCK = 128\n\n\ndef launch(q, k):\n    return q + k\n",
                 "BLOCK = 64\n\n\ndef launch(q, k, split=1):\n    return q + k\n"):
        src.write_text(code)
        f = lever_context.freshness(ev, repo, *now(repo))
        assert not f.fresh
    assert "gqa_swap's source files (vtengine/kernels/attention.py::decode_attention) changed" in f.reasons[0]
    assert lever_context.normalized("conf/x.yaml", b"a: 1\n") != lever_context.normalized("conf/x.yaml",
                                                                                            b"a: 1  # c\n")
    src.write_text('"""Other words."""\nBLOCK = 64\n\n\ndef launch(q, k):\n    return q + k\n')
    assert lever_context.freshness(ev, repo, *now(repo)).fresh
    ev.fingerprint.git_sha = "f" * 40
    assert not lever_context.freshness(ev, repo, *now(repo)).fresh


def test_sources_compare_as_git_stores_them_links_and_line_endings_too(repo):
    """A linked source compares as the file it names on both sides (the link's own blob, its target's path, never
    equalled the working tree's contents; the two paths alone missed an edit of the target), and a CRLF checkout of
    a non-Python source that git's filters store as committed (core.autocrlf) as unchanged; a retargeted link to
    other code, an edited target or an edited line is a change, and a new untracked CRLF file is no absence."""
    import os
    r = git.Repo(repo)
    kernels = repo / "vtengine" / "kernels"
    (kernels / "attn.cu").write_bytes(b"__global__ void k() {\n  return;\n}\n")
    os.symlink("attention.py", kernels / "alias.py")
    sha = commit_all(repo, "a CUDA source and a linked one")
    entries = ["vtengine/kernels/attn.cu", "vtengine/kernels/alias.py"]
    assert lever_context.changed_sources(repo, sha, entries) == []
    r.config_writer().set_value("core", "autocrlf", "true").release()
    (kernels / "attn.cu").write_bytes(b"__global__ void k() {\r\n  return;\r\n}\r\n")
    assert lever_context.changed_sources(repo, sha, entries) == []
    assert lever_context.sources_diff(repo, sha, entries) == ""
    (kernels / "attn.cu").write_bytes(b"__global__ void k() {\r\n  return 1;\r\n}\r\n")
    assert lever_context.changed_sources(repo, sha, entries) == ["vtengine/kernels/attn.cu"]
    (kernels / "attention.py").write_text((kernels / "attention.py").read_text() + "\nEXTRA = 1\n")
    assert lever_context.changed_sources(repo, sha, entries) == entries       # the target edited
    r.git.checkout("--", "vtengine/kernels/attention.py")
    (kernels / "alias.py").unlink()
    os.symlink("gemv.py", kernels / "alias.py")
    assert lever_context.changed_sources(repo, sha, entries) == entries
    (kernels / "new.cu").write_bytes(b"__global__ void n() {}\r\n")          # untracked: present, not HEAD's None
    assert lever_context.changed_sources(repo, sha, ["vtengine/kernels/new.cu"]) == ["vtengine/kernels/new.cu"]


def test_a_lever_added_since_stales_only_at_an_on_default(repo):
    """The campaign's liveness was counted against the levers of its day, so it cannot list a lever added since:
    such a lever is live there when one of its kernels ran (split_rule's decode_attention, which gqa_swap's
    counting shows ran), not when none did (marlin_dense's W4A16 GEMM on bf16)."""
    ev = recorded(repo)
    for arm in ev.arms:                                          # the campaign predates split_rule and marlin_dense
        del ev.context[arm.name]["split_rule"]
        del ev.context[arm.name]["marlin_dense"]
        ev.gate("mechanism", arm.name).details["counters"] = {"decode_attention": {"gqa_swap": {"launches": 10}}}
    assert "split_rule" not in ev.live_levers["on"]
    set_default(repo, "split_rule", "off")
    set_default(repo, "marlin_dense", False)
    assert lever_context.freshness(ev, repo, *now(repo)).fresh   # added at "off": the engine the campaign ran
    set_default(repo, "split_rule", "len512")
    set_default(repo, "marlin_dense", True)
    f = lever_context.freshness(ev, repo, *now(repo))
    assert not f.fresh and f.reasons == ["split_rule: added since the campaign, with its default len512, which the "
                                         "campaign never ran"]
    assert f.short() == "STALE (new: split_rule)"
    # fuse_rope's qkv_epilogue is a kernel the mechanism gate's counters never keep, so nothing says it did not
    # run (its counted kernels, dense_linear and w4a16_gemm, did not): a new fuse_rope at on is live
    for arm in ev.arms:
        ev.context[arm.name].pop("fuse_rope", None)
    set_default(repo, "fuse_rope", True)
    f = lever_context.freshness(ev, repo, *now(repo))
    assert "new fuse_rope" in f.causes, f.causes


def test_a_reconstructed_context_resolves_the_commits_quantization_defaults_and_presets(repo):
    """Evidence without recorded context is read from the lever files at its commit as the engine resolved them:
    a quantization's own default (default_by_quant) and the levers an on preset sets. pdl_stack on for bf16 at the
    commit ran pdl on: FRESH while that holds, STALE once bf16's pdl_stack default is off (the engine now runs pdl
    off where the campaign measured it on)."""
    set_default(repo, "pdl_stack", False)
    set_default(repo, "pdl_stack", True, quant="bf16")
    sha = commit_all(repo, "pdl_stack on for bf16")
    ev = make_evidence(TPUT_WIN)                                  # bf16, no context recorded
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = sha, sha[:7]
    ctx = lever_context.context_of(ev, repo, now(repo)[0])
    assert ctx.values["off"]["pdl_stack"] is True and ctx.values["off"]["pdl"] is True
    assert ctx.values["off"]["pdl_prefetch"] is True and not ctx.notes
    assert lever_context.freshness(ev, repo, *now(repo)).fresh
    set_default(repo, "pdl_stack", False, quant="bf16")
    f = lever_context.freshness(ev, repo, *now(repo))
    assert not f.fresh and any(r.startswith("pdl_stack's default is now off") or "pdl's default is now off" in r
                               for r in f.reasons), f.reasons
    # a default at the commit that no longer parses is drift, not a lever added since
    raw = (repo / "conf" / "lever" / "split_rule.yaml").read_text()
    (repo / "conf" / "lever" / "split_rule.yaml").write_text(re.sub(r"(?m)^default: .*$", "default: len999", raw))
    sha = commit_all(repo, "a split_rule value since removed")
    (repo / "conf" / "lever" / "split_rule.yaml").write_text(raw)
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = sha, sha[:7]
    ctx = lever_context.context_of(ev, repo, now(repo)[0])
    assert isinstance(ctx.values["on"]["split_rule"], lever_context.Unparsable)
    assert any("split_rule's default 'len999'" in n for n in ctx.notes), ctx.notes
    f = lever_context.freshness(ev, repo, *now(repo))
    assert any(r.startswith("split_rule's default is now") and "len999 (no longer a value)" in r
               for r in f.reasons), f.reasons


def test_schema_1_evidence_is_reconstructed_from_git(repo):
    sha = git.Repo(repo).head.commit.hexsha
    ev = make_evidence(TPUT_WIN)                                  # no context recorded
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = sha, sha[:7]
    mech_counters = {"decode_attention": {"gqa_swap": {"launches": 10}}, "rms_norm": {"precise": {"launches": 4}}}
    for arm in ev.arms:
        ev.gate("mechanism", arm.name).details["counters"] = mech_counters
    ctx = lever_context.context_of(ev, repo, now(repo)[0])
    assert ctx.source == f"git {sha[:7]}"
    assert ctx.values["on"]["gqa_swap"] is True and ctx.values["off"]["pdl"] is False
    # counted kernels decide where they can: no W4A16 launch among the counted kernels, so marlin_dense was inert;
    # pdl and triton_gemv route kernels the old counters did not keep, so they count as live (the safe answer)
    assert "marlin_dense" not in ctx.live["on"] and {"pdl", "triton_gemv", "fast_math"} <= set(ctx.live["on"])
    assert lever_context.freshness(ev, repo, *now(repo)).fresh
    set_default(repo, "triton_gemv", not levers.get("triton_gemv").default)     # a live lever flips either way
    assert not lever_context.freshness(ev, repo, *now(repo)).fresh
    # a commit this repository does not have: nothing can be told, and STALE is the answer
    ev.fingerprint.git_sha = "f" * 40
    f = lever_context.freshness(ev, repo, *now(repo))
    assert not f.fresh and any("source files at the campaign are not known" in r for r in f.reasons)


def _flip_measured_with_pdl_on():
    """A binding mixed_steps FLIP (baseline off: its default today) whose context had pdl on, and pdl's kernels ran:
    STALE while pdl's default is off."""
    ev = make_evidence(TPUT_WIN, lever="mixed_steps")
    reg = levers.registry()
    for arm in ev.arms:
        ev.context[arm.name] = {**{n: lv.default for n, lv in reg.items()}, "mixed_steps": arm.value, "pdl": True}
        ev.live_levers[arm.name] = ["mixed_steps", "pdl"]
    ev.lever_digests = lever_context.tree_digests(reg, ROOT)
    return ev


def test_a_stale_flip_is_refused(tmp_path, plain_defaults, capsys):
    """commit=true and `vtcampaign flip` refuse a stale FLIP, naming why (here: pdl recorded on, but its default
    is off, and its kernels ran)."""
    from campaigns.runner import CampaignError, check_flippable
    ev = _flip_measured_with_pdl_on()
    with pytest.raises(CampaignError, match=r"STALE \(pdl's default is now off; the campaign ran with on"):
        check_flippable(ev)
    out = tmp_path / "records" / "campaigns"
    save_evidence(ev, out / ev.campaign_id)
    from campaigns import cli         # in this process: the plain defaults hold there too
    assert cli.main(["flip", ev.campaign_id, "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "is STALE" in err and "vtcampaign recheck" in err
    # the same FLIP in today's context, at today's commit (after every engine epoch), is fresh and flippable
    for arm in ev.arms:
        ev.context[arm.name]["pdl"] = False
    ev.fingerprint.git_sha = git.Repo(ROOT).head.commit.hexsha
    check_flippable(ev)


def test_vtcampaign_merge_refuses_a_stale_flip_branch_and_merges_a_fresh_one(tmp_path, monkeypatch, capsys,
                                                                            plain_defaults):
    """`vtcampaign merge <lever>` checks the branch's FLIP against the checkout it merges into (a flip merged since
    may have staled it) and refuses a stale one, naming why, with nothing changed; a fresh one is merged as a merge
    commit, the lever file takes the new default and STATUS.md is rendered from the merged tree."""
    from campaigns import cli
    from campaigns.gitops import flip_commit
    root = tmp_path / "proj"
    helpers.copy_plain_levers(root / "conf" / "lever")
    r = git.Repo.init(root, initial_branch="main")
    r.git.add(A=True)
    r.index.commit("project", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    out = root / "records" / "campaigns"
    ev = _flip_measured_with_pdl_on()
    ev.fingerprint.git_sha = git.Repo(ROOT).head.commit.hexsha

    def branch(ev):
        path = save_evidence(ev, out / ev.campaign_id)
        flip_commit(root, "mixed_steps", True, [path], "PR text\n", campaign_id=ev.campaign_id,
                    rendered=lambda d: {root / "records" / "STATUS.md": "# as the flip rendered it\n"})
        path.unlink()

    branch(ev)
    monkeypatch.chdir(root)
    head = r.head.commit.hexsha
    assert cli.main(["merge", "mixed_steps", "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "row/mixed_steps-flip is not merged" in err and "STALE (pdl's default is now off" in err
    assert r.head.commit.hexsha == head and not r.is_dirty()
    for arm in ev.arms:                                       # the same FLIP measured on today's pdl default
        ev.context[arm.name]["pdl"] = False
    branch(ev)
    assert cli.main(["merge", "mixed_steps", "--out-dir", str(out)]) == 0
    assert "merged row/mixed_steps-flip" in capsys.readouterr().out
    assert len(r.head.commit.parents) == 2 and not r.is_dirty()
    assert "default: true" in (root / "conf" / "lever" / "mixed_steps.yaml").read_text().splitlines()
    status = (root / "records" / "STATUS.md").read_text()     # committed by the flip, rendered by the merge
    assert status != "# as the flip rendered it\n" and ev.campaign_id in status
    assert r.head.commit.tree["records/STATUS.md"].data_stream.read().decode() == status
    assert cli.main(["merge", "row/nope-flip", "--out-dir", str(out)]) == 2
    assert "no branch 'row/nope-flip'; flip branches here: ['row/mixed_steps-flip']" in capsys.readouterr().err


def test_vtcampaign_merge_finds_evidence_committed_before_the_flip(tmp_path, monkeypatch, capsys, plain_defaults):
    """The usual path from a device run: its evidence is committed on main as the call returns, then flipped. The
    flip branch then changes no evidence; its commit's Campaign-Id trailer names the campaign, whose evidence the
    merge checks (a stale one is refused, as above) before merging. A flip commit without the trailer, whose
    evidence is already on main, is no flip branch of vtcampaign's."""
    from campaigns import cli
    from campaigns.gitops import CAMPAIGN_TRAILER, flip_commit
    root = tmp_path / "proj"
    helpers.copy_plain_levers(root / "conf" / "lever")
    r = git.Repo.init(root, initial_branch="main")
    out = root / "records" / "campaigns"
    ev = _flip_measured_with_pdl_on()
    ev.fingerprint.git_sha = git.Repo(ROOT).head.commit.hexsha
    path = save_evidence(ev, out / ev.campaign_id)
    r.git.add(A=True)
    r.index.commit("project and the device run's evidence", author=git.Actor("t", "t@t"),
                   committer=git.Actor("t", "t@t"))
    monkeypatch.chdir(root)
    for campaign_id in ("", ev.campaign_id):
        flip_commit(root, "mixed_steps", True, [path], "PR text\n", campaign_id=campaign_id)
        assert r.git.diff("--name-only", "main", "row/mixed_steps-flip") == "conf/lever/mixed_steps.yaml"
        trailer = f"{CAMPAIGN_TRAILER}: {ev.campaign_id}" in r.heads["row/mixed_steps-flip"].commit.message
        assert trailer == bool(campaign_id)
        assert cli.main(["merge", "mixed_steps", "--out-dir", str(out)]) == 2
        err = capsys.readouterr().err
        if not campaign_id:
            assert "carries no campaign evidence" in err
    assert "row/mixed_steps-flip is not merged" in err and "STALE (pdl's default is now off" in err
    for arm in ev.arms:                                       # measured on today's pdl default: fresh, merged
        ev.context[arm.name]["pdl"] = False
    save_evidence(ev, out / ev.campaign_id)
    r.git.add(A=True)
    r.index.commit("the evidence, fresh", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    flip_commit(root, "mixed_steps", True, [path], "PR text\n", campaign_id=ev.campaign_id)
    assert cli.main(["merge", "mixed_steps", "--out-dir", str(out)]) == 0, capsys.readouterr().err
    assert len(r.head.commit.parents) == 2
    assert "default: true" in (root / "conf" / "lever" / "mixed_steps.yaml").read_text().splitlines()


def test_vtcampaign_merge_reads_the_evidence_main_holds_and_a_trailer_under_a_fixup(tmp_path, monkeypatch, capsys,
                                                                                     plain_defaults):
    """A flip branch that adds no evidence leaves main's copy in force: the merge checks that copy, not the one the
    flip was made from. Re-decided on main since the flip (here: KEEP), it is refused; and a fixup commit on top of
    the flip commit does not hide the flip's Campaign-Id trailer."""
    from dataclasses import replace
    from campaigns import cli
    from campaigns.gitops import flip_commit
    root = tmp_path / "proj"
    helpers.copy_plain_levers(root / "conf" / "lever")
    r = git.Repo.init(root, initial_branch="main")
    out = root / "records" / "campaigns"
    ev = _flip_measured_with_pdl_on()
    for arm in ev.arms:                                       # fresh: measured on today's pdl default
        ev.context[arm.name]["pdl"] = False
    ev.fingerprint.git_sha = git.Repo(ROOT).head.commit.hexsha
    path = save_evidence(ev, out / ev.campaign_id)
    who = {"author": git.Actor("t", "t@t"), "committer": git.Actor("t", "t@t")}
    r.git.add(A=True)
    r.index.commit("project and the device run's evidence", **who)
    monkeypatch.chdir(root)
    flip_commit(root, "mixed_steps", True, [path], "PR text\n", campaign_id=ev.campaign_id)
    ev.decision = replace(ev.decision, verdict="KEEP")       # decided again on main after the flip
    save_evidence(ev, out / ev.campaign_id)
    r.git.add(A=True)
    r.index.commit("re-decided: KEEP", **who)
    assert cli.main(["merge", "mixed_steps", "--out-dir", str(out)]) == 2
    assert "its verdict is KEEP, not FLIP" in capsys.readouterr().err
    assert "default: false" in (root / "conf" / "lever" / "mixed_steps.yaml").read_text().splitlines()

    ev.decision = replace(ev.decision, verdict="FLIP")       # FLIP again on main; the branch gets a fixup on top
    save_evidence(ev, out / ev.campaign_id)
    r.git.add(A=True)
    r.index.commit("re-decided: FLIP", **who)
    r.git.checkout("row/mixed_steps-flip")
    (root / "NOTES.md").write_text("why\n")
    r.git.add("NOTES.md")
    r.index.commit("fixup: a note (Campaign-Id: not a trailer here)", **who)
    r.git.checkout("main")
    assert cli.main(["merge", "mixed_steps", "--out-dir", str(out)]) == 0, capsys.readouterr().err
    assert "default: true" in (root / "conf" / "lever" / "mixed_steps.yaml").read_text().splitlines()


def test_a_pinned_lever_is_part_of_the_verdict_and_blocks_its_flip_until_it_is_the_default(monkeypatch,
                                                                                          plain_defaults):
    """pdl_prefetch measured with pdl pinned on: pdl's off default does not stale the verdict (it claims what
    pdl_prefetch does with pdl on), but the FLIP cannot change the default users run while pdl is off; an unpinned
    pdl recorded on is context and does stale it."""
    from campaigns.runner import CampaignError, check_flippable
    ev = make_evidence(TPUT_WIN, lever="pdl_prefetch")
    ev.config["campaign"]["with_levers"] = {"pdl": True}
    ev.__dict__.pop("_settings", None)
    reg = levers.registry()
    for arm in ev.arms:
        ev.context[arm.name] = {**{n: lv.default for n, lv in reg.items()}, "pdl_prefetch": arm.value, "pdl": True}
        ev.live_levers[arm.name] = ["pdl", "pdl_prefetch"]
    ev.lever_digests = lever_context.tree_digests(reg, ROOT)
    ev.fingerprint.git_sha = git.Repo(ROOT).head.commit.hexsha
    assert lever_context.pinned_levers(ev) == {"pdl": True}
    assert lever_context.freshness(ev, ROOT).fresh
    with pytest.raises(CampaignError, match=r"measured with pdl=true \(its default: false\) pinned: .*Flip the "
                                            r"pinned lever first.*together with the preset that sets them: "
                                            r"`vtcampaign run campaign=pdl_stack`"):
        check_flippable(ev)
    # the command that measures with the pin at its default: the same campaign (its other pins kept), shell words
    # that compose: a brace of two pins unquoted would be split by bash's brace expansion
    ev.config["campaign"]["with_levers"] = {"pdl": True, "fast_math": True}
    ev.__dict__.pop("_settings", None)
    with pytest.raises(CampaignError) as refused:
        check_flippable(ev)
    command = re.search(r"with the pins at today's defaults: `vtcampaign run ([^`]+)`", str(refused.value)).group(1)
    words = subprocess.run(["bash", "-c", f"printf '%s\\n' {command}"], capture_output=True, text=True,
                           check=True).stdout.splitlines()                  # the words bash passes, braces and all
    assert "+campaign.with_levers={fast_math:true,pdl:false}" in words and "campaign=pdl_prefetch" in words, words
    assert compose(words).campaign.with_levers == {"pdl": False, "fast_math": True}
    ev.config["campaign"]["with_levers"] = {"pdl": True}
    ev.__dict__.pop("_settings", None)
    # the same pin at pdl's default is no obstacle (async_device_mirror with async_scheduling=true)
    real = levers.effective_defaults
    with monkeypatch.context() as m:
        m.setattr(levers, "effective_defaults", lambda reg=None, quant=None: {**real(reg, quant), "pdl": True})
        check_flippable(ev)
    # not pinned, the same recorded pdl=on is the campaign's context, and pdl's off default stales it
    ev.config["campaign"]["with_levers"] = {}
    ev.__dict__.pop("_settings", None)
    f = lever_context.freshness(ev, ROOT)
    assert not f.fresh and f.reasons[0].startswith("pdl's default is now off"), f.reasons


def test_a_flip_is_refused_once_the_default_is_not_its_baseline():
    """A fresh FLIP whose default was flipped already (async_device_mirror's recheck), or one measured against a
    baseline the default has left since (gqa_swap off -> on, measured when off was the default), commits nothing."""
    from campaigns.runner import CampaignError, check_flippable
    ev = make_evidence(TPUT_WIN)                                  # gqa_swap off -> on; gqa_swap's default is on
    with pytest.raises(CampaignError, match="gqa_swap's default is already on; nothing to flip"):
        check_flippable(ev)
    ev = make_evidence(TPUT_WIN, lever="nsplits_cap", candidates=(8,))
    ev.arms[0].value, ev.decision.new_default = 4, 8                 # measured 8 against 4; the default is off
    ev.decision.verdict, ev.decision.binding = "FLIP", True
    with pytest.raises(CampaignError, match=r"measured 8 against the baseline 4, but nsplits_cap's default is now "
                                            r"off: .*`vtcampaign run campaign=nsplits_cap`"):
        check_flippable(ev)


def test_an_engine_epoch_stales_what_was_measured_before_it(repo):
    """A fix outside every lever's files (here: a stand-in for the lever-lookup fix) is declared an engine epoch in
    conf/epochs.yaml; verdicts measured at a commit without it go STALE with its reason, later ones do not, and a
    malformed file is an error naming the entry."""
    before = git.Repo(repo).head.commit.hexsha
    (repo / "vtengine" / "levers.py").parent.mkdir(parents=True, exist_ok=True)
    (repo / "vtengine" / "levers.py").write_text("# on() is a dict lookup now\n")
    epoch = commit_all(repo, "the fix")
    (repo / "conf" / "epochs.yaml").write_text(
        f"- commit: {epoch[:7]}\n  date: 2026-12-01\n  why: lever lookups no longer scan files\n")
    after = commit_all(repo, "declare it")
    old, new = recorded(repo), recorded(repo)
    old.fingerprint.git_sha, new.fingerprint.git_sha = before[:7], after[:7]
    f = lever_context.freshness(old, repo, *now(repo))
    assert not f.fresh and f.reasons == [f"measured before the engine epoch {epoch[:7]} (2026-12-01): lever lookups "
                                         "no longer scan files"]
    assert f.short() == f"STALE (epoch {epoch[:7]})"
    assert lever_context.freshness(new, repo, *now(repo)).fresh
    new.fingerprint.git_sha = "e" * 40                           # a commit this repository does not have
    assert "is not in this repository" in lever_context.freshness(new, repo, *now(repo)).reasons[0]
    (repo / "conf" / "epochs.yaml").write_text("- commit: abc\n  why: no date\n")
    with pytest.raises(ValueError, match="entry 0.*needs exactly commit, date and a non-empty why"):
        lever_context.freshness(old, repo, *now(repo))


def test_every_lever_file_names_source_files_that_exist():
    """Each lever's `paths:` are files of this checkout (a typo would keep its verdicts FRESH for ever)."""
    assert {n: lever_context.missing_sources(lv, ROOT) for n, lv in levers.registry().items()
            if lever_context.missing_sources(lv, ROOT)} == {}


def test_a_campaign_refuses_a_lever_whose_paths_are_not_files(tmp_path, monkeypatch):
    """The preflight names the lever file and the missing paths (here the source root moved to an empty folder,
    so none of gqa_swap's files are there)."""
    from campaigns.config import compose
    from campaigns.runner import CampaignError, _preflight
    from helpers import temp_repo
    from vtengine import confdirs
    repo = temp_repo(tmp_path)
    monkeypatch.setattr(confdirs, "SOURCE_ROOT", tmp_path / "empty")
    cfg = compose(["campaign=gqa_swap", "tracking=off"], cuda=False)
    with pytest.raises(CampaignError, match=r"gqa_swap.yaml: paths \['vtengine/kernels/attention.py::"
                                            r"decode_attention'\] are no file under .*empty, or name no definition "
                                            r"in it; list the lever's own sources"):
        _preflight(cfg, repo, repo / "records" / "campaigns")


def _fresh_today(ev):
    """``ev`` as if measured at today's commit in today's context (fresh)."""
    reg = levers.registry()
    for arm in ev.arms:
        ev.context[arm.name] = {**levers.effective_defaults(reg), ev.lever: arm.value}
        ev.live_levers[arm.name] = [ev.lever]
    ev.lever_digests = lever_context.tree_digests(reg, ROOT)
    ev.fingerprint.git_sha = git.Repo(ROOT).head.commit.hexsha
    return ev


def test_a_flip_refuted_on_another_workload_is_refused(tmp_path, plain_defaults, capsys):
    """mixed_steps FLIPs on the standard grid but a fresh long-prompt campaign refuted it: two workloads, two verdicts
    (the workload is part of what a verdict is on), and the flip would trade one for the other, so it is refused.
    A REJECT on the same workload (online_span: the same requests) is another verdict's business, not this one's."""
    from campaigns.recheck import measured_on, plan_key
    from campaigns.runner import CampaignError, check_flippable
    loss = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]}}
    flip = _fresh_today(make_evidence(TPUT_WIN, lever="mixed_steps", campaign_id="2026-12-03-mixed_steps-aaa1111"))
    long = _fresh_today(make_evidence(loss, lever="mixed_steps", campaign_id="2026-12-03-mixed_steps-bbb2222",
                                      created="2026-12-01T10:00:00Z"))
    long.config["grid"].update(name="long_prompt", input_len=32000, output_len=128)
    long.__dict__.pop("_settings", None)
    assert long.decision.verdict == "REJECT-PERFORMANCE" and long.decision.candidate == flip.decision.candidate
    assert measured_on(long) == "qwen3-8b (bf16), 32000 in / 128 out" and measured_on(flip) == "qwen3-8b (bf16)"
    assert plan_key(long) != plan_key(flip)
    out = tmp_path / "records" / "campaigns"
    for ev in (flip, long):
        save_evidence(ev, out / ev.campaign_id)
    check_flippable(flip)                                        # alone it is a fresh, binding FLIP
    with pytest.raises(CampaignError, match=r"mixed_steps FLIPped on qwen3-8b \(bf16\), H200, but 2026-12-03-"
                                            r"mixed_steps-bbb2222 \(qwen3-8b \(bf16\), 32000 in / 128 out, H200\) "
                                            r"is a fresh REJECT-PERFORMANCE of the same change"):
        check_flippable(flip, out)
    from campaigns import cli
    assert cli.main(["flip", flip.campaign_id, "--out-dir", str(out)]) == 2
    assert "would trade what that measurement refuted" in capsys.readouterr().err
    long.config["grid"].update(name="online_span", input_len=1024, output_len=128)    # the same requests
    long.created = "2026-11-29T10:00:00Z"        # before the FLIP: that plan's history (after it, it would overturn it)
    long.__dict__.pop("_settings", None)
    save_evidence(long, out / long.campaign_id)
    assert plan_key(long) == plan_key(flip)
    check_flippable(flip, out)
    # the same requests measured on another GPU: a verdict of its own (an H100 campaign says nothing of the H200),
    # and a default holds on both, so its REJECT refuses the flip
    long.fingerprint.device_name = "NVIDIA H100 80GB HBM3"
    save_evidence(long, out / long.campaign_id)
    assert plan_key(long) == "mixed_steps on qwen3-8b (bf16), H100 80GB HBM3" != plan_key(flip)
    with pytest.raises(CampaignError, match=r"bbb2222 \(qwen3-8b \(bf16\), H100 80GB HBM3\) is a fresh "
                                            r"REJECT-PERFORMANCE of the same change: a default holds for every "
                                            r"model, workload and GPU"):
        check_flippable(flip, out)


def test_a_flip_a_later_verdict_of_the_same_plan_overturned_is_refused(tmp_path, plain_defaults, capsys):
    """A later binding REJECT of the same lever, model, workload, GPU and pins is what STATUS shows; `flip` of the
    older FLIP committed it anyway (a review's repro: async_device_mirror, 2026-12-08)."""
    from campaigns.recheck import plan_key
    from campaigns.runner import CampaignError, check_flippable
    loss = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]}}
    flip = _fresh_today(make_evidence(TPUT_WIN, lever="mixed_steps", campaign_id="2026-12-03-mixed_steps-aaa1111",
                                      created="2026-12-03T10:00:00Z"))
    later = _fresh_today(make_evidence(loss, lever="mixed_steps", campaign_id="2026-12-04-mixed_steps-bbb2222",
                                       created="2026-12-04T10:00:00Z"))
    assert plan_key(later) == plan_key(flip) and later.decision.verdict == "REJECT-PERFORMANCE"
    out = tmp_path / "records" / "campaigns"
    save_evidence(flip, out / flip.campaign_id)
    check_flippable(flip, out)                                  # alone: the latest of its plan
    save_evidence(later, out / later.campaign_id)
    with pytest.raises(CampaignError, match=r"a later binding campaign of the same lever, model, workload, GPU and "
                                            r"pins, 2026-12-04-mixed_steps-bbb2222, reads REJECT-PERFORMANCE"):
        check_flippable(flip, out)
    from campaigns import cli
    assert cli.main(["flip", flip.campaign_id, "--out-dir", str(out)]) == 2
    assert "that is the verdict STATUS shows" in capsys.readouterr().err


def test_a_long_prompt_verdict_of_varied_outputs_is_filed_under_its_mean_and_shows_its_range():
    """The long-prompt grid's outputs vary since 2026-12-04 (64-192, mean 128): its verdicts show the range where
    they are read, and are filed under "32000 in / 128 out", so a new one replaces the stale fixed-output ones."""
    from campaigns import records
    from campaigns.recheck import measured_on, plan_key
    fixed = make_evidence(TPUT_WIN, lever="mixed_prefill", campaign_id="2026-12-03-mixed_prefill-aaa1111")
    varied = make_evidence(TPUT_WIN, lever="mixed_prefill", campaign_id="2026-12-05-mixed_prefill-bbb2222")
    fixed.config["grid"].update(name="long_prompt", input_len=32000, output_len=128)
    varied.config["grid"].update(name="long_prompt", input_len=32000, output_len=128, output_len_range=0.5)
    for ev in (fixed, varied):
        ev.__dict__.pop("_settings", None)
    assert measured_on(fixed) == "qwen3-8b (bf16), 32000 in / 128 out"
    assert measured_on(varied) == "qwen3-8b (bf16), 32000 in / 64-192 out"
    assert plan_key(fixed) == plan_key(varied) == "mixed_prefill on qwen3-8b (bf16), 32000 in / 128 out, H200"
    assert "32000 in / 64-192, mean 128 out)" in records.render_record(varied)


def _stale(ev):
    """``ev`` measured with gqa_swap off and live, against its on default now: STALE."""
    for arm in ev.arms:
        ev.context[arm.name]["gqa_swap"] = False
        ev.live_levers[arm.name] = [ev.lever, "gqa_swap"]


def test_a_flip_refuted_on_another_quantization_flips_its_own_quantization_alone(tmp_path, plain_defaults):
    """pdl_stack FLIPped on bf16 (TPOT x1.012) and was refuted on MXFP4 (total tok/s x0.79), H200 2026-12-04: one
    default for both would trade one for the other, so the flip is scoped to bf16 (default_by_quant) and MXFP4 keeps
    its default, also once that REJECT is stale. A fresh REJECT on another model of the same quantization still
    refuses it; one measured with other pins says nothing of it."""
    from campaigns.runner import CampaignError, check_flippable
    loss = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [79.0, 80.0, 81.0]}}
    flip = _fresh_today(make_evidence(TPUT_WIN, lever="pdl_stack", campaign_id="2026-12-04-pdl_stack-aaa1111-2"))
    mx = _fresh_today(make_evidence(loss, lever="pdl_stack", campaign_id="2026-12-04-pdl_stack-aaa1111",
                                    created="2026-12-01T10:00:00Z"))
    mx.config["model"]["quant"] = "mxfp4"
    mx.__dict__.pop("_settings", None)
    assert mx.decision.verdict == "REJECT-PERFORMANCE" and mx.decision.candidate == flip.decision.candidate
    out = tmp_path / "records" / "campaigns"
    for ev in (flip, mx):
        save_evidence(ev, out / ev.campaign_id)
    assert check_flippable(flip) == "bf16"                      # alone too: its W4A16 form never ran on bf16
    assert check_flippable(flip, out) == "bf16"
    _stale(mx)
    save_evidence(mx, out / mx.campaign_id)
    assert not lever_context.freshness(mx, ROOT).fresh
    assert check_flippable(flip, out) == "bf16"                 # a stale REJECT still says the change may cost there
    other = _fresh_today(make_evidence(loss, lever="pdl_stack", campaign_id="2026-12-04-pdl_stack-ccc3333",
                                       created="2026-12-01T11:00:00Z"))
    other.config["model"]["name"] = "llama-3.1-8b"             # bf16, another model: the bf16 default is refuted
    other.__dict__.pop("_settings", None)
    save_evidence(other, out / other.campaign_id)
    with pytest.raises(CampaignError, match=r"pdl_stack FLIPped on qwen3-8b \(bf16\), H200, but 2026-12-04-"
                                            r"pdl_stack-ccc3333 \(llama-3.1-8b \(bf16\), H200\) is a fresh "
                                            r"REJECT-PERFORMANCE.*every model, workload and GPU of bf16"):
        check_flippable(flip, out)
    _stale(other)
    save_evidence(other, out / other.campaign_id)
    assert check_flippable(flip, out) == "bf16"                 # a stale one on bf16 does not refuse it
    for ev in (mx, other):
        ev.config["campaign"]["with_levers"] = {"gqa_swap": False}
        ev.__dict__.pop("_settings", None)
        save_evidence(ev, out / ev.campaign_id)
    assert check_flippable(flip, out) == "bf16"                 # other pins refute nothing; its sources still scope it


def test_a_sweep_flips_by_the_flip_commands_rule(tmp_path, plain_defaults):
    """`-m campaign=pdl_stack model.quant=bf16,mxfp4 commit=true` on the H200 of 2026-12-04 (FLIP on bf16, REJECT
    on MXFP4): the sweep flips bf16's default alone, as `vtcampaign flip` does, where it used to refuse every FLIP
    of a lever any model rejected; a second bf16 FLIP of it is refused naming the first, and a fresh REJECT on
    bf16 refuses them all."""
    from campaigns.sweep import plan_flips
    loss = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [79.0, 80.0, 81.0]}}
    flip = _fresh_today(make_evidence(TPUT_WIN, lever="pdl_stack", campaign_id="2026-12-04-pdl_stack-aaa1111-2"))
    again = _fresh_today(make_evidence(TPUT_WIN, lever="pdl_stack", campaign_id="2026-12-04-pdl_stack-aaa1111-3"))
    again.config["model"]["name"] = "llama-3.1-8b"             # bf16 too: the same default (on the same model, the
    again.__dict__.pop("_settings", None)                      # later FLIP would supersede the earlier one)
    mx = _fresh_today(make_evidence(loss, lever="pdl_stack", campaign_id="2026-12-04-pdl_stack-aaa1111",
                                    created="2026-12-01T10:00:00Z"))
    mx.config["model"]["quant"] = "mxfp4"
    mx.__dict__.pop("_settings", None)
    out = tmp_path / "records" / "campaigns"
    for ev in (flip, again, mx):
        save_evidence(ev, out / ev.campaign_id)
    plan = plan_flips([mx, flip, again], out)
    assert plan[flip.campaign_id] == ("flip", "bf16")
    assert plan[again.campaign_id] == ("refused", f"already flipped by {flip.campaign_id}")
    assert mx.campaign_id not in plan                           # a REJECT is nothing to commit
    other = _fresh_today(make_evidence(loss, lever="pdl_stack", campaign_id="2026-12-04-pdl_stack-ccc3333",
                                       created="2026-12-01T11:00:00Z"))
    other.config["model"]["name"] = "llama-3.1-8b"             # bf16, another model: the bf16 default is refuted
    other.__dict__.pop("_settings", None)
    save_evidence(other, out / other.campaign_id)
    plan = plan_flips([mx, flip, other], out)
    assert plan[flip.campaign_id][0] == "refused" and "ccc3333" in plan[flip.campaign_id][1]


def test_a_flip_from_one_quantization_sets_only_its_default_where_the_others_ran_none_of_its_code(tmp_path,
                                                                                                  plain_defaults,
                                                                                                  monkeypatch):
    """fuse_rope FLIPped on bf16 (H200 2026-12-05) but its W4A16 form (w4a16.py, MXFP4/NVFP4 only) never ran there:
    the flip sets the bf16 default alone. A lever whose sources all run on bf16 flips for every
    quantization, unless a REJECT on another one refuted it. Measured on MXFP4, every source of fuse_rope can run.
    (prefill_gqa_pack stands for a lever whose sources all run on bf16; its off default is the premise, and
    fuse_rope's, which the MXFP4 FLIP of 2026-12-05 has since turned on everywhere.)"""
    import dataclasses
    from campaigns.runner import check_flippable
    plain = levers.registry
    monkeypatch.setattr(levers, "registry", lambda lever_dir=None: {
        n: dataclasses.replace(lv, default=False) if n == "fuse_rope" else lv for n, lv in plain(lever_dir).items()})
    rope = _fresh_today(make_evidence(TPUT_WIN, lever="fuse_rope", campaign_id="2026-12-05-fuse_rope-aaa1111"))
    assert "vtengine/kernels/w4a16.py" in levers.registry()["fuse_rope"].paths
    assert check_flippable(rope) == "bf16"
    rope.config["model"]["quant"] = "mxfp4"
    rope.__dict__.pop("_settings", None)
    assert check_flippable(rope) is None
    swap = _fresh_today(make_evidence(TPUT_WIN, lever="prefill_gqa_pack",
                                      campaign_id="2026-12-05-prefill_gqa_pack-aaa1111"))
    assert check_flippable(swap) is None
    loss = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [79.0, 80.0, 81.0]}}
    mx = _fresh_today(make_evidence(loss, lever="prefill_gqa_pack", campaign_id="2026-12-04-prefill_gqa_pack-bbb2222",
                                    created="2026-12-01T10:00:00Z"))
    mx.config["model"]["quant"] = "mxfp4"
    mx.__dict__.pop("_settings", None)
    out = tmp_path / "records" / "campaigns"
    for ev in (swap, mx):
        save_evidence(ev, out / ev.campaign_id)
    assert check_flippable(swap, out) == "bf16"


def _preset_verdict():
    """A fresh mixed_prefill FLIP: its ON arm ran the levers the preset sets, both arms with them live."""
    sets = levers.registry()["mixed_prefill"].sets
    ev = _fresh_today(make_evidence(TPUT_WIN, lever="mixed_prefill"))
    ev.context["on"].update(sets)
    for arm in ev.arms:
        ev.live_levers[arm.name] = sorted({"mixed_prefill", *sets})
    return ev


def test_a_presets_own_levers_are_the_lever_not_its_context(plain_defaults):
    """mixed_prefill's ON arm runs chunk_graphs, chunked_prefill=512... because the preset under test sets them: its
    first H200 verdict was marked STALE at once ("chunk_graphs's default is now off; the campaign ran with on").
    They are context only where the preset is off, and there a drift from the default still stales the verdict."""
    ev = _preset_verdict()
    f = lever_context.freshness(ev, ROOT)
    assert f.fresh, f.reasons
    ev.context["off"]["chunk_graphs"] = True         # the baseline ran a set lever off its default: that is context
    f = lever_context.freshness(ev, ROOT)
    assert not f.fresh and f.reasons[0].startswith("chunk_graphs's default is now off; the campaign ran with on")


def test_a_presets_own_flip_does_not_stale_its_verdict(plain_defaults):
    """pdl_stack FLIPped on bf16 (H200, 2026-12-04) and its flip marked its own verdict STALE at once ("pdl's default
    is now on; the campaign ran with off"): the OFF arm ran pdl off because the preset was off there, which is what
    the engine with the preset off still does. A set lever the OFF arm ran at another value stays context."""
    import dataclasses
    reg = levers.registry()
    flipped = {**reg, "mixed_prefill": dataclasses.replace(reg["mixed_prefill"], default=True)}
    ev = _preset_verdict()
    digests = lever_context.tree_digests(flipped, ROOT)
    assert levers.effective_defaults(flipped)["chunk_graphs"] is True
    f = lever_context.freshness(ev, ROOT, flipped, digests)
    assert f.fresh, f.reasons
    ev.context["off"]["chunk_graphs"] = True
    f = lever_context.freshness(ev, ROOT, flipped, digests)
    assert not f.fresh and f.reasons[0] == ("the off arm ran chunk_graphs at on, where the engine with mixed_prefill at "
                                           "off gives off, and chunk_graphs shapes every step")


def test_levers_an_on_preset_sets_are_one_reason_named_for_the_preset(repo):
    """After the pdl_stack flip STATUS said "STALE (defaults: pdl, pdl_prefetch, pdl_stack)" with three reasons:
    the change to look up is the preset's. One reason names it and what it sets; a lever it does not set stays
    its own reason."""
    ev = recorded(repo, live=("gqa_swap", "pdl", "pdl_prefetch", "fast_math"))
    set_default(repo, "pdl_stack", True)
    set_default(repo, "fast_math", False)
    f = lever_context.freshness(ev, repo, *now(repo))
    assert f.reasons == ["fast_math's default is now off; the campaign ran with on and fast_math's kernels ran there",
                         "pdl_stack's default is now on (it sets pdl=on, pdl_prefetch=on); the campaign ran with pdl "
                         "off, pdl_prefetch off, and they were live there"]
    assert f.short() == "STALE (defaults: fast_math, pdl_stack)"


def test_a_source_that_runs_on_other_quantizations_alone_does_not_stale_a_bf16_verdict(repo):
    """fuse_silu lists w4a16.py for its W4A16 form: its bf16 verdict measured none of that code, so a change there
    (a W4A16 tile) leaves it FRESH, while the MXFP4 verdict goes STALE; a change to a file bf16 runs stales both,
    and the bf16 reason names only the files bf16 runs."""
    sha = git.Repo(repo).head.commit.hexsha

    def verdict(quant):
        reg, digests = now(repo)
        ev = make_evidence(TPUT_WIN, lever="fuse_silu")
        ev.config["model"]["quant"] = quant
        ev.__dict__.pop("_settings", None)
        for arm in ev.arms:
            ev.context[arm.name] = {**{n: lv.default for n, lv in reg.items()}, "fuse_silu": arm.value}
            ev.live_levers[arm.name] = ["fuse_silu"]
        ev.lever_digests = digests
        ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = sha, sha[:7]
        return ev

    bf16, mx = verdict("bf16"), verdict("mxfp4")
    (repo / "vtengine" / "kernels" / "w4a16.py").write_text("BLOCK_N = 64\n")
    assert lever_context.freshness(bf16, repo, *now(repo)).fresh
    assert lever_context.freshness(mx, repo, *now(repo)).reasons == [
        f"fuse_silu's source files (vtengine/kernels/w4a16.py) changed since {sha[:7]}"]
    (repo / "vtengine" / "kernels" / "gemv.py").write_text("BLOCK_N = 64\n")
    assert lever_context.freshness(bf16, repo, *now(repo)).reasons == [
        f"fuse_silu's source files (vtengine/kernels/gemv.py) changed since {sha[:7]}"]
    assert lever_context.freshness(mx, repo, *now(repo)).reasons == [
        f"fuse_silu's source files (vtengine/kernels/w4a16.py, vtengine/kernels/gemv.py) changed since {sha[:7]}"]


def _code_run_from(files: set[str], llm, prompt: list[int]) -> set[str]:
    """The functions defined in ``files`` that run while ``llm`` generates a few tokens (the interpreter runs the
    Triton kernels as Python on CPU, so kernels count too)."""
    from vtengine.engine.sampling_params import SamplingParams
    ran: set[str] = set()

    def probe(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in files:
            ran.add(frame.f_code.co_name)

    sys.setprofile(probe)
    try:
        llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        sys.setprofile(None)
    return ran


def test_the_quantization_scoped_sources_run_on_their_quantizations_alone():
    """QUANT_SOURCES is a claim about the engine, checked: a bf16 engine on the Triton backend (prefill and decode,
    its defaults) runs no code of those files, while an MXFP4 one does (the probe can see them); and no engine
    module but the backend that routes quantized weights imports them (the benches and gates are not the engine)."""
    import ast
    from vtengine.engine.llm import LLM
    files = {str((ROOT / p).resolve()) for p in lever_context.QUANT_SOURCES}
    prompt = list(range(3, 40))
    assert _code_run_from(files, LLM(model="tiny", quant="bf16", backend="triton"), prompt) == set()
    assert "w4a16_linear" in _code_run_from(files, LLM(model="tiny", quant="mxfp4", backend="triton"), prompt)
    importers = set()
    for path in (ROOT / "vtengine").rglob("*.py"):
        if "bench" in path.relative_to(ROOT / "vtengine").parts or path.name == "cli.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(n.endswith("kernels.w4a16") for n in names):
                importers.add(str(path.relative_to(ROOT)))
    assert importers == {"vtengine/backends/triton_backend.py"}


def test_a_full_length_sha_the_repository_lacks_is_unknown(repo):
    """gitpython's repo.commit() takes any 40-hex string on trust; a missing commit must read as unknown (its
    sources cannot be compared: STALE), not fail on the first file read."""
    r = git.Repo(repo)
    assert lever_context._commit_known(r, r.head.commit.hexsha)
    assert not lever_context._commit_known(r, "0" * 40)
    assert lever_context.changed_sources(repo, "0" * 40, ["vtengine/kernels/attention.py"]) is None


def test_status_at_a_commit_names_the_verdicts_it_would_stale(repo, capsys, monkeypatch):
    """`vtcampaign status --at REV` judges today's verdicts against another commit's lever files and sources (in a
    temporary git worktree, removed after): a branch that changes gqa_swap's kernel stales its FRESH verdict, with
    the reason; one that flips a live lever's default stales it for that; one that only rewrites a comment leaves it
    FRESH; the working tree is judged as it is. A commit that is not there is refused, naming it."""
    from campaigns import cli, recheck
    helpers.plain_defaults(monkeypatch)        # this checkout's registry: the project's levers, as the repo's copies
    out = repo / "records" / "campaigns"
    ev = recorded(repo)
    save_evidence(ev, out / ev.campaign_id)
    base = commit_all(repo, "the verdict")
    r = git.Repo(repo)
    src = repo / "vtengine" / "kernels" / "attention.py"

    def branch(name: str, change) -> None:
        r.git.checkout("-q", "-b", name, base)
        change()
        commit_all(repo, name)
        r.git.checkout("-q", base)

    branch("kernel", lambda: src.write_text("SOURCE = 'a faster kernel'\n"))
    branch("comment", lambda: src.write_text(src.read_text() + "# a comment\n"))
    branch("pdl-flip", lambda: set_default(repo, "pdl", True))
    r.git.worktree("add", "--detach", str(repo.parent / "killed"), base)       # a run killed before its cleanup
    shutil.rmtree(repo.parent / "killed")
    rows = {rev: recheck.freshness_at(out, rev, repo) for rev in ("kernel", "comment", "pdl-flip")}
    for rev, (short, got) in rows.items():
        assert short == r.commit(rev).hexsha[:7] and [e.campaign_id for e, _, _ in got] == [ev.campaign_id]
        assert got[0][1].fresh, got[0][1].reasons                        # here: FRESH
    assert not rows["kernel"][1][0][2].fresh and rows["comment"][1][0][2].fresh
    assert "gqa_swap's source files (vtengine/kernels/attention.py::decode_attention) changed" \
        in rows["kernel"][1][0][2].reasons[0]
    assert "pdl's default is now on" in rows["pdl-flip"][1][0][2].reasons[0]
    text, lost = recheck.at_report("kernel", *rows["kernel"])
    assert lost == 1 and "would go STALE: 1" in text and ev.campaign_id in text and "FRESH in both: 0" in text
    assert len(r.git.worktree("list").splitlines()) == 1 and not r.is_dirty()
    src.write_text("SOURCE = 'edited here'\n")             # the working tree, uncommitted: STALE here, FRESH there
    _, got = recheck.freshness_at(out, "comment", repo)
    assert not got[0][1].fresh and got[0][2].fresh
    assert "would turn FRESH: 1" in recheck.at_report("comment", "abc1234", got)[0]
    with pytest.raises(recheck.RecheckError, match="'nope' is not a commit in the repository at .*accepted: a "
                                                   "branch, tag or commit sha"):
        recheck.freshness_at(out, "nope", repo)
    # the command: the report, --strict's exit status, and its errors on one line
    monkeypatch.setattr(recheck.confdirs, "SOURCE_ROOT", repo)
    src.write_text(r.commit(base).tree["vtengine/kernels/attention.py"].data_stream.read().decode())
    assert cli.main(["status", "--at", "kernel", "--strict", "--out-dir", str(out)]) == 3
    assert "would go STALE: 1" in capsys.readouterr().out
    assert cli.main(["status", "--at", "comment", "--strict", "--out-dir", str(out)]) == 0
    assert cli.main(["status", "--strict", "--out-dir", str(out)]) == 2
    assert "--strict needs --at REV" in capsys.readouterr().err
    assert cli.main(["status", "--at", "nope", "--out-dir", str(out)]) == 2
    assert "'nope' is not a commit" in capsys.readouterr().err


def test_a_campaign_whose_commit_was_rewritten_is_read_at_a_landed_commit_of_its_code(repo):
    """A commit a campaign ran on can be rewritten before it lands (its subject reworded): its sha is then in no
    repository, but the code it measured landed under another sha with the same code digest. Staleness reads its
    sources there (FRESH until they change) instead of calling them unknown; a digest that matches no commit here
    leaves the campaign's own sha, which freshness reports as not in this repository."""
    from campaigns.gitops import code_digest
    ev = recorded(repo)
    measured = ev.fingerprint.git_sha
    ev.fingerprint.code_digest = code_digest(repo)
    (repo / "NOTES.md").write_text("prose: the same code\n")
    prose = commit_all(repo, "notes")
    (repo / "vtengine" / "kernels" / "attention.py").write_text("SPLITS = 8\n")
    commit_all(repo, "gqa_swap's source moves")                  # HEAD's code is not the campaign's
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = "f" * 40, "f" * 7      # the rewritten commit: gone
    landed = lever_context.campaign_commit(ev, repo)
    assert landed in (measured, prose)
    old = recorded(repo)                                         # evidence from before context was recorded
    old.context, old.live_levers, old.lever_digests = {}, {}, {}
    old.fingerprint = ev.fingerprint
    assert lever_context.context_of(old, repo, now(repo)[0]).source == f"git {landed[:7]}"
    f = lever_context.freshness(ev, repo, *now(repo))
    assert f.reasons == ["gqa_swap's source files (vtengine/kernels/attention.py::decode_attention) changed since "
                         f"fffffff (its code landed as {landed[:7]})"], f.reasons
    ev.fingerprint.code_digest = "0" * 64                        # no commit here has this code
    assert lever_context.campaign_commit(ev, repo) == "f" * 40
    assert "is not in this repository" in " ".join(lever_context.freshness(ev, repo, *now(repo)).reasons)


def test_every_committed_campaign_reads_its_code_at_a_commit_of_this_repository():
    """A committed campaign whose commit this repository lacks (rewritten before it landed, with no landed commit of
    the same code) can never be FRESH or have its context read: the history rewrite that caused it must be caught
    where it happens, not sessions later on a fresh clone (2026-12-06-gqa_swap-aa-3df4786 rendered FRESH only
    where the dangling commit survived)."""
    from campaigns.evidence import find_evidence, load_evidence
    repo = git.Repo(ROOT)
    if repo.git.rev_parse("--is-shallow-repository") == "true":
        pytest.skip("a shallow clone lacks the campaigns' commits")
    lost = []
    for path in find_evidence(ROOT / "records" / "campaigns"):
        ev = load_evidence(path)
        at = lever_context.campaign_commit(ev, ROOT)
        # reachable from HEAD: a rewritten commit lingers as a dangling object where it was rewritten
        if not lever_context._commit_known(repo, at) or not repo.is_ancestor(at, "HEAD"):
            lost.append(f"{ev.campaign_id} ({ev.fingerprint.git_short_sha})")
    assert len(find_evidence(ROOT / "records" / "campaigns")) >= 100
    assert lost == [], "campaigns whose code is in no commit here: " + ", ".join(lost)


def test_a_pin_whose_value_was_since_removed_stales_the_verdict_and_renders(repo):
    """campaign.with_levers pinned a value a lever no longer accepts: its verdict is about an engine nobody can run
    now, so STALE (and its flip refused as off-default), never an error that stops STATUS rendering."""
    ev = recorded(repo, live=("gqa_swap", "split_rule"))
    ev.config = {**ev.config, "campaign": {**ev.config["campaign"], "with_levers": {"split_rule": "len999"}}}
    for arm in ev.arms:
        ev.context[arm.name]["split_rule"] = "len999"
    pins = lever_context.pinned_levers(ev, now(repo)[0])
    assert isinstance(pins["split_rule"], lever_context.Unparsable)
    f = lever_context.freshness(ev, repo, *now(repo))
    assert not f.fresh and any("the campaign ran with len999" in r for r in f.reasons), f.reasons
    assert "split_rule" in lever_context.off_default_pins(ev, now(repo)[0])
