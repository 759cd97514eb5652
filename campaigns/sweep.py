"""``vtcampaign run -m ...``: many independent campaigns as a Hydra multirun, on any Hydra launcher.

    vtcampaign run -m campaign=gqa_swap,pdl model.quant=bf16,mxfp4                 # 4 campaigns, one after another
    vtcampaign run -m campaign=gqa_swap,fast_math hydra/launcher=submitit_local    # side by side, one GPU each
    vtcampaign run -m campaign=gqa_swap,pdl hydra/launcher=submitit_slurm hydra.launcher.gpus_per_node=1

The command is a Hydra app (Hydra's own sweep syntax, sweepers and launcher plugins), composed from the same conf/
as a single run. Each job runs one ordinary single campaign (``vtcampaign run <its overrides>``, in a child process
so it composes, defaults by host and validates exactly as a single run does) inside a GPU slot of its host
(campaigns/gpus.py: the campaign's gates and both arms' servers on one GPU, one campaign per GPU).

What the jobs share is left to the submitting process, which does it once at the end, from the evidence files:
- records: each job writes only its own record.md/pr.md (``summaries=false``); STATUS.md and BENCHMARKS.md are
  rendered once over all of out_dir, never half-written by two jobs at once;
- MLflow: with the local sqlite store (one writer at a time) the jobs run ``tracking=off`` and their evidence is
  ingested here; a tracking server (``tracking=remote``) is logged to by the jobs directly;
- flips: jobs never commit (``commit=false``); with ``commit=true`` this process commits each fresh, binding FLIP.
A lever with several values stays one campaign with several candidates (its calibration counts their
comparisons); a sweep is for independent campaigns. A job that fails or is killed leaves its evidence in-progress
and resumable (``vtcampaign run campaign=<its campaign> resume=<id>``); the others' evidence is untouched.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from campaigns import gpus
from campaigns.evidence import find_evidence, load_evidence

MULTIRUN_FLAGS = ("-m", "--multirun")


def is_sweep(args: list[str]) -> bool:
    return any(a in MULTIRUN_FLAGS for a in args)


def _job_overrides(cfg: DictConfig) -> list[str]:
    """What a job passes to its single campaign besides its own sweep overrides: no flip (the submitting process
    commits), no summaries (rendered once at the end), and no sqlite writes (ingested at the end)."""
    extra = ["commit=false", "summaries=false"]
    tracking = cfg.get("tracking") or {}
    if tracking.get("enabled", False) and str(tracking.get("uri", "")).startswith("sqlite:"):
        extra.append("tracking=off")
    return extra


def job(cfg: DictConfig) -> int:
    """One Hydra job: its campaign, as a single run, in a GPU slot of this host."""
    from hydra.core.hydra_config import HydraConfig
    hc = HydraConfig.get()
    task = [o for o in hc.overrides.task]
    out_dir = Path(str(cfg.get("out_dir", "records/campaigns")))
    env = dict(os.environ)
    with gpus.gpu_slot(out_dir / ".gpu-locks",
                       on_wait=lambda g: print(f"job {hc.job.num}: waiting for one of GPUs {g}", flush=True)) as gpu:
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd = [sys.executable, "-m", "campaigns.cli", "run", *task, *_job_overrides(cfg)]
        print(f"job {hc.job.num}{'' if gpu is None else f' on GPU {gpu}'}: {' '.join(cmd[3:])}", flush=True)
        rc = subprocess.call(cmd, env=env)
    from campaigns.cli import EXIT_CODES
    if rc != 0 and rc not in EXIT_CODES.values():       # 3, 4: the campaign ran to a verdict, in its evidence
        raise RuntimeError(f"job {hc.job.num} ({' '.join(task)}) exited with {rc}; its evidence is kept and "
                           "resumable (resume=<campaign id>)")
    return rc


def _sweep_conf(conf: Path, first_campaign: str) -> Path:
    """The conf directory with a ``sweep.yaml`` primary config: config.yaml with its mandatory campaign defaulted
    to the sweep's first. Hydra composes a multirun's base config before it sweeps, and other overrides (e.g.
    campaign.gates=[...]) need a campaign there; every job then sets its own."""
    import shutil
    import tempfile
    text = (conf / "config.yaml").read_text()
    if "  - campaign: ???" not in text:
        raise RuntimeError(f"{conf / 'config.yaml'}: its defaults must list '- campaign: ???'")
    out = Path(tempfile.mkdtemp(prefix="vtcampaign-sweep-conf-"))
    shutil.copytree(conf, out, dirs_exist_ok=True)
    (out / "sweep.yaml").write_text(text.replace("  - campaign: ???", f"  - campaign: {first_campaign}"))
    return out


def _touched(out_dir: Path, since: float) -> list[Path]:
    return [p for p in find_evidence(out_dir) if p.stat().st_mtime >= since]


def run_sweep(args: list[str], out_dir: str = "records/campaigns") -> int:
    """Run the Hydra multirun ``args`` (overrides and Hydra flags, ``-m`` among them), then render, ingest and
    flip once over the campaigns it touched. Returns the exit code (1 when a job failed)."""
    import hydra

    from campaigns import config as _config  # noqa: F401  (registers the schema the app composes with)
    from vtengine import confdirs

    overrides = [a for a in args if not a.startswith("-")]
    campaigns = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "campaign"), "")
    if not campaigns:
        from campaigns.config import CampaignConfigError, options
        raise CampaignConfigError("a sweep needs campaign=<name>[,<name>...]; accepted: "
                                  + ", ".join(options("campaign")))
    out_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("out_dir=")), out_dir)
    commit = any(o in ("commit=true", "commit=True") for o in overrides)
    uri = next((o.split("=", 1)[1] for o in overrides if o.startswith("tracking.uri=")), None)
    tracking = next((o.split("=", 1)[1] for o in overrides if o.startswith("tracking=")), "local")
    os.environ.setdefault(gpus.ENV, ",".join(gpus.host_gpus()))
    t0 = time.time() - 1
    failed = None
    argv, sys.argv = sys.argv, ["vtcampaign run", *args]
    try:
        conf = _sweep_conf(confdirs.merged(), campaigns.split(",")[0].strip())
        hydra.main(config_path=str(conf), config_name="sweep", version_base="1.3")(job)()
    except SystemExit as e:                 # hydra.main reports a failed job and exits
        failed = e.code or 1
    except Exception as e:              # a failed job, re-raised by the launcher after the others finished
        failed = e
    finally:
        sys.argv = argv
    return _after_sweep(Path(out_dir), t0, commit, tracking, uri, failed)


def plan_flips(evs: list, records_dir: Path) -> dict[str, tuple[str, str | None]]:
    """What a commit=true sweep does with each complete FLIP among ``evs``, by campaign id: ("flip", scope) or
    ("refused", why). The rule is `vtcampaign flip`'s (runner.check_flippable), with the sweep's own campaigns in
    ``records_dir``: a fresh REJECT of the same change on the same quantization refuses the FLIP; one on another
    quantization scopes it to its own (``default_by_quant``: bf16 FLIP, MXFP4 REJECT flips bf16's default alone).
    One flip per lever and scope: a second FLIP of it in the sweep is refused, naming the first."""
    from campaigns.runner import CampaignError, check_flippable
    plan, first = {}, {}
    for ev in evs:
        if ev.status != "complete" or ev.decision is None or ev.decision.verdict != "FLIP":
            continue
        try:
            scope = check_flippable(ev, records_dir)
        except CampaignError as e:
            plan[ev.campaign_id] = ("refused", str(e))
            continue
        taken = first.get((ev.lever, scope)) or first.get((ev.lever, None)) or (
            next((cid for (lever, _s), cid in first.items() if lever == ev.lever), None) if scope is None else None)
        if taken:
            plan[ev.campaign_id] = ("refused", f"already flipped by {taken}")
            continue
        first[(ev.lever, scope)] = ev.campaign_id
        plan[ev.campaign_id] = ("flip", scope)
    return plan


def _after_sweep(out_dir: Path, t0: float, commit: bool, tracking: str, uri: str | None, failed) -> int:
    from rich.console import Console
    from rich.table import Table

    from campaigns import records
    from campaigns.gitops import project_root
    from campaigns.runner import CampaignError, status_dir
    console = Console(stderr=True)
    out_dir = Path(out_dir) if Path(out_dir).is_absolute() else project_root() / out_dir     # where the jobs wrote
    touched = _touched(out_dir, t0) if out_dir.is_dir() else []
    evs = [load_evidence(p) for p in touched]
    if out_dir.is_dir() and find_evidence(out_dir):
        records.render_all(out_dir, status_dir(project_root(), out_dir.resolve()))
    if tracking == "local" or (uri and uri.startswith("sqlite:")):
        from campaigns import tracking as mlflow_tracking
        target = uri or "sqlite:///mlflow.db"
        for ev, path in zip(evs, touched):
            mlflow_tracking.log_evidence(ev, target, campaign_dir=path.parent)
    table = Table(title=f"sweep: {len(evs)} campaign(s) in {out_dir}")
    for col in ("campaign", "status", "verdict", "flip"):
        table.add_column(col)
    plan = plan_flips(evs, out_dir) if commit else {}
    committed = []
    for ev, path in zip(evs, touched):
        flip = ""
        action, detail = plan.get(ev.campaign_id, ("", None))
        if action == "refused":
            flip = f"refused: {detail}"
        elif action == "flip":
            from campaigns.runner import _flip
            try:
                _flip(ev, path.parent, project_root(), status_dir(project_root(), out_dir.resolve()), clear=False)
                flip = ev.flip.get("branch", "")
                committed.append(ev.flip["commit"])
            except CampaignError as e:
                flip = f"refused: {e}"
        table.add_row(ev.campaign_id, ev.status, ev.decision.verdict if ev.decision else "—", flip)
    console.print(table)
    from campaigns.gitops import clear_for_merge
    for commit_sha in committed:        # after the last flip: each one's summaries were rendered from every campaign
        clear_for_merge(project_root(), commit_sha)
    if failed is not None:
        console.print(f"[red]a job failed[/]: {failed}")
        return 1
    return 0
