"""The load generator: prompt partitions, the vLLM metric definitions, validation, and a real c=4 leg against
``vtengine serve`` (tiny model, loopback) whose client-side figures must agree with the server's own counters."""
from __future__ import annotations

import re

import numpy as np
import pytest

from campaigns import grid
from campaigns.loadgen import (SERVER_COUNTERS, SERVER_GAUGES, SERVER_MEANS, LegMetrics, RequestResult,
                               _server_deltas, compute_metrics, format_summary, get_model_info, make_output_lens,
                               make_prompts, prompts_sha256, run_leg, safe_vocab_range)
from helpers import serving
from vtengine import levers

pytestmark = pytest.mark.timeout(180)


def test_make_prompts_exact_seeded_and_in_range():
    a = make_prompts(5, 33, seed=7, vocab_range=(10, 20))
    assert len(a) == 5 and all(len(p) == 33 for p in a)
    assert all(10 <= t < 20 and isinstance(t, int) for p in a for t in p)
    assert a == make_prompts(5, 33, seed=7, vocab_range=(10, 20))
    b = make_prompts(5, 33, seed=8, vocab_range=(10, 20))
    assert a != b and prompts_sha256(a) != prompts_sha256(b)
    assert prompts_sha256(a) == prompts_sha256([list(p) for p in a])
    assert len({t for p in a for t in p}) == 10, "the whole range is drawn from"
    with pytest.raises(ValueError, match="vocab_range"):
        make_prompts(1, 4, seed=0, vocab_range=(5, 5))


def test_make_output_lens_spans_the_range_seeded_and_refuses_what_cannot_run():
    assert make_output_lens(4, 128, 0.0, seed=1) == [128] * 4
    assert make_output_lens(3, 1, 0.0, seed=0) == [1] * 3        # `bench serve --output-len 1` still runs
    a = make_output_lens(400, 128, 0.5, seed=1)
    assert a == make_output_lens(400, 128, 0.5, seed=1) != make_output_lens(400, 128, 0.5, seed=2)
    assert min(a) == 64 and max(a) == 192 and all(isinstance(n, int) for n in a)
    assert 120 < sum(a) / len(a) < 136                     # uniform about the asked length
    with pytest.raises(ValueError, match=r"range_ratio must be in \[0, 1\), got 1.0"):
        make_output_lens(2, 128, 1.0, seed=0)
    with pytest.raises(ValueError, match="shortest 1"):
        make_output_lens(2, 4, 0.75, seed=0)


def test_each_request_is_validated_against_its_own_output_length():
    """Per-request lengths: a request is checked against what it asked for, so a 4-token answer where 6 were asked
    fails even though another request asked for 4; the metrics' output_len is the lengths' mean."""
    results = [_result(4, 0.1, [0.01] * 3), _result(6, 0.1, [0.01] * 5), _result(4, 0.1, [0.01] * 3)]
    m = compute_metrics(results, 1.0, concurrency=2, output_len=[4, 6, 4], prompts=[[1] * 4] * 3)
    assert m.valid and m.total_output_tokens == 14 and m.output_len == 5
    m = compute_metrics(results, 1.0, concurrency=2, output_len=[4, 6, 6], prompts=[[1] * 4] * 3)
    assert not m.valid and m.failures == ["request 2: usage.completion_tokens = 4, expected 6"]
    with pytest.raises(ValueError, match="2 output lengths for 3 prompts"):
        compute_metrics(results, 1.0, concurrency=2, output_len=[4, 6], prompts=[[1] * 4] * 3)


def test_safe_vocab_range():
    assert safe_vocab_range({"vocab_size": 151936, "tokenizer_vocab_size": 151643}) == (16, 151643)
    assert safe_vocab_range({"vocab_size": 512}) == (16, 512)


def _result(prompt_len, ttft, gaps, tokens=None):
    tokens = len(gaps) + 1 if tokens is None else tokens
    return RequestResult(prompt_len=prompt_len, success=True, ttft=ttft, itl=list(gaps),
                         latency=ttft + sum(gaps), output_tokens=tokens, chunk_tokens=len(gaps) + 1,
                         num_chunks=len(gaps) + 1, server_prompt_tokens=prompt_len)


def test_metric_definitions_match_vllm():
    rng = np.random.default_rng(0)
    out_len = 6
    results = [_result(10, float(rng.uniform(0.05, 0.2)), rng.uniform(0.01, 0.03, out_len - 1).tolist())
               for _ in range(7)]
    prompts = [[1] * 10] * 7
    m = compute_metrics(results, 2.5, concurrency=3, output_len=out_len, prompts=prompts)
    assert m.valid and m.completed == 7 and m.failed == 0
    assert m.total_input_tokens == 70 and m.total_output_tokens == 42
    assert m.request_throughput == pytest.approx(7 / 2.5)
    assert m.output_throughput == pytest.approx(42 / 2.5)
    assert m.total_token_throughput == pytest.approx(112 / 2.5)
    ttft = np.array([r.ttft for r in results]) * 1e3
    tpot = np.array([(r.latency - r.ttft) / (out_len - 1) for r in results]) * 1e3
    itl = np.concatenate([r.itl for r in results]) * 1e3
    e2el = np.array([r.latency for r in results]) * 1e3
    for name, a in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        assert getattr(m, f"mean_{name}_ms") == pytest.approx(a.mean())
        assert getattr(m, f"median_{name}_ms") == pytest.approx(np.median(a))
        assert getattr(m, f"std_{name}_ms") == pytest.approx(a.std())
        assert getattr(m, f"p90_{name}_ms") == pytest.approx(np.percentile(a, 90))
        assert getattr(m, f"p99_{name}_ms") == pytest.approx(np.percentile(a, 99))
        assert getattr(m, f"max_{name}_ms") == pytest.approx(a.max())
    assert len(itl) == 7 * (out_len - 1)


def test_a_stall_in_fewer_than_one_percent_of_the_gaps_shows_in_the_max_and_tpot_not_the_p99():
    """The 32k grid at c2 (H200, 2026-12-05): prefill first stalls each request once for a prompt's prefill, one gap
    in ~128, so its P99 ITL (20.9 ms) looked better than 512-token mixed steps' (43.6 ms). The max ITL and the TPOT
    carry the stall."""
    smooth = [0.007] * 127
    stalled = [0.007] * 126 + [2.0]
    m = compute_metrics([_result(4, 0.1, smooth), _result(4, 0.1, stalled)], 1.0, concurrency=2, output_len=128,
                        prompts=[[1] * 4] * 2)
    assert m.valid
    assert m.p99_itl_ms == pytest.approx(7.0)
    assert m.max_itl_ms == pytest.approx(2000.0)
    assert m.p99_tpot_ms > 20.0
    assert re.search(r"^Max ITL \(ms\) +2000\.00$", format_summary(m), re.M)


def test_validation_reports_failures():
    good = _result(4, 0.1, [0.01] * 3)
    short_usage = _result(4, 0.1, [0.01] * 3, tokens=3)
    merged_chunks = _result(4, 0.1, [0.01] * 2, tokens=4)            # 4 tokens in 3 chunks
    merged_chunks.chunk_tokens = 4
    http_fail = RequestResult(prompt_len=4, error="HTTP 400: prompt too long")
    m = compute_metrics([good, short_usage, merged_chunks, http_fail], 1.0, concurrency=2, output_len=4,
                        prompts=[[1] * 4] * 4)
    assert not m.valid and m.completed == 1 and m.failed == 3
    assert len(m.failures) == 3
    assert "completion_tokens = 3" in m.failures[0]
    assert "2 inter-token gaps" in m.failures[1]
    assert "HTTP 400" in m.failures[2]
    # only the good request counts in the figures
    assert m.total_output_tokens == 4 and m.total_input_tokens == 4
    assert isinstance(m, LegMetrics) and m.to_dict()["failed"] == 3


@pytest.mark.parametrize("results,missing", [
    ([_result(4, 0.1, [0.01] * 3)] * 2, 2),                                    # fewer results than prompts
    ([_result(4, 0.1, [0.01] * 3), None, _result(4, 0.1, [0.01] * 3)], 1),     # a request that left no result
])
def test_a_missing_result_makes_the_leg_invalid(results, missing):
    m = compute_metrics(results, 1.0, concurrency=2, output_len=4, prompts=[[1] * 4] * 3)
    assert not m.valid
    assert m.failures == [f"request {missing}: no result (the request was not sent, or its result was lost)"]
    assert m.completed == 2 and m.failed == 1 and m.completed + m.failed == m.num_prompts
    assert m.total_output_tokens == 8 and m.request_throughput == 2.0


@pytest.mark.parametrize("server_prompt_tokens,reason", [
    (5, "usage.prompt_tokens = 5, expected 4 (the server added or cut prompt tokens"),      # a BOS added
    (3, "usage.prompt_tokens = 3, expected 4 (the server added or cut prompt tokens"),      # truncated
    (None, "usage carried no prompt_tokens: the prompt the server read is unknown"),
])
def test_a_prompt_the_server_read_otherwise_makes_the_leg_invalid(server_prompt_tokens, reason):
    """The leg's input-token total is the client's count: a server that read another prompt length would make the
    total tok/s wrong, so its usage must confirm every prompt's length."""
    bad = _result(4, 0.1, [0.01] * 3)
    bad.server_prompt_tokens = server_prompt_tokens
    m = compute_metrics([_result(4, 0.1, [0.01] * 3), bad], 1.0, concurrency=2, output_len=4, prompts=[[1] * 4] * 2)
    assert not m.valid and len(m.failures) == 1 and m.failures[0].startswith(f"request 1: {reason}")
    assert m.total_input_tokens == 4


def test_more_results_than_prompts_make_the_leg_invalid():
    m = compute_metrics([_result(4, 0.1, [0.01] * 3)] * 3, 1.0, concurrency=2, output_len=4, prompts=[[1] * 4] * 2)
    assert not m.valid
    assert m.failures == ["3 results for 2 prompts: the results do not belong to this leg's prompts"]
    assert m.completed == 2 and m.failed == 0 and m.total_output_tokens == 8      # the extra one is not counted


def _counted(output_tokens, chunk_tokens, num_chunks):
    """A successful request whose usage, chunk token ids and content chunks say what the arguments say."""
    return RequestResult(prompt_len=4, success=True, ttft=0.1, itl=[0.01] * (num_chunks - 1),
                         latency=0.1 + 0.01 * (num_chunks - 1), output_tokens=output_tokens,
                         chunk_tokens=chunk_tokens, num_chunks=num_chunks, server_prompt_tokens=4)


@pytest.mark.parametrize("output_tokens,chunk_tokens,num_chunks,reason", [
    # a chunk without token ids: usage and chunk count say 4, the chunks' token ids say 3
    (4, 3, 4, "chunks carried 3 token ids, expected 4"),
    # usage counts a token the stream never carried
    (5, 4, 4, "usage.completion_tokens = 5, expected 4"),
    # two tokens merged into one chunk: right token counts, one gap short
    (4, 4, 3, "2 inter-token gaps (3 content chunks), expected 3"),
    # an extra content chunk with no token ids: one gap too many
    (4, 4, 5, "4 inter-token gaps (5 content chunks), expected 3"),
])
def test_chunk_and_token_counts_that_disagree_make_the_leg_invalid(output_tokens, chunk_tokens, num_chunks,
                                                                     reason):
    good = _counted(4, 4, 4)
    m = compute_metrics([good, _counted(output_tokens, chunk_tokens, num_chunks)], 1.0, concurrency=2,
                        output_len=4, prompts=[[1] * 4] * 2)
    assert not m.valid
    assert m.failures == [f"request 1: {reason}"]
    assert m.completed == 1 and m.failed == 1 and m.total_output_tokens == 4
    assert m.mean_itl_ms == pytest.approx(10.0) and m.mean_e2el_ms == pytest.approx(130.0)


@pytest.fixture(scope="module")
def served():
    with serving(max_num_seqs=4) as (server, url):
        yield server, url


@pytest.fixture(scope="module")
def server_url(served):
    return served[1]


def test_leg_c4_agrees_with_server_counters(server_url):
    info = get_model_info(server_url)
    lo, hi = safe_vocab_range(info)
    n, input_len, output_len, c = 8, 24, 8, 4
    allp = make_prompts(n + c, input_len, seed=3, vocab_range=(lo, hi))
    warm, prompts = allp[:c], allp[c:]
    m = run_leg(server_url, info["id"], prompts, output_len, c, warmup_prompts=warm, timeout_s=120)
    assert m.valid, m.failures
    assert m.completed == n and m.failed == 0 and m.prompts_sha256 == prompts_sha256(prompts)
    assert m.total_output_tokens == n * output_len and m.total_input_tokens == n * input_len
    # the server's own counters over the leg (warm-up excluded) agree with what the client counted
    s = m.server
    assert s["tokens_generated"] == n * output_len
    assert s["prompt_tokens"] == n * input_len
    assert s["requests_finished"] == n
    assert s["steps"] >= output_len and s["step_time_s"] > 0
    # throughputs are the counts over the wall time; every latency is bounded by the leg's duration
    assert m.total_token_throughput * m.duration_s == pytest.approx(n * (input_len + output_len))
    assert m.request_throughput * m.duration_s == pytest.approx(n)
    assert 0 < m.mean_ttft_ms <= m.mean_e2el_ms <= m.duration_s * 1e3
    assert 0 < m.median_itl_ms <= m.p99_itl_ms and 0 < m.mean_tpot_ms < m.mean_e2el_ms
    # the engine's mean step bounds how fast tokens can stream: client ITL cannot beat it by much
    assert m.mean_itl_ms >= 0.5 * s["mean_decode_step_ms"]
    # every server figure the leg promises is there, none missing; the server's latency histograms counted exactly
    # the leg's requests, and each server-side latency is within what the client measured
    fields = set(SERVER_COUNTERS) | set(SERVER_GAUGES) | set(SERVER_MEANS)
    assert fields <= set(s) and "missing" not in s, sorted(fields - set(s))
    assert all(isinstance(s[f], float) for f in fields)
    assert s["ttft_count"] == s["e2el_count"] == s["queue_count"] == n
    assert s["itl_count"] == n * (output_len - 1)
    assert 0 < s["mean_ttft_ms"] <= m.mean_ttft_ms and 0 < s["mean_e2el_ms"] <= m.mean_e2el_ms
    assert 0 <= s["mean_queue_ms"] <= s["mean_ttft_ms"]
    assert s["e2el_s"] == pytest.approx(s["ttft_s"] + s["itl_s"], rel=1e-9)
    assert s["peak_gpu_memory_bytes"] == 0.0          # CPU: the metric is there, and 0 is its true value


def test_a_leg_of_varied_output_lengths_gets_each_one_from_the_server(server_url):
    info = get_model_info(server_url)
    prompts = make_prompts(6, 16, seed=5, vocab_range=safe_vocab_range(info))
    lens = make_output_lens(6, 8, 0.5, seed=5)
    assert len(set(lens)) > 1
    m = run_leg(server_url, info["id"], prompts, lens, 3, warmup_prompts=prompts[:1], timeout_s=120)
    assert m.valid, m.failures
    assert m.total_output_tokens == sum(lens) and m.server["tokens_generated"] == sum(lens)
    assert m.server["itl_count"] == sum(n - 1 for n in lens)


def test_leg_with_rejected_requests_is_invalid(server_url):
    info = get_model_info(server_url)
    too_long = make_prompts(3, info["max_model_len"] - 2, seed=1, vocab_range=(16, 200))
    m = run_leg(server_url, info["id"], too_long, 8, 2, timeout_s=60)
    assert not m.valid and m.completed == 0 and m.failed == 3
    assert all("HTTP 400" in f for f in m.failures), m.failures


def test_cli_writes_result_json(server_url, tmp_path):
    import json

    from campaigns.loadgen import main
    out = tmp_path / "leg.json"
    rc = main(["--base-url", server_url, "--input-len", "12", "--output-len", "4", "--concurrency", "2",
               "--num-prompts", "4", "--warmup", "1", "--result-json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["valid"] and res["completed"] == 4 and res["total_output_tokens"] == 16
    assert res["model"] == "tiny" and res["concurrency"] == 2 and len(res["prompts_sha256"]) == 64
    # the figures name the server they came from: its device and build, and every lever as it resolved them
    build, lev = res["context"]["build"], res["context"]["levers"]
    assert build["device"] == "cpu" and build["model"] == "tiny" and build["torch"]
    assert set(lev) == set(levers.registry()) and lev == grid.server_info(server_url)["levers"]


def test_cli_records_why_a_server_has_no_context(served, tmp_path, monkeypatch):
    import json

    from campaigns.loadgen import main
    server, url = served
    _without(server, monkeypatch, "vtengine_build_info")
    out = tmp_path / "leg.json"
    rc = main(["--base-url", url, "--input-len", "12", "--output-len", "4", "--num-prompts", "2",
               "--warmup", "0", "--result-json", str(out)])
    res = json.loads(out.read_text())
    assert rc == 0 and res["completed"] == 2
    assert "vtengine_build_info" in res["context"]["error"] and "build" not in res["context"]


def _without(server, monkeypatch, name: str, renamed: str | None = None) -> None:
    """Make ``server``'s /metrics lose every series of the family ``name`` (or call it ``renamed``)."""
    render = server.metrics.render

    def filtered() -> bytes:
        keep = []
        for line in render().decode().splitlines():
            series = line.split(" ")[2] if line.startswith("#") else line
            if series.split("{")[0].split(" ")[0] == name:
                if renamed is None:
                    continue
                line = line.replace(name, renamed)
            keep.append(line)
        return ("\n".join(keep) + "\n").encode()
    monkeypatch.setattr(server.metrics, "render", filtered)


def test_a_renamed_server_metric_is_reported_missing_by_name(served, monkeypatch):
    server, url = served
    _without(server, monkeypatch, "vtengine_engine_steps_total", renamed="vtengine_engine_step_count_total")
    info = get_model_info(url)
    prompts = make_prompts(2, 12, seed=5, vocab_range=safe_vocab_range(info))
    m = run_leg(url, info["id"], prompts, 4, 2, timeout_s=60)
    # every request was fine; the leg is not, and says which metric it could not read
    assert m.completed == 2 and not m.valid
    assert m.server["missing"] == ["vtengine_engine_steps_total"]
    assert "steps" not in m.server and "mean_step_ms" not in m.server        # left out, not 0
    assert m.server["tokens_generated"] == 8 and m.server["decode_steps"] > 0   # what could be read is there
    assert m.failures == [f"server metrics missing from {url}/metrics: vtengine_engine_steps_total "
                          f"(renamed or removed on the server?)"]
    assert "Server mean decode step" in format_summary(m)


def test_missing_memory_and_context_series_are_grid_errors(served, monkeypatch):
    server, url = served
    assert grid.peak_memory_gib(url) == 0.0 and grid.server_info(url)["levers"]
    with monkeypatch.context() as mp:
        _without(server, mp, "vtengine_peak_gpu_memory_bytes")
        with pytest.raises(grid.GridError, match="vtengine_peak_gpu_memory_bytes"):
            grid.peak_memory_gib(url)
    with monkeypatch.context() as mp:
        _without(server, mp, "vtengine_lever_info")
        with pytest.raises(grid.GridError, match="vtengine_lever_info"):
            grid.server_info(url)
    with monkeypatch.context() as mp:
        _without(server, mp, "vtengine_build_info", renamed="vtengine_build")
        with pytest.raises(grid.GridError, match="vtengine_build_info"):
            grid.server_info(url)
    with pytest.raises(grid.GridError, match="cannot read http://127.0.0.1:9/metrics"):
        grid.peak_memory_gib("http://127.0.0.1:9")


def test_unreadable_metrics_make_every_server_field_missing():
    everything = sorted(list(SERVER_COUNTERS.values()) + list(SERVER_GAUGES.values()))
    out = _server_deltas("/metrics could not be read: ConnectError: refused", None)
    assert out == {"missing": list(SERVER_COUNTERS.values()) + list(SERVER_GAUGES.values())}
    assert sorted(out["missing"]) == everything
    before = {name: 1.0 for name in everything}
    after = {name: 3.0 for name in everything}
    out = _server_deltas(before, after)
    assert "missing" not in out and out["steps"] == 2.0 and out["mean_step_ms"] == 1000.0
    assert out["peak_gpu_memory_bytes"] == 3.0
    # a count that did not move leaves its mean out rather than reporting 0
    out = _server_deltas(before, dict(after, **{"vtengine:time_to_first_token_seconds_count": 1.0}))
    assert "mean_ttft_ms" not in out and out["ttft_count"] == 0.0


def test_a_sum_missing_beside_its_moving_count_is_reported_not_raised():
    """The step count moved but its time series is gone (renamed on the server): the mean is left out and the sum
    listed as missing; it must not raise and lose the leg's figures."""
    everything = list(SERVER_COUNTERS.values()) + list(SERVER_GAUGES.values())
    before = {name: 1.0 for name in everything}
    after = {name: 3.0 for name in everything}
    gone = SERVER_COUNTERS["step_time_s"]
    out = _server_deltas({k: v for k, v in before.items() if k != gone}, after)
    assert out["missing"] == [gone] and "step_time_s" not in out and "mean_step_ms" not in out
    assert out["steps"] == 2.0 and out["mean_decode_step_ms"] == 1000.0


def test_a_counter_that_went_down_is_a_reset_not_a_negative_delta():
    everything = list(SERVER_COUNTERS.values()) + list(SERVER_GAUGES.values())
    before = {name: 5.0 for name in everything}
    after = dict({name: 7.0 for name in everything}, **{SERVER_COUNTERS["steps"]: 2.0})
    out = _server_deltas(before, after)
    assert out["reset"] == [f"{SERVER_COUNTERS['steps']} 5 -> 2"]
    assert "steps" not in out and "mean_step_ms" not in out and "missing" not in out
    assert out["decode_steps"] == 2.0


@pytest.fixture()
def odd_stream():
    """A real HTTP server on loopback whose completions stream the events a test sets (server-sent events), each
    after the pause a test sets."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    events: list[str] = []
    pause = {"s": 0.0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for e in events:
                time.sleep(pause["s"])
                self.wfile.write(f"data: {e}\n\n".encode())
                self.wfile.flush()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", events, pause
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("event, reason", [
    ('{"error": "out of memory"}', "in-stream error: out of memory"),
    ('[1, 2]', "a stream event that is no JSON object: [1, 2]"),
    ('{"choices": "not a list"}', "AttributeError"),
    ('{"usage": {"completion_tokens": "many"}}', "ValueError"),
])
def test_an_odd_stream_event_fails_its_request_not_the_leg(odd_stream, event, reason):
    """Whatever a server streams, one request's odd event is that request's failure, named, and the leg's other
    requests keep their figures: it must not escape the gather and lose the leg."""
    url, events, _ = odd_stream
    events[:] = [event, "[DONE]"]
    m = run_leg(url, "m", [[5, 6, 7]] * 2, 4, 2, timeout_s=10, read_server_metrics=False)
    assert m.failed == 2 and m.completed == 0 and not m.valid
    assert any(reason in f for f in m.failures), m.failures


def test_the_timeout_bounds_a_whole_request_not_each_read(odd_stream):
    """A stream that keeps sending, slowly, never trips httpx's per-read timeout; --timeout is per request."""
    url, events, pause = odd_stream
    chunk = '{"choices": [{"text": "a", "token_ids": [7]}]}'
    events[:] = [chunk] * 4 + ['{"usage": {"completion_tokens": 4, "prompt_tokens": 3}}', "[DONE]"]
    pause["s"] = 0.25                   # 1.5 s in all, no read waits more than 0.25 s
    m = run_leg(url, "m", [[5, 6, 7]], 4, 1, timeout_s=1.0, read_server_metrics=False)
    assert m.failed == 1 and any("no complete response within the 1 s timeout" in f for f in m.failures), m.failures
    m = run_leg(url, "m", [[5, 6, 7]], 4, 1, timeout_s=5.0, read_server_metrics=False)
    assert m.valid and m.completed == 1, m.failures
