"""Campaigns as a Hydra multirun: `vtcampaign run -m ... hydra/launcher=submitit_local` runs each campaign as its own
process, one GPU slot each; records are rendered and MLflow ingested once, by the submitting process; a killed job
leaves the other's evidence intact and its own resumable."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from campaigns import gpus
from campaigns.evidence import load_evidence
from helpers import TPUT_WIN, make_evidence, temp_repo

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)
SMALL = ["campaign.gates=[mechanism]", "grid.concurrency=[1,2]", "grid.prompts_per_leg=[2,2]"]


def test_gpu_slots_give_each_job_its_own_gpu_and_make_the_rest_wait(tmp_path):
    held, order = [], []
    gate = threading.Event()

    def job(name):
        with gpus.gpu_slot(tmp_path, gpus=["0", "1"], poll_s=0.05) as g:
            held.append(g)
            order.append((name, g))
            if name != "third":
                gate.wait(10)
            held.remove(g)

    threads = [threading.Thread(target=job, args=(n,)) for n in ("first", "second")]
    for t in threads:
        t.start()
    time.sleep(0.5)
    assert sorted(held) == ["0", "1"]                         # one GPU each, never the same one
    third = threading.Thread(target=job, args=("third",))
    third.start()
    time.sleep(0.5)
    assert [n for n, _ in order] == ["first", "second"] or [n for n, _ in order] == ["second", "first"]
    gate.set()                                                # both free their GPU: the third gets one
    for t in threads + [third]:
        t.join(10)
    assert order[-1][0] == "third" and order[-1][1] in ("0", "1")
    with gpus.gpu_slot(tmp_path, gpus=[]) as g:               # a CPU host: no slot, no wait
        assert g is None


def test_host_gpus_prefers_the_sweeps_list(monkeypatch):
    monkeypatch.setenv(gpus.ENV, "2,3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.host_gpus() == ["2", "3"]
    monkeypatch.delenv(gpus.ENV)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpus.host_gpus() == ["1"]


def test_a_submitit_local_sweep_runs_campaigns_side_by_side_and_merges_once(tmp_path):
    import mlflow
    repo = temp_repo(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, "-m", "campaigns.cli", "run", "-m", "campaign=async_scheduling,gqa_swap", *SMALL,
            f"tracking.uri={uri}", "hydra/launcher=submitit_local", f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    t_start = time.time()
    sweep = subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out_dir = repo / "records" / "campaigns"
    victim, runners, deadline = None, {}, time.time() + 600
    while time.time() < deadline and sweep.poll() is None and victim is None:
        for ev_path in out_dir.glob("*gqa_swap*/evidence.json"):
            pid_file = ev_path.parent / "runner.pid"
            try:
                legs = len(json.loads(ev_path.read_text())["legs"])
            except (json.JSONDecodeError, KeyError, FileNotFoundError):
                continue
            if legs >= 1 and pid_file.is_file():
                victim = (ev_path, int(pid_file.read_text()))
        for p in out_dir.glob("*/runner.pid"):
            runners[p.parent.name] = p
        time.sleep(0.2)
    assert victim is not None, f"the gqa_swap job never reached its grid: {sweep.communicate(timeout=60)[0][-3000:]}"
    # both campaigns were running at once, as separate processes
    assert len(runners) == 2 and len({p.read_text() for p in runners.values() if p.is_file()} | {"x"}) >= 2
    os.kill(victim[1], signal.SIGKILL)                       # kill one job's campaign mid-grid
    out = sweep.communicate(timeout=900)[0]
    assert sweep.returncode == 1, out[-3000:]                 # the sweep reports the failed job ...
    evs = {p.parent.name: load_evidence(p) for p in out_dir.glob("*/evidence.json")}
    survivor = next(e for e in evs.values() if e.lever == "async_scheduling")
    killed = next(e for e in evs.values() if e.lever == "gqa_swap")
    assert survivor.status == "complete" and len(survivor.legs) == 8 and all(leg.valid for leg in survivor.legs)
    assert killed.status == "in-progress" and 1 <= len(killed.legs) < 8
    # side by side: each began before the other's last leg ended (run one after the other, the second would not)
    assert killed.created < max(leg.ended for leg in survivor.legs), (killed.created, survivor.legs[-1].ended)
    assert survivor.created < max(leg.ended for leg in killed.legs), (survivor.created, killed.legs[-1].ended)
    # ... and still renders once, after every job ended, and ingests both into the local store
    status = repo / "records" / "STATUS.md"
    assert status.stat().st_mtime >= max(p.stat().st_mtime for p in out_dir.glob("*/evidence.json"))
    assert survivor.campaign_id in status.read_text() and status.stat().st_mtime > t_start
    client = mlflow.MlflowClient(tracking_uri=uri)
    from campaigns.tracking import CAMPAIGN_TAG
    logged = {r.data.tags.get(CAMPAIGN_TAG) for exp_name in ("vtcampaign/async_scheduling", "vtcampaign/gqa_swap")
              for r in client.search_runs([client.get_experiment_by_name(exp_name).experiment_id])}
    assert {survivor.campaign_id, killed.campaign_id} <= logged
    # the killed campaign is left resumable, and `vtcampaign status` says how (the resume after a SIGKILL itself runs
    # in test_campaign_e2e, not here again: a grid is a minute of CI)
    status = subprocess.run([sys.executable, "-m", "campaigns.cli", "status"], cwd=repo, env=env, capture_output=True,
                            text=True, timeout=300)
    assert status.returncode == 0, status.stdout[-3000:] + status.stderr[-3000:]
    line = next(ln for ln in status.stdout.splitlines() if killed.campaign_id in ln and "legs" in ln)
    assert f"resume={killed.campaign_id}" in " ".join(status.stdout.split()), line
