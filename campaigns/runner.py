"""One campaign, end to end: preflight -> gates per arm -> servers -> async gate -> grid legs -> statistics ->
decision -> evidence -> records, MLflow, PR text, optional flip commit.

Evidence is written after every gate and every leg (atomically), so Ctrl-C or a crash keeps everything finished;
``resume=<campaign id>`` reloads it and runs only what is missing, and ``resume=auto`` finds it: the newest
unfinished campaign of this lever with the same composed config and code (this commit, or one that changed only
records, results or prose since), else a new campaign (what a campaign spread over several time-limited commands
wants). Everything after the evidence file is a pure function
of it (``vtcampaign render`` rebuilds the records from evidence alone).
"""
from __future__ import annotations

import os
import shlex
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from campaigns import calibrate
from campaigns import context as lever_context
from campaigns import fingerprint as fp
from campaigns import grid as gridmod
from campaigns import policy, recheck, records
from campaigns.config import config_diff, config_hash, settings
from campaigns.evidence import (Evidence, EvidenceError, Fingerprint, evidence_head, find_evidence, load_evidence,
                                new_campaign_id, new_evidence, save_evidence, utc_now)
from campaigns.gates import IN_PROCESS_GATES, SERVER_GATES, GateContext, run_gate, skipped
from campaigns.gitops import RUN_OUTPUTS
from vtengine import confdirs, levers

console = Console(stderr=True)
# what running campaigns writes into the tree, which is no dirt: records, MLflow's files, Hydra's sweep directories


class CampaignError(RuntimeError):
    """A campaign could not run (a server failed to start, a resume id is unknown...): one clear message."""


class RunFailed(CampaignError):
    """The run stopped on a failure of what it runs (a server that did not start, or died mid-grid), not of its
    input: its evidence is saved and it resumes (`vtcampaign run` exits 5, not a usage error's 2)."""


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=False)


def _preflight(cfg: DictConfig, repo: Path, out_dir: Path) -> Evidence:
    lever = levers.get(cfg.campaign.lever)
    missing = lever_context.missing_sources(lever, confdirs.SOURCE_ROOT)
    if missing:
        raise CampaignError(f"lever file {lever.path}: paths {missing} are no file under {confdirs.SOURCE_ROOT}, "
                            "or name no definition in it; list the lever's own sources (repository-relative files, "
                            "or file::definition), or its verdicts could never go STALE when they change")
    kind = "aa" if cfg.aa else "lever"
    arms = fp.make_arms(lever.name, cfg.campaign.arms.baseline, list(cfg.campaign.arms.candidates), aa=cfg.aa)
    fpr = fp.collect(repo, cfg.device, lever.env, arms, config_hash(cfg), ignore_dirty=not_dirt(repo, out_dir),
                     pinned=_pinned_env(cfg))
    check_tree(fpr, cfg)
    cid = new_campaign_id(out_dir, utc_now()[:10], lever.name, fpr.git_short_sha, kind)
    ev = new_evidence(OmegaConf.to_container(cfg, resolve=True), fpr, arms, cid, kind=kind)
    # the lever sources measured: a later change to them makes the verdict STALE (campaigns/context.py)
    ev.lever_digests = lever_context.tree_digests(levers.registry(), confdirs.SOURCE_ROOT)
    ev.lever_summary = " ".join((lever.summary or "").split())
    return ev


def check_tree(fpr, cfg: DictConfig) -> None:
    """A campaign that could bind (a binding grid on CUDA) refuses a dirty tree unless allow_dirty=true: its
    verdict must name the code it measured, and a dirty one could only end NON-BINDING after minutes of device
    time. A rehearsal (CPU, or a rehearsal grid) runs on a work in progress."""
    if fpr.dirty and not cfg.allow_dirty and fpr.device_type == "cuda" and cfg.grid.binding:
        files = ", ".join(fpr.dirty_files[:8]) + (f" and {len(fpr.dirty_files) - 8} more"
                                                   if len(fpr.dirty_files) > 8 else "")
        raise CampaignError(f"the git tree is dirty ({files}): a binding campaign must measure committed code. "
                            "Commit or stash the change, or pass allow_dirty=true (the verdict is then NON-BINDING)")


def not_dirt(repo: Path, out_dir: Path) -> tuple[str, ...]:
    """What a campaign writes itself (its evidence, the run outputs): never counted as a dirty tree."""
    own = str(out_dir.relative_to(repo)) if out_dir.is_relative_to(repo) else ""
    return tuple(i for i in (own, *RUN_OUTPUTS) if i)


def _save(ev: Evidence, cdir: Path) -> None:
    save_evidence(ev, cdir)


def run_campaign(cfg: DictConfig, repo: Path | str = ".", inject: dict[str, Any] | None = None,
                 on_start: Callable[[str], None] | None = None) -> Evidence:
    """Run (or resume) the campaign ``cfg`` (a composed AppConfig). ``inject``: deliberate faults for the product's
    own tests, e.g. {"inert_arm": "on"} runs that arm with the lever forced to the baseline value, {"broken_arm":
    "on"} runs its in-process engine with the lever's kernel broken. ``on_start`` gets the campaign id as soon as
    its evidence file exists (recheck keeps it to resume)."""
    with _ctrl_c_raises():
        return _run_campaign(cfg, repo, inject, on_start)


class Stopped(KeyboardInterrupt):
    """SIGTERM (a scheduler's time limit or preemption, `kill`, a closed session) while a campaign runs: handled as
    Ctrl-C is (servers stopped, evidence kept, MLflow's run ended KILLED); the command exits 128 + signum."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


def exit_status(e: KeyboardInterrupt) -> int:
    """A stopped campaign's exit status, as a shell reports a signal: 130 for Ctrl-C, 143 for SIGTERM."""
    return 128 + getattr(e, "signum", signal.SIGINT)


@contextmanager
def _ctrl_c_raises():
    """While a campaign runs, Ctrl-C (SIGINT) raises KeyboardInterrupt wherever the main thread is, inside a leg's
    or a gate's asyncio loop too. asyncio.run's own handler only cancels the running task, and a cancellation
    absorbed below it lets the leg return and the campaign go on: in CI a Ctrl-C sent mid-grid was lost and the
    campaign ran to its end. With this handler installed asyncio.run leaves SIGINT alone (it only takes over the
    default handler), and the interrupted leg is simply not recorded. SIGTERM raises Stopped, a KeyboardInterrupt:
    by default it killed the runner outright, leaving its servers to die with it and MLflow's run RUNNING. While a
    finished leg or gate is being recorded (``_recording``) the first signal waits for the record to be complete."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum, frame):
        _raise_or_hold(KeyboardInterrupt())

    def raise_stopped(signum, frame):
        _raise_or_hold(Stopped(signum))

    previous = signal.signal(signal.SIGINT, raise_interrupt), signal.signal(signal.SIGTERM, raise_stopped)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


_held: list = []            # while a result is being recorded: [pending interrupt or None] (main thread only)


def _raise_or_hold(e: KeyboardInterrupt) -> None:
    """Raise ``e`` now, or hold it while a record is being written. A second signal while one is held raises at
    once: the record may be stuck (MLflow retries an unreachable server for minutes), and a second Ctrl-C, or a
    scheduler's SIGTERM after a first, must still stop the campaign."""
    if _held and _held[0] is None:
        _held[0] = e
        return
    raise e


@contextmanager
def _recording():
    """A gate's or a leg's record as one step: appended to the evidence, saved, and logged to MLflow as a child run.
    Under ``_ctrl_c_raises`` (a campaign's run), a Ctrl-C or SIGTERM that comes in between waits until all three
    are done and is raised then; an error of the step itself goes up as it is, not masked by the held signal.
    Before, a signal between the save and the MLflow log left a leg in the evidence that MLflow never had (the
    interruption test caught it under load: 3 legs recorded, 2 leg runs)."""
    if threading.current_thread() is not threading.main_thread():     # signals reach the main thread only
        yield
        return
    outer = bool(_held)
    if not outer:
        _held.append(None)
    try:
        yield
    except BaseException:
        if not outer:
            _held.pop()
        raise
    if not outer:
        pending = _held.pop()
        if pending is not None:
            raise pending


@dataclass
class _Run:
    """One campaign run's state, handed from phase to phase."""
    cfg: DictConfig
    repo: Path
    out_dir: Path
    cdir: Path
    ev: Evidence
    ctx: GateContext
    gates: list[str]                    # the gates to run (inapplicable ones already recorded as skipped)
    inject: dict[str, Any]
    t_start: float
    live: Any                           # tracking.LiveCampaign: the MLflow runs while the campaign runs


def _run_campaign(cfg: DictConfig, repo: Path | str, inject: dict[str, Any] | None,
                  on_start: Callable[[str], None] | None = None) -> Evidence:
    """The phases: open (preflight or resume) -> in-process gates -> servers (server gates, then the grid unless
    the gates already fixed the verdict) -> conclude (policy, records, tracking, flip)."""
    run = _open(cfg, Path(repo).resolve(), dict(inject or {}), on_start)
    try:
        _measure(run)
        _conclude(run)
    except KeyboardInterrupt:
        run.live.end("KILLED")
        raise
    except BaseException:
        run.live.end("FAILED")
        raise
    return run.ev


def _measure(run: _Run) -> None:
    """Gates and grid: what is left of them (all of it, on a new campaign)."""
    try:
        _in_process_gates(run)
        why = _gates_decide(run.ev)
        if why and "async_parity" not in run.gates:
            console.print(f"[yellow]grid skipped:[/] {why}")
        elif _served(run):
            console.print("resume: every server gate, leg and server report is recorded already; concluding "
                          "without starting the servers")
        else:
            _serve(run)         # the server gates may complete what the in-process ones left open (a fix's RED)
    except KeyboardInterrupt:
        _save(run.ev, run.cdir)
        console.print(f"[red]interrupted[/]: {len(run.ev.legs)} legs kept; continue with "
                      f"`{resume_command(run.ev)}` (or resume=auto in place of the id)")
        raise
    except gridmod.GridError as e:
        _save(run.ev, run.cdir)
        raise RunFailed(str(e) + memory_hint(run.ev, str(e))) from None
    finally:
        run.ctx.release_engines()


def conclude_recorded(campaign_id: str, repo: Path | str = ".", out_dir: Path | str | None = None) -> Evidence:
    """Conclude a campaign whose every gate, leg and server report is recorded but whose run stopped before its
    verdict (a device command's time limit landed there), on any host and at any commit: the policy, the records,
    tracking and the flip as the campaign was configured. Nothing is measured, so the device, versions and commit
    of the run need not be here; the verdict's reasons say where and when it was concluded. A campaign with
    anything left to measure is refused, naming what, with the command that resumes it where it ran."""
    repo = Path(repo).resolve()
    out_dir = Path(out_dir).resolve() if out_dir is not None else repo / "records" / "campaigns"
    cdir = out_dir / campaign_id
    if not (cdir / "evidence.json").is_file():
        known = sorted(p.parent.name for p in find_evidence(out_dir))
        raise CampaignError(f"unknown campaign id {campaign_id!r} under {out_dir}; accepted: "
                            f"{', '.join(known) or '(none yet)'}")
    ev = load_evidence(cdir)
    _refuse_abandoned(ev)
    if ev.status == "complete":
        verdict = ev.decision.verdict if ev.decision else "no verdict"
        raise CampaignError(f"{campaign_id} is complete already ({verdict}); `vtcampaign decide {campaign_id}` "
                            "applies this checkout's policy to it again")
    cfg = _recorded_cfg(ev)
    gates = _gates_to_run(cfg, ev)
    left = left_to_measure(ev)
    if left:
        raise CampaignError(f"{campaign_id} has measurements left ({'; '.join(left)}); resume it where it ran "
                            f"(its device and the code of {ev.fingerprint.git_short_sha}): `{resume_command(ev)}`")
    from campaigns.gitops import repo_state
    run = _Run(cfg, repo, out_dir, cdir, ev, _gate_context(cfg, ev, cdir, {}), gates, {}, time.perf_counter(),
               _live(cfg, off=True))   # nothing runs: the end logs the campaign whole, as a run's end does
    here = repo_state(repo).short_sha
    ran = f"{ev.fingerprint.git_short_sha} on {ev.fingerprint.device_name}"
    _conclude(run, note=f"{CONCLUDED} {utc_now()[:10]} at {here} from the recorded gates and legs (the run at "
                        f"{ran} stopped before its verdict); the conclusion measured nothing")
    return ev


CONCLUDED = "concluded on"       # the reason conclude_recorded adds: where and when, not the policy's own


def _recorded_cfg(ev: Evidence) -> DictConfig:
    """The campaign's composed config as recorded, with the defaults of keys an older campaign did not have."""
    return OmegaConf.structured(settings(ev))


def left_to_measure(ev: Evidence) -> list[str]:
    """What an unfinished campaign has yet to measure (gates per arm, legs, server reports), by the plan of its
    own recorded config; [] when only its conclusion is missing (``conclude_recorded``)."""
    cfg = _recorded_cfg(ev)
    gates = [g for g in cfg.campaign.gates if g not in dict(cfg.campaign.inapplicable)]
    left = [f"gate {g} on {a.name}" for g in gates if g in IN_PROCESS_GATES for a in ev.arms
            if ev.gate(g, a.name) is None]
    if left or (_gates_decide(ev) and "async_parity" not in gates):
        return left
    return _unserved(ev, cfg, [g for g in gates if g in SERVER_GATES])


def _open(cfg: DictConfig, repo: Path, inject: dict[str, Any], on_start: Callable[[str], None] | None) -> _Run:
    """A new campaign (preflight) or the one ``resume=`` names, its evidence saved, and the gate context."""
    if not _cuda():
        import torch
        torch.set_num_threads(1)    # tiny CPU models: one thread beats two on a small, shared host
    out_dir = (repo / cfg.out_dir).resolve()
    t_start = time.perf_counter()
    if cfg.resume == "auto":
        found = _unfinished(cfg, repo, out_dir)
        console.print(f"resume=auto: resuming {found}" if found else
                      "resume=auto: no unfinished campaign of this config and code; a new one")
        cfg = cfg.copy()
        OmegaConf.update(cfg, "resume", found, force_add=True)
    if cfg.resume:
        cdir = out_dir / str(cfg.resume)
        ev = _resumable(cfg, cdir, repo, out_dir)
        ev.status = "in-progress"
        console.print(f"[bold]resuming[/] {ev.campaign_id}: {len(ev.gates)} gate results and {len(ev.legs)} legs kept")
    else:
        ev = _preflight(cfg, repo, out_dir)
        cdir = out_dir / ev.campaign_id
    _save(ev, cdir)
    (cdir / "runner.pid").write_text(f"{os.getpid()}\n")     # which process runs it (a sweep's job, to stop it)
    if on_start:
        on_start(ev.campaign_id)
    console.print(f"[bold]campaign[/] {ev.campaign_id}  lever={ev.lever}  arms="
                  f"{[f'{a.name}({a.role})' for a in ev.arms]}  model={cfg.model.name}/{cfg.model.quant}  "
                  f"device={ev.fingerprint.device_name}  evidence={cdir}")
    ctx = _gate_context(cfg, ev, cdir, inject)
    gates = _gates_to_run(cfg, ev)     # records the inapplicable ones as skipped, before MLflow hears of it
    live = _live(cfg)
    live.start(ev, cdir)
    return _Run(cfg, repo, out_dir, cdir, ev, ctx, gates, inject, t_start, live)


def _live(cfg: DictConfig, off: bool = False):
    """The campaign's live MLflow runs (tracking.LiveCampaign); inert under tracking=off (or ``off``)."""
    from campaigns import tracking
    on = cfg.tracking.enabled and not off
    return tracking.LiveCampaign(str(cfg.tracking.uri) if on else None,
                                 lambda msg: console.print(f"[yellow]{msg}[/]"))


def _gate_context(cfg: DictConfig, ev: Evidence, cdir: Path, inject: dict[str, Any]) -> GateContext:
    return GateContext(lever=ev.lever, arms=ev.arms, model=str(cfg.model.name), quant=str(cfg.model.quant),
                       device=ev.fingerprint.device_type, gate_cfg=cfg.gate,
                       near_tie_max_mnats=float(cfg.campaign.policy.near_tie_max_mnats), work_dir=cdir,
                       inert_arm=inject.get("inert_arm"), broken_arm=inject.get("broken_arm"),
                       with_levers=dict(cfg.campaign.with_levers), cpu_max_model_len=_cpu_max_model_len(cfg))


def _gates_to_run(cfg: DictConfig, ev: Evidence) -> list[str]:
    """The campaign's gates less the inapplicable ones, which are recorded as skipped with their reason."""
    gates = list(cfg.campaign.gates)
    unknown = sorted(set(gates) - set(IN_PROCESS_GATES) - set(SERVER_GATES))
    if unknown:
        raise CampaignError(f"unknown gate(s) {unknown}; accepted: {list(IN_PROCESS_GATES + SERVER_GATES)}")
    exempt = dict(cfg.campaign.inapplicable)
    for g in gates:                 # declared inapplicable by the campaign or the lever: recorded with the reason
        for a in ev.arms:
            if g in exempt and ev.gate(g, a.name) is None:
                ev.gates.append(skipped(g, a, f"inapplicable: {exempt[g]}"))
    return [g for g in gates if g not in exempt]


def _in_process_gates(run: _Run) -> None:
    """The gates that run on in-process engines, then the async gate's anchors; the engines are freed after, so
    they never sit on the GPU beside the servers."""
    _run_gates(run.ev, run.cdir, run.ctx, [g for g in run.gates if g in IN_PROCESS_GATES],
               bool(run.cfg.gate.self_check), run.live.gate)
    if "async_parity" in run.gates:
        from campaigns.gates.parity import sync_reference
        for arm in run.ev.arms:
            sync_reference(run.ctx, arm)
    run.ctx.release_engines()


def server_order(ev: Evidence) -> list:
    """The arms in the order their servers start: a permutation drawn from the campaign id (the same on every
    resume). Two servers of one build run at steadily different speeds, the second one started slower in every A/A
    pair measured (0.4-0.7% on TPOT at c1); with the baseline always first that offset fell on every candidate, a
    bias. Drawn, it falls on either arm, as the calibration's null assumes."""
    import random
    arms = list(ev.arms)
    random.Random(ev.campaign_id).shuffle(arms)
    return arms


def _serve(run: _Run) -> None:
    """Every arm's server: the server gates, then the grid (unless the gates, the server gates included, fixed the
    verdict), then what the servers report (peak memory, lever context). The servers run side by side (together)
    unless grid.residency says alternate, or (auto) they do not fit: then one at a time (_serve_alternating)."""
    ev, cfg = run.ev, run.cfg
    stale = gridmod.stop_stale_servers(run.cdir)        # an earlier run killed with SIGKILL may have left some
    if stale:
        console.print(f"[yellow]stopped {len(stale)} server(s) an earlier run of {ev.campaign_id} left running: "
                      f"{stale}[/]")
    order = server_order(ev)
    ev.server_order = [a.name for a in order]
    residency = str(cfg.grid.residency)
    if residency != "alternate" and ev.residency != "alternate":
        try:
            _serve_together(run, order)
            return
        except gridmod.GridError as e:
            if residency == "together" or not gridmod.out_of_memory(str(e)):
                raise
            if ev.legs:     # legs measured side by side, more one at a time: two memory shares in one grid
                raise gridmod.GridError(f"{e}\n{ev.campaign_id} measured {len(ev.legs)} legs with its servers "
                                        "side by side, and they no longer fit so: resume it on a GPU with the "
                                        "memory free, or start a new campaign (grid.residency=alternate)") from None
            share = 0.9 / len(ev.arms)
            console.print(f"[yellow]the {len(ev.arms)} arms' servers do not fit side by side ({share:.0%} of the "
                          "GPU's memory each; the server's log says so): one at a time from here on, each with 90%, "
                          "restarted between blocks of legs[/]")
    ev.residency = "alternate"
    _save(ev, run.cdir)
    _serve_alternating(run, order)


def _serve_together(run: _Run, order: list) -> None:
    ev, cfg = run.ev, run.cfg
    t = time.perf_counter()         # the phases' seconds go to the log: what a device call pays besides the legs
    with gridmod.servers(order, lambda a: _server_cmd(cfg, ev, a, run.inject), str(run.cdir), _server_env(),
                         on_start=lambda n: console.print(f"starting the {n!r} server ...")) as handles:
        console.print(f"servers ready in {time.perf_counter() - t:.1f} s")
        run.ctx.server_urls = {n: h.url for n, h in handles.items()}
        run.ctx.server_model = next(iter(handles.values())).model_name
        with _reports_kept(ev, handles, run.cdir):
            _run_gates(ev, run.cdir, run.ctx, [g for g in run.gates if g in SERVER_GATES],
                       bool(cfg.gate.self_check), run.live.gate)
            why = _gates_decide(ev)                 # the gates so far, the server gates included
            if why:
                console.print(f"[yellow]grid skipped:[/] {why}")
            else:
                _run_grid(ev, run.cdir, cfg, handles, run.live.leg)
        _server_reports(ev, handles)
        _save(ev, run.cdir)
        t = time.perf_counter()
    console.print(f"servers stopped in {time.perf_counter() - t:.1f} s")


def _serve_alternating(run: _Run, order: list) -> None:
    """One server at a time, each with 90% of the GPU's memory: the arms' legs in blocks (gridmod.leg_plan by_arm:
    per rep, every concurrency of one arm, the arms in the drawn server ``order``, flipped on odd reps, so neither
    arm is always the one after a restart), a server started per run of blocks of its arm. An arm's server gates run
    in its first block; once the gates fix the verdict (or a leg is invalid) no more legs run, but every arm still
    runs its server gates and reports. A resume skips the blocks that have nothing left."""
    ev, cfg = run.ev, run.cfg
    g = cfg.grid
    plan = list(enumerate(gridmod.leg_plan(order, list(g.concurrency), int(g.reps), bool(g.alternate_order),
                                           by_arm=True)))
    runs: list[tuple[Any, list]] = []          # (arm, its legs) per server start: consecutive blocks of one arm
    for i, (c, rep, arm) in plan:
        if runs and runs[-1][0].name == arm.name:
            runs[-1][1].append((i, (c, rep, arm)))
        else:
            runs.append((arm, [(i, (c, rep, arm))]))
    gates = [name for name in run.gates if name in SERVER_GATES]
    for arm, legs in runs:
        done = ev.done_legs()
        legs = [(i, leg) for i, leg in legs if (leg[0], leg[1], arm.name) not in done]
        if void_leg(ev) is not None or _gates_decide(ev):
            legs = []
        if not legs and all(ev.gate(name, arm.name) for name in gates) and arm.name in ev.peak_memory_gib \
                and arm.name in ev.context:
            continue
        with gridmod.servers([arm], lambda a: _server_cmd(cfg, ev, a, run.inject, alone=True), str(run.cdir),
                             _server_env(), on_start=lambda n: console.print(f"starting the {n!r} server ...")) \
                as handles:
            run.ctx.server_urls = {n: h.url for n, h in handles.items()}
            run.ctx.server_model = handles[arm.name].model_name
            with _reports_kept(ev, handles, run.cdir):
                _run_gates(ev, run.cdir, run.ctx, gates, bool(cfg.gate.self_check), run.live.gate, arms=[arm])
                if legs and not _gates_decide(ev):
                    _run_grid(ev, run.cdir, cfg, handles, run.live.leg, legs=legs)
            _server_reports(ev, handles)
            _save(ev, run.cdir)
    if (why := _gates_decide(ev)):
        console.print(f"[yellow]grid skipped:[/] {why}")


@contextmanager
def _reports_kept(ev: Evidence, handles: dict, cdir: Path):
    """On the way out of a stopped run (Ctrl-C, a step's time limit, an error), what its servers report is still
    recorded where they answer: the kernels that ran in its legs count toward the arms' live levers, and a resume
    that has no legs left need not start fresh servers whose counters saw only their start-up."""
    try:
        yield
    except BaseException:
        try:        # seconds, not the usual 30: a step's time limit sends SIGKILL 15 s after its SIGINT
            _server_reports(ev, handles, timeout_s=3.0)
            _save(ev, cdir)
        except Exception as e:      # the servers may be gone already: the first error is the one to report
            console.print(f"the servers' reports (peak memory, lever context) were not recorded: {e}",
                          style="yellow", markup=False)
        raise


def _server_reports(ev: Evidence, handles: dict, timeout_s: float = 30.0) -> None:
    """What each running server reports: its peak memory (the largest of its arm's servers, one at a time) and
    its lever context."""
    for n, h in handles.items():
        ev.peak_memory_gib[n] = max(gridmod.peak_memory_gib(h.url, timeout_s), ev.peak_memory_gib.get(n, 0.0))
    _record_context(ev, handles, timeout_s)


def _served(run: _Run) -> bool:
    """Whether a resumed campaign has all that its servers give (the server gates, every planned leg or the invalid
    one that stopped the grid, each arm's peak memory and lever context): a run stopped after the grid (a device
    command's time limit, landing in the verdict) then concludes at once instead of starting every server again."""
    return not _unserved(run.ev, run.cfg, [g for g in run.gates if g in SERVER_GATES])


def _unserved(ev: Evidence, cfg: DictConfig, gates: list[str]) -> list[str]:
    """What the servers have yet to give: each of ``gates`` on each arm, the planned legs (none once an invalid leg
    voided the grid, or once the gates fixed the verdict: a correctness fix's RED needs its server gates, not the
    grid), each arm's server report (peak memory, lever context); [] when nothing is left."""
    arms = [a.name for a in ev.arms]
    out = [f"gate {g} on {a}" for g in gates for a in arms if ev.gate(g, a) is None]
    plan = [(c, r, a.name) for c, r, a in _leg_plan(ev, cfg)]
    done = ev.done_legs()
    todo = [leg for leg in plan if leg not in done]
    if todo and void_leg(ev) is None and (out or not _gates_decide(ev)):
        c, r, a = todo[0]
        out.append(f"{len(todo)} of {len(plan)} legs (the first: c={c} rep={r} arm {a})")
    out += [f"the {a} server's report (peak memory, lever context)" for a in arms
            if a not in ev.peak_memory_gib or a not in ev.context]
    return out


def _leg_plan(ev: Evidence, cfg: DictConfig) -> list:
    """The grid's legs in run order, (concurrency, rep, arm): what a run measures and a resume checks off."""
    g = cfg.grid
    return gridmod.leg_plan(ev.arms, list(g.concurrency), int(g.reps), bool(g.alternate_order))


def _conclude(run: _Run, note: str | None = None) -> None:
    """Statistics, calibration and the verdict (``note`` joins its reasons); then records, tracking, the flip and
    the summary."""
    ev, cfg = run.ev, run.cfg
    if not ev.context:             # no server ran (the gates fixed the verdict): the gate engines' context
        _record_gate_context(ev, run.ctx)
    t = time.perf_counter()
    policy.conclude(ev, noise=calibrate.pool_for(ev, _other_evidence(run.out_dir, ev.campaign_id)))
    t_verdict = time.perf_counter() - t
    if note and ev.decision is not None:
        ev.decision.reasons.append(note)
    ev.status = "complete"
    _save(ev, run.cdir)
    summaries = status_dir(run.repo, run.out_dir)
    if cfg.summaries:
        records.render_all(run.out_dir, summaries, only=[ev.campaign_id])
    else:                           # one job of a sweep: its own records; the sweep renders the summaries once
        records.write_campaign(ev, run.cdir)
    console.print(f"verdict in {t_verdict:.1f} s (statistics and calibration), records in "
                  f"{time.perf_counter() - t - t_verdict:.1f} s")
    refused = None
    if ev.decision and ev.decision.verdict == "FLIP" and cfg.commit:
        try:
            _flip(ev, run.cdir, run.repo, summaries)
        except CampaignError as e:      # stale, or the default moved: the campaign is complete all the same
            refused = e
    live_id = run.live.finish(ev, run.cdir)     # the run MLflow has shown since the start, completed
    if live_id:
        console.print(f"MLflow: {cfg.tracking.uri} run {live_id}")
    else:
        _track(cfg, ev, run.cdir)       # last: a tracking store out of reach costs nothing but the logging
    (run.cdir / "runner.pid").unlink(missing_ok=True)
    _summary(ev, run.cdir, time.perf_counter() - run.t_start)
    if refused is not None:             # commit=true asked for a flip it did not get: the command fails, saying why
        raise CampaignError(f"commit=true: no flip committed: {refused}")


def _other_evidence(out_dir: Path, own: str) -> list[Evidence]:
    out = []
    for path in find_evidence(out_dir):
        if path.parent.name != own:
            try:
                out.append(load_evidence(path))
            except Exception as e:      # one unreadable file must not stop a campaign from concluding
                console.print(f"[yellow]calibration skips {path}: {e}[/]")
    return out


def _record_context(ev: Evidence, handles: dict, timeout_s: float = 30.0) -> None:
    """Each arm's context as its server reports it (/metrics): every lever's resolved value, the levers whose
    kernels ran during the campaign, and a fingerprint of what it runs (model, quant, dtype, device, versions)."""
    import hashlib
    import json
    registry = levers.registry()
    for name, h in handles.items():
        info = gridmod.server_info(h.url, timeout_s)
        ev.context[name] = {k: registry[k].parse(v, "server-reported value") if k in registry else v
                            for k, v in info["levers"].items()}
        # kernels that ran on any of the arm's servers (one per block of legs when they run one at a time, one per
        # command when a campaign is resumed)
        ran = set(lever_context.live_levers(registry, info["kernels_ran"])) | set(ev.live_levers.get(name, ()))
        ev.live_levers[name] = sorted(ran)
        ev.arm_fingerprints[name] = hashlib.sha256(json.dumps(info["build"], sort_keys=True).encode()).hexdigest()[:16]


def _record_gate_context(ev: Evidence, ctx: GateContext) -> None:
    registry = levers.registry()
    for arm in ev.arms:
        ev.context[arm.name] = dict(levers.resolve(ctx.lever_values(arm), environ={}, quant=ctx.quant).values)
        mech = ev.gate("mechanism", arm.name)
        counted = (mech.details.get("counters") if mech is not None else None) or {}
        # without counters nothing shows a lever inert: count every lever live (STALE is the safe answer)
        ev.live_levers[arm.name] = (lever_context.live_levers(registry, lever_context.kernels_ran(counted))
                                    if counted else sorted(registry))


def _unfinished(cfg: DictConfig, repo: Path, out_dir: Path) -> str | None:
    """The newest in-progress campaign under ``out_dir`` that ``cfg`` may resume (its lever, its composed config,
    this code: this commit or one that differs in records, results or prose alone; the same dirty files, GPU and
    versions, as ``_check_resumable`` asks), or None. A campaign cut on another GPU is not one: the plan of
    ``vtcampaign recheck`` keeps one entry per GPU with the same overrides, each resumed with resume=auto."""
    mine = _of_this_run(cfg, repo, out_dir, "in-progress")
    return mine[-1].campaign_id if mine else None


def _resume_target(cfg: DictConfig, repo: Path, out_dir: Path) -> str | None:
    """The campaign ``cfg.resume`` names: resume=auto's find (``_unfinished``), an id as given, or None."""
    if cfg.resume == "auto":
        return _unfinished(cfg, repo, out_dir)
    return str(cfg.resume) if cfg.resume else None


def share_measured(cfg: DictConfig, repo: Path | str) -> float:
    """The share of its grid's legs measured already by the campaign ``cfg`` would resume here (``cfg.resume``: an
    id, or auto: the newest unfinished one of this config and code), 0.0 where it would start anew: what
    ``vtcampaign recheck --within`` counts as done when it times an entry."""
    repo = Path(repo).resolve()
    out_dir = (repo / cfg.out_dir).resolve()
    cid = _resume_target(cfg, repo, out_dir)
    if cid is None or not (out_dir / cid / "evidence.json").is_file():
        return 0.0
    ev = load_evidence(out_dir / cid)
    planned = {(c, rep, arm.name) for c, rep, arm in _leg_plan(ev, cfg)}
    return len(ev.done_legs() & planned) / len(planned) if planned else 0.0


def concluded_here(cfg: DictConfig, repo: Path | str) -> Evidence | None:
    """The newest complete campaign with a binding verdict under ``cfg.out_dir`` of ``cfg``'s lever, kind and
    composed config, measured on this code, tree, GPU and versions (what resume=auto asks of an unfinished one), or
    None. ``vtcampaign recheck``: a plan entry whose campaign concluded in a device call whose plan file did not come
    back is done, not run again (2026-12-07: a third call re-ran an entry concluded in the second, 15 legs measured
    twice). A verdict that binds nothing (invalid legs, a skipped gate) renews nothing: the entry runs again."""
    repo = Path(repo).resolve()
    kind = "aa" if cfg.aa else "lever"
    mine = [ev for ev in _of_this_run(cfg, repo, (repo / cfg.out_dir).resolve(), "complete")
            if ev.kind == kind and ev.decision is not None and ev.decision.binding]
    return mine[-1] if mine else None


def _of_this_run(cfg: DictConfig, repo: Path, out_dir: Path, status: str) -> list[Evidence]:
    """The campaigns under ``out_dir`` of ``status`` that ``cfg`` would run again here, oldest first."""
    want = config_hash(cfg)
    # a file whose head names another status, lever or config, or that does not parse, is not built here: a fault
    # in it is reported by the commands that build every file (render, status), not by this run's resume
    heads = ((p, evidence_head(p)) for p in find_evidence(out_dir))
    this = (status, cfg.campaign.lever, want)
    maybe = (p for p, head in heads if head is not None and (None in head or head == this))
    mine = [ev for ev in filter(None, map(_loadable, maybe))
            if ev.status == status and ev.lever == cfg.campaign.lever and ev.fingerprint.config_hash == want]
    if not mine:
        return []
    now = _fingerprint_now(cfg, mine[0], repo, not_dirt(repo, out_dir))
    mine = [ev for ev in mine if same_code(ev.fingerprint, now.git_sha, now.code_digest)
            and tree_change(ev.fingerprint, now) is None and ev.fingerprint.arms_env == now.arms_env
            and all(getattr(ev.fingerprint, k) == getattr(now, k) for k, _ in SAME_ON_RESUME)]
    return sorted(mine, key=lambda ev: (ev.created, ev.campaign_id))


def _fingerprint_now(cfg: DictConfig, ev: Evidence, repo: Path, ignore_dirty: tuple[str, ...]) -> Fingerprint:
    """This checkout's fingerprint for ``ev``'s arms, what a resume compares with the first run's: code, tree,
    setup and the servers' VT_* environment (inherited variables too: the engine applies them to every lever that
    no --lever names)."""
    return fp.collect(repo, cfg.device, levers.get(ev.lever).env, ev.arms, ev.fingerprint.config_hash,
                      ignore_dirty=ignore_dirty, pinned=_pinned_env(cfg))


def _pinned_env(cfg: DictConfig) -> dict[str, Any]:
    """campaign.with_levers by env name: what a preflight records in the arms' environment, a resume compares."""
    return {levers.get(n).env: v for n, v in cfg.campaign.with_levers.items()}


def _loadable(path: Path) -> Evidence | None:
    """The evidence at ``path``, or None (with a warning) where it does not load: one torn or conflicted file
    must not stop every resume=auto of every lever."""
    try:
        return load_evidence(path.parent)
    except EvidenceError as e:
        console.print(f"[yellow]skipped {path}: {e}[/]")
        return None


# what must match between a campaign's first run and its resumption, with how a difference reads
SAME_ON_RESUME = (("device_name", "device"), ("torch_version", "torch"), ("triton_version", "triton"),
                  ("cuda_version", "CUDA"), ("python_version", "Python"))


def resume_plan(cfg: DictConfig, repo: Path | str) -> str:
    """What ``resume=`` would do, for --dry-run: the campaign it takes (resume=auto: the newest unfinished one of
    this config and code, or none), the legs done and left; the checks a real resume makes, made."""
    repo = Path(repo).resolve()
    out_dir = (repo / cfg.out_dir).resolve()
    cid = _resume_target(cfg, repo, out_dir)
    if cid is None:
        return "resume=auto: no unfinished campaign of this config and code; a new one would start"
    ev = _resumable(cfg, out_dir / cid, repo, out_dir)
    planned = len(_leg_plan(ev, cfg))
    done = len(ev.done_legs())
    void = void_leg(ev)
    return (f"resume {cid} ({ev.status}): {len(ev.gates)} gate results kept, {done} of {planned} legs done, "
            f"{planned - done} left" + (f"; but {void}" if void else ""))


def _resumable(cfg: DictConfig, cdir: Path, repo: Path, out_dir: Path) -> Evidence:
    """The evidence in ``cdir``, once it is shown to be a campaign ``cfg`` may resume here."""
    if not (cdir / "evidence.json").exists():
        known = sorted(p.parent.name for p in out_dir.glob("*/evidence.json"))
        raise CampaignError(f"resume={cfg.resume!r}: no evidence at {cdir}; campaigns here: {known}")
    ev = load_evidence(cdir)
    _refuse_abandoned(ev)
    if ev.status == "complete":     # resuming would reset it to in-progress and decide it again, maybe flip again
        verdict = ev.decision.verdict if ev.decision else "no verdict"
        raise CampaignError(f"resume={cfg.resume!r}: {ev.campaign_id} is complete ({verdict}); nothing is left to "
                            f"measure (`vtcampaign decide {ev.campaign_id}` applies this checkout's policy again)")
    if ev.lever != cfg.campaign.lever:
        raise CampaignError(f"resume={cfg.resume!r} is a {ev.lever!r} campaign, not {cfg.campaign.lever!r}")
    pid = running_pid(cdir)
    if pid is not None:     # two runs of one campaign would stop each other's servers and save over each other's legs
        raise CampaignError(f"resume={cfg.resume!r}: {ev.campaign_id} is running now (pid {pid}, "
                            f"{cdir / 'runner.pid'}); wait for it, or stop it (Ctrl-C keeps every finished leg) and "
                            "resume then")
    later = _check_resumable(ev, cfg, repo, out_dir)
    if later and later not in ev.resumed_at:
        ev.resumed_at.append(later)
    return ev


def _refuse_abandoned(ev: Evidence) -> None:
    if ev.status == "abandoned":
        raise CampaignError(f"{ev.campaign_id} was abandoned on {ev.abandoned.get('at', '?')[:10]} "
                            f"({ev.abandoned.get('why', 'no reason given')}); its legs stay in its evidence, but "
                            f"it is not resumed or concluded: run the campaign anew")


def abandon(campaign_ids: list[str], out_dir: Path | str, why: str) -> list[Evidence]:
    """Mark unfinished campaigns abandoned (`vtcampaign abandon`): they are no longer listed as unfinished, resumed
    by resume=auto or by id, or concluded; nothing of them is deleted (the evidence keeps every gate and leg, the
    record says when and why). A complete or abandoned campaign, or one whose legs are all recorded (conclude it),
    is refused; every id is checked before any campaign is changed."""
    why = " ".join(why.split())
    if not why:
        raise CampaignError("abandon: --why is empty; say why the campaign is given up (it goes into its record)")
    evs = [_abandonable(cid, Path(out_dir)) for cid in dict.fromkeys(campaign_ids)]
    for ev in evs:
        ev.status = "abandoned"
        ev.abandoned = {"at": utc_now(), "why": why}
        _save(ev, Path(out_dir) / ev.campaign_id)
    return evs


def _abandonable(campaign_id: str, out_dir: Path) -> Evidence:
    cdir = out_dir / campaign_id
    if not (cdir / "evidence.json").is_file():
        known = sorted(ev.campaign_id for ev in map(load_evidence, (p.parent for p in find_evidence(out_dir)))
                       if ev.status == "in-progress")
        raise CampaignError(f"unknown campaign id {campaign_id!r} under {out_dir}; unfinished campaigns there: "
                            f"{', '.join(known) or '(none)'}")
    ev = load_evidence(cdir)
    if ev.status != "in-progress":
        raise CampaignError(f"{campaign_id} is {ev.status} already; only an unfinished campaign can be abandoned")
    if not left_to_measure(ev):
        raise CampaignError(f"{campaign_id} has every gate and leg recorded: nothing is left to give up; "
                            f"`vtcampaign conclude {campaign_id}` gives its verdict")
    pid = running_pid(cdir)
    if pid is not None:     # its next save would write in-progress over the abandon
        raise CampaignError(f"{campaign_id} is running now (pid {pid}, {cdir / 'runner.pid'}): stop it first "
                            "(Ctrl-C keeps every finished leg), then abandon it")
    return ev


def running_pid(cdir: Path) -> int | None:
    """The live process running the campaign in ``cdir`` (its runner.pid, written at the start and removed at the
    end; a killed run leaves it behind), or None. A live pid counts only where its command line is a campaign run's
    (not a recycled pid); without /proc a live pid is trusted."""
    try:
        pid = int((cdir / "runner.pid").read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    if pid == os.getpid():
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return pid
    return pid if b"campaign" in cmdline else None


def _check_resumable(ev: Evidence, cfg: DictConfig, repo: Path, out_dir: Path | None = None) -> str | None:
    """New legs must compare like with like: the same composed config, the same code (the campaign's commit, or a
    later one that changed only records, results or prose: same_code), the same tree (clean, or dirty in the same
    files), device and versions as the first run. The host may differ (a fresh device machine per command is the
    normal way to spread a grid). Returns the later commit a resume runs at, else None."""
    if config_hash(cfg) != ev.fingerprint.config_hash:
        differ = config_diff(ev.config, cfg)
        raise CampaignError(f"resume={cfg.resume!r}: the composed config differs from the campaign's"
                            f"{' (' + '; '.join(differ) + ')' if differ else ''}; resume with "
                            f"`{resume_command(ev)}`, or start a new campaign")
    then = ev.fingerprint
    now = _fingerprint_now(cfg, ev, repo, not_dirt(repo, out_dir) if out_dir is not None else RUN_OUTPUTS)
    if not same_code(then, now.git_sha, now.code_digest):
        why = ("its code at that commit was not recorded (before 2026-12-05)" if then.code_digest is None else
               "the commits between them change code, not only records, results, prose (*.md) or record "
               "templates")
        raise CampaignError(f"resume={cfg.resume!r}: the campaign ran at {then.git_short_sha}, the checkout "
                            f"is now at {now.git_short_sha} and {why}; legs from two codes would not compare "
                            f"(resume on a checkout of {then.git_short_sha}, or start a new campaign)")
    change = tree_change(then, now)
    if change is not None:
        raise CampaignError(f"resume={cfg.resume!r}: {change}; legs from two trees would not compare (commit or "
                            "stash the change, or start a new campaign)")
    differ = [f"{label} {getattr(then, k)} then, {getattr(now, k)} now" for k, label in SAME_ON_RESUME
              if getattr(then, k) != getattr(now, k)]
    if differ:
        raise CampaignError(f"resume={cfg.resume!r}: {'; '.join(differ)}; legs measured on two setups would not "
                            "compare: resume where it ran, or start a new campaign")
    if now.arms_env != then.arms_env:
        def env(e):
            return " ".join(f"{k}={v}" for k, v in sorted(e.items())) or "(none)"
        differ = [f"{arm}: {env(then.arms_env.get(arm, {}))} then, {env(now.arms_env.get(arm, {}))} now"
                  for arm in sorted(set(then.arms_env) | set(now.arms_env))
                  if then.arms_env.get(arm) != now.arms_env.get(arm)]
        raise CampaignError(f"resume={cfg.resume!r}: the servers' VT_* environment differs ({'; '.join(differ)}); "
                            "the engine applies an inherited VT_* variable to every lever no --lever names, so legs "
                            "would not compare: set the environment as it was, or start a new campaign")
    return now.git_short_sha if now.git_sha != then.git_sha else None


def tree_change(then, now) -> str | None:
    """How the checkout's tree differs from the one a campaign ran on, or None where they are the same: clean both,
    or dirty in the same files with the same contents (an edit to a file that was dirty already changes no list of
    files, but the code the next legs run)."""
    def tree(f):
        return f"dirty in {', '.join(sorted(f))}" if f else "clean"
    if sorted(now.dirty_files) != sorted(then.dirty_files):
        return f"the campaign ran on a tree {tree(then.dirty_files)}, the checkout is {tree(now.dirty_files)}"
    if not then.dirty_files or then.dirty_digest == now.dirty_digest:
        return None
    if then.dirty_digest is None:
        return (f"the campaign ran on a tree {tree(then.dirty_files)} whose contents it did not record (before "
                "2026-12-07), so the checkout's cannot be shown the same")
    return f"the campaign ran on a tree {tree(then.dirty_files)}, and their contents changed since"


def resume_command(ev: Evidence) -> str:
    """The command that resumes ``ev``: its recorded overrides (config ``overrides``, since 2026-12-05) and
    resume=<id>; before they were recorded, the campaign's name and a placeholder for the rest."""
    recorded = (ev.config or {}).get("overrides")
    name = (ev.config or {}).get("campaign", {}).get("name", ev.lever)
    words = list(recorded) if recorded else [f"campaign={name}", "<the overrides it ran with>"]
    return " ".join(["vtcampaign", "run", *words, f"resume={ev.campaign_id}"])


def same_code(then, sha: str, digest: str | None) -> bool:
    """Whether a campaign of fingerprint ``then`` ran the code of commit ``sha`` (code digest ``digest``): that
    commit, or one whose code digest (gitops.code_digest: every file but the run outputs and the prose) is equal,
    e.g. a resume after the first command's results were committed."""
    return then.git_sha == sha or (then.code_digest is not None and then.code_digest == digest)


def _run_gates(ev: Evidence, cdir: Path, ctx: GateContext, names: list[str], self_check: bool,
               on_result: Callable[[Any], None] = lambda g: None, arms: list | None = None) -> None:
    todo = [(g, a) for g in names for a in (ev.arms if arms is None else arms) if ev.gate(g, a.name) is None]
    if not todo:
        return
    with _progress() as prog:
        task = prog.add_task("gates", total=len(todo))
        for gate, arm in todo:
            prog.update(task, description=f"gate {gate} [{arm.name}]")
            res = run_gate(gate, ctx, arm, self_check=self_check)
            with _recording():
                ev.gates.append(res)
                _save(ev, cdir)
                on_result(res)
            mark = "skip" if res.skipped else ("pass" if res.passed else "FAIL")
            if gate == "battery" and not res.passed and not res.skipped and res.counts.get("divergent") == 0:
                mark = "near-ties (near_tie rules)"     # only near-tie divergences: RATIFIED or FAIL after it
            sc = "" if res.self_check is None else (" self-check ok" if res.self_check else " SELF-CHECK PASSED (gate broken)")
            prog.console.print(f"  {gate:<13} {arm.name:<6} {mark}{sc}  {res.counts if not res.skipped else res.reason}")
            prog.advance(task)


def _gates_decide(ev: Evidence) -> str:
    """Why the grid need not run: the gates alone already fix the verdict (INVALID or REJECT correctness, by the
    policy's own rules on the gates run so far), or '' to run it."""
    d = policy.decide(ev)
    if d.verdict in ("INVALID", "REJECT-CORRECTNESS"):
        return f"{d.verdict}: " + "; ".join(d.reasons)
    return ""


def _server_env() -> dict[str, str]:
    env = dict(os.environ)     # each server's lever is set by --lever, which wins over any inherited VT_* value
    env.setdefault("PYTHONUNBUFFERED", "1")
    if not _cuda():
        env.setdefault("OMP_NUM_THREADS", "1")      # two CPU servers on a small host: no thread oversubscription
    return env


def _cpu_max_model_len(cfg: DictConfig) -> int:
    """max_model_len of every CPU engine of the campaign (gates and servers alike: decode splits follow it)."""
    longest = round(int(cfg.grid.output_len) * (1 + float(getattr(cfg.grid, "output_len_range", 0.0) or 0.0)))
    return max(512, int(cfg.grid.input_len) + longest + 64)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def _server_cmd(cfg: DictConfig, ev: Evidence, arm, inject: dict, alone: bool = False) -> list[str]:
    """An arm's `vtengine serve` command; on a GPU with 0.9 / arms of its memory, or 0.9 when it runs ``alone``."""
    value = ev.baseline.value if inject.get("inert_arm") == arm.name else arm.value
    others = dict(cfg.campaign.with_levers)
    cuda = ev.fingerprint.device_type == "cuda"
    util = round(0.9 / (1 if alone else len(ev.arms)), 3) if cuda else None
    max_seqs = max(16, max(int(c) for c in cfg.grid.concurrency))
    # on CPU: the Triton interpreter for the lever's own kernels only, and a short max_model_len (see GateContext)
    kernels = None if cuda else list(levers.get(ev.lever).affects)
    max_len = None if cuda else _cpu_max_model_len(cfg)
    # a lever that routes no kernel (an engine-loop lever) rehearses on the torch references alone
    backend = "torch" if kernels == [] else "triton"
    return gridmod.server_command(str(cfg.model.name), str(cfg.model.quant), {**others, ev.lever: value},
                                  backend=backend, gpu_util=util, max_num_seqs=max_seqs, triton_kernels=kernels,
                                  max_model_len=max_len, fault_injection=True)


def memory_hint(ev: Evidence, error: str) -> str:
    """The arms' servers run side by side, each with 0.9 / arms of the GPU's memory (_server_cmd), unless they do
    not fit (grid.residency=auto runs them one at a time when a server's log says so). A server that did not start
    side by side for another stated reason, or under grid.residency=together, gets the memory share said beside
    its log."""
    n = len(ev.arms)
    if ev.fingerprint.device_type != "cuda" or ev.residency == "alternate" or "did not start" not in error:
        return ""
    return (f"\n(the {n} arms' servers run side by side, each with {0.9 / n:.0%} of the GPU's memory: if the log says "
            "the weights or the KV cache did not fit, grid.residency=alternate runs them one at a time, each with "
            "90%; or run fewer candidates per campaign, campaign.arms.candidates=[...])")


def void_leg(ev: Evidence) -> str | None:
    """The first invalid leg, described, or None. An invalid leg voids the grid (the policy's rule 3: no verdict of
    it binds): the grid stops there, and a resumed campaign runs no more legs, rather than spend device time on a
    grid that cannot bind."""
    bad = next((leg for leg in ev.legs if not leg.valid), None)
    if bad is None:
        return None
    return (f"leg c={bad.concurrency} rep={bad.rep} arm {bad.arm} is INVALID ({'; '.join(bad.reasons)}): an invalid "
            "leg voids the grid, so no more legs run; find the cause in the servers' logs and start a new campaign")


def _run_grid(ev: Evidence, cdir: Path, cfg: DictConfig, handles: dict,
              on_leg: Callable[[Any], None] = lambda leg: None, legs: list | None = None) -> None:
    """The legs not yet measured, each on its arm's server in ``handles``: ``legs`` as (run-order index,
    (concurrency, rep, arm)), by default the whole plan (_leg_plan)."""
    if (why := void_leg(ev)) is not None:
        console.print(f"[red]{why}[/]")
        return
    g = cfg.grid
    info = __import__("campaigns.loadgen", fromlist=["get_model_info"]).get_model_info(
        next(iter(handles.values())).url)
    from campaigns.loadgen import safe_vocab_range
    parts, warm = gridmod.prompt_partitions(g, safe_vocab_range(info))
    lens = gridmod.output_len_partitions(g)
    plan = list(enumerate(_leg_plan(ev, cfg))) if legs is None else legs
    done = ev.done_legs()
    with _progress() as prog:
        task = prog.add_task("grid", total=len(plan), completed=sum((c, r, a.name) in done for _, (c, r, a) in plan))
        for i, (c, rep, arm) in plan:
            if (c, rep, arm.name) in done:
                continue
            prog.update(task, description=f"leg c={c} rep={rep} [{arm.name}]")
            leg = gridmod.run_leg(handles[arm.name], arm, c, rep, i, parts[(c, rep)],
                                  gridmod.warmup_for(warm, c, int(g.warmup_requests)), lens[(c, rep)])
            with _recording():
                ev.legs.append(leg)
                _save(ev, cdir)
                on_leg(leg)
            m = leg.metrics
            prog.console.print(f"  c={c} rep={rep} {arm.name:<6} {'valid' if leg.valid else 'INVALID'}  "
                               f"total {m.get('total_token_throughput', 0):.1f} tok/s  "
                               f"TPOT {m.get('median_tpot_ms', 0):.2f} ms  TTFT {m.get('median_ttft_ms', 0):.1f} ms")
            prog.advance(task)
            if not leg.valid:
                prog.console.print(f"[red]{void_leg(ev)}[/]")
                return


def _track(cfg: DictConfig, ev: Evidence, cdir: Path) -> None:
    if not cfg.tracking.enabled:
        console.print("tracking=off: evidence only (ingest later with `vtcampaign log`)")
        return
    try:
        from campaigns import tracking
    except ImportError as e:
        console.print(f"[yellow]MLflow tracking unavailable ({e}); evidence kept at {cdir}[/]")
        return
    try:
        run_id = tracking.log_campaign(ev, cdir, uri=str(cfg.tracking.uri))
    except Exception as e:          # MLflow raises many types (connection, bad URI, store schema): all just a warning
        msg = str(e).splitlines()[0] if str(e) else ""
        console.print(f"[yellow]MLflow logging to {cfg.tracking.uri} failed ({type(e).__name__}: {msg}); the "
                      f"evidence is kept: `vtcampaign log {cdir / 'evidence.json'} --tracking-uri <uri>` later[/]")
        return
    console.print(f"MLflow: {cfg.tracking.uri} run {run_id}")


def status_dir(repo: Path, out_dir: Path) -> Path:
    """Where STATUS.md and BENCHMARKS.md are rendered: records/ for the repository's own records/campaigns, else
    the out_dir itself. They summarise every campaign in out_dir, so a run elsewhere (a rehearsal into a scratch
    directory) must not overwrite the repository's summary of its binding campaigns with its own."""
    out_dir = Path(out_dir).resolve()
    own = (Path(repo) / "records" / "campaigns").resolve()
    return own.parent if out_dir == own else out_dir


def _flip(ev: Evidence, cdir: Path, repo: Path, summaries: Path, clear: bool = True) -> None:
    """Commit the flip on row/<lever>-flip: only a fresh, binding FLIP (a stale one measured another engine).
    ``clear``: then put the working copies of what it carries back as HEAD has them (gitops.clear_for_merge); a
    sweep committing several flips clears after the last, so each flip's summaries see every campaign."""
    from campaigns.gitops import flip_commit
    quant = check_flippable(ev, cdir.parent)
    files = [cdir / n for n in ("evidence.json", "record.md", "pr.md", "grid.png") if (cdir / n).exists()]
    info = flip_commit(repo, ev.lever, ev.decision.new_default, files, (cdir / "pr.md").read_text(),
                       lever_dir=levers.lever_file(ev.lever).parent, quant=quant,
                       rendered=lambda copy: records.render_summaries_flipped(cdir.parent, summaries, ev.lever, copy))
    ev.flip = info          # kept in memory (the sweep's table): the evidence on disk stays the committed one
    from campaigns.gitops import clear_for_merge
    cleared = clear_for_merge(repo, info["commit"]) if clear else []
    console.print(f"flip{f' of the {quant} default' if quant else ''} committed on {info['branch']} "
                  f"({info['commit'][:7]}) with the campaign's records; `vtcampaign merge {info['branch']}` "
                  f"brings both in" + (f" ({len(cleared)} working copies of them put back as HEAD has them, so the "
                                       "merge can write them)" if cleared else ""))


def _unpinned_run(ev: Evidence, off_default: dict, defaults: dict) -> str:
    """The command that re-runs ``ev``'s campaign as it ran (model, grid, candidates, the other pins) with each pin in
    ``off_default`` at today's default: a FLIP there is one about the engine users run."""
    registry = levers.registry()
    pins = {**settings(ev).campaign.with_levers, **{n: defaults[n] for n in off_default}}
    ovs = [o for o in recheck.overrides_for(ev, registry) if not o.startswith("+campaign.with_levers=")]
    ovs.append("+campaign.with_levers={" + ",".join(f"{k}:{recheck.render_value(v)}" for k, v in sorted(pins.items()))
               + "}")
    return "vtcampaign run " + " ".join(shlex.quote(o) for o in ovs)      # a shell word each: {a:1,b:2} expands


def check_flippable(ev: Evidence, records_dir: Path | None = None, root: Path | None = None) -> str | None:
    """Raise CampaignError, saying why, unless ``ev`` is a complete, binding, fresh FLIP of a lever campaign, and
    (with ``records_dir``) no fresh binding verdict of the same lever on another model or workload of its
    quantization refuted it. Returns the flip's scope: None (the lever's ``default``, every quantization), or the
    quantization whose own default it sets (``default_by_quant``) where a binding REJECT on another quantization,
    fresh or stale, refuted the change (pdl_stack, H200 2026-12-04: FLIP on bf16, REJECT on MXFP4), where the
    lever already has its own default on this one, or where some of its sources cannot run on this quantization
    (``context.QUANT_SOURCES``): a bf16 campaign never ran a lever's W4A16 form, so it says nothing of it
    (pdl_stack again: flipped for every quantization from bf16 alone, it cost MXFP4 x0.79 in total tok/s).
    ``root``: the source tree freshness is judged against (None: the engine's own, confdirs.SOURCE_ROOT)."""
    root = confdirs.SOURCE_ROOT if root is None else root
    d = ev.decision
    if ev.kind != "lever" or d is None or d.verdict != "FLIP":
        raise CampaignError(f"{ev.campaign_id}: its verdict is {d.verdict if d else 'not decided'}, not FLIP; only a "
                            "FLIP changes a default")
    if not d.binding:
        raise CampaignError(f"{ev.campaign_id}: its FLIP is not binding; nothing to commit")
    quant = lever_context.quant_of(ev)
    lever, defaults = levers.get(ev.lever), levers.effective_defaults(quant=quant)
    now, base, new = (("on" if v else "off") if isinstance(v, bool) else v
                      for v in (defaults[ev.lever], lever.parse(ev.baseline.value), lever.parse(d.new_default)))
    if now == new:
        raise CampaignError(f"{ev.campaign_id}: {ev.lever}'s default is already {now}; nothing to flip")
    if now != base:
        raise CampaignError(f"{ev.campaign_id}: its FLIP measured {new} against the baseline {base}, but "
                            f"{ev.lever}'s default is now {now}: it says nothing about the engine users run. Re-run "
                            f"it against today's default: `vtcampaign run campaign={settings(ev).campaign.name}`")
    off_default = lever_context.off_default_pins(ev)
    if off_default:
        pins = ", ".join(f"{n}={records.fmt_lever_value(v)} (its default: {records.fmt_lever_value(defaults[n])})"
                         for n, v in sorted(off_default.items()))
        # a preset that sets the lever and its pins at these values decides them together (pdl_stack)
        presets = sorted(n for n, lv in levers.registry().items()
                         if {ev.lever: lever.parse(d.new_default), **off_default}.items() <= lv.sets.items())
        both = ""
        if presets:
            from campaigns.config import options
            run = (f": `vtcampaign run campaign={presets[0]}`" if presets[0] in options("campaign")
                   else f" {presets[0]!r} (a campaign of that lever)")
            both = f", or decide them together with the preset that sets them{run}"
        raise CampaignError(f"{ev.campaign_id}: its FLIP was measured with {pins} pinned: it says what {ev.lever} "
                            "does where those levers are set so, not in the engine users run by default. Flip the "
                            f"pinned lever first (its own campaign), or measure with the pins at today's defaults: "
                            f"`{_unpinned_run(ev, off_default, defaults)}`{both}")
    fresh = lever_context.freshness(ev, root)
    if not fresh.fresh:
        raise CampaignError(f"{ev.campaign_id}: its FLIP is STALE ({'; '.join(fresh.reasons)}); a stale verdict "
                            "measured another engine than the one users run. Re-run it: `vtcampaign recheck`, or "
                            f"`vtcampaign run campaign={settings(ev).campaign.name}`")
    scope = quant if quant in lever.default_by_quant else None
    if quant is not None and len(lever_context.live_paths(lever, quant)) < len(lever.paths):
        scope = quant       # its code for other quantizations did not run here
    if records_dir is not None:
        evs = [load_evidence(p.parent) for p in find_evidence(records_dir)]     # read once for both checks
        later = _superseded_by(ev, evs)
        if later is not None:
            raise CampaignError(
                f"{ev.campaign_id}: a later binding campaign of the same lever, model, workload, GPU and pins, "
                f"{later.campaign_id}, reads {later.decision.verdict} ({later.decision.headline}): that is the "
                "verdict STATUS shows and the one a flip must follow" + (
                    f"; flip it instead: `vtcampaign flip {later.campaign_id}`" if later.decision.verdict == "FLIP"
                    else ""))
        refuted = _refuted_elsewhere(ev, evs)
        same = [r for r in refuted if quant is None or lever_context.quant_of(r) in (quant, None)]
        here = [r for r in same if lever_context.freshness(r, root).fresh]
        if here:
            raise CampaignError(
                f"{ev.campaign_id}: {ev.lever} FLIPped on {recheck.measured_on(ev)}, {records.gpu_label(ev)}, but "
                f"{here[0].campaign_id} ({recheck.measured_on(here[0])}, {records.gpu_label(here[0])}) is a fresh "
                f"{here[0].decision.verdict} of the same change: a default holds for every model, workload and "
                f"GPU{f' of {quant}' if quant else ''}, and a flip would trade what that measurement refuted. Its reasons: {'; '.join(here[0].decision.reasons[:3])}")
        if len(refuted) > len(same):
            # refuted on another quantization (fresh or stale: a stale REJECT still says the change may cost
            # there, and scoping costs nothing): this one's default moves, theirs stays
            scope = quant       # refuted on another quantization only
    return scope


def _superseded_by(ev: Evidence, evs: list[Evidence]) -> Evidence | None:
    """The latest binding campaign of ``evs`` filed under ``ev``'s plan key (``recheck.plan_key``) where it began
    after ``ev`` (``ev`` itself need not be among them yet)."""
    latest = recheck.latest_binding([e for e in evs if e.lever == ev.lever]).get(recheck.plan_key(ev))
    later = latest is not None and (latest.created, latest.campaign_id) > (ev.created, ev.campaign_id)
    return latest if later else None


def _refuted_elsewhere(ev: Evidence, evs: list[Evidence]) -> list[Evidence]:
    """The latest binding REJECTs, fresh or stale, of ``ev``'s lever and candidate value with the same pins but on
    another model, quantization, workload or GPU (``recheck.plan_key``), one per plan: a default is one value for all
    of them but the quantizations a lever file gives their own (pdl_stack, H200 2026-12-04: FLIP on bf16, TPOT
    x1.012; REJECT on MXFP4, total tok/s x0.79)."""
    def elsewhere(other: Evidence) -> bool:
        return (recheck.plan_key(other) != recheck.plan_key(ev)
                and lever_context.pinned_levers(other) == lever_context.pinned_levers(ev))
    out = []
    for other in recheck.latest_binding([e for e in evs if e.lever == ev.lever]).values():
        d = other.decision
        if elsewhere(other) and d.verdict.startswith("REJECT") and d.candidate == ev.decision.candidate:
            out.append(other)
    return out


def _summary(ev: Evidence, cdir: Path, elapsed_s: float) -> None:
    t = Table(title=f"{ev.campaign_id}: {ev.decision.verdict}")
    t.add_column("gate")
    for a in ev.arms:
        t.add_column(records.arm_label(ev, a.name))
    for gname in dict.fromkeys(g.gate for g in ev.gates):
        row = [gname]
        for a in ev.arms:
            g = ev.gate(gname, a.name)
            row.append("-" if g is None else records.gate_result(ev, g))     # what record.md says (RATIFIED...)
        t.add_row(*row)
    console.print(t)
    console.print(f"[bold]{ev.decision.verdict}[/]: {ev.decision.rule}")
    for r in ev.decision.reasons:
        console.print(f"  - {r}")
    console.print(f"records: {cdir / 'record.md'}  PR text: {cdir / 'pr.md'}  ({elapsed_s:.0f} s)")
