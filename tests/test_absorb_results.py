"""scripts/absorb_results.py: one GPU call's tarball into a checkout, nothing of the checkout's overwritten."""
import importlib.util
import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("absorb_results", ROOT / "scripts" / "absorb_results.py")
absorb_results = importlib.util.module_from_spec(spec)
sys.modules["absorb_results"] = absorb_results
spec.loader.exec_module(absorb_results)


def _tgz(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_new_evidence_and_bench_files_come_in_and_nothing_is_overwritten(tmp_path):
    root = tmp_path / "repo"
    (root / "records" / "campaigns" / "old").mkdir(parents=True)
    (root / "records" / "campaigns" / "old" / "evidence.json").write_text(json.dumps({"legs": 1}))
    (root / "bench" / "results").mkdir(parents=True)
    (root / "bench" / "results" / "decode-2026-12-03.md").write_text("first call\n")
    (root / "bench" / "results" / "same.md").write_text("kept\n")
    (root / "campaigns" / "gates").mkdir(parents=True)
    (root / "campaigns" / "gates" / "op_bounds.yaml").write_text("a: 1\n")
    tgz = _tgz(tmp_path / "results.tgz", {
        "records/campaigns/old/evidence.json": json.dumps({"legs": 1}),              # carried there unchanged
        "records/campaigns/new/evidence.json": json.dumps({"legs": 40}),
        "records/campaigns/new/runner.pid": "123\n",
        "bench/results/decode-2026-12-03.md": "second call\n",                       # same name, new content
        "bench/results/same.md": "kept\n",
        "bench/results/w4a16-new.json": "{}\n",
        "campaigns/gates/op_bounds.yaml": "a: 2\n",
        "vt-logs/campaign-x.log": "log\n",
    })
    campaigns, bench, logs = absorb_results.absorb(tgz, root)
    assert campaigns == ["new"]
    assert json.loads((root / "records/campaigns/new/evidence.json").read_text()) == {"legs": 40}
    assert not (root / "records/campaigns/new/runner.pid").exists()
    assert sorted(bench) == ["decode-2026-12-03-2.md", "w4a16-new.json"]
    assert (root / "bench/results/decode-2026-12-03.md").read_text() == "first call\n"
    assert (root / "bench/results/decode-2026-12-03-2.md").read_text() == "second call\n"
    assert (root / "campaigns/gates/op_bounds.yaml").read_text() == "a: 2\n"
    assert (logs / "campaign-x.log").read_text() == "log\n" and not str(logs).startswith(str(root))
    # the same tarball again: nothing new
    assert absorb_results.absorb(tgz, root)[:2] == ([], [])
    # a file the checkout renamed since the call's copy was made comes back under its old name: already held
    (root / "bench/results/w4a16-new.json").rename(root / "bench/results/w4a16-h100-new.json")
    assert absorb_results.absorb(tgz, root)[:2] == ([], [])
    assert not (root / "bench/results/w4a16-new.json").exists()


def test_commit_subjects_stay_within_72_characters():
    """The subject names what fits in 72 characters and counts the rest (two of this session's subjects ran to
    74 and 94 characters when every name went into it)."""
    names = ["2026-12-02-fuse_norm-0a873f1", "decode-2026-12-02-2.json", "decode-2026-12-02-2.md"]
    assert absorb_results.commit_subject(names) == "Device results: 2026-12-02-fuse_norm-0a873f1 and 2 more"
    both = "Device results: decode-2026-12-02-2.json, decode-2026-12-02-2.md"
    assert absorb_results.commit_subject(names[1:]) == both
    assert absorb_results.commit_subject(["x" * 100]) == "Device results: 1 file"


def test_a_retry_after_a_failed_render_still_names_what_the_first_try_took(tmp_path):
    """The first absorb copied a campaign and then stopped (its render failed); the retry finds nothing new in the
    tarball, and pending() names what the checkout holds uncommitted so that the commit is not "0 files"."""
    root = tmp_path / "repo"
    (root / "records" / "campaigns" / "old").mkdir(parents=True)
    (root / "records" / "campaigns" / "old" / "evidence.json").write_text("{}")
    (root / "bench" / "results").mkdir(parents=True)
    (root / "bench" / "results" / "a.md").write_text("a\n")
    git = lambda *a: subprocess.run(["git", *a], cwd=root, check=True, capture_output=True)     # noqa: E731
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "root")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "records")
    assert absorb_results.pending(root) == []
    tgz = _tgz(tmp_path / "results.tgz", {"records/campaigns/new/evidence.json": "{}",
                                          "records/campaigns/new/record.md": "r\n", "bench/results/b.md": "b\n"})
    assert absorb_results.absorb(tgz, root)[:2] == (["new"], ["b.md"])
    assert absorb_results.absorb(tgz, root)[:2] == ([], [])
    assert absorb_results.pending(root) == ["b.md", "new"]


def test_no_render_takes_the_files_in_and_neither_renders_nor_commits(tmp_path, monkeypatch):
    """Between two calls on a warm machine (given back after 30 s idle) there is no time for the ~100 s render:
    --no-render copies the call's files in and runs nothing; absorbing the tarball again renders and commits."""
    root = tmp_path / "repo"
    (root / "records" / "campaigns").mkdir(parents=True)
    (root / "bench" / "results").mkdir(parents=True)
    git = lambda *a: subprocess.run(["git", *a], cwd=root, check=True, capture_output=True)     # noqa: E731
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "root")
    tgz = _tgz(tmp_path / "results.tgz", {"records/campaigns/new/evidence.json": "{}", "bench/results/b.md": "b\n"})
    ran = []
    monkeypatch.setattr(absorb_results, "ROOT", root)
    monkeypatch.setattr(absorb_results.subprocess, "run", lambda *a, **k: ran.append(a[0]))
    assert absorb_results.main([str(tgz), "--no-render"]) == 0
    assert ran == []                                    # no render, no git add, no commit
    assert (root / "records" / "campaigns" / "new" / "evidence.json").read_text() == "{}"
    assert (root / "bench" / "results" / "b.md").read_text() == "b\n"


def test_a_second_campaign_under_the_same_id_comes_in_as_a_re_run_id(tmp_path):
    """Each GPU call starts from the checkout, so two campaigns of one lever at one commit (mixed_prefill's standard
    grid, then its long-prompt grid) both take <date>-<lever>-<sha7>: the second used to be copied over the first,
    losing its evidence. It comes in as <id>-2 with that id inside; its resumed growth goes to <id>-2 too."""
    root = tmp_path / "repo"
    cid = "2026-12-03-mixed_prefill-7ef9e40"
    first = {"campaign_id": cid, "created": "2026-12-03T16:50:24Z", "legs": [1, 2]}
    (root / "records" / "campaigns").mkdir(parents=True)
    tgz1 = _tgz(tmp_path / "r1.tgz", {f"records/campaigns/{cid}/evidence.json": json.dumps(first)})
    assert absorb_results.absorb(tgz1, root)[0] == [cid]
    second = {"campaign_id": cid, "created": "2026-12-03T16:55:09Z", "legs": [3]}
    tgz2 = _tgz(tmp_path / "r2.tgz", {f"records/campaigns/{cid}/evidence.json": json.dumps(second),
                                      f"records/campaigns/{cid}/record.md": "long grid\n"})
    assert absorb_results.absorb(tgz2, root)[0] == [f"{cid}-2"]
    assert json.loads((root / "records/campaigns" / cid / "evidence.json").read_text()) == first
    again = json.loads((root / "records/campaigns" / f"{cid}-2" / "evidence.json").read_text())
    assert again == {**second, "campaign_id": f"{cid}-2"}
    assert absorb_results.absorb(tgz2, root)[0] == []                    # the same tarball again: nothing new
    grown = {**second, "legs": [3, 4]}                                   # a resumed call of the second campaign
    tgz3 = _tgz(tmp_path / "r3.tgz", {f"records/campaigns/{cid}/evidence.json": json.dumps(grown)})
    assert absorb_results.absorb(tgz3, root)[0] == [f"{cid}-2"]
    assert json.loads((root / "records/campaigns" / f"{cid}-2" / "evidence.json").read_text())["legs"] == [3, 4]
    assert json.loads((root / "records/campaigns" / cid / "evidence.json").read_text()) == first


def test_an_older_copy_of_a_campaign_never_replaces_the_checkouts(tmp_path):
    """A call launched before the previous call's tarball was absorbed carries the campaign as it was: absorbing it
    copied an in-progress 29-leg evidence over the finished 40-leg one the previous call had brought back (pdl_stack,
    H200, 2026-12-04). The checkout's copy is kept when it has come further; a grown copy still comes in."""
    root = tmp_path / "repo"
    cid = "2026-12-04-pdl_stack-fb30438"
    (root / "records" / "campaigns").mkdir(parents=True)
    created = "2026-12-04T09:23:19Z"
    done = {"campaign_id": cid, "created": created, "status": "complete", "legs": list(range(40)), "gates": [1, 2]}
    cut = {**done, "status": "in-progress", "legs": list(range(29))}
    for name, ev in (("cut", cut), ("done", done)):
        tgz = _tgz(tmp_path / f"{name}.tgz", {f"records/campaigns/{cid}/evidence.json": json.dumps(ev),
                                               f"records/campaigns/{cid}/record.md": f"{name}\n"})
        assert absorb_results.absorb(tgz, root)[0] == [cid]
    stale = _tgz(tmp_path / "stale.tgz", {f"records/campaigns/{cid}/evidence.json": json.dumps(cut),
                                           f"records/campaigns/{cid}/record.md": "cut\n"})
    assert absorb_results.absorb(stale, root)[0] == []
    assert json.loads((root / "records/campaigns" / cid / "evidence.json").read_text()) == done
    assert (root / "records/campaigns" / cid / "record.md").read_text() == "done\n"
    fewer_gates = {**done, "gates": [1]}
    assert absorb_results.absorb(_tgz(tmp_path / "g.tgz", {f"records/campaigns/{cid}/evidence.json":
                                                           json.dumps(fewer_gates)}), root)[0] == []
    # abandoned here after a call carried it: that call's in-progress copy must not undo the abandon
    other = "2026-12-04-fuse_norm-0a873f1"
    given_up = {**cut, "campaign_id": other, "status": "abandoned", "abandoned": {"why": "x"}}
    (root / "records/campaigns" / other).mkdir()
    (root / "records/campaigns" / other / "evidence.json").write_text(json.dumps(given_up))
    carried = {**given_up, "status": "in-progress", "abandoned": {}}
    assert absorb_results.absorb(_tgz(tmp_path / "a.tgz", {f"records/campaigns/{other}/evidence.json":
                                                           json.dumps(carried)}), root)[0] == []
    assert json.loads((root / "records/campaigns" / other / "evidence.json").read_text())["status"] == "abandoned"


def test_a_campaign_stopped_only_short_of_its_verdict_is_named_concludable(tmp_path):
    """The H200 evidence of a campaign whose every gate and leg is recorded (a bf16 pdl_prefetch recheck): unfinished
    with all of it, absorb names it for `vtcampaign conclude`; one leg or one gate result short, it does not."""
    cid = "2026-12-04-pdl_prefetch-97ad59f"
    raw = json.loads((ROOT / "records" / "campaigns" / cid / "evidence.json").read_text())
    dest = tmp_path / "records" / "campaigns"

    def state(**changes):
        for name, ev in (("whole", dict(raw, **changes)), ("leg-short", dict(raw, legs=raw["legs"][1:], **changes)),
                         ("gate-short", dict(raw, gates=[g for g in raw["gates"] if g["gate"] != "op"], **changes))):
            (dest / name).mkdir(parents=True, exist_ok=True)
            (dest / name / "evidence.json").write_text(json.dumps(ev))
        return absorb_results.concludable(["whole", "leg-short", "gate-short"], root=tmp_path)

    assert state(status="in-progress", decision=None) == ["whole"]
    assert state() == []                                    # complete: nothing to conclude
