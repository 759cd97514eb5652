"""The campaign end to end on CPU: `tiny`, real servers on loopback, a real MLflow sqlite store, inside a temporary
git repository. Rehearsal -> NON-BINDING with its reason; records re-render byte for byte; a campaign interrupted
mid-grid resumes and keeps every finished leg; an inert lever makes the campaign INVALID.
"""
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from campaigns import records, runner
from campaigns.config import compose
from campaigns.evidence import load_evidence
from campaigns.runner import run_campaign
from helpers import TPUT_WIN, alive, temp_repo
from vtengine import levers

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(1200)


def test_rehearsal_end_to_end(tmp_path):
    import mlflow
    repo = temp_repo(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # the baseline is pinned (not the file default, which a FLIP may change) so the arms' roles are fixed here
    cfg = compose(["campaign=gqa_swap", "campaign.arms.baseline=false", f"tracking.uri={uri}"], cuda=False)
    t0 = time.time()
    ev = run_campaign(cfg, repo=repo)
    elapsed = time.time() - t0
    assert elapsed < 600, f"the CPU rehearsal took {elapsed:.0f} s (limit 10 min)"

    # verdict: non-binding, with the reason
    assert ev.status == "complete" and ev.decision.verdict == "NON-BINDING"
    assert any("cuda" in r.lower() or "rehearsal" in r.lower() for r in ev.decision.reasons), ev.decision.reasons
    # gates ran with working self-checks (or were skipped with a reason on CPU)
    for g in ev.gates:
        assert g.skipped or (g.passed and g.self_check is True), (g.gate, g.arm, g.passed, g.self_check, g.details)
    assert {g.gate for g in ev.gates if g.skipped} == {"graph_parity", "memcheck"}
    mech = ev.gate("mechanism", "on")
    assert mech.details["probe"]["routes"] == ["gqa_swap"] and mech.details["baseline_probe"]["routes"] == ["per_q_head"]
    # the grid: every planned leg, valid, prompts disjoint across (c, rep) and shared by the arms within one
    grid = cfg.grid
    assert len(ev.legs) == len(grid.concurrency) * grid.reps * 2 and all(leg.valid for leg in ev.legs)
    by_point = {}
    for leg in ev.legs:
        by_point.setdefault((leg.concurrency, leg.rep), set()).add(leg.prompts_sha256)
    assert all(len(s) == 1 for s in by_point.values())
    assert len({next(iter(s)) for s in by_point.values()}) == len(by_point)
    # every leg carries the server's own view of it, read by name (a missing metric would void the leg)
    for leg in ev.legs:
        assert leg.metrics["server_tokens_generated"] == leg.num_prompts * grid.output_len
        assert leg.metrics["server_requests_finished"] == leg.num_prompts and leg.metrics["server_ttft_count"] > 0
        assert 0 < leg.metrics["server_mean_ttft_ms"] <= leg.metrics["mean_ttft_ms"]
    orders = [[leg.arm for leg in sorted(ev.legs, key=lambda x: x.order_index) if leg.rep == r] for r in (0, 1)]
    assert orders[0][0] == "off" and orders[1][0] == "on"          # arm order alternates per rep
    # the servers started in the order drawn from the campaign id, recorded and stated in the record
    assert ev.server_order == [a.name for a in runner.server_order(ev)] and sorted(ev.server_order) == ["off", "on"]
    record = (repo / "records" / "campaigns" / ev.campaign_id / "record.md").read_text()
    assert f"Servers started in the order {', '.join(ev.server_order)}" in record

    # the attribution: both arms profiled from real profiler events, the lever's kernel explaining the delta
    prof = {a: ev.gate("profile", a) for a in ("off", "on")}
    assert all(p.passed and p.self_check for p in prof.values())
    assert set(prof["on"].details["windows"]) == {"1", "2"}
    assert "decode_attention" in prof["on"].details["windows"]["1"]["kernels"]
    # records rendered, and re-rendered byte for byte from evidence alone
    cdir = repo / "records" / "campaigns" / ev.campaign_id
    files = [cdir / "evidence.json", cdir / "record.md", cdir / "pr.md", repo / "records" / "STATUS.md",
             repo / "records" / "BENCHMARKS.md"]
    before = {f: f.read_bytes() for f in files}
    assert "NON-BINDING" in before[cdir / "record.md"].decode() and "row/gqa_swap" in before[cdir / "pr.md"].decode()
    summary = " ".join(levers.get("gqa_swap").summary.split())     # what the lever did as the campaign ran
    assert ev.lever_summary == summary and f"Lever `gqa_swap` — {summary}\n" in before[cdir / "pr.md"].decode()
    record, pr = before[cdir / "record.md"].decode(), before[cdir / "pr.md"].decode()
    assert "### Attribution" in record and "| decode_attention |" in record.split("### Attribution")[1]
    assert "## Attribution" in pr and "From the attribution: at batch 2 the step" in pr
    for f in files[1:]:
        f.unlink()
    records.render_all(repo / "records" / "campaigns", repo / "records")
    assert {f: f.read_bytes() for f in files} == before

    # MLflow: parent run with the tags, child runs per gate x arm and per leg
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("vtcampaign/gqa_swap")
    runs = client.search_runs([exp.experiment_id], max_results=500)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert any(r.data.tags.get("verdict") == "NON-BINDING" and r.data.tags.get("lever") == "gqa_swap"
               for r in parents)
    assert len(children) >= len(ev.gates) + len(ev.legs)


def _wait_legs(proc: subprocess.Popen, repo: Path, at_least: int) -> tuple[Path, list[int]]:
    """Wait until the campaign ``proc`` runs has recorded ``at_least`` legs: its evidence file and its servers' pids."""
    out_dir = repo / "records" / "campaigns"
    deadline, evidence, pids = time.time() + 600, None, []
    while time.time() < deadline and proc.poll() is None:
        found = list(out_dir.glob("*/evidence.json"))
        if found:
            try:
                if len(json.loads(found[0].read_text())["legs"]) >= at_least:
                    evidence = found[0]
                    pids = [json.loads(p.read_text())["pid"] for p in evidence.parent.glob("server-*.pid")]
                    break
            except (json.JSONDecodeError, KeyError, OSError):      # a file mid-write, or gone as a server stops
                pass
        time.sleep(0.3)
    if evidence is None:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=60)[0] if proc.stdout else ""
        pytest.fail(f"no {at_least} legs recorded in time: {(out or '')[-3000:]}")
    assert len(pids) == 2, "the grid did not run on two servers"
    return evidence, pids


@pytest.fixture
def spawned():
    """The campaign processes a test starts (append them): any still running at its end is killed, servers and
    all (they exit with their parent), so a failed assertion leaves nothing running into later tests."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_interrupted_campaign_resumes_keeping_finished_legs(tmp_path, spawned):
    """One campaign stopped three ways and resumed each time (one campaign, not three: each full grid is minutes of
    CI). SIGKILL gives the runner no chance to stop its servers: they exit with their parent (--exit-with-parent),
    and the pid files they leave let resume= stop any survivor before it starts its own. SIGTERM (a scheduler's time
    limit, `kill`) stops it as Ctrl-C does: the runner stops its servers, keeps the finished legs, says how to resume
    and exits 143. Ctrl-C (SIGINT) exits 130; MLflow, following live, hears how it stopped; resume=auto finishes it
    with every finished leg kept as it was."""
    repo = temp_repo(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"         # MLflow follows the campaign live, and hears how it stopped
    args = [sys.executable, "-m", "campaigns.cli", "run", "campaign=gqa_swap", "campaign.arms.baseline=false",
            "tracking=local", f"tracking.uri={uri}", "campaign.gates=[op,mechanism]"]

    # SIGKILL after the first leg: no handler runs in the runner; its servers follow it within seconds
    proc = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spawned.append(proc)
    evidence, pids = _wait_legs(proc, repo, 1)
    proc.kill()
    proc.wait(timeout=30)
    t0 = time.time()
    while any(alive(p) for p in pids) and time.time() - t0 < 15:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), f"servers outlived their campaign: {[p for p in pids if alive(p)]}"
    ev = load_evidence(evidence)
    assert ev.status == "in-progress" and list(evidence.parent.glob("server-*.pid"))     # left behind

    # resume=<id>, then SIGTERM after one more leg
    proc = subprocess.Popen(args + [f"resume={ev.campaign_id}"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    spawned.append(proc)
    _, pids = _wait_legs(proc, repo, len(ev.legs) + 1)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, out[-3000:]
    assert "interrupted" in out and "resume=" in out
    assert not list(evidence.parent.glob("server-*.pid"))       # stopped by the runner, not orphaned
    assert not any(alive(p) for p in pids), f"servers outlived the runner: {[p for p in pids if alive(p)]}"
    after_term = load_evidence(evidence)
    assert after_term.status == "in-progress" and len(ev.legs) < len(after_term.legs) < 8
    # what the stopped run's servers report is kept (their kernels count toward the arms' live levers; only the
    # servers report peak memory)
    assert set(after_term.peak_memory_gib) == set(after_term.live_levers) == {a.name for a in after_term.arms}

    # resume=auto, then Ctrl-C after one more leg
    proc = subprocess.Popen(args + ["resume=auto"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    spawned.append(proc)
    _wait_legs(proc, repo, len(after_term.legs) + 1)
    proc.send_signal(signal.SIGINT)                           # Ctrl-C mid-grid
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-3000:]
    assert "resume=" in out
    ev = load_evidence(evidence)
    assert ev.status == "in-progress" and 3 <= len(ev.legs) < 8
    kept = {leg.key: leg.started for leg in ev.legs}
    assert {leg.key: leg.started for leg in after_term.legs} == {k: kept[k] for k in
                                                                  (leg.key for leg in after_term.legs)}
    runs = _mlflow_runs(uri, ev)
    assert [(r.info.status, r.data.tags["verdict"]) for r in runs["campaign"]] == [("KILLED", "IN-PROGRESS")]
    assert len(runs["leg"]) == len(ev.legs) and len(runs["gate"]) == len(ev.gates) > 0   # each as it was recorded

    # resume=auto finds it (what a campaign spread over time-limited device commands passes every time)
    done = subprocess.run(args + ["resume=auto"], cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resume=auto: resuming {ev.campaign_id}" in done.stdout + done.stderr
    ev2 = load_evidence(evidence)
    assert ev2.status == "complete" and len(ev2.legs) == 8 and not list(evidence.parent.glob("server-*.pid"))
    assert {leg.key: leg.started for leg in ev2.legs if leg.key in kept} == kept     # finished legs kept as they were
    assert ev2.decision.verdict == "NON-BINDING"
    runs = _mlflow_runs(uri, ev)        # the resume's runs replaced the killed ones; the end logged it whole
    assert [(r.info.status, r.data.tags["verdict"]) for r in runs["campaign"]] == [("FINISHED", "NON-BINDING")]
    assert len(runs["leg"]) == 8 and len(runs["arm-summary"]) == 2

    # stopped after the grid, before the verdict (on the H200 a command's time limit landed there): the resume
    # concludes from what is recorded and starts no server (that took 73 s of device time for two qwen3-8b servers)
    raw = json.loads(evidence.read_text())
    raw.update(status="in-progress", decision=None)
    evidence.write_text(json.dumps(raw))
    logs = {f: f.stat().st_mtime_ns for f in evidence.parent.glob("server-*.log")}
    assert logs
    again = subprocess.run(args + ["resume=auto"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    out = again.stdout + again.stderr
    assert "without starting the servers" in " ".join(out.split()) and "starting the '" not in out
    assert {f: f.stat().st_mtime_ns for f in evidence.parent.glob("server-*.log")} == logs
    ev3 = load_evidence(evidence)
    assert ev3.status == "complete" and ev3.decision.verdict == "NON-BINDING" and ev3.legs == ev2.legs

    # the same state concluded off the run's commit (`vtcampaign conclude`, what a host without the device does):
    # no server, the same verdict, its reasons naming where it was concluded
    evidence.write_text(json.dumps(raw))
    (repo / "later.txt").write_text("a later commit\n")
    subprocess.run(["git", "add", "later.txt"], cwd=repo, check=True)
    subprocess.run(["git", "commit", "-qm", "later"], cwd=repo, check=True)
    here = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True).stdout
    conclude = [sys.executable, "-m", "campaigns.cli", "conclude", ev.campaign_id]
    done = subprocess.run(conclude, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {f: f.stat().st_mtime_ns for f in evidence.parent.glob("server-*.log")} == logs
    ev4 = load_evidence(evidence)
    assert ev4.status == "complete" and ev4.decision.verdict == "NON-BINDING" and ev4.legs == ev2.legs
    today = datetime.now(timezone.utc).date().isoformat()
    assert [r for r in ev4.decision.reasons if r.startswith("concluded on")] == [
        f"concluded on {today} at {here.strip()} from the recorded gates and legs (the run at "
        f"{ev.fingerprint.git_short_sha} on {ev.fingerprint.device_name} stopped before its verdict); the "
        "conclusion measured nothing"]
    twice = subprocess.run(conclude, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert twice.returncode == 2 and "is complete already (NON-BINDING)" in twice.stderr
    # a leg short: refused, naming it, and nothing written
    evidence.write_text(json.dumps(dict(raw, legs=raw["legs"][:-1])))
    short = subprocess.run(conclude, cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    assert short.returncode == 2, short.stderr
    assert "has measurements left (1 of 8 legs (the first: c=" in short.stderr
    assert f"resume={ev.campaign_id}" in short.stderr
    left = load_evidence(evidence)
    assert left.status == "in-progress" and left.decision is None and len(left.legs) == 7


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_result_is_recorded_waits_until_it_is_logged(signum):
    """A leg or gate is appended, saved and logged to MLflow as one step (runner._recording): Ctrl-C or SIGTERM in
    between is raised once all three are done, never between the save and the log (the evidence would hold a leg
    MLflow never had). Outside such a step it stops the campaign where it stands."""
    import threading

    from campaigns.runner import Stopped, _ctrl_c_raises, _recording, exit_status
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers are installed from the main thread only")
    want = Stopped if signum == signal.SIGTERM else KeyboardInterrupt

    def wait_for_signal():                      # the handler runs between two bytecodes of this loop
        deadline = time.time() + 5
        while time.time() < deadline and not (runner._held and runner._held[0]):
            time.sleep(0.01)

    steps = []
    with pytest.raises(want) as caught:
        with _ctrl_c_raises():
            with _recording():
                steps.append("saved")
                os.kill(os.getpid(), signum)
                wait_for_signal()
                steps.append("logged")
            steps.append("after the step")
    assert steps == ["saved", "logged"] and exit_status(caught.value) == 128 + signum
    steps = []
    with pytest.raises(want):
        with _ctrl_c_raises():
            os.kill(os.getpid(), signum)
            wait_for_signal()
            steps.append("went on")
    assert steps == []
    # a second signal while one is held stops it at once (a record stuck on an unreachable MLflow must not keep
    # Ctrl-C from stopping the campaign), and an error of the record itself is not masked by the held signal
    with pytest.raises(want):
        with _ctrl_c_raises():
            with _recording():
                os.kill(os.getpid(), signum)
                wait_for_signal()
                steps.append("held")
                os.kill(os.getpid(), signum)
                wait_for_signal()
                steps.append("went on")
    assert steps == ["held"] and not runner._held
    with pytest.raises(OSError, match="disk full"):
        with _ctrl_c_raises():
            with _recording():
                os.kill(os.getpid(), signum)
                wait_for_signal()
                raise OSError("disk full")
    assert not runner._held


def _mlflow_runs(uri: str, ev) -> dict[str, list]:
    """The active MLflow runs of ``ev``'s campaign by kind (campaign, gate, leg, arm-summary)."""
    from campaigns import tracking
    c = tracking.client(uri)
    exp = c.get_experiment_by_name(tracking.experiment_name(ev.lever))
    by: dict[str, list] = {}
    for r in tracking.campaign_runs(c, exp.experiment_id, ev.campaign_id):
        by.setdefault(r.data.tags[tracking.KIND_TAG], []).append(r)
    return by


def test_resume_auto_finds_the_newest_unfinished_campaign_of_its_config_at_its_commit(tmp_path):
    """resume=auto (a campaign spread over time-limited commands): of the campaigns under out_dir it takes the newest
    in-progress one with this lever, this composed config and this commit, on this GPU and versions; a finished
    one, another config, commit, GPU or torch is never resumed (a recheck plan holds one entry per GPU with the same
    overrides: on 2026-12-07 an H100 call could have picked an H200 campaign and stopped on the resume's refusal),
    and with none left it starts a new campaign."""
    import dataclasses

    import git
    from campaigns.config import config_hash
    from campaigns.evidence import save_evidence
    from campaigns.fingerprint import collect
    from campaigns.gitops import RUN_OUTPUTS
    from campaigns.runner import _unfinished
    from helpers import make_evidence
    from vtengine import levers
    repo = temp_repo(tmp_path)
    sha = git.Repo(repo).head.commit.hexsha
    cfg = compose(["campaign=gqa_swap", "tracking=off", "resume=auto"], cuda=False)
    out = repo / "records" / "campaigns"

    def put(name, created, status="in-progress", git_sha=sha, config=None, lever="gqa_swap", **setup):
        ev = make_evidence(lever=lever, created=created, campaign_id=name)
        ev.status = status
        here = collect(repo, "cpu", levers.get(lever).env, ev.arms, config or config_hash(cfg),   # this host's
                       ignore_dirty=RUN_OUTPUTS)
        ev.fingerprint = dataclasses.replace(here, git_sha=git_sha, git_short_sha=git_sha[:7], **setup)
        save_evidence(ev, out / name)
    put("a-older", "2026-12-01T10:00:00Z")
    put("b-newer", "2026-12-01T11:00:00Z")
    put("c-finished", "2026-12-01T12:00:00Z", status="complete")
    put("d-other-config", "2026-12-01T13:00:00Z", config="1" * 64)
    put("e-other-commit", "2026-12-01T14:00:00Z", git_sha="f" * 40, code_digest="f" * 64)    # other code
    put("f-other-lever", "2026-12-01T15:00:00Z", lever="fast_math")
    put("g-other-gpu", "2026-12-01T16:00:00Z", device_name="NVIDIA H200")
    put("h-other-torch", "2026-12-01T17:00:00Z", torch_version="2.11.0+cu130")
    put("i-other-env", "2026-12-01T18:00:00Z", arms_env={"off": {"VT_FAST_MATH": "off"}, "on": {}})
    (out / "j-torn").mkdir()
    (out / "j-torn" / "evidence.json").write_text('{"status": "in-progress", "lev')     # one torn file stops nothing
    assert _unfinished(cfg, repo, out) == "b-newer"
    for name in ("a-older", "b-newer"):
        (out / name / "evidence.json").unlink()
    assert _unfinished(cfg, repo, out) is None                  # run_campaign then starts a new one


def test_a_resume_refuses_another_tree_device_or_versions(tmp_path):
    """Legs added on resume must compare with the kept ones: a campaign begun on a clean tree does not resume on an
    edited one (naming the file), one begun on a dirty tree not after a further edit of its dirty files, nor with
    another torch or device; its own evidence under out_dir is no dirt, and the same setup on another host
    resumes."""
    import dataclasses

    from campaigns.config import config_hash
    from campaigns.fingerprint import collect
    from campaigns.runner import CampaignError, _check_resumable
    from helpers import make_evidence
    from vtengine import levers
    repo = temp_repo(tmp_path)
    cfg = compose(["campaign=gqa_swap", "tracking=off", "resume=x"], cuda=False)
    out = repo / "records" / "campaigns"
    ev = make_evidence(lever="gqa_swap", campaign_id="x")
    ev.fingerprint = collect(repo, "cpu", levers.get("gqa_swap").env, ev.arms, config_hash(cfg))
    ev.fingerprint = dataclasses.replace(ev.fingerprint, hostname="another-host")
    (out / "x").mkdir(parents=True)
    (out / "x" / "evidence.json").write_text("{}")           # the campaign's own, untracked evidence
    _check_resumable(ev, cfg, repo, out)                     # same tree, device and versions: resumes
    (repo / "README.md").write_text("edited\n")
    with pytest.raises(CampaignError, match=r"ran on a tree clean, the checkout is dirty in README.md"):
        _check_resumable(ev, cfg, repo, out)
    # begun on a tree dirty in README.md: an edit to that file changes no list of dirty files, but the code
    dirty = collect(repo, "cpu", levers.get("gqa_swap").env, ev.arms, config_hash(cfg), ignore_dirty=("records",))
    assert dirty.dirty_files == ["README.md"] and dirty.dirty_digest is not None
    ev.fingerprint = dataclasses.replace(dirty, hostname="another-host")
    _check_resumable(ev, cfg, repo, out)                     # the same edit: resumes
    (repo / "README.md").write_text("edited again\n")
    with pytest.raises(CampaignError, match=r"ran on a tree dirty in README.md, and their contents changed since"):
        _check_resumable(ev, cfg, repo, out)
    (repo / "README.md").unlink()                            # a deletion is a content too
    with pytest.raises(CampaignError, match=r"contents changed since"):
        _check_resumable(ev, cfg, repo, out)
    (repo / "README.md").write_text("edited\n")
    ev.fingerprint = dataclasses.replace(dirty, dirty_digest=None)      # recorded before contents were
    with pytest.raises(CampaignError, match=r"whose contents it did not record"):
        _check_resumable(ev, cfg, repo, out)
    ev.fingerprint = dataclasses.replace(dirty, hostname="another-host")
    (repo / "README.md").write_text("campaign sandbox\n")
    ev.fingerprint = dataclasses.replace(ev.fingerprint, dirty_files=[], dirty_digest=None)
    ev.fingerprint = dataclasses.replace(ev.fingerprint, torch_version="2.11.0+cu130")
    with pytest.raises(CampaignError, match=r"torch 2.11.0\+cu130 then, .* now; legs measured on two setups"):
        _check_resumable(ev, cfg, repo, out)


def test_a_resume_refuses_another_vt_environment_a_complete_or_a_running_campaign(tmp_path, monkeypatch):
    """The servers inherit VT_* variables, and the engine applies one to every lever no --lever names: a resume in
    a shell that exports one the first run had not is refused, naming it. A complete campaign is not reopened (its
    verdict would be decided again), and one that another live process runs is not resumed beside it (each would
    stop the other's servers and save over its legs)."""
    import subprocess

    from campaigns.config import config_hash
    from campaigns.evidence import save_evidence
    from campaigns.fingerprint import collect
    from campaigns.gitops import RUN_OUTPUTS
    from campaigns.runner import CampaignError, _check_resumable, _resumable
    from helpers import make_evidence
    from vtengine import levers
    repo = temp_repo(tmp_path)
    cfg = compose(["campaign=gqa_swap", "tracking=off", "resume=x"], cuda=False)
    out = repo / "records" / "campaigns"
    monkeypatch.delenv("VT_FAST_MATH", raising=False)
    ev = make_evidence(lever="gqa_swap", campaign_id="x")
    ev.status = "in-progress"
    ev.fingerprint = collect(repo, "cpu", levers.get("gqa_swap").env, ev.arms, config_hash(cfg),
                             ignore_dirty=RUN_OUTPUTS)
    save_evidence(ev, out / "x")
    assert _resumable(cfg, out / "x", repo, out).campaign_id == "x"
    monkeypatch.setenv("VT_FAST_MATH", "off")
    with pytest.raises(CampaignError, match=r"VT_\* environment differs \(off: VT_DECODE_GQA_SWAP=off then, "
                                            r"VT_DECODE_GQA_SWAP=off VT_FAST_MATH=off now"):
        _check_resumable(ev, cfg, repo, out)
    monkeypatch.delenv("VT_FAST_MATH")

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "campaigns.cli", "run"])
    try:
        (out / "x" / "runner.pid").write_text(f"{sleeper.pid}\n")
        with pytest.raises(CampaignError, match=rf"x is running now \(pid {sleeper.pid}.*wait for it, or stop it"):
            _resumable(cfg, out / "x", repo, out)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _resumable(cfg, out / "x", repo, out).campaign_id == "x"      # its runner gone: resumable again

    ev.status = "complete"
    save_evidence(ev, out / "x")
    with pytest.raises(CampaignError, match=r"x is complete \([A-Z-]+\); nothing is left to measure "
                                            r"\(`vtcampaign decide x`"):
        _resumable(cfg, out / "x", repo, out)


def test_a_resume_crosses_commits_of_records_and_prose_but_not_of_code(tmp_path):
    """A grid spread over device commands has its first command's results committed before the next one runs:
    a resume at that later commit goes on (the code digest is the campaign's: only records, results, *.md and a
    record template changed), and the record names the commit it resumed at; one commit that touches code (here a
    conf file) makes the next resume refuse, saying why, and resume=auto no longer takes the campaign."""
    import dataclasses

    import git
    from campaigns.config import config_hash
    from campaigns.evidence import save_evidence
    from campaigns.fingerprint import collect
    from campaigns.runner import CampaignError, _check_resumable, _resumable, _unfinished
    from helpers import make_evidence
    from vtengine import levers
    repo = temp_repo(tmp_path)
    r = git.Repo(repo)

    def commit(files: dict[str, str], msg: str) -> str:
        for name, text in files.items():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            (repo / name).write_text(text)
        r.index.add(list(files))
        return r.index.commit(msg, author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t")).hexsha[:7]

    commit({"vtengine/x.py": "A = 1\n"}, "code")
    cfg = compose(["campaign=gqa_swap", "tracking=off", "resume=x"], cuda=False)
    out = repo / "records" / "campaigns"
    ev = make_evidence(lever="gqa_swap", campaign_id="x")
    ev.status = "in-progress"
    ev.fingerprint = collect(repo, "cpu", levers.get("gqa_swap").env, ev.arms, config_hash(cfg))
    assert ev.fingerprint.code_digest and len(ev.fingerprint.code_digest) == 64
    save_evidence(ev, out / "x")
    assert _check_resumable(ev, cfg, repo, out) is None              # its own commit
    later = commit({"records/campaigns/x/evidence.json": ev.to_json(), "bench/results/r.md": "figures\n",
                    "README.md": "what the first command measured\n", "notes/n.md": "a note\n",
                    "templates/record.md.j2": "a record's wording\n"}, "results")
    assert _check_resumable(ev, cfg, repo, out) == later
    auto = compose(["campaign=gqa_swap", "tracking=off", "resume=auto"], cuda=False)
    assert _unfinished(auto, repo, out) == "x"
    resumed = _resumable(cfg, out / "x", repo, out)
    assert resumed.resumed_at == [later]
    assert f"(resumed at {later}: the same code)" in records.render_record(resumed)
    commit({"conf/x.yaml": "a: 1\n"}, "code change")
    with pytest.raises(CampaignError, match=r"the commits between them change code, not only records, results, "
                                            r"prose \(\*\.md\) or record templates; legs from two codes would "
                                            r"not compare"):
        _check_resumable(ev, cfg, repo, out)
    assert _unfinished(auto, repo, out) is None
    ev.fingerprint = dataclasses.replace(ev.fingerprint, code_digest=None)      # evidence from before the digest
    with pytest.raises(CampaignError, match=r"its code at that commit was not recorded"):
        _check_resumable(ev, cfg, repo, out)


def test_a_resume_with_other_overrides_is_told_what_differs_and_what_to_run(tmp_path):
    """A campaign records its command line's overrides; a resume whose composed config differs names the keys that
    differ and the command that resumes it. Where it writes (out_dir) and how it logs do not make a difference."""
    from campaigns.config import config_hash, to_plain
    from campaigns.fingerprint import collect
    from campaigns.runner import CampaignError, _check_resumable, resume_command
    from helpers import make_evidence
    from vtengine import levers
    repo = temp_repo(tmp_path)
    first = ["campaign=nsplits_cap", "tracking=off", "campaign.arms.candidates=[8]"]
    cfg = compose(first, cuda=False)
    cfg.overrides = first
    ev = make_evidence(lever="nsplits_cap", campaign_id="2026-12-05-nsplits_cap-abc1234")
    ev.config = to_plain(cfg)
    ev.fingerprint = collect(repo, "cpu", levers.get("nsplits_cap").env, ev.arms, config_hash(cfg))
    out = repo / "records" / "campaigns"
    assert resume_command(ev) == ("vtcampaign run campaign=nsplits_cap tracking=off campaign.arms.candidates=[8] "
                                  "resume=2026-12-05-nsplits_cap-abc1234")
    again = compose(first + [f"out_dir={tmp_path / 'elsewhere'}", "tracking=local", f"resume={ev.campaign_id}"],
                    cuda=False)
    _check_resumable(ev, again, repo, out)
    other = compose(["campaign=nsplits_cap", "tracking=off", f"resume={ev.campaign_id}"], cuda=False)
    with pytest.raises(CampaignError) as err:
        _check_resumable(ev, other, repo, out)
    assert "campaign.arms.candidates: [8] then, ['auto'] now" in str(err.value)
    assert f"resume with `{resume_command(ev)}`" in str(err.value)


def test_an_invalid_leg_stops_the_grid_and_a_resume_runs_no_more_legs(tmp_path, monkeypatch):
    """The grid of a campaign that holds an invalid leg is void: resumed, it runs nothing (no server is even asked:
    the handles here are empty), says why, and the policy reads NON-BINDING naming the leg."""
    import io

    from rich.console import Console

    from campaigns import policy
    from campaigns.runner import _run_grid, void_leg
    said = io.StringIO()
    monkeypatch.setattr(runner, "console", Console(file=said, width=400))
    from helpers import make_evidence
    cfg = compose(["campaign=gqa_swap", "tracking=off"], cuda=False)
    ev = make_evidence(reps=5)
    assert void_leg(ev) is None
    bad = ev.legs[3]
    bad.valid, bad.reasons = False, ["2 of 6 requests returned fewer than 128 tokens"]
    ev.legs = ev.legs[:4]                                       # stopped right after it
    _run_grid(ev, tmp_path, cfg, handles={})
    assert f"leg c={bad.concurrency} rep={bad.rep} arm {bad.arm} is INVALID (2 of 6 requests" in said.getvalue()
    assert len(ev.legs) == 4
    d = policy.decide(ev)
    assert d.verdict == "NON-BINDING"
    assert any(r.startswith("void grid: 1 invalid leg(s)") and "fewer than 128 tokens" in r for r in d.reasons)


def test_inert_lever_makes_the_campaign_invalid(tmp_path):
    repo = temp_repo(tmp_path)
    cfg = compose(["campaign=gqa_swap", "campaign.arms.baseline=false", "tracking=off", "campaign.gates=[mechanism]"],
                  cuda=False)
    ev = run_campaign(cfg, repo=repo, inject={"inert_arm": "on"})
    assert ev.decision.verdict == "INVALID"
    assert any("inert" in r for r in ev.decision.reasons), ev.decision.reasons
    assert not ev.legs                                        # nothing measured on an inert lever


def test_aa_rehearsal_reports_its_separations_against_the_calibration(tmp_path):
    repo = temp_repo(tmp_path)
    # an engine-loop lever: its rehearsal runs the torch references, and an A/A grid's lever is only its label
    cfg = compose(["campaign=async_scheduling", "aa=true", "tracking=off"], cuda=False)
    assert list(cfg.campaign.gates) == [] and cfg.campaign.arms.candidates == [cfg.campaign.arms.baseline]
    ev = run_campaign(cfg, repo=repo)
    assert ev.kind == "aa" and ev.campaign_id.startswith(f"{ev.date}-async_scheduling-aa-")
    assert [(a.name, a.role, a.value) for a in ev.arms] == [("a", "baseline", True), ("b", "candidate", True)]
    assert not ev.gates and len(ev.legs) == 8 and all(leg.valid for leg in ev.legs)
    cal = ev.calibration
    assert cal is not None and cal.comparisons == 14 and 0 <= cal.false_flip <= 1 and cal.separations_q95 >= 0
    d = ev.decision
    from campaigns import policy
    # separations the lever rule counts (their ratio clears 1 +/- min_effect); smaller ones are listed, not counted
    seen = sum(policy.counts(s, policy.policy_params(ev)) for s in ev.stats)
    # the A/A rule: pass while the separations seen stay within what the calibration says chance shows
    # on a CPU host nothing binds: NON-BINDING under the A/A rule's text, saying what a binding grid would say
    assert d.verdict == "NON-BINDING" and not d.binding and d.rule.startswith("A/A NON-BINDING")
    assert f"on a binding grid this would be {'AA-PASS' if seen <= cal.separations_q95 else 'AA-FAIL'}" in d.reasons
    assert d.reasons[0].startswith(f"{seen} separated point(s)")
    assert f"at most {cal.separations_q95} in 95% of {cal.sims} simulated campaigns" in d.reasons[0]
    assert any(r.startswith("server-instance bias (above 1 favours b): total tok/s ×") for r in d.reasons)
    assert ev.context["a"] == ev.context["b"] and ev.context["a"]["async_scheduling"] is True
    status = (repo / "records" / "STATUS.md").read_text()
    aa_part = status.split("## Grid self-checks (A/A)")[1]
    assert ev.campaign_id in aa_part and "async_scheduling=true" in aa_part
    assert ev.campaign_id not in status.split("## Refuted levers")[0]      # an A/A run is no lever verdict


def test_correctness_fix_rehearsal_is_red_first(tmp_path):
    """A baseline broken where a real bug would be (its decode attention kernel) fails battery and near_tie, the
    candidate passes them: RED -> GREEN (non-binding on CPU). With nothing broken the baseline passes, so the gates
    cannot prove the fix: INVALID, saying so, and no grid is run."""
    fix = ["campaign=gqa_swap", "campaign.arms.baseline=false", "tracking=off",
           "campaign.gates=[battery,near_tie]", "campaign.policy.flip_on_correctness=true",
           "campaign.policy.fix_gates=[battery,near_tie]", "grid.concurrency=[1]", "grid.prompts_per_leg=[2]"]
    repo = temp_repo(tmp_path)
    ev = run_campaign(compose(fix, cuda=False), repo=repo, inject={"broken_arm": "off"})
    assert not ev.gate("battery", "off").passed and not ev.gate("near_tie", "off").passed
    assert ev.gate("battery", "on").passed and ev.gate("near_tie", "on").passed
    d = ev.decision
    assert d.verdict == "NON-BINDING" and any("not CUDA" in r for r in d.reasons)
    red_green = [r for r in d.reasons if "RED on off" in r]
    assert len(red_green) == 2 and all("→ GREEN on on" in r for r in red_green), d.reasons
    assert ev.legs, "a correctness fix still measures its grid"

    (tmp_path / "clean").mkdir()
    repo2 = temp_repo(tmp_path / "clean")
    ev = run_campaign(compose(fix, cuda=False), repo=repo2)
    assert ev.decision.verdict == "INVALID" and not ev.legs
    assert any("baseline off passes battery" in r and "cannot prove the fix" in r for r in ev.decision.reasons)


def test_async_device_mirror_rehearsal_is_red_then_green(tmp_path):
    """Nothing planted: with async scheduling pinned on, the baseline (decode inputs from the host's copy) really
    embeds stale tokens, and battery, near_tie and async_parity catch it; the device token mirror passes them."""
    cfg = compose(["campaign=async_device_mirror", "tracking=off", "grid.concurrency=[1]", "grid.prompts_per_leg=[2]",
                   "campaign.gates=[battery,near_tie,async_parity,mechanism]"], cuda=False)
    ev = run_campaign(cfg, repo=temp_repo(tmp_path))
    for gate in ("battery", "near_tie", "async_parity"):
        assert not ev.gate(gate, "off").passed and ev.gate(gate, "on").passed, gate
        assert ev.gate(gate, "off").self_check is True and ev.gate(gate, "on").self_check is True, gate
    assert ev.gate("async_parity", "off").counts["batch1_mismatched"] > 0
    assert ev.context["off"]["async_scheduling"] is True and ev.context["on"]["async_device_mirror"] is True
    d = ev.decision
    assert d.verdict == "NON-BINDING" and any("not CUDA" in r for r in d.reasons), d.reasons
    red_green = [r for r in d.reasons if "RED on off" in r and "→ GREEN on on" in r]
    assert sorted(r.split(":")[0] for r in red_green) == ["async_parity", "battery", "near_tie"], d.reasons
    assert ev.legs and not any("void grid" in r for r in d.reasons), "a correctness fix still measures its grid"


def test_a_broken_candidate_is_rejected_by_its_gates(tmp_path):
    repo = temp_repo(tmp_path)
    cfg = compose(["campaign=gqa_swap", "campaign.arms.baseline=false", "tracking=off",
                   "campaign.gates=[battery,near_tie,mechanism]"], cuda=False)
    ev = run_campaign(cfg, repo=repo, inject={"broken_arm": "on"})
    assert ev.decision.verdict == "REJECT-CORRECTNESS" and not ev.legs
    assert {r.split(" fails")[0] for r in ev.decision.reasons if " fails on arm on" in r} >= {"near_tie"}
    for g in ev.gates:                    # every gate still proved it can fail
        assert g.self_check is True, (g.gate, g.arm)


def test_server_start_order_is_drawn_from_the_campaign_id():
    """The same id gives the same order (a resume restarts the servers as before); across ids both orders occur, so
    a steady offset of the second server does not fall on the candidate every time."""
    from campaigns.evidence import Arm, Evidence
    from helpers import fingerprint

    def ev(cid):
        return Evidence(campaign_id=cid, lever="gqa_swap", arms=[Arm("off", False, "baseline"),
                                                                 Arm("on", True, "candidate")],
                        config={}, fingerprint=fingerprint(), created="2026-12-03T00:00:00Z")
    ids = [f"2026-12-03-gqa_swap-{i:07x}" for i in range(16)]
    orders = [[a.name for a in runner.server_order(ev(cid))] for cid in ids]
    assert orders == [[a.name for a in runner.server_order(ev(cid))] for cid in ids]
    assert {tuple(o) for o in orders} == {("off", "on"), ("on", "off")}


def test_a_binding_campaign_refuses_a_dirty_tree_unless_allowed(tmp_path):
    """On CUDA with a binding grid a dirty tree is refused before any device time is spent, naming the files and
    allow_dirty; with allow_dirty=true, on a CPU host, or with a rehearsal grid it runs (and cannot bind)."""
    import dataclasses

    from campaigns.fingerprint import collect
    from campaigns.runner import CampaignError, check_tree
    from vtengine import levers
    repo = temp_repo(tmp_path)
    (repo / "README.md").write_text("edited\n")
    cfg = compose(["campaign=gqa_swap", "grid=online", "tracking=off"], cuda=False)
    fpr = collect(repo, "cpu", levers.get("gqa_swap").env, [], "0" * 64)
    assert fpr.dirty and fpr.dirty_files == ["README.md"]
    check_tree(fpr, cfg)                                                 # a CPU host: a rehearsal at most
    gpu = dataclasses.replace(fpr, device_type="cuda")
    with pytest.raises(CampaignError, match=r"the git tree is dirty \(README.md\): a binding campaign .* "
                                            r"allow_dirty=true \(the verdict is then NON-BINDING\)"):
        check_tree(gpu, cfg)
    check_tree(gpu, compose(["campaign=gqa_swap", "grid=online", "allow_dirty=true"], cuda=False))
    check_tree(gpu, compose(["campaign=gqa_swap", "grid=rehearsal"], cuda=False))


def test_commit_true_on_a_flip_it_cannot_commit_completes_the_campaign_then_fails(tmp_path):
    """commit=true on a FLIP whose default is already applied (a recheck of a flipped lever): the campaign is
    complete, its records written, its runner.pid gone, and only then the command fails, saying why."""
    from campaigns.runner import CampaignError, _conclude, _Run
    from helpers import make_evidence
    from vtengine import levers
    repo = temp_repo(tmp_path)
    cfg = compose(["campaign=gqa_swap", "tracking=off", "commit=true"], cuda=False)
    ev = make_evidence(TPUT_WIN)                                  # gqa_swap off -> on; its default is on already
    reg = levers.registry()
    ev.context = {a.name: {**{n: lv.default for n, lv in reg.items()}, "gqa_swap": a.value} for a in ev.arms}
    cdir = repo / "records" / "campaigns" / ev.campaign_id
    cdir.mkdir(parents=True)
    (cdir / "runner.pid").write_text("1\n")
    run = _Run(cfg, repo, repo / "records" / "campaigns", cdir, ev, None, [], {}, time.perf_counter(),
               runner._live(cfg))
    with pytest.raises(CampaignError, match="commit=true: no flip committed: .*gqa_swap's default is already on"):
        _conclude(run)
    assert load_evidence(cdir).status == "complete" and ev.decision.verdict == "FLIP"
    assert (cdir / "record.md").is_file() and not (cdir / "runner.pid").exists()


def test_arms_that_do_not_fit_side_by_side_run_one_at_a_time(tmp_path, monkeypatch):
    """grid.residency=auto: the servers start side by side; when a server's log says its memory share could not
    hold the model (here a stand-in command that fails as the engine does), the arms run one at a time: each rep a
    block of every concurrency per arm, arms in the drawn server order and alternating, one server start per run of
    blocks of an arm (A | B B | A: 3 starts for 2 reps), server gates and reports on every arm, the record saying so."""
    repo = temp_repo(tmp_path)
    real, starts = runner._server_cmd, []

    def server_cmd(cfg, ev, arm, inject, alone=False):
        starts.append((arm.name, alone))
        if not alone:
            return [sys.executable, "-c", "print('vtengine.config.ConfigError: no room for the KV cache (-41 blocks): "
                                          "lower the model size or raise gpu_memory_utilization (now 0.45)')\n"
                                          "raise SystemExit(1)"]
        return real(cfg, ev, arm, inject, alone=True)
    monkeypatch.setattr(runner, "_server_cmd", server_cmd)
    # async_scheduling: an engine-loop lever, so its rehearsal runs the torch references (no interpreter)
    cfg = compose(["campaign=async_scheduling", "campaign.arms.baseline=false", "tracking=off",
                   "campaign.gates=[mechanism,async_parity]"], cuda=False)
    ev = run_campaign(cfg, repo=repo)
    assert ev.residency == "alternate" and ev.status == "complete" and ev.decision.verdict == "NON-BINDING"
    # side by side in the drawn server order, then one at a time in it: first | second second | first
    first, second = ev.server_order
    assert starts == [(first, False), (second, False), (first, True), (second, True), (first, True)]
    legs = sorted(ev.legs, key=lambda leg: leg.order_index)
    assert [(leg.arm, leg.rep, leg.concurrency) for leg in legs] == [
        (first, 0, 1), (first, 0, 2), (second, 0, 1), (second, 0, 2), (second, 1, 1), (second, 1, 2), (first, 1, 1),
        (first, 1, 2)]
    assert all(leg.valid for leg in legs)
    by_point: dict = {}
    for leg in legs:                    # the arms still share each (c, rep)'s prompts
        by_point.setdefault((leg.concurrency, leg.rep), set()).add(leg.prompts_sha256)
    assert all(len(s) == 1 for s in by_point.values())
    assert {g.arm for g in ev.gates if g.gate == "async_parity" and g.passed} == {"off", "on"}
    assert set(ev.peak_memory_gib) == set(ev.context) == set(ev.live_levers) == {"off", "on"}
    assert "async_scheduling" in ev.live_levers["on"]
    record = (repo / "records" / "campaigns" / ev.campaign_id / "record.md").read_text()
    assert "The arms' servers ran one at a time, each with 90% of the GPU's memory (grid.residency auto" in record
