"""``vtcampaign recheck``: re-run the campaign of every stale binding verdict, one after another, resumably.

The plan is each lever's latest binding verdict that STATUS marks STALE (campaigns/context.py), and each model's
latest binding A/A grid gone stale the same way (the grid's self-check measured on an engine that has moved since),
ordered so the table settles fast: the levers live in the most other verdicts' contexts first (a flip of theirs
would stale those again; a lever newer than a verdict counts as live in it when its kernels ran there), among those
first a KEEP that had WINs (its re-run may flip), then the FLIPs, then by name; the A/A grids last, measuring the
engine as the plan leaves it. Each entry re-runs the stale campaign's own campaign file, model, pins and binding
grid on today's defaults; its candidates are the stale campaign's candidate values other than today's default (none
left: the campaign file's own, i.e. the flip of today's default).

The plan and progress live in ``<out_dir>/.recheck.json``: a recheck interrupted (Ctrl-C, or a GPU command's time
limit) continues where it stopped, resuming the campaign in flight with ``resume=<id>`` (an entry with none runs with
``resume=auto``, so a campaign begun where the plan's progress was lost is resumed too); ``--restart`` plans anew. A
saved plan is checked against the verdicts each time it is loaded: a pending entry whose lever is FRESH again (a
campaign run outside the plan measured it) is done, one still STALE takes its latest verdict's reasons and arms, and
a lever gone STALE since (a flip merged meanwhile, a changed source file) joins the plan in the place a new plan
would give it, so a plan never re-runs what no longer needs it. Freshness needs the repository's history (the
campaigns' commits, the engine epochs): on a copy without it (a GPU host) run the plan made here with ``--frozen``.
A FLIP found here changes no default until it is committed (``vtcampaign flip <id>``) and merged, so a FLIP that
moves a default stops the run (what is left would run on the default it replaces); after the merge, recheck again:
the flip stales the verdicts it is live in, and the rest is re-planned.

``vtcampaign status --at <rev>`` (``freshness_at``) asks the question before a merge: which of today's FRESH verdicts
would the lever files and sources of another commit make STALE, and what would re-measuring them cost.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from campaigns import context as lever_context
from campaigns.evidence import Evidence, find_evidence, load_evidence, parse_utc, write_atomic
from vtengine import confdirs

STATE_FILE = ".recheck.json"


class RecheckError(ValueError):
    """A recheck that cannot start as asked (the message says why and what to do)."""


def _latest(evs: list[Evidence], kind: str) -> dict[str, Evidence]:
    """The latest complete, binding campaign of ``kind`` per plan key."""
    out: dict[str, Evidence] = {}
    for ev in sorted(evs, key=lambda e: (e.created, e.campaign_id)):
        if ev.kind == kind and ev.status == "complete" and ev.decision is not None and ev.decision.binding:
            out[plan_key(ev)] = ev
    return out


def latest_binding(evs: list[Evidence]) -> dict[str, Evidence]:
    """The latest complete, binding lever campaign per plan key (lever, model, pinned levers)."""
    return _latest(evs, "lever")


STANDARD_WORKLOAD = (1024, 128)     # conf/grid/online.yaml's prompt and output tokens (online_span, online_wide too)


def workload(ev: Evidence, key: bool = False) -> str:
    """The grid's requests when they are not the standard grid's ("32000 in / 64-192 out" for long_prompt), else "".
    A lever decided on two workloads holds two verdicts: the long-prompt grid measures another thing than the
    standard one, while online_span and online_wide only span more concurrencies of the same requests. ``key``:
    the name a verdict is filed under, with the mean output length ("32000 in / 128 out"), so that a campaign on the
    long-prompt grid of varied outputs (2026-12-04) replaces the stale ones of its fixed-output form."""
    from campaigns.config import settings
    from campaigns.records import output_lens_text
    grid = settings(ev).grid
    shape = (int(grid.input_len), int(grid.output_len))
    if shape == STANDARD_WORKLOAD:
        return ""
    return f"{shape[0]} in / {shape[1] if key else output_lens_text(grid, mean=False)} out"


def measured_on(ev: Evidence, with_workload: bool = True, key: bool = False) -> str:
    """What a campaign measured on: "<model> (<quant>)", its pinned levers and its workload where not the standard
    one ("qwen3-8b (bf16) with async_scheduling=true", "qwen3-8b (bf16), 32000 in / 64-192 out"); ``key``: the
    name its verdict is filed under (``workload``)."""
    from campaigns.config import settings
    cfg = settings(ev)
    model = f"{cfg.model.get('name', '?')} ({cfg.model.get('quant', '?')})"
    pins = dict(cfg.campaign.with_levers or {}) if ev.kind != "aa" else {}
    text = model + (" with " + ", ".join(f"{k}={render_value(v)}" for k, v in sorted(pins.items())) if pins else "")
    shape = workload(ev, key=key) if with_workload else ""
    return text + (f", {shape}" if shape else "")


def plan_key(ev: Evidence) -> str:
    """The name of what a campaign measured, one verdict per name: "<lever> on <measured_on>, <GPU>" ("pdl on
    qwen3-8b (mxfp4), H200"), or "A/A <model> (<quant>), <GPU>" for a grid self-check. A lever decided on two models
    holds two verdicts: a bf16 campaign does not hide (nor recheck) the MXFP4 one. Likewise on two GPUs: the lender
    may give an H100 for an H200 call, and an H100 campaign says nothing of the H200 (the H100 A/A of 2026-12-05
    had replaced every H200 A/A of bf16 in STATUS); a default holds on every GPU, so a fresh REJECT on one refuses
    a FLIP on the other."""
    from campaigns.records import gpu_label
    name = f"{measured_on(ev, key=True)}, {gpu_label(ev)}"
    return f"A/A {name}" if ev.kind == "aa" else f"{ev.lever} on {name}"


def latest_aa(evs: list[Evidence]) -> dict[str, Evidence]:
    """Each model's latest complete, binding A/A grid: the self-check that today's engine and grid invent no
    effects. It goes stale like a verdict (a live lever's default or the engine moved since it ran)."""
    return _latest(evs, "aa")


def stale_verdicts(out_dir: Path | str,
                   root: Path | str | None = None) -> list[tuple[Evidence, lever_context.Freshness]]:
    from vtengine import levers
    root = Path(root) if root is not None else confdirs.SOURCE_ROOT
    registry = levers.registry()
    digests = lever_context.tree_digests(registry, root)
    evs = [load_evidence(p) for p in find_evidence(out_dir)]
    out = []
    for ev in [*latest_aa(evs).values(), *latest_binding(evs).values()]:
        f = lever_context.freshness(ev, root, registry, digests)
        if not f.fresh:
            out.append((ev, f))
    return out


def freshness_at(out_dir: Path | str, rev: str, root: Path | str | None = None) -> tuple[str, list[tuple]]:
    """What checking out (or merging) commit ``rev`` would do to today's verdicts: every latest binding verdict and
    A/A grid of ``out_dir``, judged against this checkout's working tree and against ``rev``'s lever files, sources
    and engine epochs (checked out in a temporary git worktree, removed after). Returns (rev's short sha,
    [(evidence, freshness here, freshness at rev)]), binding verdicts first. The evidence is this checkout's: a
    branch's own new campaigns are not in it (the merge of a flip branch judges those)."""
    import shutil
    import tempfile

    import git

    from campaigns.gitops import open_repo
    from vtengine import levers
    root = Path(root) if root is not None else Path(confdirs.SOURCE_ROOT)
    repo = open_repo(root)
    try:
        commit = repo.commit(rev)
    except (git.BadName, ValueError):
        raise RecheckError(f"{rev!r} is not a commit in the repository at {root}; accepted: a branch, tag or "
                           "commit sha (e.g. main, HEAD~1, 3f2a9c1)") from None
    evs = [load_evidence(p) for p in find_evidence(out_dir)]
    latest = [*latest_binding(evs).values(), *latest_aa(evs).values()]
    registry_here = levers.registry()            # this checkout's levers, as `vtcampaign status` reads them
    digests_here = lever_context.tree_digests(registry_here, root)
    here = {ev.campaign_id: lever_context.freshness(ev, root, registry_here, digests_here) for ev in latest}
    tmp = Path(tempfile.mkdtemp(prefix="vtcampaign-at-"))
    tree = tmp / "tree"
    try:
        repo.git.worktree("prune")   # a run killed before its cleanup left a registration whose folder is gone
        repo.git.worktree("add", "--detach", str(tree), commit.hexsha)
        registry_at = levers.registry(tree / "conf" / "lever")
        digests_at = lever_context.tree_digests(registry_at, tree)
        rows = [(ev, here[ev.campaign_id], lever_context.freshness(ev, tree, registry_at, digests_at))
                for ev in latest]
    finally:
        try:                         # a failed add left nothing registered: removing it fails, the rest goes on
            if tree.exists():
                repo.git.worktree("remove", "--force", str(tree))
        except git.GitCommandError:
            pass                     # the next call's prune drops the registration
        shutil.rmtree(tmp, ignore_errors=True)
        levers.reload()              # the registry cache holds the worktree's lever files: let them go
    return commit.hexsha[:7], rows


def at_report(rev: str, short: str, rows: list[tuple]) -> tuple[str, int]:
    """``vtcampaign status --at`` as text, and how many verdicts FRESH here would go STALE at ``rev``."""
    lost = [(ev, b) for ev, a, b in rows if a.fresh and not b.fresh]
    gained = [(ev, b) for ev, a, b in rows if not a.fresh and b.fresh]
    both = sum(a.fresh and b.fresh for _, a, b in rows)
    neither = sum(not a.fresh and not b.fresh for _, a, b in rows)
    lines = [f"the verdicts at {rev} ({short}) against this checkout (its evidence, {len(rows)} latest binding "
             "verdicts and A/A grids):"]
    cost = [took_s(ev) for ev, _ in lost]
    timed = [c for c in cost if c is not None]
    lines.append(f"  would go STALE: {len(lost)}" + (
        f" (re-measuring them: about {sum(timed) / 60:.0f} min of GPU time at their last durations"
        + (f", {len(cost) - len(timed)} untimed" if len(timed) < len(cost) else "") + ")" if lost else ""))
    lines += [f"    {plan_key(ev)} {ev.campaign_id} {ev.decision.verdict}: {'; '.join(f.reasons)}" for ev, f in lost]
    lines.append(f"  would turn FRESH: {len(gained)}")
    lines += [f"    {plan_key(ev)} {ev.campaign_id} {ev.decision.verdict}" for ev, _ in gained]
    lines.append(f"  FRESH in both: {both}; STALE in both: {neither}")
    return "\n".join(lines) + "\n", len(lost)


def order(stale: list[tuple[Evidence, Any]], out_dir: Path | str, root: Path | str | None = None) -> list:
    """The levers others depend on first: a lever live in more of the other latest verdicts' contexts goes first."""
    from vtengine import levers
    root = Path(root) if root is not None else confdirs.SOURCE_ROOT
    registry = levers.registry()
    latest = latest_binding([load_evidence(p) for p in find_evidence(out_dir)])
    contexts = [(ev.lever, lever_context.context_of(ev, root, registry)) for ev in latest.values()]

    def dependents(lever: str) -> int:
        """Other verdicts the lever is live in: listed live there, or its kernels ran there (a lever newer than
        the verdict is live in it all the same once its default moves), or it shapes every step (engine loop)."""
        own = registry.get(lever)
        mine = set(own.affects) if own is not None else set()
        n = 0
        for name, ctx in contexts:
            live = {x for names in ctx.live.values() for x in names}
            ran = {k for x in live if x in registry for k in registry[x].affects}
            n += name != lever and (lever in live or (own is not None and not own.affects) or bool(mine & ran))
        return n

    def may_move(ev: Evidence) -> int:
        """0: a KEEP that had WINs (its re-run may flip it); 1: a FLIP; 2: the rest."""
        from campaigns import policy
        if ev.decision.verdict == "FLIP":
            return 1
        p = policy.policy_params(ev)
        wins = [st for st in ev.stats if st.separation == "WIN" and st.primary and policy.counts(st, p)]
        return 0 if ev.decision.verdict == "KEEP" and wins else 2
    # the levers most others depend on first, among equals the verdict likeliest to move a default; the grid's
    # self-checks last, on the engine as the plan leaves it (a flip before them would stale them again)
    return sorted(stale, key=lambda item: (item[0].kind == "aa", -dependents(item[0].lever), may_move(item[0]),
                                           plan_key(item[0])))


def overrides_for(ev: Evidence, registry: dict) -> list[str]:
    """Hydra overrides that re-run ``ev``'s campaign on today's defaults, on its own binding grid (named unless it
    is the one the campaign's file takes by default: config.campaign_grid)."""
    from campaigns.config import campaign_grid, settings
    cfg = settings(ev)
    camp, model = cfg.campaign, cfg.model
    out = [f"campaign={camp.name}"] + (["aa=true"] if ev.kind == "aa" else [])
    if model.get("name"):
        out.append(f"model={model['name']}")
    if model.get("quant"):
        out.append(f"model.quant={model['quant']}")
    if cfg.grid.binding and cfg.grid.name != campaign_grid(camp.name):
        out.append(f"grid={cfg.grid.name}")       # a verdict decided on another binding grid keeps it
    lever = registry[ev.lever]
    from vtengine import levers
    default = levers.effective_defaults(registry, lever_context.quant_of(ev))[ev.lever]
    cands = [a.value for a in ev.candidates if a.value != default] if ev.kind != "aa" else []
    if cands:
        out.append("campaign.arms.candidates=[" + ",".join(render_value(v) for v in cands) + "]")
    pins = dict(camp.with_levers)
    if pins:
        # one shell word (no spaces): the device script's steps split their overrides on spaces
        out.append("+campaign.with_levers={" + ",".join(f"{k}:{render_value(v)}" for k, v in sorted(pins.items()))
                   + "}")
    return out


def render_value(v: Any) -> str:
    """A lever value as a Hydra override writes it (true/false for booleans)."""
    return {True: "true", False: "false"}.get(v, str(v)) if isinstance(v, bool) else str(v)


def load_state(out_dir: Path | str) -> dict:
    path = Path(out_dir) / STATE_FILE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RecheckError(f"recheck: the saved plan {path} is not readable JSON ({e}); a copy cut short on its way "
                           "back from a GPU host reads so: restore it from git, or plan afresh with "
                           "`vtcampaign recheck --dry-run --restart`") from None
    if not isinstance(state, dict) or not isinstance(state.get("entries", []), list):
        raise RecheckError(f"recheck: the saved plan {path} holds no object with a list of entries; plan afresh "
                           "with `vtcampaign recheck --dry-run --restart`")
    return state


def save_state(out_dir: Path | str, state: dict) -> None:
    write_atomic(Path(out_dir) / STATE_FILE, json.dumps(state, indent=2, sort_keys=True) + "\n")


RESUME_GAP_S = 120.0    # legs follow each other within seconds; a longer pause between two is an interruption


def took_s(ev: Evidence) -> float | None:
    """How long a campaign ran, from its start to its last leg's end (gates, servers and grid): what re-running it
    should cost. A pause of more than RESUME_GAP_S between two legs is a campaign cut and resumed in a later command
    (on the H200, pdl_stack's 6.8 minutes read 15): it is left out. So is a cut before the first leg (during the
    gates or a server's start): the time to the first leg counts at most the gates' own recorded time plus
    RESUME_GAP_S. None without timed legs."""
    timed = sorted((parse_utc(leg.started), parse_utc(leg.ended)) for leg in ev.legs if leg.started and leg.ended)
    if not timed or not ev.created:
        return None
    total = max(0.0, (timed[0][0] - parse_utc(ev.created)).total_seconds())
    gates_s = sum(g.duration_s for g in ev.gates)
    if gates_s > 0.0:                   # evidence without gate timings keeps its whole span (nothing to bound it by)
        total = min(total, gates_s + RESUME_GAP_S)
    last = timed[0][0]
    for started, ended in timed:
        gap = (started - last).total_seconds()
        total += (gap if 0.0 < gap <= RESUME_GAP_S else 0.0) + max(0.0, (ended - max(started, last)).total_seconds())
        last = max(last, ended)
    return total


# What a device step spends beyond took_s: the process start before the campaign is created, and after its last leg
# the servers' stop, the verdict, the records and their plot. On the H200 (2026-12-04) campaigns of 229 and 267 s of
# took_s stopped before their verdict in steps of 250-260 and 285 s; one of 240 s concluded in ~285 s.
STEP_OVERHEAD_S = 60.0
# The most one call's steps may take: the lender's 600 s, less setup (the wheel install, the copy's commit, the
# imports: 9 s and 7 s on the H100, 2026-12-06; ~35 s allowed), less the 25 s scripts/h200_session.sh keeps back
# for a stopped step to end and for the tarball (it cuts any step past that).
DEVICE_CALL_S = 540
# A recheck budget this large is a whole device call's step (a step's limit is what is left of its call: 539 s on
# the H100, 2026-12-07, for a call of 575 s): no call has more room, so it opens with its first campaign whatever it
# needs (``run``'s ``within``).
WHOLE_CALL_S = DEVICE_CALL_S - STEP_OVERHEAD_S


def need_s(entry: dict, measured: float = 0.0) -> float | None:
    """The seconds a plan entry's campaign should take to its verdict: its last run's took_s less the ``measured``
    share of its legs (a resumed campaign), plus STEP_OVERHEAD_S; None where the last run has no timing."""
    if entry.get("took_s") is None:
        return None
    return entry["took_s"] * (1.0 - min(max(measured, 0.0), 1.0)) + STEP_OVERHEAD_S


# override keys a plan entry sets itself (what its verdict was measured on): an extra override of one would re-run
# the entry as another campaign and file that as its renewal (model.quant=mxfp4 over a bf16 entry)
ENTRY_KEYS = ("campaign", "aa", "model", "grid", "campaign.arms", "campaign.with_levers")


def check_extra(extra: list[str]) -> None:
    """Refuse extra overrides a recheck cannot pass on: resume= (recheck picks what each campaign resumes) and the
    keys each entry sets itself (ENTRY_KEYS)."""
    keys = [(o, o.split("=", 1)[0].lstrip("+~")) for o in extra]
    asked = [o for o, k in keys if k == "resume"]
    if asked:
        raise RecheckError(f"recheck: {' '.join(asked)}: recheck picks what each campaign resumes (the one its plan "
                           "entry began, else resume=auto); drop it, or resume one campaign with `vtcampaign run`")
    own = [o for o, k in keys if any(k == e or k.startswith(e + ".") for e in ENTRY_KEYS)]
    if own:
        raise RecheckError(f"recheck: {' '.join(own)}: each stale verdict is re-run as it was measured (its "
                           f"campaign, model, grid, arms and pins: {', '.join(ENTRY_KEYS)} are the entry's own); "
                           "drop it, or run that campaign with `vtcampaign run`")


def device_step(entry: dict, extra: list[str] = ()) -> tuple[str, int] | None:
    """(the `scripts/h200_session.sh` step that re-runs a plan entry, the seconds it should need), or None when the
    entry's last run has no timing. The step's seconds are took_s + STEP_OVERHEAD_S, rounded up to 5 s and at most
    DEVICE_CALL_S: a longer campaign is cut there, and the same step in the next call resumes it (campaign steps
    run with resume=auto). The overrides are one word each (overrides_for), so the step splits back into them;
    ``extra``: the recheck command's own overrides (tracking=off), after the entry's."""
    need = need_s(entry)
    if need is None:
        return None
    need = int(-(-need // 5) * 5)
    words = [*entry["overrides"], *extra]
    name = words.pop(0).removeprefix("campaign=")
    return f"{min(need, DEVICE_CALL_S)}@campaign:{name}" + (":" + " ".join(words) if words else ""), need


def device_calls(steps: list[tuple[str, int]], call_s: int = DEVICE_CALL_S) -> list[list[str]]:
    """The device steps [(step, seconds needed)], in the plan's order (``order``: the levers others depend on
    first), packed into calls of at most ``call_s`` seconds each: each step into the first call it fits (first-fit),
    so the calls, run in turn, reach the plan's first verdicts first; a later step may fill room left in an
    earlier call. A step longer than one call is cut at ``call_s`` (device_step); what is left of it goes in a
    later call, where the same step resumes it. (Until 2026-12-04 the steps went longest first, first-fit
    decreasing: a call or two fewer, but the plan's first verdicts could come last.)"""
    calls: list[tuple[int, list[str]]] = []
    for step, need in steps:
        first = 0                                       # a resumed part goes in a later call than the part before
        while need > call_s:
            calls.append((call_s, [f"{call_s}@{step.split('@', 1)[1]}"]))
            first = len(calls)
            need -= call_s - STEP_OVERHEAD_S            # the resumed run starts again, but its legs are kept
            step = f"{int(-(-(need) // 5) * 5)}@{step.split('@', 1)[1]}"
        for i, (used, names) in enumerate(calls[first:], first):
            if used + need <= call_s:
                calls[i] = (used + need, names + [step])
                break
        else:
            calls.append((need, [step]))
    return [names for _, names in calls]


def _key(e: dict) -> str:
    """A plan entry's verdict key (entries saved before verdicts were keyed by model carry the lever only)."""
    return e.get("key", e["lever"])


def _entry(ev: Evidence, f: lever_context.Freshness, registry: dict) -> dict:
    return {"key": plan_key(ev), "lever": ev.lever if ev.kind == "lever" else plan_key(ev), "stale": ev.campaign_id,
            "why": f.reasons, "overrides": overrides_for(ev, registry),
            "new": None, "status": "pending", "took_s": took_s(ev), "gpu": ev.fingerprint.device_name}


def plan(out_dir: Path | str, restart: bool = False, root: Path | str | None = None, frozen: bool = False) -> dict:
    """The recheck state: the saved one while it has unfinished entries (unless ``restart``), brought up to date
    with today's verdicts (see the module docstring), else a new plan. ``root``: the repository the verdicts'
    freshness is judged against (the installed project's by default). ``frozen``: the saved plan as it is, for a
    copy of the project without its git history (a GPU host), where every verdict's commit is unknown and so every
    verdict would read STALE; it is an error when no saved plan has work left."""
    if frozen:
        if restart:
            raise RecheckError("recheck: --frozen works through the saved plan; it cannot be combined with --restart")
        state = load_state(out_dir)
        if not any(e["status"] != "done" for e in state.get("entries", [])):
            raise RecheckError(f"recheck --frozen: no saved plan with work left in {Path(out_dir) / STATE_FILE}; "
                             "plan where the repository's history is (vtcampaign recheck --dry-run) and bring the "
                             "file along")
        return state
    from vtengine import levers
    registry = levers.registry()
    current = order(stale_verdicts(out_dir, root), out_dir, root)
    state = {} if restart else load_state(out_dir)
    if state.get("entries") and any(e["status"] != "done" for e in state["entries"]):
        for e in state["entries"]:          # keyed as plan_key keys now (by model since 2026-12-03, GPU 2026-12-05)
            if (Path(out_dir) / e["stale"] / "evidence.json").is_file():
                e["key"] = plan_key(load_evidence(Path(out_dir) / e["stale"]))
        stale_now = {plan_key(ev): (ev, f) for ev, f in current}
        for e in state["entries"]:
            gone = _gone(out_dir, e.get("new")) if e["status"] == "running" else None
            if gone:
                # nothing of its campaign to resume: the entry is planned again like a pending one (today's reasons
                # and arms, or done where its verdict is fresh now), not run afresh on the overrides of the default
                # it was first planned on
                e["status"], e["new"], e["abandoned"] = "pending", None, gone
            if e["status"] != "pending":
                continue
            if _key(e) not in stale_now:
                e["status"], e["verdict"] = "done", "FRESH without it (measured outside this plan)"
            else:                               # still stale, maybe from a later campaign: its reasons and arms
                e.update(_entry(*stale_now[_key(e)], registry))
        open_keys = {_key(e) for e in state["entries"] if e["status"] != "done"}
        state["entries"] += [_entry(ev, f, registry) for ev, f in current if plan_key(ev) not in open_keys]
        # what is done stays as history, a campaign stopped midway resumes first, and what is left to run follows
        # today's order (a verdict that joined may be one that others depend on: it goes before them)
        rank = {plan_key(ev): i for i, (ev, _f) in enumerate(current)}
        phase = {"done": 0, "running": 1}
        state["entries"].sort(key=lambda e: (phase.get(e["status"], 2),
                                             rank.get(_key(e), len(rank)) if e["status"] == "pending" else 0))
    else:
        state = {"entries": [_entry(ev, f, registry) for ev, f in current]}
    save_state(out_dir, state)
    return state


def _gone(out_dir: Path | str, campaign_id: str | None) -> str | None:
    """Why a running plan entry's campaign cannot be resumed or concluded (abandoned, deleted), else None."""
    if not campaign_id:
        return "its campaign was not recorded"
    path = Path(out_dir) / campaign_id / "evidence.json"
    if not path.is_file():
        return f"{campaign_id} is gone ({path} does not exist)"
    ev = load_evidence(path)
    if ev.status == "abandoned":
        return f"{campaign_id} was abandoned ({ev.abandoned.get('why', '')})"
    return None


def run(out_dir: Path | str, extra: list[str], run_one: Callable[[list[str], Callable[[str], None]], Evidence],
        restart: bool = False, echo: Callable[[str], None] = print, root: Path | str | None = None,
        frozen: bool = False, conclude_one: Callable[[str], Evidence] | None = None,
        gpu: str | None = None, concluded: Callable[[list[str]], Evidence | None] | None = None,
        within: float | None = None, measured: Callable[[list[str]], float] | None = None,
        clock: Callable[[], float] = time.monotonic) -> dict:
    """Work through the plan: ``run_one(overrides, on_start)`` runs one campaign (on_start gets its id as soon as
    its evidence exists, so an interruption can resume it). ``conclude_one(campaign_id)``: concludes a campaign
    stopped with nothing left to measure but its verdict, where it is (runner.conclude_recorded), instead of
    resuming it on the device it ran on. ``gpu``: this host's device name; a verdict measured on another GPU is left
    pending for a host that has it (a campaign here would file a verdict of this GPU beside it, not renew it).
    ``concluded(overrides)``: the newest complete campaign with a binding verdict that those overrides would run
    again here (same kind, config, code and setup: runner.concluded_here), or None; an entry that names no campaign
    of its own takes one begun after its stale verdict as its renewal instead of running the campaign again.
    ``within``: the seconds this run may take from its call (a device call's step); an entry is started only where
    it should end in what is left (``need_s``: its last run's time, less the share of legs ``measured(overrides)``
    says its resumed campaign holds), else left pending for a command with room, and a later one that fits runs
    instead (about the first-fit ``device_calls`` packs the printed calls by). An entry without a timing is left
    so too. Only a command of a whole call (``within`` >= WHOLE_CALL_S), which no call can better, starts its
    first campaign whatever it needs: one longer than a call is cut there and resumes in the next."""
    from campaigns.records import short_gpu
    from campaigns.runner import left_to_measure
    check_extra(extra)
    t0 = clock()
    out_dir = Path(out_dir)
    state = plan(out_dir, restart, root, frozen)
    if not state["entries"]:
        echo("recheck: no stale binding verdict")
        return state
    elsewhere, waiting, ran, stopped = [], [], False, False
    for entry in state["entries"]:
        if entry["status"] == "done":
            continue
        if gpu and entry.get("gpu") and short_gpu(entry["gpu"]) != short_gpu(gpu):
            elsewhere.append(entry)
            echo(f"recheck {_key(entry)}: measured on {short_gpu(entry['gpu'])}, this host has {short_gpu(gpu)}: "
                 "left for a host with that GPU")
            continue
        overrides = list(entry["overrides"]) + list(extra)
        ev = None
        begun = None
        if entry.get("abandoned") and not entry["new"]:
            echo(f"recheck {_key(entry)}: {entry['abandoned']}; planned again on today's defaults")
        if entry["new"] and (out_dir / entry["new"] / "evidence.json").is_file():
            begun = load_evidence(out_dir / entry["new"])
            if begun.status == "complete":      # concluded in a call whose plan came back before its verdict did
                ev, begun = begun, None         # its verdict as a run's: a FLIP that moves a default stops here too
            elif begun.status == "abandoned":   # `vtcampaign abandon`: resume=auto passes it by
                echo(f"recheck {_key(entry)}: {entry['new']} was abandoned ({begun.abandoned.get('why', '')}); "
                     "resuming another campaign of its config and code, else starting one")
                begun = entry["new"] = None
                entry["status"] = "pending"
                save_state(out_dir, state)
        if begun is not None:
            if conclude_one is not None and not left_to_measure(begun):
                echo(f"recheck {_key(entry)}: {entry['new']} has every gate and leg; concluding it here")
                ev = conclude_one(entry["new"])
            overrides.append(f"resume={entry['new']}")
        elif ev is None:
            # the plan may not know a campaign begun for it: progress saved on a GPU host whose plan file did not
            # come back (2026-12-07: the next call started the same campaign afresh, 14 legs measured twice).
            # resume=auto takes the newest unfinished campaign of this config and code, else starts one. A
            # complete one begun after the stale verdict renews it already (concluded in such a call)
            ev = _renewal(concluded(overrides), entry, out_dir) if concluded is not None else None
            if ev is not None:
                echo(f"recheck {_key(entry)}: {ev.campaign_id} renews it already (complete, of this config, code and "
                     f"setup, begun after {entry['stale']}): not run again")
            overrides.append("resume=auto")
        if ev is None and within is not None:
            need = need_s(entry, measured(overrides) if measured is not None else 0.0)
            spent = clock() - t0
            # no command has more room than a whole device call: its opening campaign runs even where it will
            # not end (cut, it resumes in the next call); elsewhere only one that should end in what is left
            opening = not ran and spent < STEP_OVERHEAD_S and within >= WHOLE_CALL_S
            if (need is None or need > within - spent) and not opening:
                waiting.append(entry)
                echo(f"recheck {_key(entry)}: needs " + (f"~{need:.0f} s" if need is not None else "a time not known")
                     + f", {max(within - spent, 0.0):.0f} s left of {within:.0f}: left pending for a command with "
                     "room")
                continue
        if ev is None:
            echo(f"recheck {_key(entry)}: {entry['stale']} is STALE ({'; '.join(entry['why'])}); "
                 f"running {' '.join(overrides)}")
            ran = True

            def started(cid: str, entry=entry) -> None:
                entry["new"], entry["status"] = cid, "running"
                entry.pop("abandoned", None)
                save_state(out_dir, state)
            ev = run_one(overrides, started)
        entry["new"], entry["status"] = ev.campaign_id, "done"
        entry["verdict"] = ev.decision.verdict if ev.decision else None
        save_state(out_dir, state)
        refused = _flip_refused(ev, out_dir, root)
        if refused:
            echo(f"recheck {_key(entry)}: {ev.campaign_id} FLIPs {ev.lever} to "
                 f"{render_value(ev.decision.new_default)} but moves no default, so the recheck goes on: "
                 f"`vtcampaign flip` refuses it: {refused}")
        elif _moves_a_default(ev) and any(e["status"] != "done" for e in state["entries"]):
            # what is left would run on the default this FLIP replaces, and its verdicts go stale at the merge
            echo(f"recheck stops: {ev.campaign_id} FLIPs {ev.lever} to {render_value(ev.decision.new_default)}. Commit "
                 f"it (vtcampaign flip {ev.campaign_id}), merge, and run recheck again: the rest is re-planned "
                 "on the new default")
            stopped = True
            break
    if waiting and not stopped:
        echo(f"recheck: {len(waiting)} stale verdict(s) left pending for want of time ({within:.0f} s); run recheck "
             "again")
    if elsewhere:
        echo(f"recheck: {len(elsewhere)} stale verdict(s) of other GPUs left pending "
             f"({', '.join(sorted({short_gpu(e['gpu']) for e in elsewhere}))}); run recheck on those GPUs")
    return state


def _renewal(ev: Evidence | None, entry: dict, out_dir: Path) -> Evidence | None:
    """``ev`` where it was begun after the entry's stale verdict, else None (the stale verdict itself is one of
    this code and config where a lever default's change alone made it stale; without the stale verdict's evidence
    nothing says when it was begun: None)."""
    stale = out_dir / entry["stale"] / "evidence.json"
    if ev is None or not stale.is_file() or parse_utc(ev.created) <= parse_utc(load_evidence(stale.parent).created):
        return None
    return ev


def _moves_a_default(ev: Evidence) -> bool:
    """A binding FLIP whose new default is not the lever's default now (one `vtcampaign flip` may still refuse:
    _flip_refused)."""
    from vtengine import levers
    d = ev.decision
    if ev.kind != "lever" or d is None or d.verdict != "FLIP" or not d.binding:
        return False
    defaults = levers.effective_defaults(quant=lever_context.quant_of(ev))
    return ev.lever in defaults and d.new_default != defaults[ev.lever]


def _flip_refused(ev: Evidence, out_dir: Path, root: Path | str | None) -> str:
    """Why `vtcampaign flip` would refuse a binding FLIP that differs from today's default (runner.check_flippable:
    a pinned lever off its default, a baseline no longer the default, a fresh REJECT of the same change elsewhere),
    else "". Such a FLIP moves no default, so a recheck must not stop at it (2026-12-07, H100: prefill_splits
    FLIPped with chunked_prefill=256 pinned, the default 512; the recheck stopped and asked for a flip that
    `vtcampaign flip` then refused)."""
    from campaigns.runner import CampaignError, check_flippable
    if not _moves_a_default(ev):
        return ""
    try:
        check_flippable(ev, out_dir, root=None if root is None else Path(root))
    except CampaignError as e:
        return str(e).removeprefix(f"{ev.campaign_id}: ")
    return ""
