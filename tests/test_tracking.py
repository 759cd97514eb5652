"""MLflow layout against a real sqlite store: experiment per lever, parent run per campaign with its tags, nested
children per gate x arm and per leg, a summary run per arm with metrics at step = concurrency, artifacts, and
re-logging that replaces rather than duplicates. One store per module (MLflow's sqlite set-up takes seconds)."""
from __future__ import annotations

import statistics

import pytest

from campaigns import records, tracking
from campaigns.cli import main
from campaigns.evidence import save_evidence
from campaigns.gates import GATE_NAMES
from helpers import TPUT_WIN, make_evidence


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    ev = make_evidence(TPUT_WIN)
    ev.peak_memory_gib = {"off": 21.5, "on": 19.25}
    ev.legs[0].gpu_samples = [{"sm_clock_mhz": 1980.0, "temp_c": 41.0}, {"sm_clock_mhz": 1965.0, "temp_c": 44.0}]
    cdir = root / "campaigns" / ev.campaign_id
    save_evidence(ev, cdir)
    records.write_campaign(ev, cdir, plot=False)
    parent_id = tracking.log_evidence(ev, uri, campaign_dir=cdir)
    c = tracking.client(uri)
    exp = c.get_experiment_by_name("vtcampaign/gqa_swap")
    return {"uri": uri, "root": root, "ev": ev, "cdir": cdir, "parent": parent_id, "client": c, "exp": exp}


def _runs(store, kind=None):
    runs = tracking.campaign_runs(store["client"], store["exp"].experiment_id, store["ev"].campaign_id)
    return [r for r in runs if kind is None or r.data.tags.get(tracking.KIND_TAG) == kind]


def test_parent_run_carries_the_campaign_tags(store):
    ev, c = store["ev"], store["client"]
    assert store["exp"] is not None and store["exp"].artifact_location.startswith(
        (store["root"] / "mlartifacts").as_uri())              # beside the db, not ./mlruns of the cwd
    parent = c.get_run(store["parent"])
    tags = parent.data.tags
    assert (tags["lever"], tags["verdict"], tags["git_sha"], tags["dirty"], tags["device"]) == (
        "gqa_swap", "FLIP", ev.fingerprint.git_sha, "false", "NVIDIA H200")
    assert tags[tracking.CAMPAIGN_TAG] == ev.campaign_id and parent.info.status == "FINISHED"
    assert parent.data.params["grid.reps"] == "3" and parent.data.params["campaign.lever"] == "gqa_swap"
    hist = c.get_metric_history(store["parent"], "ratio/on/total_token_throughput")
    assert sorted((m.step, round(m.value, 6)) for m in hist) == [(c_, round(111 / 101, 6)) for c_ in (1, 2, 4, 8)]
    names = {f.path for f in c.list_artifacts(store["parent"])}
    assert {"evidence.json", "record.md", "pr.md"} <= names


def test_children_are_nested_per_gate_arm_and_per_leg(store):
    ev = store["ev"]
    gates, legs = _runs(store, "gate"), _runs(store, "leg")
    assert len(gates) == len(ev.gates) == 2 * len(GATE_NAMES) and len(legs) == len(ev.legs) == 24
    for r in gates + legs + _runs(store, "arm-summary"):
        assert r.data.tags["mlflow.parentRunId"] == store["parent"]
    op_on = next(r for r in gates if r.data.tags["gate"] == "op" and r.data.tags["arm"] == "on")
    assert op_on.data.tags["byte_exact"] == "true" and op_on.data.metrics["checks"] == 8
    leg = next(r for r in legs if r.data.tags["concurrency"] == "4" and r.data.tags["rep"] == "2"
               and r.data.tags["arm"] == "on")
    assert leg.data.metrics["total_token_throughput"] == 112.0
    clocks = store["client"].get_metric_history(ev.legs[0] and next(
        r.info.run_id for r in legs if r.data.tags["order_index"] == "0"), "sm_clock_mhz")
    assert sorted((m.step, m.value) for m in clocks) == [(0, 1980.0), (1, 1965.0)]


def test_arm_summaries_log_medians_at_step_concurrency(store):
    ev, c = store["ev"], store["client"]
    arms = {r.data.tags["arm"]: r for r in _runs(store, "arm-summary")}
    assert set(arms) == {"off", "on"}
    for arm, run in arms.items():
        hist = c.get_metric_history(run.info.run_id, "total_token_throughput")
        expected = {cc: statistics.median(leg.metrics["total_token_throughput"] for leg in ev.legs
                                          if leg.arm == arm and leg.concurrency == cc) for cc in (1, 2, 4, 8)}
        assert {m.step: m.value for m in hist} == expected
    assert arms["on"].data.params["env"] == "VT_DECODE_GQA_SWAP=on"
    assert {a: r.data.metrics["peak_memory_gib"] for a, r in arms.items()} == ev.peak_memory_gib


def test_relogging_replaces_instead_of_duplicating(store):
    c = store["client"]
    before = {r.info.run_id for r in _runs(store)}
    assert len(before) == 1 + 2 * len(GATE_NAMES) + 24 + 2
    new_parent = tracking.log_evidence(store["ev"], store["uri"], campaign_dir=store["cdir"])
    after = {r.info.run_id for r in _runs(store)}
    assert len(after) == len(before) and not (after & before) and new_parent in after
    assert c.get_run(store["parent"]).info.lifecycle_stage == "deleted"
    store["parent"] = new_parent


def test_cli_log_ingests_an_evidence_file_written_with_tracking_off(store, capsys):
    ev = make_evidence(TPUT_WIN, lever="fast_math", campaign_id="2026-11-30-fast_math-abc1234")
    cdir = store["root"] / "campaigns" / ev.campaign_id
    save_evidence(ev, cdir)
    assert main(["log", str(cdir / "evidence.json"), "--tracking-uri", store["uri"]]) == 0
    assert "logged 2026-11-30-fast_math-abc1234" in capsys.readouterr().out
    exp = store["client"].get_experiment_by_name("vtcampaign/fast_math")
    runs = tracking.campaign_runs(store["client"], exp.experiment_id, ev.campaign_id)
    assert sum(r.data.tags.get(tracking.KIND_TAG) == "campaign" for r in runs) == 1
    assert main(["log", str(cdir / "missing.json"), "--tracking-uri", store["uri"]]) == 2


def test_experiments_open_on_runs_and_ingested_runs_keep_the_campaigns_own_times(store):
    """MLflow 3 opens an untagged experiment on its (empty) GenAI traces view; and an ingested run's end time was
    the time of ingestion, so an arm run showed a duration of a day."""
    c, ev = store["client"], store["ev"]
    exp = c.get_experiment(store["exp"].experiment_id)
    assert exp.tags[tracking.EXPERIMENT_KIND[0]] == "custom_model_development"
    start, end = tracking.campaign_span(ev)
    parent = c.get_run(store["parent"])
    assert (parent.info.start_time, parent.info.end_time) == (start, end)
    # make_evidence's legs run 10:00:00 -> 10:00:05 (5 s each): the arm run spans exactly that
    for arm in _runs(store, "arm-summary"):
        assert arm.info.end_time - arm.info.start_time == 5000
    for gate in _runs(store, "gate"):
        assert gate.info.end_time - gate.info.start_time == 1500           # duration_s 1.5 in the builder


def test_a_tracking_store_out_of_reach_is_a_clear_error_and_loses_nothing(store, capsys, tmp_path, monkeypatch):
    """`vtcampaign log` to a URI MLflow cannot use says so in one line (no traceback); a campaign's own logging
    only warns (the evidence, the records and a commit=true flip come first), naming the command to log it later."""
    import io

    from rich.console import Console

    from campaigns import runner
    from campaigns.config import compose
    ev, cdir = store["ev"], store["cdir"]
    (tmp_path / "a-file").write_text("not a directory\n")
    for uri in ("bogus://nowhere", f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"):
        assert main(["log", str(cdir / "evidence.json"), "--tracking-uri", uri]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vtcampaign: error: could not log {ev.campaign_id} to {uri!r}: ")
        assert err.count("\n") == 1
    said = io.StringIO()
    monkeypatch.setattr(runner, "console", Console(file=said, width=400))
    cfg = compose(["campaign=gqa_swap", "tracking=remote", "tracking.uri=bogus://nowhere"], cuda=False)
    runner._track(cfg, ev, cdir)                                    # returns: a warning, not an exception
    assert "MLflow logging to bogus://nowhere failed (" in said.getvalue()
    assert f"`vtcampaign log {cdir / 'evidence.json'} --tracking-uri <uri>` later" in said.getvalue()


def test_mlflow_tracking_uri_names_the_default_store(monkeypatch):
    from campaigns.config import compose
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://tracking.example:5000")
    assert compose(["campaign=gqa_swap"], cuda=False).tracking.uri == "http://tracking.example:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert compose(["campaign=gqa_swap"], cuda=False).tracking.uri == "sqlite:///mlflow.db"


def test_the_default_store_is_the_project_roots_from_any_sub_folder(tmp_path, monkeypatch):
    """`sqlite:///mlflow.db` (the default) names the store at the project root, as the README says, wherever the
    command runs; an absolute sqlite path and a server URI stay as they are."""
    import git

    from campaigns.tracking import at_project_root
    git.Repo.init(tmp_path)
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    monkeypatch.chdir(sub)
    assert at_project_root("sqlite:///mlflow.db") == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert at_project_root("sqlite:////x/y.db") == "sqlite:////x/y.db"
    assert at_project_root("http://mlflow:5000") == "http://mlflow:5000"


def test_a_campaign_decided_again_is_re_logged_where_the_store_holds_it(store, tmp_path):
    """`vtcampaign decide` may change a verdict: the store that holds the campaign gets it again (its runs replaced,
    the verdict tag the new one); a store without it, or a sqlite file that does not exist, is left alone."""
    import copy
    ev = copy.deepcopy(store["ev"])
    ev.decision.verdict = "KEEP"
    run_id = tracking.relog_if_logged(ev, store["cdir"], store["uri"])
    assert run_id and run_id != store["parent"]
    parents = _runs(store, "campaign")
    assert [r.data.tags["verdict"] for r in parents] == ["KEEP"]
    other = copy.deepcopy(ev)
    other.campaign_id = "2026-12-05-gqa_swap-fff0000"
    assert tracking.relog_if_logged(other, None, store["uri"]) is None
    missing = tmp_path / "none.db"
    assert tracking.relog_if_logged(ev, None, f"sqlite:///{missing}") is None and not missing.exists()
    tracking.relog_if_logged(store["ev"], store["cdir"], store["uri"])        # the module's store as it was


def test_a_verdict_decided_again_reaches_the_store_the_campaign_logged_to(store, capsys):
    """decide and abandon re-logged only the local default store: a campaign logged to its own tracking.uri kept its
    old verdict there, silently (a review's repro)."""
    import copy

    from campaigns import cli
    ev = copy.deepcopy(store["ev"])
    ev.config["tracking"] = {"name": "local", "enabled": True, "uri": store["uri"]}
    assert tracking.stores(ev)[-1] == store["uri"] and len(tracking.stores(ev)) == 2
    ev.decision.verdict = "KEEP"
    cli._relog(ev, store["cdir"])
    assert f"MLflow: {store['uri']} re-logged {ev.campaign_id}" in capsys.readouterr().out
    assert [r.data.tags["verdict"] for r in _runs(store, "campaign")] == ["KEEP"]
    ev.config["tracking"]["enabled"] = False
    assert len(tracking.stores(ev)) == 1
    tracking.relog_if_logged(store["ev"], store["cdir"], store["uri"])        # the module's store as it was


def test_live_logging_follows_the_campaign_and_an_unreachable_store_only_warns_once(store, tmp_path):
    """LiveCampaign on a store of its own: the parent RUNNING from the start with its recorded legs, each later leg
    a child as it comes, the parent ended KILLED; the end's whole logging replaces them. A URI MLflow cannot use
    warns once and does nothing after; tracking=off (uri None) does nothing at all."""
    import copy
    ev = copy.deepcopy(store["ev"])
    ev.campaign_id, ev.status, ev.decision = "2026-12-05-gqa_swap-live000", "in-progress", None
    later, ev.legs = ev.legs[2:], ev.legs[:2]
    uri = f"sqlite:///{tmp_path / 'live.db'}"
    said: list[str] = []
    live = tracking.LiveCampaign(uri, said.append)
    live.start(ev)
    c = tracking.client(uri)
    exp = c.get_experiment_by_name("vtcampaign/gqa_swap").experiment_id

    def runs(kind):
        return [r for r in tracking.campaign_runs(c, exp, ev.campaign_id) if r.data.tags[tracking.KIND_TAG] == kind]
    assert [(r.info.status, r.data.tags["verdict"]) for r in runs("campaign")] == [("RUNNING", "IN-PROGRESS")]
    assert len(runs("leg")) == 2 and len(runs("gate")) == len(ev.gates) and not runs("arm-summary")
    live.leg(later[0])
    leg = [r for r in runs("leg") if r.data.tags["order_index"] == str(later[0].order_index)]
    assert len(runs("leg")) == 3 and leg[0].data.metrics == later[0].metrics
    assert leg[0].data.tags["mlflow.parentRunId"] == runs("campaign")[0].info.run_id
    live.end("KILLED")
    live.end("FAILED")                  # a later end changes nothing
    assert [r.info.status for r in runs("campaign")] == ["KILLED"]
    ev.legs += later
    tracking.log_evidence(ev, uri)
    assert [r.info.status for r in runs("campaign")] == ["FINISHED"] and len(runs("leg")) == len(ev.legs)
    assert said == []

    # a campaign that ends: finish completes the run it has had since its start (the id a user watched), with
    # the verdict, the arm summaries, and what was recorded without a live call (gates skipped at the start)
    ev.legs, ev.decision, ev.status = ev.legs[:2], None, "in-progress"
    gates, ev.gates = ev.gates, ev.gates[:-1]
    live = tracking.LiveCampaign(uri, said.append)
    live.start(ev)
    first = runs("campaign")
    assert [r.info.status for r in first] == ["RUNNING"]
    ev.gates = gates
    for leg in later:
        live.leg(leg)
    ev.legs += later
    ev.decision, ev.status = copy.deepcopy(store["ev"].decision), "complete"
    assert live.finish(ev) == first[0].info.run_id
    assert live.finish(ev) is None                  # once
    parent = runs("campaign")
    assert [(r.info.run_id, r.info.status) for r in parent] == [(first[0].info.run_id, "FINISHED")]
    assert parent[0].data.tags["verdict"] == ev.decision.verdict and parent[0].data.tags["status"] == "complete"
    assert any(k.startswith("ratio/") for k in parent[0].data.metrics)
    assert len(runs("gate")) == len(ev.gates) and len(runs("leg")) == len(ev.legs)
    assert {r.data.tags["arm"] for r in runs("arm-summary")} == {a.name for a in ev.arms}
    assert said == []

    (tmp_path / "a-file").write_text("not a directory\n")
    bad = tracking.LiveCampaign(f"sqlite:///{tmp_path / 'a-file' / 'm.db'}", said.append)
    bad.start(ev)
    bad.leg(later[0])
    bad.end("KILLED")
    assert len(said) == 1 and said[0].startswith(f"MLflow live logging to sqlite:///{tmp_path / 'a-file'}")
    assert "the evidence keeps every gate and leg" in said[0]
    off = tracking.LiveCampaign(None, said.append)
    off.start(ev)
    off.leg(later[0])
    off.end("KILLED")
    assert len(said) == 1


def _fail_on_call(monkeypatch, method: str, n: int) -> None:
    """MlflowClient.<method> raises on its n-th call from now on, and only then: a store that fails part-way."""
    from mlflow.tracking import MlflowClient
    real, calls = getattr(MlflowClient, method), []

    def flaky(self, *args, **kwargs):
        calls.append(method)
        if len(calls) == n:
            raise ConnectionError(f"injected: {method} call {n}")
        return real(self, *args, **kwargs)
    monkeypatch.setattr(MlflowClient, method, flaky)


def _statuses(uri: str, ev) -> dict[tuple[str, str], int]:
    """How many runs of each (kind, status) the campaign has in the store."""
    from collections import Counter
    c = tracking.client(uri)
    exp = c.get_experiment_by_name(tracking.experiment_name(ev.lever))
    runs = tracking.campaign_runs(c, exp.experiment_id, ev.campaign_id)
    return dict(Counter((r.data.tags[tracking.KIND_TAG], r.info.status) for r in runs))


@pytest.mark.parametrize("method,nth,where", [("log_batch", 4, "a gate's metrics"),
                                              ("set_terminated", len(GATE_NAMES) * 2 + 3, "a leg's end"),
                                              ("log_batch", 1 + len(GATE_NAMES) * 2 + 24 + 1, "an arm's metrics")])
def test_logging_that_fails_part_way_leaves_no_run_running(tmp_path, monkeypatch, method, nth, where):
    """An error part-way through logging a campaign whole (the store going away, say) propagated, but left the parent
    and the half-logged child RUNNING for good: every run it created is ended, FAILED where its logging failed."""
    ev = make_evidence(TPUT_WIN)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.client(uri).search_experiments()       # the store's schema first: its set-up is no part of the count
    _fail_on_call(monkeypatch, method, nth)
    with pytest.raises(ConnectionError, match="injected"):
        tracking.log_evidence(ev, uri)
    gates = 2 * len(GATE_NAMES)
    expected = {"a gate's metrics": {("campaign", "FAILED"): 1, ("gate", "FINISHED"): 2, ("gate", "FAILED"): 1},
                "a leg's end": {("campaign", "FAILED"): 1, ("gate", "FINISHED"): gates, ("leg", "FINISHED"): 2,
                                ("leg", "FAILED"): 1},
                "an arm's metrics": {("campaign", "FAILED"): 1, ("gate", "FINISHED"): gates, ("leg", "FINISHED"): 24,
                                     ("arm-summary", "FAILED"): 1}}[where]
    assert _statuses(uri, ev) == expected


@pytest.mark.parametrize("fails", ["start", "leg", "finish"])
def test_live_logging_that_fails_part_way_still_ends_its_runs(store, tmp_path, monkeypatch, fails):
    """The first MLflow error stops live logging with one warning; it also dropped the client, so the campaign's end
    left the parent RUNNING for good (and the leg whose logging failed). Now each run ends: the half-logged child
    FAILED, the parent with the status ``end`` gives it (FAILED where the campaign's completion could not be logged
    on it, and after a failed start), and only once."""
    import copy
    ev = copy.deepcopy(store["ev"])
    ev.campaign_id, ev.status, ev.decision = f"2026-12-05-gqa_swap-fail-{fails}", "in-progress", None
    later, ev.legs = ev.legs[2:4], ev.legs[:2]
    uri = f"sqlite:///{tmp_path / 'live.db'}"
    tracking.client(uri).search_experiments()
    said: list[str] = []
    live = tracking.LiveCampaign(uri, said.append)
    gates = len(ev.gates)
    if fails == "start":
        _fail_on_call(monkeypatch, "log_batch", 3)          # the parent's batch, a gate's, then the next gate's
    live.start(ev)
    if fails == "leg":
        _fail_on_call(monkeypatch, "log_batch", 1)
    for leg in later:
        live.leg(leg)                                       # after a failure: not logged, no second warning
    ev.legs += later
    if fails == "finish":
        _fail_on_call(monkeypatch, "log_batch", 1)          # the verdict's figures on the parent
        ev.decision, ev.status = copy.deepcopy(store["ev"].decision), "complete"
        assert live.finish(ev) is None                      # the runner then logs the campaign whole
    live.end("KILLED")
    live.end("FINISHED")                                    # a later end changes nothing
    assert len(said) == 1 and said[0].startswith(f"MLflow live logging to {uri} stopped (ConnectionError: injected")
    assert _statuses(uri, ev) == {
        "start": {("campaign", "FAILED"): 1, ("gate", "FINISHED"): 1, ("gate", "FAILED"): 1},
        "leg": {("campaign", "KILLED"): 1, ("gate", "FINISHED"): gates, ("leg", "FINISHED"): 2, ("leg", "FAILED"): 1},
        "finish": {("campaign", "FAILED"): 1, ("gate", "FINISHED"): gates, ("leg", "FINISHED"): 4},
    }[fails]


def test_long_params_are_cut_visibly_and_logged_whole_as_tags(store):
    """MLflow params are cut at 500 characters (the smallest limit of the servers still deployed); the cut was silent,
    and the hypothesis of many campaigns lost its end. The param now ends with an ellipsis, and the parent run carries
    the whole text in the tag ``<param>.full`` (itself cut visibly at 5000 characters, the tag limit)."""
    import copy
    ev = copy.deepcopy(store["ev"])
    ev.campaign_id = "2026-12-05-gqa_swap-longtext"
    hypothesis = " ".join(f"step {i}: the split count halves the tail." for i in range(40))   # 1,669 characters
    huge = "x" * 6000
    ev.config["campaign"].update(hypothesis=hypothesis, residual=hypothesis[:526], notes=huge)
    run = store["client"].get_run(tracking.log_evidence(ev, store["uri"]))
    params, tags = run.data.params, run.data.tags
    assert len(hypothesis) > 500 and params["campaign.hypothesis"] == hypothesis[:499] + "…"
    assert params["campaign.residual"] == hypothesis[:499] + "…" and params["campaign.notes"] == "x" * 499 + "…"
    assert tags["campaign.hypothesis.full"] == hypothesis and tags["campaign.residual.full"] == hypothesis[:526]
    assert tags["campaign.notes.full"] == "x" * 4999 + "…"
    assert params["campaign.lever"] == "gqa_swap" and "campaign.lever.full" not in tags     # short: the param only


def test_long_tags_are_cut_visibly(store):
    """The verdict's rule and an abandoned campaign's reason were cut at 5,000 characters silently."""
    import copy
    ev = copy.deepcopy(store["ev"])
    ev.campaign_id = "2026-12-08-gqa_swap-longrule"
    ev.decision.rule = "r" * 6000
    ev.abandoned = {"why": "w" * 5001}
    tags = store["client"].get_run(tracking.log_evidence(ev, store["uri"])).data.tags
    assert tags["rule"] == "r" * 4999 + "…" and tags["abandoned"] == "w" * 4999 + "…"
