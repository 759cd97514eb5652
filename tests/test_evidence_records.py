"""Evidence JSON round trip and atomic writes; records rendered from evidence, re-rendered byte for byte;
STATUS.md and BENCHMARKS.md keyed by lever and updated in place as campaigns accumulate."""
from __future__ import annotations

import json
import math
import os
import re
import shutil

import pytest

from campaigns import records
from campaigns.evidence import (Evidence, EvidenceError, LegResult, dump_json, find_evidence, load_evidence,
                                new_campaign_id, save_evidence, write_atomic)
from helpers import TPUT_WIN, gates, make_evidence

LOSS = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [90.0, 91.0, 92.0]}}
NEUTRAL = {"total_token_throughput": {"off": [101.0, 102.0, 104.0], "on": [100.0, 103.0, 106.0]}}


def _rich_evidence() -> Evidence:
    g = gates(byte_exact=False, **{"battery@on": {"passed": False, "counts": {"prompts": 16, "strict": 15,
                                                                              "near_tie": 1, "divergent": 0},
                                                   "details": {"divergences": [{"prompt": 3, "gap": 0.0}]}},
                                    "near_tie@on": {"counts": {"divergences": 1, "max_gap_mnats": 12.5}},
                                    "memcheck@on": {"skipped": True, "reason": "compute-sanitizer not found"},
                                    "mechanism@on": {"details": {"routes": {"gqa_swap": 36}, "grid": "1x8x4"}}})
    ev = make_evidence(TPUT_WIN, gate_results=g, inapplicable={"memcheck": "compute-sanitizer not found"})
    ev.legs[0].gpu_samples = [{"t_s": 0.0, "sm_clock_mhz": 1980.0, "temp_c": 41.0}]
    ev.peak_memory_gib = {"off": 21.5, "on": 19.25}
    return ev


# ----------------------------------------------------------------------------------------------- evidence


def test_evidence_text_reads_back_exactly_with_nan_nesting_and_empties():
    data = {"b": [{"x": float("nan"), "y": [1, 2.5]}, {"x": -0.0}], "a": {"k": {"z": 1, "w": None}, "e": []},
            "c": [], "d": {}, "s": "t\u00e9\n", "i": 3, "f": 1e-300}
    text = dump_json(data)
    back = json.loads(text)
    assert json.dumps(back, sort_keys=True) == json.dumps(data, sort_keys=True)
    assert math.isnan(back["b"][0]["x"]) and math.copysign(1.0, back["b"][1]["x"]) == -1.0
    assert text.splitlines()[:5] == ['{', ' "a":{', '  "e":[],', '  "k":{"w":null,"z":1}', ' },']
    assert text.endswith("\n}\n")
    # keys that are not strings become strings, as json.dumps writes them, at every depth
    assert json.loads(dump_json({"a": {1: 2, 3: [{4: 5}]}})) == {"a": {"1": 2, "3": [{"4": 5}]}}


def test_json_round_trip_is_exact(tmp_path):
    ev = _rich_evidence()
    path = save_evidence(ev, tmp_path / ev.campaign_id)
    back = load_evidence(path)
    assert back == ev
    assert back.to_json() == path.read_text()
    # One line per leg and per gate: a resumed campaign's diff reads leg by leg.
    lines = path.read_text().splitlines()
    assert sum(line.startswith('  {"arm":') and '"concurrency":' in line for line in lines) == len(ev.legs) > 0
    assert sum(line.startswith('  {"arm":') and '"gate":' in line for line in lines) == len(ev.gates) > 0
    # Types survive, not just values: ints stay ints, floats stay floats, lever values keep their type.
    bat = back.gate("battery", "on")
    assert type(bat.counts["strict"]) is int and type(back.gate("near_tie", "on").counts["max_gap_mnats"]) is float
    assert back.arms[1].value is True and back.decision.new_default is True
    assert back.stats[0].summary["on"].n == 3


def test_load_refuses_other_schema_versions_and_bad_files(tmp_path):
    ev = make_evidence(TPUT_WIN)
    path = save_evidence(ev, tmp_path / "c")
    data = json.loads(path.read_text())
    data["schema_version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(EvidenceError, match=r"schema_version 99 is not supported; accepted: 1, 2"):
        load_evidence(path)
    data["schema_version"] = 2
    data["legs"][0]["mystery"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(EvidenceError, match=r"evidence.legs\[0\]: unknown keys \['mystery'\]"):
        load_evidence(path)
    del data["legs"][0]["mystery"]
    data["legs"][0]["concurrency"] = "four"
    path.write_text(json.dumps(data))
    with pytest.raises(EvidenceError, match=r"legs\[0\].concurrency: expected int, got 'four'"):
        load_evidence(path)
    path.write_text(path.read_text()[:100])       # a torn file
    with pytest.raises(EvidenceError, match="not valid JSON"):
        load_evidence(path)


def test_atomic_write_leaves_the_old_file_on_interruption(tmp_path, monkeypatch):
    path = write_atomic(tmp_path / "evidence.json", "old\n")

    def crash(src, dst):
        raise KeyboardInterrupt("killed mid-write")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new and much longer contents\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evidence.json"]     # no temporary left behind


def test_campaign_ids_do_not_collide(tmp_path):
    """Each id claims its directory as it is handed out: two jobs of one lever (a sweep over quantizations) that
    start at once get two ids, as a re-run does."""
    from concurrent.futures import ThreadPoolExecutor
    assert new_campaign_id(tmp_path, "2026-11-30", "gqa_swap", "abc1234ffff") == "2026-11-30-gqa_swap-abc1234"
    assert (tmp_path / "2026-11-30-gqa_swap-abc1234").is_dir()
    assert new_campaign_id(tmp_path, "2026-11-30", "gqa_swap", "abc1234") == "2026-11-30-gqa_swap-abc1234-2"
    with ThreadPoolExecutor(8) as pool:
        ids = list(pool.map(lambda _: new_campaign_id(tmp_path, "2026-12-01", "pdl", "abc1234"), range(8)))
    assert len(set(ids)) == 8


def test_leg_from_loadgen_metrics():
    loadgen = pytest.importorskip("campaigns.loadgen")
    m = loadgen.LegMetrics(concurrency=4, input_len=32, output_len=8, num_prompts=12, prompts_sha256="ab" * 32,
                           completed=11, failed=1, valid=False, failures=["request 3: 7 tokens, expected 8"],
                           total_token_throughput=1234.5, median_tpot_ms=3.25, server={"engine_steps": 90})
    leg = LegResult.from_loadgen(m.to_dict(), rep=1, arm="on", order_index=5, started="a", ended="b")
    assert (leg.concurrency, leg.num_prompts, leg.valid) == (4, 12, False)
    assert leg.reasons == ["request 3: 7 tokens, expected 8"]
    assert leg.metrics["total_token_throughput"] == 1234.5 and leg.metrics["median_tpot_ms"] == 3.25
    assert leg.metrics["server_engine_steps"] == 90.0 and "valid" not in leg.metrics


# ----------------------------------------------------------------------------------------------- records


def test_record_and_pr_carry_the_ritual_sections():
    ev = _rich_evidence()
    rec, pr = records.render_record(ev), records.render_pr(ev)
    assert rec.splitlines()[0] == ("## row/gqa_swap — FLIP: default off → on, total tok/s ×1.099 at c1 (WIN) "
                                   "(2026-11-30, main, abc1234, NVIDIA H200)")
    # a battery whose divergences near_tie ratified reads RATIFIED, not FAIL; arms read by role and value
    assert ("| battery | candidate (on) | RATIFIED | divergent 0, near_tie 1, prompts 16, strict 15 | caught | no |"
            in rec)
    assert "| memcheck | candidate (on) | SKIP |" in rec and "compute-sanitizer not found" in rec
    assert "Gate memcheck is inapplicable here: compute-sanitizer not found." in rec
    assert '{"grid": "1x8x4", "routes": {"gqa_swap": 36}}' in rec            # mechanism proof printed
    assert re.search(r"\| 4 \| candidate \(on\) \| total tok/s \(tok/s\) \| 111\.0 \| 101\.0 \| 1\.099 \| "
                     r"×1\.099 \[1\.078, 1\.120\] \(90%\) \| "
                     r"110\.0 / 111\.0 / 112\.0 \| 100\.0 / 101\.0 / 102\.0 \| .* \| WIN \|", rec)
    assert f"Rule: “{ev.decision.rule}”" in rec
    assert "Peak GPU memory: baseline (off) 21.50 GiB, candidate (on) 19.25 GiB." in rec
    assert rec.rstrip().endswith("**Default.** `gqa_swap` flips false → true in conf/lever/gqa_swap.yaml; "
                                 "roll back with `VT_DECODE_GQA_SWAP=off`.")   # the baseline server's env
    assert pr.splitlines()[0] == "row/gqa_swap: default off → on — total tok/s ×1.099 at c1 (WIN)"
    heads = [ln for ln in pr.splitlines() if ln.startswith("## ")]
    assert heads == ["## Correctness", "## Mechanism", "## Binding", "## Verdict", "## Residual"]
    assert "`VT_DECODE_GQA_SWAP=0` always means off" in pr and "split count next." in pr
    # a flip away from on rolls back with on, not with the "=0" every record used to print
    assert records._env_value(ev, ev.candidates[0], "VT_DECODE_GQA_SWAP") == "on"
    ev.fingerprint.arms_env = {}                                   # evidence without the servers' env: spelled
    assert [records._env_value(ev, a, "VT_DECODE_GQA_SWAP") for a in ev.arms] == ["0", "1"]
    assert "ratified by near_tie (max gap 12.5 mnats <= 500)" in pr


@pytest.mark.parametrize("values,verdict,default_line", [
    (NEUTRAL, "KEEP", "`gqa_swap` stays false"),
    (LOSS, "REJECT-PERFORMANCE", "`gqa_swap` stays false"),
])
def test_record_default_line_follows_the_verdict(values, verdict, default_line):
    ev = make_evidence(values)
    rec = records.render_record(ev)
    assert ev.decision.verdict == verdict and f"- **{verdict}** (arm on)" in rec
    assert f"**Default.** {default_line}" in rec


def _campaigns(tmp_path, *evs):
    out = tmp_path / "records" / "campaigns"
    for ev in evs:
        save_evidence(ev, out / ev.campaign_id)
    return out


def _snapshot(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_render_is_byte_identical_and_rebuilds_from_evidence_alone(tmp_path):
    out = _campaigns(tmp_path, _rich_evidence(), make_evidence(LOSS, lever="fast_math",
                                                               created="2026-11-30T12:00:00Z"))
    records.render_all(out)
    first = _snapshot(tmp_path / "records")
    assert {"STATUS.md", "BENCHMARKS.md", "campaigns/2026-11-30-gqa_swap-abc1234/record.md",
            "campaigns/2026-11-30-gqa_swap-abc1234/pr.md",
            "campaigns/2026-11-30-gqa_swap-abc1234/grid.png"} <= set(first)
    assert first["campaigns/2026-11-30-gqa_swap-abc1234/grid.png"][:8] == b"\x89PNG\r\n\x1a\n"
    # Delete every view, keep only evidence: the render reproduces every byte.
    for name in list(first):
        if not name.endswith("evidence.json"):
            (tmp_path / "records" / name).unlink()
    records.render_all(out)
    assert _snapshot(tmp_path / "records") == first


def test_render_of_one_campaign_leaves_the_others_files_alone(tmp_path):
    """What a concluding campaign renders: its own files and the summaries, which still read every campaign."""
    other = make_evidence(LOSS, lever="fast_math", created="2026-11-30T12:00:00Z")
    out = _campaigns(tmp_path, _rich_evidence(), other)
    written = records.render_all(out, plots=False, only=["2026-11-30-gqa_swap-abc1234"])
    names = {p.relative_to(tmp_path / "records").as_posix() for p in written}
    assert names == {"STATUS.md", "BENCHMARKS.md", "campaigns/2026-11-30-gqa_swap-abc1234/record.md",
                     "campaigns/2026-11-30-gqa_swap-abc1234/pr.md"}
    assert not (out / other.campaign_id / "record.md").exists()
    assert "fast_math" in (tmp_path / "records" / "STATUS.md").read_text()


def _status_row(status: str, lever: str, on: str | None = None, gpu: str | None = None) -> list[str]:
    """The lever's STATUS row (of the model ``on`` and the GPU ``gpu``, when given) without its "measured on" and
    GPU cells."""
    table = status.split("## Refuted levers")[0]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in table.splitlines()
            if ln.startswith(f"| {lever} |")]
    rows = [r for r in rows if (on is None or r[1] == on) and (gpu is None or r[2] == gpu)]
    assert len(rows) == 1, rows                    # keyed: exactly one row per lever, model and GPU
    return rows[0][:1] + rows[0][3:]


def _gpu_cell(status: str, lever: str) -> str:
    table = status.split("## Refuted levers")[0]
    return [ln.strip("|").split("|")[2].strip() for ln in table.splitlines() if ln.startswith(f"| {lever} |")][0]


def test_status_gives_each_quantizations_row_its_own_default(tmp_path):
    """A lever with its own default on bf16 (default_by_quant): the bf16 row says the bf16 default, the MXFP4 row
    MXFP4's, and both say the lever's defaults differ by quantization."""
    import shutil
    from vtengine import levers
    lever_dir = tmp_path / "lever"
    shutil.copytree(levers.LEVER_DIR, lever_dir)
    levers.set_default_in_file("pdl", True, lever_dir=lever_dir, quant="bf16")
    bf16 = make_evidence(NEUTRAL, lever="pdl", created="2026-11-29T09:00:00Z")
    mx = make_evidence(NEUTRAL, lever="pdl", created="2026-11-29T10:00:00Z", campaign_id="2026-11-29-pdl-def5678")
    mx.config["model"]["quant"] = "mxfp4"
    mx.__dict__.pop("_settings", None)
    out = _campaigns(tmp_path, bf16, mx)
    records.render_all(out, lever_dir=lever_dir, plots=False)
    status = (tmp_path / "records" / "STATUS.md").read_text()
    assert _status_row(status, "pdl", "qwen3-8b (bf16)")[1] == "true (bf16: true; else false)"
    assert _status_row(status, "pdl", "qwen3-8b (mxfp4)")[1] == "false (bf16: true; else false)"


def test_status_and_benchmarks_are_keyed_and_updated_in_place(tmp_path):
    keep = make_evidence(NEUTRAL, created="2026-11-29T09:00:00Z")
    out = _campaigns(tmp_path, keep)
    records.render_all(out, plots=False)
    status = (tmp_path / "records" / "STATUS.md").read_text()
    row = _status_row(status, "gqa_swap")
    assert row[5] == "KEEP" and "2026-11-29-gqa_swap-abc1234" in row[4]
    assert {"fast_math", "marlin_dense", "nsplits_cap"} <= {ln.split("|")[1].strip() for ln in status.splitlines()
                                                              if ln.startswith("| ") and "---" not in ln}

    # A second, later campaign of the same lever replaces the row; a refuted lever joins the refuted section.
    flip = make_evidence(TPUT_WIN, created="2026-11-30T09:00:00Z")
    refuted = make_evidence(LOSS, lever="fast_math", created="2026-11-30T10:00:00Z")
    _campaigns(tmp_path, flip, refuted)
    records.render_all(out, plots=False)
    status = (tmp_path / "records" / "STATUS.md").read_text()
    row = _status_row(status, "gqa_swap")
    assert row[5] == "FLIP" and "2026-11-30-gqa_swap-abc1234" in row[4] and row[3] == "yes"
    assert _gpu_cell(status, "gqa_swap") == "H200" and _gpu_cell(status, "nsplits_cap") == "—"
    assert _status_row(status, "fast_math")[5] == "REJECT-PERFORMANCE"
    refuted_part = status.split("## Refuted levers")[1]
    assert "| fast_math | qwen3-8b (bf16) | on | REJECT-PERFORMANCE |" in refuted_part
    assert "| gqa_swap |" not in refuted_part
    # refuted again by a re-run: one row, the latest (gqa_swap off was once listed three times)
    again = make_evidence(LOSS, lever="fast_math", created="2026-11-30T11:00:00Z",
                          campaign_id="2026-11-30-fast_math-def5678")
    _campaigns(tmp_path, again)
    records.render_all(out, plots=False)
    refuted_part = (tmp_path / "records" / "STATUS.md").read_text().split("## Refuted levers")[1]
    assert refuted_part.count("| fast_math |") == 1 and "2026-11-30-fast_math-def5678" in refuted_part
    # a later rehearsal (non-binding) reaching another verdict leaves the binding refutation listed
    rehearsed = make_evidence(TPUT_WIN, lever="fast_math", dirty=True, created="2026-11-30T12:00:00Z",
                              campaign_id="2026-11-30-fast_math-dirty01")
    assert not rehearsed.decision.binding and rehearsed.decision.verdict != again.decision.verdict
    _campaigns(tmp_path, rehearsed)
    records.render_all(out, plots=False)
    refuted_part = (tmp_path / "records" / "STATUS.md").read_text().split("## Refuted levers")[1]
    assert "2026-11-30-fast_math-def5678" in refuted_part
    assert "| fast_math | qwen3-8b (bf16) | on | REJECT-PERFORMANCE | [2026-11-30-fast_math-def5678]" in refuted_part
    shutil.rmtree(out / rehearsed.campaign_id)
    shutil.rmtree(out / again.campaign_id)

    bench = (tmp_path / "records" / "BENCHMARKS.md").read_text()
    assert bench.count("## gqa_swap") == 1 and bench.count("## fast_math") == 1
    gqa = bench.split("## gqa_swap")[1]
    assert "2026-11-30-gqa_swap-abc1234" in gqa and "2026-11-29" not in gqa
    assert "| 8 | candidate (on) | 111.0 | 101.0 | 1.099 WIN | ×1.099 [1.078, 1.120] |" in gqa

    # A later non-binding rehearsal displaces neither the binding verdict in STATUS nor the grid in BENCHMARKS.
    rehearsal = make_evidence(LOSS, device_type="cpu", created="2026-12-01T09:00:00Z",
                              campaign_id="2026-12-01-gqa_swap-abc1234")
    _campaigns(tmp_path, rehearsal)
    records.render_all(out, plots=False)
    row = _status_row((tmp_path / "records" / "STATUS.md").read_text(), "gqa_swap")
    assert row[5] == "FLIP" and "2026-11-30-gqa_swap-abc1234" in row[4]
    gqa = (tmp_path / "records" / "BENCHMARKS.md").read_text().split("## gqa_swap")[1]
    assert "2026-11-30-gqa_swap-abc1234" in gqa and "| 8 | candidate (on) | 111.0 | 101.0 | 1.099 WIN |" in gqa
    assert len(find_evidence(out)) == 4

    # A later binding verdict measured on another GPU holds its own row beside the first GPU's (one verdict per
    # lever, model and GPU), each row naming its GPU: the lender may give an H100 to a session that asked for an
    # H200, and an H100 campaign says nothing of the H200.
    assert _gpu_cell(status, "gqa_swap") == "H200"
    h100 = make_evidence(LOSS, created="2026-12-01T09:30:00Z", campaign_id="2026-12-01-gqa_swap-fed4321")
    h100.fingerprint.device_name = "NVIDIA H100 80GB HBM3"
    _campaigns(tmp_path, h100)
    records.render_all(out, plots=False)
    status = (tmp_path / "records" / "STATUS.md").read_text()
    assert "2026-12-01-gqa_swap-fed4321" in _status_row(status, "gqa_swap", gpu="H100 80GB HBM3")[4]
    h200 = _status_row(status, "gqa_swap", gpu="H200")
    assert h200[5] == "FLIP" and "2026-11-30-gqa_swap-abc1234" in h200[4]
    shutil.rmtree(out / h100.campaign_id)

    # The same lever decided on another model holds its own row; the bf16 verdict stays beside it.
    other = make_evidence(LOSS, created="2026-12-01T10:00:00Z", campaign_id="2026-12-01-gqa_swap-def5678")
    other.config["model"]["quant"] = "mxfp4"
    _campaigns(tmp_path, other)
    records.render_all(out, plots=False)
    status = (tmp_path / "records" / "STATUS.md").read_text()
    assert _status_row(status, "gqa_swap", on="qwen3-8b (bf16)")[5] == "FLIP"
    assert _status_row(status, "gqa_swap", on="qwen3-8b (mxfp4)")[5] == "REJECT-PERFORMANCE"
    heads = [ln for ln in (tmp_path / "records" / "BENCHMARKS.md").read_text().splitlines() if ln.startswith("## ")]
    assert "## gqa_swap on qwen3-8b (bf16), H200" in heads and "## gqa_swap on qwen3-8b (mxfp4), H200" in heads
    shutil.rmtree(out / other.campaign_id)

    # A refutation that a later campaign of the same lever and arm superseded leaves the refuted section.
    rerun = make_evidence(NEUTRAL, lever="fast_math", created="2026-12-02T09:00:00Z",
                          campaign_id="2026-12-02-fast_math-abc1234")
    _campaigns(tmp_path, rerun)
    records.render_all(out, plots=False)
    status = (tmp_path / "records" / "STATUS.md").read_text()
    assert _status_row(status, "fast_math")[5] == "KEEP"
    assert "fast_math" not in status.split("## Refuted levers")[1]


def test_in_progress_evidence_renders_without_a_decision(tmp_path):
    ev = make_evidence(TPUT_WIN)
    ev.decision, ev.status, ev.stats = None, "in-progress", []
    rec = records.render_record(ev)
    assert rec.startswith("## row/gqa_swap — IN PROGRESS (") and "No decision yet" in rec
    out = _campaigns(tmp_path, ev)
    records.render_all(out)
    # In-progress campaigns do not enter the lever's status row.
    assert _status_row((tmp_path / "records" / "STATUS.md").read_text(), "gqa_swap")[5] == "—"
    shutil.rmtree(out)


def test_the_console_summary_reads_as_the_record(tmp_path, monkeypatch):
    """The terminal's gate table titles arms by role and value and shows a battery whose divergences near_tie
    ratified as RATIFIED, as record.md does (it printed FAIL under columns 'on' / 'off')."""
    from rich.console import Console
    from campaigns import policy, runner
    ev = make_evidence(TPUT_WIN, gate_results=gates(**{
        "battery@on": {"passed": False, "counts": {"prompts": 16, "strict": 3, "near_tie": 13, "divergent": 0}},
        "near_tie@on": {"counts": {"divergences": 13, "ratified": 13, "max_gap_mnats": 375.0}}}))
    ev.decision = policy.decide(ev)
    with open(tmp_path / "out.txt", "w") as f:
        monkeypatch.setattr(runner, "console", Console(file=f, width=200))
        runner._summary(ev, tmp_path, 1.0)
    text = (tmp_path / "out.txt").read_text()
    assert "baseline (off)" in text and "candidate (on)" in text
    battery = next(line for line in text.splitlines() if "battery" in line)
    assert "RATIFIED" in battery and "FAIL" not in battery, battery
    # ratified as the policy reads it: a 375 mnats gap passes the gate's threshold (500) but not a policy of 200,
    # and the record says FAIL beside the policy's REJECT (it said RATIFIED)
    strict = make_evidence(TPUT_WIN, gate_results=ev.gates, policy_cfg={"near_tie_max_mnats": 200.0})
    assert strict.decision.verdict == "REJECT-CORRECTNESS"
    assert "| battery | candidate (on) | FAIL |" in records.render_record(strict)


def test_summaries_render_against_a_flipped_lever_file_without_writing(tmp_path):
    """What a flip commits: STATUS as it reads once merged (the lever's new default in its row), rendered against
    the lever files in use with that lever's replaced, written nowhere."""
    from vtengine import levers
    flip = make_evidence(TPUT_WIN, created="2026-11-30T09:00:00Z")
    out = _campaigns(tmp_path, flip)
    records.render_all(out, plots=False)
    before = (tmp_path / "records" / "STATUS.md").read_text()
    now = levers.get("gqa_swap").default
    edited = tmp_path / "edited"
    edited.mkdir()
    shutil.copyfile(levers.get("gqa_swap").path, edited / "gqa_swap.yaml")
    levers.set_default_in_file("gqa_swap", not now, lever_dir=edited)
    texts = records.render_summaries_flipped(out, tmp_path / "records", "gqa_swap", edited)
    assert set(texts) == {tmp_path / "records" / "STATUS.md", tmp_path / "records" / "BENCHMARKS.md"}
    assert _status_row(before, "gqa_swap")[1] == str(now).lower()
    assert _status_row(texts[tmp_path / "records" / "STATUS.md"], "gqa_swap")[1] == str(not now).lower()
    assert _status_row(texts[tmp_path / "records" / "STATUS.md"], "pdl")[1] == _status_row(before, "pdl")[1]
    assert (tmp_path / "records" / "STATUS.md").read_text() == before


def test_the_record_shows_each_arms_gpu_clock_and_says_when_they_differ():
    """Per concurrency each arm's median SM clock with its range; a point where the arms ran more than 5% apart (the
    H200's power limit at c64 clocked async scheduling's busier arm at 1,590 against 1,965 MHz) says which arm ran
    slower, so a ratio there is read with its clock."""
    ev = make_evidence(TPUT_WIN)
    for leg in ev.legs:
        mhz = 1590.0 if (leg.concurrency == 8 and leg.arm == "on") else 1980.0 - 15.0 * leg.rep
        leg.gpu_samples = [{"sm_clock_mhz": 345.0}, {"sm_clock_mhz": mhz}, {"sm_clock_mhz": mhz}]
    rows = {r["c"]: r for r in records.clock_rows(ev)}
    assert rows[1]["arms"] == "baseline (off) 1,965 [1,950–1,980]; candidate (on) 1,965 [1,950–1,980]"
    assert rows[1]["note"] == ""
    assert rows[8]["note"].startswith("arms 19% apart: candidate (on) ran slower clocks (power-limited")
    text = records.render_record(ev)
    assert "| 8 | baseline (off) 1,965 [1,950–1,980]; candidate (on) 1,590 [1,590–1,590] | arms 19% apart" in text
    ev.legs[0].valid = False                                 # an invalid leg's clock does not count
    ev.legs[0].gpu_samples = [{"sm_clock_mhz": 100.0}]
    assert "100" not in records.clock_rows(ev)[0]["arms"]


def test_where_the_policy_reads_p99_itl_the_record_shows_the_itl_tail_with_its_max():
    """The 32k grid at c2 (H200, 2026-12-05): prefill first's P99 ITL (20.9 ms) beat the mixed steps' (43.6 ms)
    because its one stall a request sits past the P99; the record shows each arm's max ITL beside it, medians over
    the valid reps, and "—" for legs recorded before the max was. A campaign whose policy does not read P99 ITL
    shows no such table."""
    assert records.itl_tail_rows(make_evidence(TPUT_WIN)) == []
    ev = make_evidence(TPUT_WIN, concurrency=(2,), policy_cfg={"primary_axes": ["total_token_throughput", "tpot",
                                                                               "p99_itl"]})
    for leg in ev.legs:
        stall = leg.arm == "off"
        leg.metrics.update(p99_itl_ms=20.9 if stall else 43.6, std_itl_ms=132.6 if stall else 10.4,
                           max_itl_ms=(2000.0 if stall else 47.0) + leg.rep)
    ev.legs[0].valid = False                                 # an invalid leg's figures do not count
    ev.legs[0].metrics["max_itl_ms"] = 1e6
    rows = {r["arm"]: r["cells"] for r in records.itl_tail_rows(ev)}
    assert rows["baseline (off)"][1:4] == ["20.90", "2001.50", "132.60"]
    assert rows["candidate (on)"][1:4] == ["43.60", "48.00", "10.40"]
    text = records.render_record(ev)
    assert "| c | arm | median ITL | P99 ITL | max ITL | ITL std | TPOT |" in text
    assert "| 2 | baseline (off) | " in text and "| 2001.50 | 132.60 |" in text
    for leg in ev.legs:
        del leg.metrics["max_itl_ms"]
    assert all(r["cells"][2] == "—" for r in records.itl_tail_rows(ev))
    # the max ITL primary and the P99 traded (mixed_prefill on the long-prompt grid): the same table
    for policy_cfg in ({"primary_axes": ["tpot", "max_itl"]},
                       {"primary_axes": ["tpot"], "traded_axes": {"p99_itl": "chunk steps sit inside the P99"}}):
        assert len(records.itl_tail_rows(make_evidence(TPUT_WIN, concurrency=(2,), policy_cfg=policy_cfg))) == 2


def test_the_mechanism_line_shows_routes_and_grids_not_their_counts():
    """The record's mechanism line is the proof a reader checks (RITUAL: the route and launch grid at the new
    default), not 'grids 1, routes 1'."""
    from campaigns.evidence import GateResult
    g = GateResult(gate="mechanism", arm="on", passed=True, counts={"grids": 1, "routes": 1}, details={
        "why": "decode_attention routes ['gqa_swap'], expected ['gqa_swap']",
        "probe": {"grids": ["4x8x17"], "routes": ["gqa_swap"]},
        "counters": {"decode_attention": {"gqa_swap": {"grids": {"4x8x17": 180, "4x8x9": 6}, "launches": 186}},
                     "rms_norm": {"fast_math": {"grids": {"132": 72}, "launches": 72}}}})
    assert records.mechanism_proof(g, ["decode_attention"]) == (
        "decode_attention routes ['gqa_swap'], expected ['gqa_swap']; probe route gqa_swap, grid 4x8x17; "
        "decode_attention gqa_swap: 186 launches, grids 4x8x17 x180, 4x8x9 x6")
    g.details = {}
    assert records.mechanism_proof(g, ["decode_attention"]) == ""          # the counts then, as before


def test_a_preset_levers_record_names_what_its_levers_ran_at_in_each_arm():
    """`VT_MIXED_PREFILL=on` alone does not say the chunk size: the arm lines add the preset's levers as the arm's
    recorded context has them; a lever the preset gained later is left out of an older campaign's line."""
    from vtengine import levers
    ev = make_evidence(TPUT_WIN, lever="mixed_prefill")
    for arm in ev.arms:
        ev.context[arm.name] = dict(levers.resolve({"mixed_prefill": arm.value}, environ={}).values)
    rec = records.render_record(ev)
    assert ("(a preset; its levers here: chunk_above=1536, chunk_graphs=true, chunked_prefill=512, mixed_steps=true, "
            "prefill_gqa_pack=true, whole_first=true)") in rec
    assert ("chunk_above=off, chunk_graphs=false, chunked_prefill=off, mixed_steps=false, prefill_gqa_pack=false, "
            "whole_first=false)" in rec)
    for arm in ev.arms:     # evidence from before chunk_above and whole_first existed: the levers its context holds
        del ev.context[arm.name]["chunk_above"], ev.context[arm.name]["whole_first"]
    assert ("(a preset; its levers here: chunk_graphs=true, chunked_prefill=512, mixed_steps=true, "
            "prefill_gqa_pack=true)") in records.render_record(ev)
    ev = make_evidence(TPUT_WIN)                                        # not a preset: nothing added
    assert "a preset" not in records.render_record(ev)


def test_a_keep_titles_a_mixed_candidate_mixed_not_by_its_pooled_direction():
    """The 2048-token chunk (H200, 2026-12-03) won total tok/s at every concurrency and lost TPOT and P99 ITL; its
    widest pooled interval is P99 ITL's, so the title read 'measured slower'. A candidate whose pooled intervals
    went both ways says it trades one primary axis for another; one that separated both ways is titled mixed; one
    that only lost stays 'measured slower'."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "records" / "campaigns"
    ev = load_evidence(root / "2026-12-03-chunked_prefill-ee665bf")
    assert records.what_changed(ev) == "keep default 512 (2048 trades one primary axis for another)"
    ev = load_evidence(root / "2026-12-01-pdl-5716ede")                  # slower pooled, no point separated
    assert records.what_changed(ev) == "keep default off (on measured slower)"
    ev = load_evidence(root / "2026-12-02-fuse_norm-b482c55")
    assert records.what_changed(ev) == "keep default off (on measured neutral)"


def test_status_says_why_a_flip_is_not_the_default(tmp_path):
    """A FLIP the lever file does not hold: with a pinned lever off its default (prefill_splits with 256-token chunks
    on the H100, 2026-12-06) STATUS says it cannot be flipped and which pin, STALE or not; with none, a FRESH one
    says it is not flipped yet; once the default is the FLIP's, nothing."""
    import shutil
    from vtengine import levers
    lever_dir = tmp_path / "lever"
    shutil.copytree(levers.LEVER_DIR, lever_dir)
    levers.set_default_in_file("gqa_swap", False, lever_dir=lever_dir)
    flip = make_evidence(TPUT_WIN, created="2026-11-30T09:00:00Z")                 # gqa_swap off -> on
    out = _campaigns(tmp_path, flip)
    records.render_all(out, lever_dir=lever_dir, plots=False)
    row = _status_row((tmp_path / "records" / "STATUS.md").read_text(), "gqa_swap")
    # its commit is not in this repository, so STALE: the freshness cell says why, the verdict cell adds nothing
    assert row[1] == "false" and row[5] == "FLIP" and row[6].startswith("STALE"), row
    flip.config["campaign"]["with_levers"] = {"nsplits_cap": 8}
    flip.__dict__.pop("_settings", None)
    _campaigns(tmp_path, flip)
    records.render_all(out, lever_dir=lever_dir, plots=False)
    status = (tmp_path / "records" / "STATUS.md").read_text()
    assert _status_row(status, "gqa_swap")[5] == "FLIP (not flippable: nsplits_cap=8 pinned, its default off)"
    levers.set_default_in_file("nsplits_cap", 8, lever_dir=lever_dir)             # the pin at its default: flippable
    records.render_all(out, lever_dir=lever_dir, plots=False)
    status = (tmp_path / "records" / "STATUS.md").read_text()
    assert _status_row(status, "gqa_swap")[5] == "FLIP"                          # flippable, but STALE
    levers.set_default_in_file("gqa_swap", True, lever_dir=lever_dir)
    records.render_all(out, lever_dir=lever_dir, plots=False)
    assert _status_row((tmp_path / "records" / "STATUS.md").read_text(), "gqa_swap")[5] == "FLIP"
    # a STALE FLIP: its freshness cell says why, nothing here; a default that left the baseline since (measured 8
    # against 4, the default off: `flip` refuses it too); a value no longer accepted: nothing, and no error
    reg = levers.registry(lever_dir)
    flip.config["campaign"]["with_levers"] = {}
    flip.__dict__.pop("_settings", None)
    assert records._unapplied_flip(flip, reg["gqa_swap"], False, reg, fresh=True).startswith(" (not flipped yet")
    assert records._unapplied_flip(flip, reg["gqa_swap"], False, reg, fresh=False) == ""
    cap = make_evidence(TPUT_WIN, lever="nsplits_cap", candidates=(8,))
    cap.arms[0].value, cap.decision.new_default, cap.decision.verdict = 4, 8, "FLIP"
    assert records._unapplied_flip(cap, reg["nsplits_cap"], "off", reg, fresh=True) == \
        " (measured against 4; the default is off now)"
    cap.decision.new_default = "sixteen"
    assert records._unapplied_flip(cap, reg["nsplits_cap"], "off", reg, fresh=True) == ""


def test_pr_text_describes_the_lever_as_it_was_when_the_campaign_ran(tmp_path, monkeypatch):
    """A lever's summary says what its values do, and that can change after a campaign measured them (the rule
    behind prefill_splits' "auto" was rewritten twice). The PR text takes the summary the evidence recorded, else
    the lever file's at the campaign's commit (git), else today's, saying so."""
    import git
    from helpers import lever_repo
    from vtengine import confdirs, levers
    root = lever_repo(tmp_path)
    lever_file = root / "conf" / "lever" / "gqa_swap.yaml"
    then = git.Repo(root).head.commit.hexsha
    text = lever_file.read_text()
    old = " ".join(levers._load_file(lever_file).summary.split())
    lever_file.write_text(text.replace("summary:", "summary: rewritten later,", 1))
    r = git.Repo(root)
    r.git.add(A=True)
    r.index.commit("a new rule", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    today = levers._load_file(lever_file)
    assert today.summary.startswith("rewritten later,")
    monkeypatch.setattr(confdirs, "SOURCE_ROOT", root)
    ev = make_evidence(TPUT_WIN)
    ev.fingerprint.git_sha = then
    assert records.lever_summary(ev, today) == old
    ev.lever_summary = "as recorded"
    assert records.lever_summary(ev, today) == "as recorded"
    ev.lever_summary, ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = "", "e" * 40, "e" * 7
    missing = " (today's lever file: no lever file gqa_swap at commit eeeeeee in this repository)"
    assert records.lever_summary(ev, today) == " ".join(today.summary.split()) + missing


def test_a_record_of_several_candidates_names_the_one_its_verdict_is_about():
    """Of candidates 512 (refuted) and 1024 (kept), the campaign's verdict is the KEEP about 1024: the record's
    default line suggests trying 1024, not the first candidate (it said 512)."""
    loss = [90.0, 91.0, 92.0]
    ev = make_evidence({"total_token_throughput": {"off": [100.0, 101.0, 102.0], "512": loss,
                                                   "1024": [100.5, 101.5, 101.0]}},
                       lever="chunked_prefill", candidates=(512, 1024), gate_results=gates(arms=("off", "512", "1024")))
    assert ev.decision.per_candidate == {"512": "REJECT-PERFORMANCE", "1024": "KEEP"}
    assert ev.decision.verdict == "KEEP" and ev.decision.candidate == "1024"
    rec = records.render_record(ev)
    assert "try the candidate with `VT_CHUNKED_PREFILL=1024`" in rec, rec.splitlines()[-1]


def test_a_flip_to_the_default_of_its_day_confirms_it(tmp_path, monkeypatch):
    """A campaign file may pin its baseline off the default (a RED-first campaign, a rerun after the flip): its
    FLIP to the candidate confirms the default of its commit, it moves nothing (async_device_mirror's reruns read
    "flips false → true", their default true already). The record says which, read from the lever files at the
    campaign's commit; one at the default reads as before."""
    import git
    from helpers import lever_repo
    from vtengine import confdirs, levers
    root = lever_repo(tmp_path)
    monkeypatch.setattr(confdirs, "SOURCE_ROOT", root)
    r, who = git.Repo(root), git.Actor("t", "t@t")
    shas = []
    for value in (False, True):
        levers.set_default_in_file("gqa_swap", value, lever_dir=root / "conf" / "lever")
        r.git.add(A=True)
        shas.append(r.index.commit(f"gqa_swap {value}", author=who, committer=who).hexsha)
    off_sha, on_sha = shas
    ev = make_evidence(TPUT_WIN)
    assert ev.decision.verdict == "FLIP" and ev.decision.new_default is True
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = on_sha, on_sha[:7]
    rec = records.render_record(ev)
    assert records.what_changed(ev) == "confirms default on (against off)"
    assert "baseline (off) (pinned by the campaign; the default was true) against candidate (on)" in rec
    assert f"`gqa_swap` was true already at {on_sha[:7]}: the campaign measured the false it pinned" in rec
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = off_sha, off_sha[:7]
    rec = records.render_record(ev)
    assert records.what_changed(ev) == "default off → on"
    assert "baseline (off) (the file default) against" in rec and "`gqa_swap` flips false → true" in rec


def test_the_tail_axes_a_campaign_measured_are_in_its_tables_and_plot(monkeypatch):
    """P99 and max ITL decide the verdicts of the prefill levers (primary there): the record's all-axes table and
    grid.png show them wherever the campaign measured them (both listed the core axes alone)."""
    from campaigns import plots
    tail = {"max_itl_ms": {"off": [400.0, 401.0, 402.0], "on": [40.0, 41.0, 42.0]},
            "p99_itl_ms": {"off": [20.0, 20.1, 20.2], "on": [30.0, 30.1, 30.2]}}
    ev = make_evidence({**TPUT_WIN, **tail}, policy_cfg={"primary_axes": ["total_token_throughput", "tpot", "max_itl"],
                                                         "traded_axes": {"p99_itl": "chunk steps sit inside it"}})
    rec = records.render_record(ev)
    header = next(line for line in rec.splitlines() if line.startswith("| candidate | c |"))
    assert "max ITL" in header and "P99 ITL" in header, header
    import matplotlib.axes
    drawn, real = [], matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, label, *a, **k: (drawn.append(label), real(self, label, *a, **k))[1])
    assert plots.grid_png(ev)[:4] == b"\x89PNG"
    assert any("max ITL" in t for t in drawn) and any("P99 ITL" in t for t in drawn), drawn
