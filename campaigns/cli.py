"""``vtcampaign``: run a lever's campaign, and view its evidence as records, MLflow runs and PR text.

    vtcampaign run campaign=gqa_swap [grid.reps=5 model=qwen3-8b ...] [--dry-run]
    vtcampaign status                  levers, defaults, resolved values, measured byte-exactness, last verdicts
    vtcampaign render                  rebuild every record.md/pr.md/grid.png and records/STATUS.md, BENCHMARKS.md
    vtcampaign log <evidence.json>     ingest a campaign into MLflow (replaces an earlier logging of the same id)
    vtcampaign pr <campaign-id>        print the PR text (title line, then the body)
    vtcampaign ui                      the MLflow UI on the default store (needs the full `mlflow` package)

User errors (a bad override, an unknown campaign, a missing evidence file) print one line and exit with code 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

from campaigns.config import CampaignConfigError, compose, options
from campaigns.evidence import EvidenceError, find_evidence, load_evidence
from campaigns.gitops import GitOpsError

USER_ERRORS = (CampaignConfigError, EvidenceError, GitOpsError)
DEFAULT_OUT_DIR = "records/campaigns"
DEFAULT_URI = "sqlite:///mlflow.db"


class UsageError(ValueError):
    """A CLI usage problem the user can fix; printed as one line, exit code 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vtcampaign", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{run,status,render,log,pr,ui}")
    run = sub.add_parser("run", help="compose the campaign config and run it",
                         description="Compose conf/config.yaml with Hydra overrides and run the campaign. "
                                     f"Campaigns: {', '.join(options('campaign'))}.")
    run.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. campaign=gqa_swap grid.reps=5")
    run.add_argument("--dry-run", action="store_true", help="print the composed config and the plan; run nothing")
    st = sub.add_parser("status", help="levers, defaults, resolved values and last verdicts")
    st.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    rd = sub.add_parser("render", help="rebuild records from evidence files")
    rd.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    rd.add_argument("--no-plots", action="store_true", help="skip grid.png")
    lg = sub.add_parser("log", help="ingest an evidence file into MLflow")
    lg.add_argument("evidence", help="path to records/campaigns/<id>/evidence.json (or its directory)")
    lg.add_argument("--tracking-uri", default=DEFAULT_URI)
    pr = sub.add_parser("pr", help="print the PR text of a campaign")
    pr.add_argument("campaign_id")
    pr.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    ui = sub.add_parser("ui", help="the MLflow UI on the tracking store")
    ui.add_argument("--tracking-uri", default=DEFAULT_URI)
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument("--host", default="127.0.0.1")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.cmd == "run":
            flags = [x for x in extra if x.startswith("-")]
            if flags:
                raise UsageError(f"unknown option(s) {flags} for run; accepted: --dry-run, and Hydra overrides key=value")
            return cmd_run(list(args.overrides) + extra, args.dry_run)
        if extra:
            raise UsageError(f"unexpected argument(s) {extra} for {args.cmd}")
        return {"status": cmd_status, "render": cmd_render, "log": cmd_log, "pr": cmd_pr, "ui": cmd_ui}[args.cmd](args)
    except (UsageError, *USER_ERRORS) as e:
        print(f"vtcampaign: error: {e}", file=sys.stderr)
        return 2


def cmd_run(overrides: list[str], dry_run: bool) -> int:
    cfg = compose(overrides)
    if dry_run:
        from omegaconf import OmegaConf
        print(OmegaConf.to_yaml(cfg), end="")
        grid, camp = cfg.grid, cfg.campaign
        arms = 1 + len(camp.arms.candidates)
        legs = len(grid.concurrency) * grid.reps * arms
        binding = "binding" if cfg.device == "cuda" and grid.binding else "non-binding"
        print(f"# plan: {camp.lever} on {cfg.device} ({binding}), {arms} arms, gates {list(camp.gates)}, "
              f"{legs} legs ({len(grid.concurrency)} concurrencies x {grid.reps} reps x {arms} arms), "
              f"model {cfg.model.name} ({cfg.model.quant}), tracking {cfg.tracking.name}")
        return 0
    try:
        from campaigns.runner import run_campaign
    except ModuleNotFoundError as e:
        if e.name != "campaigns.runner":
            raise
        raise UsageError("the campaign runner (campaigns/runner.py) is not built yet; "
                         "`vtcampaign run ... --dry-run` shows the composed config") from None
    from campaigns.runner import CampaignError
    try:
        run_campaign(cfg)
    except CampaignError as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:
        return 130          # the runner saved the evidence and printed how to resume
    return 0


def _evidence_by_lever(out_dir: str) -> dict[str, list]:
    by: dict[str, list] = {}
    for path in find_evidence(out_dir):
        ev = load_evidence(path)
        by.setdefault(ev.lever, []).append(ev)
    for evs in by.values():
        evs.sort(key=lambda e: (e.created, e.campaign_id))
    return by


def cmd_status(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from vtengine import levers

    by = _evidence_by_lever(args.out_dir)
    table = Table(title="levers (default: conf/lever/*.yaml; last campaign: " + args.out_dir + ")")
    for col in ("lever", "default", "env", "resolved", "byte-exact", "last campaign", "verdict"):
        table.add_column(col)
    try:
        resolved = levers.resolve()
    except levers.LeverError as e:
        raise UsageError(str(e)) from None
    for name, lever in sorted(levers.registry().items()):
        done = [e for e in by.get(name, []) if e.decision is not None]
        last = done[-1] if done else None
        table.add_row(name, str(lever.default), lever.env,
                      f"{resolved.values[name]} ({resolved.sources[name]})",
                      {True: "yes", False: "no", None: "—"}[last.decision.byte_exact] if last else "—",
                      last.campaign_id if last else "—", last.decision.verdict if last else "—")
    # Piped output gets a wide console so the table is not folded into unreadable columns.
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def cmd_render(args) -> int:
    from campaigns.records import render_all
    if not Path(args.out_dir).is_dir():
        raise UsageError(f"no campaigns directory {args.out_dir!r}; pass --out-dir (default {DEFAULT_OUT_DIR})")
    written = render_all(args.out_dir, plots=not args.no_plots)
    print(f"rendered {len(written)} files from {len(find_evidence(args.out_dir))} evidence file(s)")
    return 0


def cmd_log(args) -> int:
    from campaigns.tracking import log_evidence
    path = Path(args.evidence)
    ev = load_evidence(path)
    run_id = log_evidence(ev, args.tracking_uri, campaign_dir=path if path.is_dir() else path.parent)
    print(f"logged {ev.campaign_id} to {args.tracking_uri} (experiment vtcampaign/{ev.lever}, parent run {run_id})")
    return 0


def cmd_pr(args) -> int:
    from campaigns.records import render_pr
    path = Path(args.out_dir) / args.campaign_id / "evidence.json"
    if not path.is_file():
        known = [p.parent.name for p in find_evidence(args.out_dir)]
        raise UsageError(f"unknown campaign id {args.campaign_id!r} under {args.out_dir}; "
                         f"accepted: {', '.join(known) or '(none yet)'}")
    print(render_pr(load_evidence(path)), end="")
    return 0


def cmd_ui(args) -> int:
    if importlib.util.find_spec("flask") is None or shutil.which("mlflow") is None:
        raise UsageError("the MLflow UI needs the full `mlflow` package (mlflow-skinny has no server): "
                         f"`pip install mlflow`, then `mlflow ui --backend-store-uri {args.tracking_uri}`")
    cmd = ["mlflow", "ui", "--backend-store-uri", args.tracking_uri, "--host", args.host, "--port", str(args.port)]
    print(" ".join(cmd))
    return subprocess.call(cmd)


if __name__ == "__main__":
    sys.exit(main())
