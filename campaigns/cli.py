"""``vtcampaign``: run a lever's campaign, and view its evidence as records, MLflow runs and PR text.

    vtcampaign run campaign=gqa_swap [grid.reps=5 model=qwen3-8b ...] [--dry-run | --cfg job | --info]
    vtcampaign run campaign=gqa_swap aa=true   the grid's A/A self-check (two servers at one value)
    vtcampaign run -m campaign=gqa_swap,pdl [hydra/launcher=submitit_local]   a sweep (Hydra multirun): one
                                       campaign per job, one GPU per campaign; records and MLflow once at the end
    vtcampaign status                  levers, defaults, resolved values, measured byte-exactness, last verdicts, and
                                       which verdicts are STALE (and why)
    vtcampaign status --at <rev> [--strict]   which FRESH verdicts a checkout or merge of <rev> would make STALE,
                                       why, and the GPU time to re-measure them (--strict: exit 3 if any)
    vtcampaign calibrate               each binding campaign's false FLIP / false REJECT rates and minimum detectable
                                       effect, from the policy run on simulated campaigns of its grid shape
    vtcampaign flip <campaign-id>      commit a binding FLIP's default flip on row/<lever>-flip (refuses a stale one)
    vtcampaign merge <lever|branch>    merge a flip branch if its FLIP is fresh here, the summaries rendered again
    vtcampaign decide <campaign-id>    decide a complete campaign again with this checkout's policy (after a policy fix;
                                       nothing is measured again, the record keeps the earlier verdict)
    vtcampaign recheck [overrides]     re-run the campaign of every stale binding verdict, resumably
    vtcampaign render                  rebuild every record.md/pr.md/grid.png and records/STATUS.md, BENCHMARKS.md
    vtcampaign log <evidence.json>     ingest a campaign into MLflow (replaces an earlier logging of the same id)
    vtcampaign pr <campaign-id>        print the PR text (title line, then the body)
    vtcampaign ui                      the MLflow UI on the default store (needs the full `mlflow` package)

User errors (a bad override, an unknown campaign, a missing evidence file) print one line and exit with code 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from campaigns.config import CampaignConfigError, compose, options, settings
from campaigns.evidence import EvidenceError, find_evidence, load_evidence
from campaigns.gitops import GitOpsError, project_root
from campaigns.recheck import STEP_OVERHEAD_S, WHOLE_CALL_S, RecheckError

from vtengine.confdirs import ConfDirError
from vtengine.levers import LeverError

USER_ERRORS = (CampaignConfigError, EvidenceError, GitOpsError, ConfDirError, LeverError, RecheckError)
DEFAULT_OUT_DIR = "records/campaigns"       # under the project root: the git work tree the command runs in


DEFAULT_URI = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"      # as campaigns.tracking's


class UsageError(ValueError):
    """A CLI usage problem the user can fix; printed as one line, exit code 2."""


def _out_dir_arg(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--out-dir", default=None,
                     help=f"the campaigns folder (default: {DEFAULT_OUT_DIR} under the project root)")


def _seconds(text: str) -> float:
    """A positive number of seconds (argparse type: the error names the value and what is accepted)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; accepted: a positive number, e.g. 540")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vtcampaign", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="--conf-dir DIR (first argument, or VTENGINE_CONF_DIR) reads a project's "
                                       "conf/ over the packaged one")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="compose the campaign config and run it",
                         description="Compose conf/config.yaml with Hydra overrides and run the campaign. "
                                     f"Campaigns: {', '.join(options('campaign'))}.")
    run.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. campaign=gqa_swap grid.reps=5")
    run.add_argument("--dry-run", action="store_true", help="print the composed config and the plan; run nothing")
    # Hydra's own flags where a single run can honour them (a sweep, -m, is a Hydra app and takes all of Hydra's)
    run.add_argument("--cfg", "-c", choices=("job", "hydra", "all"),
                     help="print the composed config and exit, as a Hydra app does (job; all = job here)")
    run.add_argument("--resolve", action="store_true", help="with --cfg: resolve interpolations")
    run.add_argument("--info", "-i", nargs="?", const="all", choices=("all", "searchpath", "defaults"),
                     help="print where the config is read from and the group options chosen, then exit")
    run.add_argument("--config-dir", "-cd", help="a project's conf/ over the packaged one (same as --conf-dir)")
    st = sub.add_parser("status", help="levers, defaults, resolved values and last verdicts")
    _out_dir_arg(st)
    st.add_argument("--at", metavar="REV", default=None,
                    help="instead of the table: which verdicts FRESH here a checkout or merge of commit REV (a "
                         "branch, tag or sha) would make STALE, and why (its lever files and sources, in a "
                         "temporary git worktree)")
    st.add_argument("--strict", action="store_true",
                    help="with --at: exit 3 when some verdict would go STALE (a pre-merge check)")
    cal = sub.add_parser("calibrate", help="the grid rule's error rates for every binding campaign")
    _out_dir_arg(cal)
    cal.add_argument("--sims", type=int, default=1000, help="simulated campaigns per rate (default 1000)")
    cal.add_argument("--seed", type=int, default=0)
    fl = sub.add_parser("flip", help="commit a binding, fresh FLIP on row/<lever>-flip")
    fl.add_argument("campaign_id")
    _out_dir_arg(fl)
    mg = sub.add_parser("merge", help="merge a flip branch, rendering the summaries again (no STATUS conflicts)",
                        description="Merge a flip branch (row/<lever>-flip) with git merge --no-ff after checking "
                                    "that its FLIP is still fresh on this checkout (another flip merged since may "
                                    "have staled it), then render STATUS.md and BENCHMARKS.md from the merged "
                                    "evidence and lever files: two flips made from one base no longer conflict there.")
    mg.add_argument("branch", help="the flip branch, or a lever name for row/<lever>-flip")
    _out_dir_arg(mg)
    de = sub.add_parser("decide", help="apply this checkout's policy again to a complete campaign's evidence",
                        description="Decide a complete campaign again from its stored legs, gates and statistics "
                                    "with the policy code of this checkout (after a fix to the policy); the "
                                    "record keeps the earlier verdict in the reasons. Nothing is measured again.")
    de.add_argument("campaign_id", nargs="?", help="the campaign to decide again (or --all)")
    de.add_argument("--all", action="store_true", help="every complete campaign under --out-dir, one render")
    _out_dir_arg(de)
    co = sub.add_parser("conclude", help="conclude a campaign whose legs are all recorded, on any host",
                        description="Conclude a campaign whose every gate, leg and server report is recorded but "
                                    "whose run stopped before its verdict (a device command's time limit landed "
                                    "there): the policy, records, tracking and flip as the campaign was "
                                    "configured. Nothing is measured, so it runs on any host and commit; the "
                                    "verdict's reasons say where it was concluded. A campaign with legs or gates "
                                    "left is refused, naming them: resume that one where it ran.")
    co.add_argument("campaign_id")
    _out_dir_arg(co)
    ab = sub.add_parser("abandon", help="give up unfinished campaigns: no longer listed, resumed or concluded",
                        description="Mark unfinished campaigns abandoned (e.g. cut before a code change, so no "
                                    "checkout of today's code can resume them): `vtcampaign status` stops listing "
                                    "them, resume=auto passes them by, and resume or conclude refuse them. Nothing "
                                    "is deleted: the evidence keeps every gate and leg, the record says when and "
                                    "why it was abandoned, and MLflow's status tag says so where it holds it.")
    ab.add_argument("campaign_ids", nargs="*", metavar="CAMPAIGN_ID")
    ab.add_argument("--why", required=True, help="the reason, written into each record")
    ab.add_argument("--unresumable", action="store_true",
                    help="every unfinished campaign this checkout cannot resume because its code changed since "
                         "(those `vtcampaign status` calls not resumable on this checkout; not one that only "
                         "needs `vtcampaign conclude`)")
    _out_dir_arg(ab)
    rc = sub.add_parser("recheck", help="re-run the campaigns of the stale binding verdicts, one after another",
                        description="Re-run every stale binding verdict's campaign (vtcampaign status lists them) "
                                    "on today's defaults, resumably; extra arguments are Hydra overrides for every "
                                    "campaign (e.g. tracking=off).")
    rc.add_argument("overrides", nargs="*")
    _out_dir_arg(rc)
    rc.add_argument("--dry-run", action="store_true", help="print the plan; run nothing")
    rc.add_argument("--restart", action="store_true", help="drop a saved plan and plan anew")
    rc.add_argument("--frozen", action="store_true",
                    help="work through the saved plan as it is (a copy without the repository's history, e.g. a "
                         "GPU host, cannot judge freshness: plan where the history is, carry the plan there)")
    rc.add_argument("--within", type=_seconds, metavar="SECONDS",
                    help="start only campaigns that should reach their verdict within SECONDS of this command (their "
                         "last run's time, less what a resumed one has measured, plus "
                         f"{STEP_OVERHEAD_S:.0f} s), taking a later one that fits in place of one that does "
                         "not; those left, and those never timed, stay pending. A budget of a whole device call "
                         f"({WHOLE_CALL_S:.0f} s or more) opens with the first whatever it needs: one longer than a "
                         "call is cut and resumed by the next. A device call's recheck step passes its limit")
    so = sub.add_parser("sources", help="what code counts for a lever's staleness, and what changed since a commit",
                        description="For each file a lever file lists (paths:), the whole file or the definitions "
                                    "whose code counts (the declared ones and what they reach; campaigns/sources.py)"
                                    "; with --since, the entries whose code changed since that commit (what would "
                                    "make a verdict measured there STALE by its own sources).")
    so.add_argument("lever")
    so.add_argument("--since", default=None, help="a commit: list the entries whose code changed since it")
    so.add_argument("--diff", action="store_true", help="with --since: print how the code that counts changed")
    rd = sub.add_parser("render", help="rebuild records from evidence files")
    _out_dir_arg(rd)
    rd.add_argument("--no-plots", action="store_true", help="skip grid.png")
    lg = sub.add_parser("log", help="ingest an evidence file into MLflow")
    lg.add_argument("evidence", help="path to records/campaigns/<id>/evidence.json (or its directory)")
    lg.add_argument("--tracking-uri", default=DEFAULT_URI)
    pr = sub.add_parser("pr", help="print the PR text of a campaign")
    pr.add_argument("campaign_id")
    _out_dir_arg(pr)
    ui = sub.add_parser("ui", help="the MLflow UI on the tracking store")
    ui.add_argument("--tracking-uri", default=DEFAULT_URI)
    ui.add_argument("--port", type=int, default=5000)
    ui.add_argument("--host", default="127.0.0.1")
    return p


def main(argv: list[str] | None = None) -> int:
    from vtengine.confdirs import ConfDirError, take_conf_dir_flag
    try:
        argv = take_conf_dir_flag(sys.argv[1:] if argv is None else argv)
    except ConfDirError as e:
        print(f"vtcampaign: error: {e}", file=sys.stderr)
        return 2
    from campaigns import sweep
    if argv[:1] == ["run"] and sweep.is_sweep(argv[1:]):     # a Hydra multirun: Hydra parses its own flags
        try:
            return sweep.run_sweep(argv[1:])
        except (UsageError, *USER_ERRORS) as e:
            print(f"vtcampaign: error: {e}", file=sys.stderr)
            return 2
    parser = _parser()
    if "_ARGCOMPLETE" in os.environ:            # the shell asks for completions (argcomplete's protocol); it exits
        import argcomplete

        from campaigns import completion
        completion.install(parser, DEFAULT_OUT_DIR)
        argcomplete.autocomplete(parser)
    args, extra = parser.parse_known_args(argv)
    given_out_dir = getattr(args, "out_dir", None)
    if getattr(args, "out_dir", "") is None:
        args.out_dir = str(project_root() / DEFAULT_OUT_DIR)
    try:
        if given_out_dir is not None and not Path(given_out_dir).is_dir():     # a typo must not read as "no campaigns"
            raise UsageError(f"--out-dir {given_out_dir!r} is not a directory; pass a campaigns folder (default: "
                             f"{DEFAULT_OUT_DIR} under the project root)")
        if args.cmd in ("run", "recheck"):
            flags = [x for x in extra if x.startswith("-")]
            if flags:
                raise UsageError(f"unknown option(s) {flags} for {args.cmd}; accepted: "
                                 f"{', '.join(_options(parser, args.cmd))}, and Hydra overrides key=value")
            if args.cmd == "run":
                if args.config_dir:
                    from vtengine.confdirs import set_project_conf
                    set_project_conf(args.config_dir)
                if args.cfg or args.info:
                    return cmd_show(list(args.overrides) + extra, args.cfg, args.resolve, args.info)
                return cmd_run(list(args.overrides) + extra, args.dry_run)
            args.overrides = list(args.overrides) + extra
            return cmd_recheck(args)
        if extra:
            raise UsageError(f"unexpected argument(s) {extra} for {args.cmd}")
        return {"status": cmd_status, "sources": cmd_sources, "render": cmd_render, "log": cmd_log, "pr": cmd_pr,
                "ui": cmd_ui,
                "calibrate": cmd_calibrate, "flip": cmd_flip, "merge": cmd_merge, "decide": cmd_decide,
                "conclude": cmd_conclude, "abandon": cmd_abandon}[args.cmd](args)
    except (UsageError, *USER_ERRORS) as e:
        print(f"vtcampaign: error: {e}", file=sys.stderr)
        return 2


def cmd_show(overrides: list[str], cfg_kind: str | None, resolve: bool, info: str | None) -> int:
    """Hydra's --cfg and --info for a single run. A single run composes with Hydra's compose API (one campaign,
    one process, its own Ctrl-C and exit codes), so it has no ``hydra:`` node to print."""
    if cfg_kind == "hydra":
        raise UsageError("--cfg hydra: a single run composes its config without Hydra's app, so it has no hydra "
                         "node; --cfg job prints the campaign's config, and a sweep (run -m ...) is a Hydra app "
                         "that takes --cfg hydra")
    from omegaconf import OmegaConf

    from vtengine import confdirs
    cfg = compose(overrides)
    if info:
        if info in ("all", "searchpath"):
            print("Config search path (first wins, file by file):")
            for d in confdirs.search_dirs():
                print(f"  {d}{'  (packaged)' if d == confdirs.PACKAGED.resolve() else '  (project)'}")
        if info in ("all", "defaults"):
            print("Defaults chosen:")
            chosen = {"campaign": cfg.campaign.name, "model": f"{cfg.model.name} ({cfg.model.quant})",
                      "grid": cfg.grid.name, "gate": cfg.gate.name, "tracking": cfg.tracking.name,
                      "device": cfg.device}
            for group, name in chosen.items():
                print(f"  {group:<9} {name}")
    if cfg_kind:
        print(OmegaConf.to_yaml(cfg, resolve=resolve), end="")
    return 0


def cmd_run(overrides: list[str], dry_run: bool) -> int:
    cfg = compose(overrides)
    cfg.overrides = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "resume"]
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
        if cfg.resume:
            from campaigns.runner import CampaignError, resume_plan
            try:
                print("# " + resume_plan(cfg, project_root()))
            except CampaignError as e:
                raise UsageError(str(e)) from None
        return 0
    try:
        from campaigns.runner import run_campaign
    except ModuleNotFoundError as e:
        if e.name != "campaigns.runner":
            raise
        raise UsageError("the campaign runner (campaigns/runner.py) is not built yet; "
                         "`vtcampaign run ... --dry-run` shows the composed config") from None
    from campaigns.runner import CampaignError, RunFailed
    try:
        ev = run_campaign(cfg, repo=project_root())
    except RunFailed as e:      # not the user's input: the evidence is saved, a resume goes on from it
        print(f"vtcampaign: run failed: {e}", file=sys.stderr)
        return RUN_FAILED
    except CampaignError as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt as e:
        from campaigns.runner import exit_status
        return exit_status(e)   # 130 Ctrl-C, 143 SIGTERM: the runner saved the evidence and printed how to resume
    return exit_code(ev.decision.verdict if ev.decision else None)


# `vtcampaign run`'s exit status by verdict, for CI and scripts: 0 a decision reached (whichever), 3 the product's own
# checks failed (a gate that cannot fail, a void grid: INVALID; a grid that invents effects: AA-FAIL), 4 the
# candidate is wrong (REJECT-CORRECTNESS); 2 a usage error, 5 the run failed (a server did not start or died: evidence
# kept, resumable), 130 interrupted (Ctrl-C), 143 stopped (SIGTERM)
EXIT_CODES = {"INVALID": 3, "AA-FAIL": 3, "REJECT-CORRECTNESS": 4}
RUN_FAILED = 5


def exit_code(verdict: str | None) -> int:
    return EXIT_CODES.get(verdict or "", 0)


def _options(parser: argparse.ArgumentParser, cmd: str) -> list[str]:
    """The long options a subcommand accepts, as its parser declares them (so an error's list cannot fall behind)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
    return [max(a.option_strings, key=len) for a in sub._actions if a.option_strings and a.dest != "help"]


def _campaign_evidence(out_dir: str, campaign_id: str) -> Path:
    path = Path(out_dir) / campaign_id / "evidence.json"
    if not path.is_file():
        known = [p.parent.name for p in find_evidence(out_dir)]
        raise UsageError(f"unknown campaign id {campaign_id!r} under {out_dir}; "
                         f"accepted: {', '.join(known) or '(none yet)'}")
    return path


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

    if args.strict and not args.at:
        raise UsageError("--strict needs --at REV: the commit whose effect on the verdicts it checks")
    if args.at:
        from campaigns import recheck
        try:
            short, rows = recheck.freshness_at(args.out_dir, args.at)
        except recheck.RecheckError as e:
            raise UsageError(str(e)) from None
        text, lost = recheck.at_report(args.at, short, rows)
        print(text, end="")
        return 3 if args.strict and lost else 0

    from campaigns import context as lever_context
    from campaigns.recheck import latest_aa, latest_binding, measured_on, plan_key
    from campaigns.records import gpu_label
    from vtengine import confdirs, levers

    by = _evidence_by_lever(args.out_dir)
    table = Table(title="levers (default: conf/lever/*.yaml; last campaign: " + args.out_dir + ")")
    for col in ("lever", "measured on", "GPU", "default", "env", "resolved", "byte-exact", "last campaign",
                "verdict", "fresh"):
        table.add_column(col)
    resolved_by: dict = {}

    def resolved(quant):            # the env this shell would give an engine on the row's quantization
        if quant not in resolved_by:
            try:
                resolved_by[quant] = levers.resolve(quant=quant)
            except levers.LeverError as e:
                raise UsageError(str(e)) from None
        return resolved_by[quant]

    resolved(None)
    registry = levers.registry()
    root = confdirs.SOURCE_ROOT
    digests = lever_context.tree_digests(registry, root)
    stale = []
    for name, lever in sorted(registry.items()):
        done = [e for e in by.get(name, []) if e.decision is not None and e.kind == "lever"]
        # one row per model (and pinned levers) the lever was decided on; else its latest rehearsal, or none
        for key, last in sorted(latest_binding(done).items()) or [("", done[-1] if done else None)]:
            fresh = lever_context.freshness(last, root, registry, digests) if last else None
            if fresh is not None and not fresh.fresh and last.decision.binding:
                stale.append((last, fresh))
            quant = lever_context.quant_of(last) if last else None
            now = resolved(quant)       # the row's quantization: its own defaults, with the on presets applied
            table.add_row(name, measured_on(last) if key else "—", gpu_label(last) if key else "—",
                          str(levers.effective_defaults(registry, quant)[name]), lever.env,
                          f"{now.values[name]} ({now.sources[name]})",
                          {True: "yes", False: "no", None: "—"}[last.decision.byte_exact] if last else "—",
                          last.campaign_id if last else "—", last.decision.verdict if last else "—",
                          fresh.label if fresh else "—")
    for ev in latest_aa([e for evs in by.values() for e in evs]).values():      # the grid's self-checks
        fresh = lever_context.freshness(ev, root, registry, digests)
        if not fresh.fresh:
            stale.append((ev, fresh))
    # Piped output gets a wide console so the table is not folded into unreadable columns.
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    if stale:
        console.print(f"{len(stale)} stale binding verdict(s) (`vtcampaign recheck` re-runs them):")
        for ev, f in stale:
            console.print(f"  {plan_key(ev)} {ev.campaign_id} {ev.decision.verdict}: {'; '.join(f.reasons)}")
    unfinished = [e for evs in by.values() for e in evs if e.status == "in-progress"]
    if unfinished:
        import torch

        from campaigns.fingerprint import host_setup
        from campaigns.gitops import GitOpsError, code_digest, open_repo, repo_state
        from campaigns.runner import not_dirt
        here_root = project_root()      # what a resume compares: the repository campaigns run in (cmd_run's repo)
        try:                            # this checkout's code and tree, once for all of them
            here, head = code_digest(here_root), open_repo(here_root).head.commit.hexsha
            tree = repo_state(here_root, ignore=not_dirt(here_root, Path(args.out_dir).resolve()))
        except (GitOpsError, ValueError):
            here = head = tree = None
        setups: dict[str, dict] = {}

        def setup(device_type: str) -> dict:        # this host's, for a campaign run on that kind of device
            kind = "cuda" if device_type == "cuda" and torch.cuda.is_available() else "cpu"
            if kind not in setups:
                setups[kind] = host_setup(kind)
            return setups[kind]
        from campaigns.runner import running_pid
        console.print(f"{len(unfinished)} unfinished campaign(s):")
        for ev in sorted(unfinished, key=lambda e: (e.created, e.campaign_id)):
            pid = running_pid(Path(args.out_dir).resolve() / ev.campaign_id)
            console.print(f"  {unfinished_line(ev, head, here, tree, setup(ev.fingerprint.device_type), pid)}")
    return 0


def code_here(f, head: str | None, here: str | None) -> bool:
    """Whether a campaign of fingerprint ``f`` ran this checkout's code (commit ``head``, code digest ``here``; None
    without a repository): runner.same_code."""
    from campaigns.runner import same_code
    return head is not None and same_code(f, head, here)


def unfinished_line(ev, head: str | None, here: str | None, tree=None,
                    setup: dict | None = None, running: int | None = None) -> str:
    """One unfinished campaign for `vtcampaign status`: how far it came, where it ran, and whether this checkout
    (commit ``head``, code digest ``here``, ``tree``: gitops.repo_state; None without a repository) can resume it, or
    why not, with what the resume checks (runner._check_resumable): the campaign's code (its commit, or one that
    differs in records, results or prose alone), the same tree (clean, or dirty in the same files with the same
    contents), and its device and versions, which ``setup`` (fingerprint.host_setup of this host) either has (resume
    here) or lacks (named). A campaign cut before a code change stays unfinished for good unless resumed on a
    checkout of its commit."""
    from campaigns.records import gpu_label
    from campaigns.runner import SAME_ON_RESUME, left_to_measure, resume_command, tree_change
    f = ev.fingerprint
    done = f"{len(ev.done_legs())} legs, {len(ev.gates)} gate results, on {gpu_label(ev)} at {f.git_short_sha}"
    if running is not None:             # a resume beside it is refused (runner._resumable)
        return f"{ev.campaign_id} ({done}): running now (pid {running}); nothing to do but wait, or stop it"
    if not left_to_measure(ev):         # concluded from what is recorded, anywhere (runner.conclude_recorded)
        return f"{ev.campaign_id} ({done}): only its verdict is left: `vtcampaign conclude {ev.campaign_id}`"
    if not code_here(f, head, here):
        why = ("its code digest was not recorded" if f.code_digest is None else
               "no repository here to compare with" if here is None else "the code has changed since")
        return (f"{ev.campaign_id} ({done}): not resumable on this checkout ({why}); resume on a checkout of "
                f"{f.git_short_sha}, or run the campaign anew")
    change = tree_change(f, tree) if tree is not None else None
    if change is not None:
        return (f"{ev.campaign_id} ({done}): not resumable on this checkout as it is ({change}); make the trees "
                f"match, then `{resume_command(ev)}`")
    lacks = [f"{label} {getattr(f, k)} (here {setup[k]})" for k, label in SAME_ON_RESUME
             if getattr(f, k) != setup[k]] if setup is not None else None
    where = ("on its GPU and versions" if lacks is None else f"on a host with {'; '.join(lacks)}" if lacks
             else "here")
    return f"{ev.campaign_id} ({done}): resume {where} with `{resume_command(ev)}`"


def cmd_sources(args) -> int:
    from campaigns import context as lever_context
    from campaigns import sources
    from vtengine import confdirs, levers
    if args.diff and not args.since:
        raise UsageError("--diff needs --since <commit>: the commit to compare the lever's code with")
    lever = levers.get(args.lever)
    root = confdirs.SOURCE_ROOT
    missing = lever_context.missing_sources(lever, root)
    if missing:
        raise UsageError(f"lever file {lever.path}: paths {missing} are no file under {root}, or name no "
                         "definition in it")

    def read(path: str) -> bytes | None:
        return (root / path).read_bytes() if (root / path).is_file() else None

    for f, names in sources.reached(lever.paths, read).items():
        declared = [sym for path, sym in map(levers.split_entry, lever.paths) if path == f and sym]
        if names is None:
            print(f"{f}: the whole file")
        else:
            print(f"{f}: {', '.join(declared)} and what they reach: {', '.join(names)}")
    if args.since:
        moved = lever_context.changed_sources(root, args.since, lever.paths)
        if moved is None:
            raise UsageError(f"commit {args.since!r} is not in the repository at {root}")
        print(f"changed since {args.since}: {', '.join(moved) if moved else 'nothing'}")
        if args.diff and moved:
            print(lever_context.sources_diff(root, args.since, lever.paths), end="")
    return 0


def cmd_calibrate(args) -> int:
    """Each binding campaign's grid error rates, recomputed with every binding campaign of its device pooled."""
    from rich.console import Console
    from rich.table import Table

    from campaigns import calibrate
    evs = [load_evidence(p) for p in find_evidence(args.out_dir)]
    binding = [e for e in evs if e.status == "complete" and e.decision is not None and e.decision.binding]
    if not binding:
        raise UsageError(f"no binding campaign under {args.out_dir}; calibration needs binding legs")
    table = Table(title=f"grid error rates (policy on {args.sims} simulated campaigns per rate, seed {args.seed})")
    for col in ("campaign", "reps", "comparisons", "false FLIP", "false REJECT", "P(FLIP) +5%", "MDE 80%",
                "A/A separations (mean / 95%)"):
        table.add_column(col)
    for ev in sorted(binding, key=lambda e: e.campaign_id):
        cal = calibrate.calibrate(ev, calibrate.pool_for(ev, evs), sims=args.sims, seed=args.seed)
        if cal is None:
            table.add_row(ev.campaign_id, "—", "—", "no noise model", "", "", "", "")
            continue
        table.add_row(ev.campaign_id, str(settings(ev).grid.reps), str(cal.comparisons),
                      f"{cal.false_flip:.1%}", f"{cal.false_reject:.1%}", f"{cal.power.get('0.05', 0):.1%}",
                      f"> {calibrate.MDE_SEARCH[1]:.0%}" if cal.mde_80 is None else f"{cal.mde_80:.1%}",
                      f"{cal.separations_mean:.2f} / {cal.separations_q95}")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def cmd_flip(args) -> int:
    from campaigns.runner import CampaignError, check_flippable, status_dir
    from campaigns.gitops import flip_commit
    from campaigns.records import render_all, render_summaries_flipped
    from vtengine import levers
    path = _campaign_evidence(args.out_dir, args.campaign_id)
    ev = load_evidence(path)
    try:
        quant = check_flippable(ev, path.parent.parent)
    except CampaignError as e:
        raise UsageError(str(e)) from None
    out_dir = Path(args.out_dir).resolve()
    summaries = status_dir(project_root(), out_dir)
    render_all(out_dir, summaries)
    cdir = path.parent
    files = [cdir / n for n in ("evidence.json", "record.md", "pr.md", "grid.png") if (cdir / n).exists()]
    info = flip_commit(project_root(), ev.lever, ev.decision.new_default, files, (cdir / "pr.md").read_text(),
                       lever_dir=levers.lever_file(ev.lever).parent, campaign_id=ev.campaign_id, quant=quant,
                       rendered=lambda copy: render_summaries_flipped(out_dir, summaries, ev.lever, copy))
    from campaigns.gitops import clear_for_merge
    cleared = clear_for_merge(project_root(), info["commit"])
    scope = (f" on {quant} (its own default there: refuted on another quantization, already its own, or some of "
             "its sources run on other quantizations alone)" if quant else "")
    print(f"flip of {ev.lever} to {ev.decision.new_default}{scope} committed on {info['branch']} "
          f"({info['commit'][:7]}); merge it to change the default (`vtcampaign merge {info['branch']}`: git merge "
          f"--no-ff, with the summaries rendered again)"
          + (f"; {len(cleared)} working copies of its records put back as HEAD has them, so the merge can write "
             "them" if cleared else ""))
    return 0


def cmd_merge(args) -> int:
    import tempfile
    from campaigns.gitops import branch_evidence, flip_branch, merge_flip
    from campaigns.records import render_all
    from campaigns.runner import CampaignError, check_flippable, status_dir
    root = project_root()
    branch = args.branch if args.branch.startswith("row/") else flip_branch(args.branch)
    out_dir = Path(args.out_dir).resolve()
    found = branch_evidence(root, branch)
    if not found:
        raise UsageError(f"{branch} carries no campaign evidence (records/campaigns/<id>/evidence.json): not a flip "
                         "branch of `vtcampaign flip`; merge it with git")
    for _path, data in found:        # a flip merged since this one was made may have staled it
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "evidence.json").write_bytes(data)
            ev = load_evidence(Path(tmp) / "evidence.json")
        try:
            check_flippable(ev, out_dir)
        except CampaignError as e:
            raise UsageError(f"{branch} is not merged: {e}") from None

    def render(conflicted: list[str]) -> list[Path]:
        ids = {Path(p).parent.name for p in conflicted if Path(p).parent.parent.name == "campaigns"}
        plots = any(Path(p).name == "grid.png" for p in conflicted)     # a conflicted plot is drawn again too
        return render_all(out_dir, status_dir(root, out_dir), plots=plots, only=ids)

    info = merge_flip(root, branch, render)
    print(f"merged {branch} ({info['commit'][:7]}): the summaries rendered again from the merged evidence and lever "
          f"files" + (f"; conflicts settled that way: {', '.join(info['conflicted'])}" if info["conflicted"] else ""))
    return 0


REDECIDED = "decided again by `vtcampaign decide`"


def cmd_decide(args) -> int:
    from campaigns.records import render_all
    from campaigns.runner import status_dir
    if bool(args.all) == bool(args.campaign_id):
        raise UsageError("decide takes one campaign id or --all (every complete campaign under --out-dir), not "
                         f"{'both' if args.all else 'neither'}")
    if args.all:
        paths = [p for p in find_evidence(args.out_dir) if _decidable(load_evidence(p))]
    else:
        path = _campaign_evidence(args.out_dir, args.campaign_id)
        ev = load_evidence(path)
        if not _decidable(ev):
            raise UsageError(_not_decidable(ev))
        paths = [path]
    changed, behind = [], []
    for p in paths:
        ev = _decide_again(p)
        if ev is not None:
            changed.append(ev)
        elif _record_behind(p):         # a decide (or conclude) cut between saving the evidence and rendering
            behind.append(load_evidence(p))
            print(f"{behind[-1].campaign_id}: its record is behind its evidence; rendered again")
    if args.all:
        print(f"{len(changed)} of {len(paths)} complete campaigns decided again, the rest unchanged")
    if not changed and not behind:
        return 0
    out_dir = Path(args.out_dir).resolve()
    render_all(out_dir, status_dir(project_root(), out_dir), only=[ev.campaign_id for ev in changed + behind])
    changed += behind                   # and re-logged: the store may be behind as the record was
    for ev in changed:          # the stores that hold a campaign follow its verdict (an old tag would mislead)
        _relog(ev, out_dir / ev.campaign_id)
    return 0


def _relog(ev, cdir: Path) -> None:
    """Log ``ev`` again in every store that holds it (tracking.stores: the local default and the campaign's own);
    one out of reach is said, with the command that logs it later, and costs nothing else."""
    from campaigns.tracking import relog_if_logged, stores
    for uri in stores(ev):
        try:
            run_id = relog_if_logged(ev, cdir, uri)
            if run_id:
                print(f"MLflow: {uri} re-logged {ev.campaign_id}, run {run_id}")
        except Exception as e:  # MLflow's errors are many types; the evidence and records are updated already
            print(f"{ev.campaign_id}: MLflow at {uri} not updated ({type(e).__name__}: {e}); `vtcampaign log "
                  f"{cdir / 'evidence.json'} --tracking-uri {uri}` logs it again", file=sys.stderr)


def _decidable(ev) -> bool:
    return ev.status == "complete" and ev.decision is not None


def _record_behind(path: Path) -> bool:
    """Whether the campaign's record.md or pr.md differs from what its evidence renders to now."""
    from campaigns.records import render_pr, render_record
    ev, cdir = load_evidence(path), path.parent
    return any(not (cdir / name).is_file() or (cdir / name).read_text() != text
               for name, text in (("record.md", render_record(ev)), ("pr.md", render_pr(ev))))


def _not_decidable(ev) -> str:
    """Why ``decide`` refuses ``ev``, with the command that applies to its state."""
    from campaigns.runner import left_to_measure, resume_command
    name = settings(ev).campaign.name
    if ev.status == "abandoned":
        return (f"campaign {ev.campaign_id} was abandoned ({ev.abandoned.get('why', 'no reason given')}): it has no "
                f"verdict to decide again; run the campaign anew (vtcampaign run campaign={name})")
    if ev.status == "complete":
        return (f"campaign {ev.campaign_id} is marked complete but holds no decision: `vtcampaign conclude "
                f"{ev.campaign_id}` decides it from its recorded gates and legs")
    left = left_to_measure(ev)
    if not left:
        return (f"campaign {ev.campaign_id} is in progress with every gate and leg recorded: `vtcampaign conclude "
                f"{ev.campaign_id}` gives it its verdict")
    return (f"campaign {ev.campaign_id} is in progress ({'; '.join(left)} left): finish it first "
            f"(`{resume_command(ev)}`)")


def _decide_again(path: Path):
    """Apply this checkout's policy to one campaign's evidence; save and return it where any field of the decision
    a record prints differs (verdict, rule, reasons, default, byte-exactness, token safety, headline, effect note),
    else None. The earlier verdict is kept in the reasons, with where and when the campaign was decided before."""
    import dataclasses

    from campaigns import policy
    from campaigns.evidence import save_evidence, utc_now
    from campaigns.gitops import repo_state
    from campaigns.runner import CONCLUDED
    ev = load_evidence(path)
    before = ev.decision
    after = policy.decide(ev)
    history = (REDECIDED, CONCLUDED)        # where and when it was decided: not the policy's reasons, kept as they are
    kept = [r for r in before.reasons if not r.startswith(history)]
    if dataclasses.asdict(after) == {**dataclasses.asdict(before), "reasons": kept}:
        print(f"{ev.campaign_id}: {before.verdict}, unchanged by this checkout's policy")
        return None
    fields = [f.name for f in dataclasses.fields(after) if getattr(after, f.name) != getattr(before, f.name)
              and f.name != "reasons"] + (["reasons"] if after.reasons != kept else [])
    sha = repo_state(project_root()).short_sha
    after.reasons += [r for r in before.reasons if r.startswith(history)]         # the history of earlier reads
    after.reasons.append(f"{REDECIDED} on {utc_now()[:10]} with the policy at {sha}; it had read {before.verdict}"
                         + (f" ({'; '.join(kept[:2])})" if kept else ""))
    ev.decision = after
    save_evidence(ev, path.parent)
    print(f"{ev.campaign_id}: {before.verdict} -> {after.verdict} ({after.headline}); changed: {', '.join(fields)}")
    return ev


def _conclude_recorded(campaign_id: str, out_dir: str):
    from campaigns.runner import CampaignError, conclude_recorded
    try:
        return conclude_recorded(campaign_id, project_root(), out_dir)
    except CampaignError as e:
        raise UsageError(str(e)) from None


def cmd_conclude(args) -> int:
    ev = _conclude_recorded(args.campaign_id, args.out_dir)
    print(f"{ev.campaign_id}: {ev.decision.verdict} ({ev.decision.headline})")
    return 0


def cmd_abandon(args) -> int:
    from campaigns import records
    from campaigns.gitops import code_digest, open_repo
    from campaigns.runner import CampaignError, abandon, left_to_measure, status_dir
    ids = list(args.campaign_ids)
    if args.unresumable:        # status's "not resumable on this checkout": the code differs (not only the tree)
        root = project_root()
        try:
            here, head = code_digest(root), open_repo(root).head.commit.hexsha
        except (GitOpsError, ValueError) as e:
            raise UsageError(f"abandon --unresumable compares each campaign's code with this checkout's, and "
                             f"{root} has none to compare ({e}); name the campaigns instead") from None
        found = [e.campaign_id for evs in _evidence_by_lever(args.out_dir).values() for e in evs
                 if e.status == "in-progress" and not code_here(e.fingerprint, head, here)
                 and left_to_measure(e)]      # one with only its verdict left: `vtcampaign conclude` ends it
        if not found and not ids:
            print("abandon --unresumable: every unfinished campaign here can resume on this checkout's code (or "
                  "only needs `vtcampaign conclude`); nothing abandoned")
            return 0
        ids += [cid for cid in found if cid not in ids]
    if not ids:
        raise UsageError("abandon: name the campaigns (CAMPAIGN_ID ...) or pass --unresumable; "
                         "`vtcampaign status` lists the unfinished ones")
    try:
        done = abandon(ids, args.out_dir, args.why)
    except CampaignError as e:
        raise UsageError(str(e)) from None
    for ev in done:
        print(f"{ev.campaign_id}: abandoned ({len(ev.legs)} legs and {len(ev.gates)} gate results kept)")
    try:            # the evidence says abandoned now; what follows derives from it and can be redone
        records.render_all(args.out_dir, status_dir(project_root(), Path(args.out_dir).resolve()), only=ids)
    except Exception as e:
        raise UsageError(f"the records were not rendered again ({type(e).__name__}: {e}); `vtcampaign render` "
                         "rebuilds them from the evidence") from None
    for ev in done:                 # a tracking store out of reach costs the logging, not the abandon
        _relog(ev, Path(args.out_dir) / ev.campaign_id)
    return 0


def cmd_recheck(args) -> int:
    from campaigns import recheck
    from campaigns.records import short_gpu
    from campaigns.runner import CampaignError, RunFailed, concluded_here, run_campaign, share_measured
    recheck.check_extra(args.overrides)
    if args.overrides:                  # a mistyped key fails here, not when the first campaign starts
        compose(["campaign=gqa_swap", *args.overrides, f"out_dir={args.out_dir}"])
    if args.dry_run:
        state = recheck.plan(args.out_dir, restart=args.restart, frozen=args.frozen)
        if not state["entries"]:
            print("recheck: no stale binding verdict")
        for e in state["entries"]:
            took = f"~{e['took_s'] / 60:.1f} min" if e.get("took_s") else "time unknown"
            if e.get("gpu"):        # the last run's device: its time, and the GPU the verdict moves from
                took += f" on {short_gpu(e['gpu'])}"
            key = e.get("key", e["lever"])
            words = " ".join(shlex.quote(o) for o in [*e["overrides"], *args.overrides])   # pasted into a shell
            print(f"{e['status']:<8} {key:<13} {e['stale']} ({took} last time)  ->  vtcampaign run {words}  "
                  f"({'; '.join(e['why'])})")
        todo = [e for e in state["entries"] if e["status"] != "done"]
        if todo:
            # a verdict is renewed only on the GPU it was measured on (recheck.run leaves the others pending): one
            # list of calls per GPU, in the plan's order, so a session takes the list of the GPU it was lent
            by_gpu: dict[str, list[tuple[str, int] | None]] = {}
            for e in todo:
                gpu = short_gpu(e["gpu"]) if e.get("gpu") else "a GPU not recorded"
                by_gpu.setdefault(gpu, []).append(recheck.device_step(e, args.overrides))
            known = [s for steps in by_gpu.values() for s in steps if s]
            print(f"device calls by the GPU each verdict was measured on (each step: its last run's gates and legs + "
                  f"{recheck.STEP_OVERHEAD_S:.0f} s to start and conclude; a call: at most {recheck.DEVICE_CALL_S} s "
                  "of steps; a step in two calls resumes in the second):")
            for gpu, all_steps in by_gpu.items():
                steps = [s for s in all_steps if s]
                calls = recheck.device_calls(steps)
                untimed = len(all_steps) - len(steps)
                print(f"on {gpu}: {len(calls)} call(s), ~{sum(need for _, need in steps) / 60:.0f} min"
                      + (f"; {untimed} without a timing (no timed legs last time: run by its command above)"
                         if untimed else ""))
                for i, call in enumerate(calls, 1):
                    print(f"  {i}: bash scripts/h200_session.sh " + " ".join(f'"{step}"' for step in call))
            print(f"{len(todo)} to run: ~{sum(need for _, need in known) / 60:.0f} min of device steps at their last "
                  "durations" + (f" ({len(todo) - len(known)} unknown)" if len(known) < len(todo) else ""))
            extra = (":" + " ".join(args.overrides)) if args.overrides else ""
            print(f'or, on whichever GPU comes, "{recheck.DEVICE_CALL_S}@recheck{extra}" steps (recheck --frozen '
                  f"--within {recheck.DEVICE_CALL_S}): that GPU's entries in the plan's order, each started only "
                  "where it should end in what is left of the step (about as the calls above are packed)")
        return 0

    def run_one(overrides, on_start):
        cfg = compose(overrides + [f"out_dir={args.out_dir}"])
        try:
            return run_campaign(cfg, repo=project_root(), on_start=on_start)
        except RunFailed:
            raise                           # the run's own failure: exit 5 below, not a usage error
        except CampaignError as e:
            # a plan entry's own campaign refused to resume (code, tree or setup changed): recheck cannot start
            # another in its place by itself, the user decides to drop its legs
            begun = next((o.split("=", 1)[1] for o in overrides if o.startswith("resume=") and o != "resume=auto"),
                         None)
            refused = str(e).startswith("resume=") and ("would not compare" in str(e) or "config differs" in str(e))
            hint = (f"; recheck resumes the campaign its plan began: to run this entry afresh, `vtcampaign abandon "
                    f"{begun} --why \"...\"` and run recheck again" if begun and refused else "")
            raise UsageError(f"{e}{hint}") from None

    def concluded(overrides):
        return concluded_here(compose(overrides + [f"out_dir={args.out_dir}"]), project_root())

    def measured(overrides):
        return share_measured(compose(overrides + [f"out_dir={args.out_dir}"]), project_root())
    try:
        # on the device (--frozen) a resume concludes without starting servers anyway, on the device it ran on
        from campaigns.config import cuda_available
        from campaigns.fingerprint import device_info
        asked = next((o.split("=", 1)[1] for o in reversed(args.overrides) if o.startswith("device=")), "auto")
        device = "cuda" if asked == "cuda" or (asked == "auto" and cuda_available()) else "cpu"
        recheck.run(args.out_dir, args.overrides, run_one, restart=args.restart, frozen=args.frozen,
                    conclude_one=None if args.frozen else lambda cid: _conclude_recorded(cid, args.out_dir),
                    gpu=device_info(device)[1], concluded=concluded, within=args.within, measured=measured)
    except KeyboardInterrupt as e:
        from campaigns.runner import exit_status
        print("recheck interrupted; run `vtcampaign recheck` again to continue where it stopped", file=sys.stderr)
        return exit_status(e)
    except RunFailed as e:
        print(f"vtcampaign: run failed: {e}; `vtcampaign recheck` again resumes it", file=sys.stderr)
        return RUN_FAILED
    return 0


def cmd_render(args) -> int:
    from campaigns.records import render_all
    from campaigns.runner import status_dir
    if not Path(args.out_dir).is_dir():
        raise UsageError(f"no campaigns directory {args.out_dir!r}; pass --out-dir (default {DEFAULT_OUT_DIR})")
    # the summaries go where a run writes them: records/ for the project's own campaigns, else beside a scratch
    # directory's (a rehearsal's render must not overwrite records/STATUS.md with its rows)
    written = render_all(args.out_dir, status_dir(project_root(), Path(args.out_dir)), plots=not args.no_plots)
    print(f"rendered {len(written)} files from {len(find_evidence(args.out_dir))} evidence file(s)")
    return 0


def cmd_log(args) -> int:
    from campaigns.tracking import log_evidence
    path = Path(args.evidence)
    ev = load_evidence(path)
    try:
        run_id = log_evidence(ev, args.tracking_uri, campaign_dir=path if path.is_dir() else path.parent)
    except Exception as e:          # an unreachable server, a bad URI: MLflow's own errors, of many types
        raise UsageError(f"could not log {ev.campaign_id} to {args.tracking_uri!r}: {type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}; the evidence is unchanged") from None
    print(f"logged {ev.campaign_id} to {args.tracking_uri} (experiment vtcampaign/{ev.lever}, parent run {run_id})")
    return 0


def cmd_pr(args) -> int:
    from campaigns.records import render_pr
    print(render_pr(load_evidence(_campaign_evidence(args.out_dir, args.campaign_id))), end="")
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
