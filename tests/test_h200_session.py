"""scripts/h200_session.sh: a malformed step is refused before the device call spends its minutes."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("step, message", [
    ("SEC@campaign:pdl_stack:model.quant=bf16", "'SEC' before @ is not a number of seconds"),
    ("400@campain:gqa_swap", "unknown kind; accepted: campaign:"),
    ("0@decode", "'0' before @ is not a number of seconds"),            # timeout(1) reads 0 as no limit
])
def test_a_bad_step_is_refused_before_anything_runs(tmp_path, step, message):
    """A literal 'SEC@' once cost a device call (both steps 'took 0 s' after the install): the script checks every
    step first, names the bad one, and exits 2 without installing, committing or running anything."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "h200_session.sh"), "300@decode:--rounds 1", step],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stdout and f"step '{step}'" in r.stdout
    assert list(tmp_path.iterdir()) == []               # no repository made, no results written


@pytest.mark.parametrize("sha", [None, "", "0", "HEAD", "$(git rev-parse --short HEAD)"])
def test_a_step_that_records_evidence_needs_a_literal_source_sha(tmp_path, sha):
    """The device copy has no .git: evidence names its commit from CAMPAIGN_SOURCE_SHA. A command once passed
    $(git rev-parse ...), which gives nothing there: its campaigns would name no commit of the repository and stay
    STALE for good. A campaign or recheck step without a hex sha is refused before anything runs."""
    import os
    env = {k: v for k, v in os.environ.items() if k != "CAMPAIGN_SOURCE_SHA"}
    if sha is not None:
        env["CAMPAIGN_SOURCE_SHA"] = sha
    for step in ("300@campaign:gqa_swap", "540@recheck"):
        r = subprocess.run(["bash", str(ROOT / "scripts" / "h200_session.sh"), step], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "CAMPAIGN_SOURCE_SHA is" in r.stdout and "not a hex commit sha" in r.stdout
        assert list(tmp_path.iterdir()) == []


def test_a_source_sha_that_is_no_commit_sha_is_refused_where_the_fingerprint_is_taken(tmp_path, monkeypatch):
    from campaigns.config import CampaignConfigError
    from campaigns.fingerprint import collect
    from helpers import make_evidence, temp_repo
    repo = temp_repo(tmp_path)
    arms = make_evidence().arms
    monkeypatch.setenv("CAMPAIGN_SOURCE_SHA", "0")
    with pytest.raises(CampaignConfigError, match=r"CAMPAIGN_SOURCE_SHA='0' is not a commit sha \(7 to 40 hex"):
        collect(repo, "cpu", "VT_DECODE_GQA_SWAP", arms, "0" * 64)
    monkeypatch.setenv("CAMPAIGN_SOURCE_SHA", "0dbde52")
    assert collect(repo, "cpu", "VT_DECODE_GQA_SWAP", arms, "0" * 64).git_short_sha == "0dbde52"


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_device_state_keeps_a_calls_campaigns_for_the_next_call_on_a_warm_machine(tmp_path):
    """A 32k grid outlasts one command; copying its evidence back between calls took longer than the machine stays
    warm (2026-12-06: the next start was refused, 211 s lost). device_state.sh saves what a call's steps added or
    changed under records/campaigns into the ignored .device-state/, and the next call restores what its copy lacks."""
    script = ROOT / "scripts" / "device_state.sh"
    camp = tmp_path / "records" / "campaigns"
    (camp / "old").mkdir(parents=True)
    (camp / "old" / "evidence.json").write_text("committed")
    (tmp_path / ".gitignore").write_text("/.device-state/\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "device copy")
    (camp / "new").mkdir()
    (camp / "new" / "evidence.json").write_text("22 legs")
    (camp / "new" / "server-a.log").write_text("log")
    run = lambda *a: subprocess.run(["bash", str(script), *a], cwd=tmp_path, capture_output=True, text=True,  # noqa
                                    timeout=60)
    assert run("save").returncode == 0
    state = tmp_path / ".device-state" / "campaigns"
    assert sorted(p.name for p in state.iterdir()) == ["new"]          # the committed campaign is not copied
    assert (state / "new" / "evidence.json").read_text() == "22 legs"
    (camp / "old" / "evidence.json").write_text("resumed")              # a changed campaign is saved too
    assert run("save").returncode == 0 and (state / "old" / "evidence.json").read_text() == "resumed"

    # the next call's copy: the campaigns the checkout holds, without the last call's new one
    import shutil
    shutil.rmtree(camp / "new")
    (camp / "new").mkdir()                  # the lender keeps a warm machine's ignored files: a runner.pid, no evidence
    (camp / "new" / "runner.pid").write_text("4242")
    (camp / "old" / "evidence.json").write_text("absorbed here")
    r = run("restore")
    assert r.returncode == 0 and "restored new" in r.stdout
    assert (camp / "new" / "evidence.json").read_text() == "22 legs"
    assert (camp / "old" / "evidence.json").read_text() == "absorbed here"   # the checkout's own copy wins
    assert "restored old" not in r.stdout
    bad = run("keep")
    assert bad.returncode == 2 and "save|restore" in bad.stdout and "'keep'" in bad.stdout


def _fake_device_checkout(tmp_path):
    """A checkout the script can run in on a CPU host: its device_state.sh, an empty wheelhouse and a python3 on
    PATH that installs nothing and runs `-m sleeper N` as `sleep N`."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "device_state.sh").write_text((ROOT / "scripts" / "device_state.sh").read_text())
    (tmp_path / ".whl").mkdir()
    for d in ("records", "bench/results", "campaigns/gates"):              # what the tarball takes
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "campaigns" / "gates" / "op_bounds.yaml").write_text("{}\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text('#!/usr/bin/env bash\n[ "$1 $2" = "-m sleeper" ] && exec sleep "$3"\n'
                    # pytest selecting nothing: its JUnit file of zero tests, exit status 5
                    'a="$*"; case "$a" in *"-m pytest"*--junitxml=*) x="${a#*--junitxml=}"; '
                    'echo "<testsuites/>" > "${x%% *}";; esac\ncase "$a" in *"-m pytest"*nomatch*) exit 5;; esac\n'
                    'exit 0\n')
    fake.chmod(0o755)
    import shutil
    logged = bin_dir / "timeout"                       # the real timeout(1), its arguments logged
    log, real = tmp_path / "timeouts.log", shutil.which("timeout")
    logged.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\nexec {real} "$@"\n')
    logged.chmod(0o755)
    import os
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}


def _timeouts(tmp_path) -> list[str]:
    return (tmp_path / "timeouts.log").read_text().splitlines()


def _session(tmp_path, env, *steps):
    return subprocess.run(["bash", str(ROOT / "scripts" / "h200_session.sh"), *steps], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_step_is_cut_to_what_is_left_of_the_call(tmp_path):
    """The lender stops a command at 600 s; a 580 s step after ~30 s of wheel install outlived it, and a step still
    running then loses its tarball with every leg it finished. Each step's SECONDS is cut to what is left of the
    call less a reserve for stopping and the tarball (25 s); a step that asks less keeps its own."""
    env = {**_fake_device_checkout(tmp_path), "CALL_S": "200"}
    r = _session(tmp_path, env, "5@py:sleeper 1", "400@py:sleeper 0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step py:sleeper 1 cut" not in r.stdout and "== step py:sleeper 1 took" in r.stdout
    cut = [line for line in r.stdout.splitlines() if line.startswith("== step py:sleeper 0 cut to ")]
    assert len(cut) == 1 and cut[0].endswith("s (asked 400): what is left of the call"), r.stdout
    seconds = int(cut[0].split("cut to ")[1].split()[0])
    assert 165 <= seconds <= 175                       # 200 - 25 reserve, less the setup and the first step
    assert _timeouts(tmp_path) == ["-s INT -k 15 5 python3 -m sleeper 1",
                                   f"-s INT -k 15 {seconds} python3 -m sleeper 0"]
    assert (tmp_path / "out" / "results.tgz").exists()


def test_each_serve_leg_is_cut_to_what_is_left_of_the_call(tmp_path):
    """A serve step's SECONDS bound each closed-loop leg; every leg is cut to what is left of the call less the
    reserve and 10 s for the server's stop, so two legs of 400 s in a 200 s call both fit."""
    env = {**_fake_device_checkout(tmp_path), "CALL_S": "200"}
    r = _session(tmp_path, env, "400@serve:--model tiny|--input-len 8|--input-len 16")
    assert r.returncode == 0, r.stdout + r.stderr
    legs = [line.split() for line in _timeouts(tmp_path)]
    assert [leg[-1] for leg in legs] == ["8", "16"], legs
    seconds = [int(leg[4]) for leg in legs]
    assert all(155 <= s <= 165 for s in seconds), seconds       # 200 - 25 - 10, less the setup


def test_a_step_with_under_a_minute_left_is_not_started(tmp_path):
    env = {**_fake_device_checkout(tmp_path), "CALL_S": "80"}     # 80 - 25 reserve: under a minute from the start
    r = _session(tmp_path, env, "400@py:sleeper 30")
    assert r.returncode == 0 and "== step py:sleeper 30 not started: " in r.stdout, r.stdout + r.stderr
    assert "took" not in r.stdout.split("== setup took")[1]


def test_gputests_leave_their_junit_record_in_bench_results(tmp_path):
    """2026-12-07: a GPU run's count line was lost to -qq and a 40-line tail, and nothing recorded when the GPU tests
    last passed. The step writes JUnit XML into bench/results/ (the tarball brings it back, absorb commits it), named
    by GPU and time, its suite named by the source commit; the full output goes to the log."""
    env = {**_fake_device_checkout(tmp_path), "CALL_S": "200", "CAMPAIGN_SOURCE_SHA": "abc1234"}
    r = _session(tmp_path, env, "100@gputests:tests/test_x.py -k graph")
    assert r.returncode == 0, r.stdout + r.stderr
    (line,) = _timeouts(tmp_path)
    args = line.split(" python3 -m pytest ")[1]
    assert args.startswith("-q -m gpu -p no:cacheprovider -rfE --junitxml=bench/results/gputests-GPU-20")
    assert args.endswith(".xml -o junit_suite_name=gpu tests at abc1234 tests/test_x.py -k graph"), args


def test_a_gputests_step_that_selects_no_test_keeps_no_record(tmp_path):
    """2026-12-07: a `-k op_gate` matched no test name; its JUnit file of zero tests came back and was committed
    beside the real runs. pytest says so with exit status 5: the step says so too and keeps no record."""
    env = {**_fake_device_checkout(tmp_path), "CALL_S": "200", "CAMPAIGN_SOURCE_SHA": "abc1234"}
    r = _session(tmp_path, env, "100@gputests:tests/test_x.py -k nomatch", "100@gputests:tests/test_x.py")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "== gputests: no test selected by 'tests/test_x.py -k nomatch'; no record kept" in r.stdout
    assert r.stdout.count("no test selected") == 1
    (kept,) = (tmp_path / "bench" / "results").iterdir()        # the run that selected tests keeps its record
    assert kept.name.startswith("gputests-GPU-") and kept.suffix == ".xml"
