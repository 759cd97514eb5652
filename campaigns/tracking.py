"""MLflow views of an evidence file (mlflow-skinny; default store ``sqlite:///mlflow.db`` at the project root).

Layout, one experiment per lever (``vtcampaign/<lever>``):

    campaign <id>                 parent run; tags lever, verdict, git_sha, dirty, device, campaign_id, ...;
    │                             params = the flattened config; metrics ratio/<candidate>/<axis> at step = c;
    │                             artifacts evidence.json, record.md, pr.md, grid.png
    ├── gate <gate> [<arm>]       one per gate x arm: counts and duration as metrics, passed/self_check as tags
    ├── leg c<c> rep<r> [<arm>]   one per leg: the leg's metrics, GPU clock/temperature samples at step = sample
    └── arm <arm>                 one per arm: the median over reps of every leg metric at step = concurrency,
                                  so the UI's chart view draws the arms against each other by concurrency

While a campaign runs (LiveCampaign), its parent run is RUNNING and each gate and leg appears as it is recorded;
a campaign stopped early ends KILLED (Ctrl-C, SIGTERM, a time limit) or FAILED (an error), with what it finished;
one that ends is completed on the same run.

Parameters are the config's leaves, each at most 500 characters (the smallest param limit of the MLflow servers still
deployed); a longer value is cut visibly, ending in ``…``, and the parent run also carries it whole as the tag
``<param>.full`` (tags hold 5000 characters, so a value past that is cut visibly there too; evidence.json holds all).

Tracking never fails a campaign, and no run is left RUNNING by logging that failed part-way: each child run's logging
ends it (FAILED where that logging raised), as does a whole logging's parent; the error then propagates to the caller
(LiveCampaign turns it into one warning, and still ends the live parent at the campaign's end).

Every run carries the tag ``vtcampaign.campaign_id``. Logging is idempotent by *replacement*: logging a campaign
id that is already in the experiment first deletes its earlier runs (MLflow's soft delete: they leave the UI and
searches but stay in the store's trash), then logs the evidence anew, so ``vtcampaign log`` can be re-run after a
resumed campaign or a re-render without duplicating runs.
"""
from __future__ import annotations

import os
import statistics
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from campaigns import gitops
from campaigns.evidence import Evidence, parse_utc

# MLflow's own environment variable first (where a team's tracking server is named), else a local sqlite store
DEFAULT_URI = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
CAMPAIGN_TAG = "vtcampaign.campaign_id"
KIND_TAG = "vtcampaign.kind"
ARTIFACTS = ("evidence.json", "record.md", "pr.md", "grid.png")
_PARAM_MAX = 500        # the smallest param-value limit among MLflow versions still deployed
_TAG_MAX = 5000         # the same for tag values (MLflow 3 takes 8000)
CUT = "…"               # ends a value cut to a limit, so the cut shows
FULL_SUFFIX = ".full"   # the parent's tag <param>.full: a param's whole value, where the param had to be cut


def experiment_name(lever: str) -> str:
    return f"vtcampaign/{lever}"


def at_project_root(uri: str, root: Path | str | None = None) -> str:
    """A sqlite URI with a relative path (the default ``sqlite:///mlflow.db``) made absolute at the project root
    (gitops.project_root), so a command run from a sub-folder logs to the project's store, not to a stray one
    there; any other URI as it is."""
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:////"):
        return uri
    root = gitops.project_root() if root is None else Path(root)
    return "sqlite:///" + str((root / uri[len("sqlite:///"):]).resolve())


def client(uri: str = DEFAULT_URI):
    from mlflow.tracking import MlflowClient
    return MlflowClient(tracking_uri=at_project_root(uri))


def _artifact_root(uri: str) -> str | None:
    """For a local sqlite store, artifacts go to mlartifacts/ beside the database (not to ./mlruns of the cwd)."""
    uri = at_project_root(uri)
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri[len("sqlite:///"):])
    return (db.resolve().parent / "mlartifacts").as_uri()


# MLflow 3 opens an experiment without this tag on its GenAI overview (traces, empty here); this kind opens the runs
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def ensure_experiment(c, lever: str, uri: str) -> str:
    name = experiment_name(lever)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.tags.get(EXPERIMENT_KIND[0]) != EXPERIMENT_KIND[1]:
            c.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
        return exp.experiment_id
    root = _artifact_root(uri)
    return c.create_experiment(name, artifact_location=f"{root}/{name}" if root else None,
                               tags={"lever": lever, "vtcampaign": "1", EXPERIMENT_KIND[0]: EXPERIMENT_KIND[1]})


def campaign_span(ev: Evidence) -> tuple[int | None, int | None]:
    """(start, end) of the campaign in ms: its creation, and its last leg's end (else creation + the gates'
    durations), so an ingested run shows how long the campaign took, not how long ago it ran."""
    start = _ms(ev.created)
    ends = [t for t in (_ms(leg.ended) for leg in ev.legs) if t]
    if ends:
        return start, max(ends)
    return start, (start + int(1000 * sum(g.duration_s for g in ev.gates))) if start else None


def campaign_runs(c, experiment_id: str, campaign_id: str) -> list:
    """The active runs (parent and children) of one campaign id."""
    runs, token = [], None
    while True:
        page = c.search_runs([experiment_id], filter_string=f"tags.`{CAMPAIGN_TAG}` = '{campaign_id}'",
                             max_results=1000, page_token=token)
        runs += list(page)
        token = page.token
        if not token:
            return runs


def _ms(iso: str) -> int | None:
    if not iso:
        return None
    try:
        return int(parse_utc(iso).timestamp() * 1000)
    except ValueError:
        return None


def _cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters; one cut ends in CUT, so a reader sees the value goes on elsewhere."""
    return text if len(text) <= limit else text[:limit - len(CUT)] + CUT


def _flatten(d: Any, prefix: str = "") -> dict[str, str]:
    """The config's leaves by dotted key, whole (``_config_params`` fits them to MLflow's limits)."""
    out: dict[str, str] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix.rstrip(".")] = str(d)
    return out


def _config_params(config: dict) -> tuple[dict[str, str], dict[str, str]]:
    """(params, tags) of the parent run for a config: every leaf a param, cut visibly at the param limit; a cut one
    also whole as the tag ``<key>.full`` (a hypothesis runs past 500 characters: its end is what it predicts)."""
    flat = _flatten(config)
    params = {k: _cut(v, _PARAM_MAX) for k, v in flat.items()}
    tags = {k + FULL_SUFFIX: _cut(v, _TAG_MAX) for k, v in flat.items() if len(v) > _PARAM_MAX}
    return params, tags


def _end_quietly(c, run_id: str, status: str, end_time: int | None = None) -> None:
    """Best effort at ending a run (the store may be what failed); never raises, so the error that brought us here
    is the one that propagates."""
    try:
        c.set_terminated(run_id, status, end_time=end_time)
    except Exception:
        pass


@contextmanager
def _ending(c, run_id: str, status: str, end_time: int | None = None) -> Iterator[None]:
    """Log a run inside the block, then end it with ``status``; where the block or that end raises, end it FAILED
    (best effort) and let the error go on, so logging that fails part-way leaves no run RUNNING for good."""
    try:
        yield
        c.set_terminated(run_id, status, end_time=end_time)
    except BaseException:
        _end_quietly(c, run_id, "FAILED", end_time)
        raise


def _log(c, run_id: str, metrics: Iterable[tuple[str, float, int]] = (), params: dict[str, str] | None = None,
         tags: dict[str, Any] | None = None, timestamp: int = 0) -> None:
    from mlflow.entities import Metric, Param, RunTag
    ms = [Metric(k, float(v), timestamp, int(step)) for k, v, step in metrics]
    ps = [Param(k, v) for k, v in sorted((params or {}).items())]
    ts = [RunTag(k, str(v)) for k, v in sorted((tags or {}).items())]
    # log_batch takes at most 1000 entities, of which at most 100 params and 100 tags.
    batches = max(-(-len(ms) // 800), -(-len(ps) // 100), -(-len(ts) // 100), 1)
    for i in range(batches):
        c.log_batch(run_id, metrics=ms[i * 800:(i + 1) * 800], params=ps[i * 100:(i + 1) * 100],
                    tags=ts[i * 100:(i + 1) * 100])


def log_evidence(ev: Evidence, uri: str = DEFAULT_URI, campaign_dir: Path | str | None = None,
                 live: bool = False) -> str:
    """Log one campaign (replacing any earlier logging of the same id); returns the parent run id. ``live``: a
    campaign that runs now (LiveCampaign.start): its gates and legs so far, the parent left RUNNING."""
    c = client(uri)
    exp = ensure_experiment(c, ev.lever, uri)
    for old in campaign_runs(c, exp, ev.campaign_id):
        c.delete_run(old.info.run_id)

    start, end = campaign_span(ev)
    base_tags = {CAMPAIGN_TAG: ev.campaign_id, "lever": ev.lever}
    parent = c.create_run(exp, start_time=start, run_name=f"campaign {ev.campaign_id}",
                          tags={**base_tags, KIND_TAG: "campaign", **_parent_tags(ev)})
    pid = parent.info.run_id
    child = {**base_tags, "mlflow.parentRunId": pid}
    try:
        params, full = _config_params(ev.config)
        _log(c, pid, params=params, tags=full, metrics=_parent_metrics(ev), timestamp=start or 0)
        for g in ev.gates:
            _log_gate(c, exp, child, g, start)
        for leg in ev.legs:
            _log_leg(c, exp, child, leg)
        if not live:    # a live campaign's arm summaries and artifacts come with its end; its parent stays RUNNING
            _finish(c, exp, pid, child, ev, campaign_dir)
    except BaseException:   # a parent that will never be completed: FAILED, not RUNNING for good
        _end_quietly(c, pid, "FAILED", None if live else end)
        raise
    return pid


def _parent_tags(ev: Evidence) -> dict[str, str]:
    fp, d = ev.fingerprint, ev.decision
    tags = {"verdict": d.verdict if d else ev.status.upper(), "git_sha": fp.git_sha, "dirty": str(fp.dirty).lower(),
            "device": fp.device_name, "device_type": fp.device_type, "branch": fp.branch, "status": ev.status,
            "candidate": (d.candidate if d else "") or "", "binding": str(bool(d and d.binding)).lower(),
            "byte_exact": str(d.byte_exact).lower() if d else "none", "kind": ev.kind}
    if ev.abandoned:
        tags["abandoned"] = _cut(ev.abandoned.get("why", ""), _TAG_MAX)
    if d:
        tags["rule"] = _cut(d.rule, _TAG_MAX)
        if d.effect_note:
            tags["effect_note"] = _cut(d.effect_note, _TAG_MAX)
    return tags


def _parent_metrics(ev: Evidence) -> list[tuple[str, float, int]]:
    """The verdict's figures: ratios and their intervals by concurrency, pooled effects, the grid's calibration,
    the attribution table."""
    metrics = [(f"ratio/{s.candidate}/{s.axis}", s.ratio, s.concurrency) for s in ev.stats if s.ratio is not None]
    for s in ev.stats:          # the effect's interval, charted by concurrency beside the ratio
        if s.effect is not None:
            metrics += [(f"effect_lo/{s.candidate}/{s.axis}", s.effect.lo, s.concurrency),
                        (f"effect_hi/{s.candidate}/{s.axis}", s.effect.hi, s.concurrency)]
    for pe in ev.pooled:
        metrics += [(f"pooled/{pe.candidate}/{pe.axis}/{k}", getattr(pe.effect, k), 0) for k in ("ratio", "lo", "hi")]
    cal = ev.calibration
    if cal is not None:         # the grid's own error rates: what the verdict is worth
        metrics += [("calibration/false_flip", cal.false_flip, 0), ("calibration/false_reject", cal.false_reject, 0),
                    ("calibration/separations_q95", float(cal.separations_q95), 0)]
        metrics += [(f"calibration/power_at_{g}", p, 0) for g, p in cal.power.items()]
        if cal.mde_80 is not None:
            metrics.append(("calibration/mde_80", cal.mde_80, 0))
    from campaigns.records import attribution_view
    for a in attribution_view(ev):      # the Attribution table, charted by concurrency per kernel
        for r in a["rows"]:
            for key in ("base", "cand", "delta"):
                metrics.append((f"attribution/{a['arm']}/{r['kernel'].replace(' ', '_')}/{key}_us",
                                float(r[key].replace(",", "")), int(a["c"])))
    return metrics


def _finish(c, exp: str, pid: str, child: dict[str, str], ev: Evidence, campaign_dir: Path | str | None) -> None:
    """A campaign's end: a summary run per arm, the artifacts, the parent FINISHED."""
    fp = ev.fingerprint
    start, end = campaign_span(ev)
    for arm in ev.arms:
        arm_legs = [leg for leg in ev.legs if leg.arm == arm.name]
        arm_start = min((_ms(leg.started) for leg in arm_legs if leg.started), default=start)
        arm_end = max((_ms(leg.ended) for leg in arm_legs if leg.ended), default=end)
        run = c.create_run(exp, start_time=arm_start, run_name=f"arm {arm.name}", tags={
            **child, KIND_TAG: "arm-summary", "arm": arm.name, "role": arm.role, "value": str(arm.value)})
        peak = ([("peak_memory_gib", float(ev.peak_memory_gib[arm.name]), 0)]
                if arm.name in ev.peak_memory_gib else [])        # the record's memory axis, per arm
        env = " ".join(f"{k}={v}" for k, v in sorted(fp.arms_env.get(arm.name, {}).items()))
        with _ending(c, run.info.run_id, "FINISHED", arm_end):
            _log(c, run.info.run_id, metrics=arm_summary_metrics(ev, arm.name) + peak, timestamp=start or 0,
                 params={"lever_value": str(arm.value), "env": env})
    if campaign_dir is not None:
        for name in ARTIFACTS:
            path = Path(campaign_dir) / name
            if path.is_file():
                c.log_artifact(pid, str(path))
    c.set_terminated(pid, "FINISHED", end_time=end)   # an in-progress campaign shows as such in its `status` tag


def _log_gate(c, exp: str, child: dict[str, str], g, start: int | None) -> None:
    run = c.create_run(exp, start_time=start, run_name=f"gate {g.gate} [{g.arm}]", tags={
        **child, KIND_TAG: "gate", "gate": g.gate, "arm": g.arm, "passed": str(g.passed).lower(),
        "skipped": str(g.skipped).lower(), "self_check": str(g.self_check).lower(),
        "byte_exact": str(g.byte_exact).lower()})
    metrics = [(k, v, 0) for k, v in g.counts.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    with _ending(c, run.info.run_id, "FINISHED" if g.passed or g.skipped else "FAILED",
                 (start + int(1000 * g.duration_s)) if start else None):
        _log(c, run.info.run_id, metrics=metrics + [("duration_s", g.duration_s, 0)],
             tags={"reason": _cut(g.reason, _TAG_MAX)} if g.reason else None, timestamp=start or 0)


def _log_leg(c, exp: str, child: dict[str, str], leg) -> None:
    t0 = _ms(leg.started)
    run = c.create_run(exp, start_time=t0, run_name=f"leg c{leg.concurrency} rep{leg.rep} [{leg.arm}]", tags={
        **child, KIND_TAG: "leg", "arm": leg.arm, "concurrency": leg.concurrency, "rep": leg.rep,
        "order_index": leg.order_index, "valid": str(leg.valid).lower(), "prompts_sha256": leg.prompts_sha256})
    metrics = [(k, v, 0) for k, v in leg.metrics.items()]
    metrics += [(k, v, i) for i, sample in enumerate(leg.gpu_samples) for k, v in sample.items()
                if isinstance(v, (int, float))]
    with _ending(c, run.info.run_id, "FINISHED" if leg.valid else "FAILED", _ms(leg.ended)):
        _log(c, run.info.run_id, metrics=metrics, timestamp=t0 or 0,
             tags={"reasons": _cut("; ".join(leg.reasons), _TAG_MAX)} if leg.reasons else None)


def stores(ev: Evidence) -> list[str]:
    """The tracking stores that may hold ``ev``: the local default, and the one the campaign logged to (its
    config's tracking.uri, where tracking was on) when that is another."""
    out = [at_project_root(DEFAULT_URI)]
    track = (ev.config or {}).get("tracking") or {}
    own = track.get("uri") if track.get("enabled", True) else None
    if isinstance(own, str) and own and at_project_root(own) not in out:
        out.append(at_project_root(own))
    return out


def relog_if_logged(ev: Evidence, campaign_dir: Path | str | None = None, uri: str = DEFAULT_URI) -> str | None:
    """Log ``ev`` again (its earlier runs replaced) where the store already holds it, so a verdict decided again
    (``vtcampaign decide``) does not leave MLflow on the old one; the new parent run id, or None where the store
    does not hold the campaign (a local sqlite store that does not exist is not created)."""
    uri = at_project_root(uri)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        return None
    c = client(uri)
    exp = c.get_experiment_by_name(experiment_name(ev.lever))
    if exp is None or not campaign_runs(c, exp.experiment_id, ev.campaign_id):
        return None
    return log_evidence(ev, uri, campaign_dir)


def log_campaign(ev: Evidence, campaign_dir: Path | str | None = None, uri: str = DEFAULT_URI) -> str:
    """The runner's spelling of ``log_evidence`` (campaign directory first); same behaviour."""
    return log_evidence(ev, uri, campaign_dir)


def arm_summary_metrics(ev: Evidence, arm: str) -> list[tuple[str, float, int]]:
    """(metric, median over the valid reps, step = concurrency) for every leg metric of one arm."""
    by: dict[tuple[str, int], list[float]] = {}
    for leg in ev.legs:
        if leg.arm == arm and leg.valid:
            for k, v in leg.metrics.items():
                by.setdefault((k, leg.concurrency), []).append(v)
    return [(k, float(statistics.median(vals)), c) for (k, c), vals in sorted(by.items())]


class LiveCampaign:
    """A campaign's MLflow runs while it runs, so the UI shows it as it goes, and shows how it stopped.

    ``start`` logs the parent run RUNNING (a resume first replaces the earlier runs of its id, its recorded gates
    and legs logged again); ``gate`` and ``leg`` add a child run as each is recorded; ``end`` ends the parent KILLED
    (Ctrl-C, SIGTERM, a device command's time limit) or FAILED (an error); ``finish`` completes the same run with the
    verdict, so the run a user watched is the one that holds it. ``uri=None`` (tracking=off) does nothing.
    Logging never stops a campaign: the first error is one warning, and live logging stops there; the evidence file
    holds everything, and the end (or `vtcampaign log`) logs it. The client and the parent's id outlive that error,
    so the parent still ends once (best effort, silently): a stopped campaign's parent with ``end``'s status, a
    completed one's FAILED (its run lacks the completion; the runner then logs the campaign whole, replacing it)."""

    def __init__(self, uri: str | None, warn: Callable[[str], None]):
        self.uri, self.warn = uri, warn
        self.c = self.exp = self.pid = None
        self.child: dict[str, str] = {}
        self.start_ms: int | None = None
        self.logged: set = set()        # the gates ((gate, arm)) and legs (their keys) the parent has as children
        self.stopped = False            # live logging stopped at an error: no more children, no completion
        self.ended = False              # the parent ended (or one try made): later ends do nothing

    def _guard(self, fn: Callable[[], None]) -> bool:
        """Run ``fn``; True where it raised nothing. The first error warns and stops live logging."""
        try:
            fn()
            return True
        except Exception as e:      # MLflow raises many types (connection, bad URI, store schema): one warning
            if not self.stopped:
                msg = str(e).splitlines()[0] if str(e) else ""
                self.warn(f"MLflow live logging to {self.uri} stopped ({type(e).__name__}: {msg}); the evidence "
                          "keeps every gate and leg, and the campaign's end logs them")
            self.stopped = True
            return False

    @property
    def _live(self) -> bool:
        return self.c is not None and not self.stopped and not self.ended

    def start(self, ev: Evidence, campaign_dir: Path | str | None = None) -> None:
        if self.uri is None:
            return

        def go():       # a log_evidence that fails part-way ends its own parent FAILED (self.pid stays None)
            self.c = client(self.uri)
            self.pid = log_evidence(ev, self.uri, campaign_dir, live=True)
            self.exp = ensure_experiment(self.c, ev.lever, self.uri)
            self.child = {CAMPAIGN_TAG: ev.campaign_id, "lever": ev.lever, "mlflow.parentRunId": self.pid}
            self.start_ms = campaign_span(ev)[0]
            self.logged = {(g.gate, g.arm) for g in ev.gates} | {leg.key for leg in ev.legs}
        self._guard(go)

    def gate(self, g) -> None:
        if self._live:
            self._guard(lambda: _log_gate(self.c, self.exp, self.child, g, self.start_ms))
            self.logged.add((g.gate, g.arm))

    def leg(self, leg) -> None:
        if self._live:
            self._guard(lambda: _log_leg(self.c, self.exp, self.child, leg))
            self.logged.add(leg.key)

    def finish(self, ev: Evidence, campaign_dir: Path | str | None = None) -> str | None:
        """The campaign's end on the run it has had since its start (its id stays the one a user watched): the
        verdict's tags and figures, any gate or leg not yet a child (gates recorded as skipped at the start), the arm
        summaries and artifacts, FINISHED. Returns the run id, or None where live logging is off or stopped (then
        log_campaign logs the campaign whole, and the parent here ends FAILED: it will not hold the completion)."""
        if not self._live:
            self.end("FAILED")
            return None
        c = self.c

        def go():
            _log(c, self.pid, metrics=_parent_metrics(ev), tags=_parent_tags(ev), timestamp=self.start_ms or 0)
            for g in ev.gates:
                if (g.gate, g.arm) not in self.logged:
                    _log_gate(c, self.exp, self.child, g, self.start_ms)
            for leg in ev.legs:
                if leg.key not in self.logged:
                    _log_leg(c, self.exp, self.child, leg)
            _finish(c, self.exp, self.pid, self.child, ev, campaign_dir)
        if self._guard(go):
            self.ended = True
            return self.pid
        self.end("FAILED")
        return None

    def end(self, status: str) -> None:
        """End the parent run with MLflow's ``status`` (FINISHED, FAILED, KILLED), even after live logging stopped
        at an error (one try, its error a warning only where none came before); later calls do nothing."""
        if self.c is None or self.pid is None or self.ended:
            return
        self.ended = True
        c, pid = self.c, self.pid
        if self.stopped:
            _end_quietly(c, pid, status)
        else:
            self._guard(lambda: c.set_terminated(pid, status))
