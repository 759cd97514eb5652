"""GET /metrics through prometheus-client: the names campaigns read are exposed exactly as before, and the vLLM-named
latency histograms and KV gauge (vtengine/metrics.py) agree with what real requests measured on the client side.

Each test starts its own server (tiny model, loopback), so every count starts at zero and is exact.
"""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import pytest

from campaigns.loadgen import parse_prometheus
from vtengine.config import EngineConfig
from vtengine.engine.llm_engine import LLMEngine
from vtengine.server import Server, start_in_thread, stop_thread
from helpers import serving

pytestmark = pytest.mark.timeout(180)

HISTOGRAMS = ("vtengine:time_to_first_token_seconds", "vtengine:inter_token_latency_seconds",
              "vtengine:e2e_request_latency_seconds", "vtengine:request_queue_time_seconds")

# every series /metrics exposed before prometheus-client, by its exact sample name (campaigns/loadgen.py,
# campaigns/grid.py and the tests read them by these names)
EXISTING = ("vtengine_num_requests_running", "vtengine_num_requests_waiting", "vtengine_kv_blocks_total",
            "vtengine_kv_blocks_free", "vtengine_kv_blocks_used", "vtengine_generation_tokens_total",
            "vtengine_prompt_tokens_total", "vtengine_requests_finished_total", "vtengine_engine_steps_total",
            "vtengine_engine_step_time_seconds_sum", "vtengine_engine_step_time_seconds_last",
            "vtengine_engine_decode_steps_total", "vtengine_engine_decode_time_seconds_sum",
            "vtengine_num_preemptions_total", "vtengine_peak_gpu_memory_bytes", "vtengine_engine_alive",
            "vtengine_http_requests_total", "vtengine_kernel_launches_total", "vtengine_lever_info",
            "vtengine_build_info")


@pytest.fixture
def served():
    with serving(max_num_seqs=4) as (server, url):
        yield server, url


def scrape(url: str) -> tuple[str, dict[str, float]]:
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text, parse_prometheus(r.text)


async def timed_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed request timed as the load generator times it: send, first chunk, last chunk."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    chunks = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(time.perf_counter())
                assert len(json.loads(line[6:])["choices"][0]["token_ids"]) == 1
    assert len(chunks) == max_tokens
    return {"ttft": chunks[0] - sent, "e2e": chunks[-1] - sent}


def test_existing_names_are_exposed_unchanged(served):
    server, url = served
    httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    text, m = scrape(url)
    names = {re.split(r"[{ ]", line, 1)[0] for line in text.splitlines() if line and not line.startswith("#")}
    for name in EXISTING:
        assert name in names, f"{name} is no longer exposed"
    assert not any(n.endswith("_total_total") or n.endswith("_created") for n in names), sorted(names)
    # counters keep their meaning (a counter's TYPE line carries the _total name, as before)
    for name in ("vtengine_generation_tokens_total", "vtengine_requests_finished_total", "vtengine_engine_steps_total",
                 "vtengine_kernel_launches_total", "vtengine_http_requests_total"):
        assert f"# TYPE {name} counter" in text, name
    assert m["vtengine_generation_tokens_total"] == 3 and m["vtengine_requests_finished_total"] == 1
    assert m["vtengine_engine_steps_total"] == 3 and m["vtengine_engine_decode_steps_total"] == 2
    assert m["vtengine_engine_step_time_seconds_count"] == 3                 # the summary's count = steps
    assert m["vtengine_engine_step_time_seconds_sum"] >= m["vtengine_engine_decode_time_seconds_sum"] > 0
    assert m['vtengine_http_requests_total{route="/v1/completions",status="200"}'] == 1
    assert m["vtengine_kv_blocks_total"] == server.engine.engine.block_manager.num_blocks
    # the info series a campaign parses (campaigns/grid.py server_info)
    from campaigns.grid import server_info
    info = server_info(url)
    assert info["levers"] == {k: ({True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v))
                              for k, v in server.engine.engine.levers.values.items()}
    assert info["build"]["model"] == "tiny" and info["build"]["device"] == "cpu"


def test_latency_histograms_agree_with_client_timings(served):
    _, url = served
    n, c, max_tokens = 6, 3, 10
    prompts = [[20 + i] * (8 + 4 * i) for i in range(n)]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            sem = asyncio.Semaphore(c)

            async def one(p):
                async with sem:
                    return await timed_request(client, url, p, max_tokens)
            return await asyncio.gather(*(one(p) for p in prompts))

    client = asyncio.run(run())
    _, m = scrape(url)
    count = {h: m[f"{h}_count"] for h in HISTOGRAMS}
    total = {h: m[f"{h}_sum"] for h in HISTOGRAMS}
    ttft, itl, e2e, queue = HISTOGRAMS
    # one observation per request (per token gap for ITL), and the +Inf bucket holds them all
    assert count[ttft] == count[e2e] == count[queue] == n == m["vtengine_requests_finished_total"]
    assert count[itl] == n * (max_tokens - 1)
    for h in HISTOGRAMS:
        buckets = [(float(k.split('le="')[1].rstrip('"}')), v) for k, v in m.items() if k.startswith(f"{h}_bucket")]
        assert buckets and max(buckets)[1] == count[h] and max(buckets)[0] == float("inf")
        values = [v for _, v in sorted(buckets)]
        assert values == sorted(values), f"{h}: buckets are not cumulative"
    # server-side, each latency starts no earlier and ends no later than the client saw it (one clock: the
    # client and the server run in this process)
    assert 0 < total[ttft] <= sum(r["ttft"] for r in client)
    assert 0 < total[e2e] <= sum(r["e2e"] for r in client)
    # ... and no shorter than the engine work inside it: every request's TTFT contains its whole prefill step, and
    # every decode step sits inside the gap before some request's token
    prefill_s = m["vtengine_engine_step_time_seconds_sum"] - m["vtengine_engine_decode_time_seconds_sum"]
    assert total[ttft] >= prefill_s > 0
    assert total[itl] >= m["vtengine_engine_decode_time_seconds_sum"] > 0
    # E2E = TTFT + the request's ITLs (the last token is the finish); queue time is part of TTFT
    assert total[e2e] == pytest.approx(total[ttft] + total[itl], rel=1e-9)
    assert 0 <= total[queue] <= total[ttft]
    assert m["vtengine:kv_cache_usage_perc"] == 0 and m["vtengine_kv_blocks_used"] == 0


def test_kv_usage_gauge_follows_the_blocks_and_an_aborted_request_is_not_observed(served):
    _, url = served
    _, m0 = scrape(url)
    assert m0["vtengine:kv_cache_usage_perc"] == 0
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": "x" * 300, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True}) as resp:
            lines = resp.iter_lines()       # held: a dropped generator would close the response on break
            got = 0
            for line in lines:
                if line.startswith("data: {"):
                    got += 1
                    if got == 3:
                        break
            _, mid = scrape(url)
            used, blocks = mid["vtengine_kv_blocks_used"], mid["vtengine_kv_blocks_total"]
            assert used >= 301 // 16
            assert mid["vtengine:kv_cache_usage_perc"] == pytest.approx(used / blocks) and 0 < used / blocks < 1
        # leaving the block hangs up mid-stream: the request is aborted
    deadline = time.monotonic() + 20
    while True:
        _, m = scrape(url)
        if m["vtengine_kv_blocks_used"] == 0:
            break
        assert time.monotonic() < deadline, "blocks not freed after the client hung up"
        time.sleep(0.05)
    assert m["vtengine:kv_cache_usage_perc"] == 0
    # an aborted request did not finish generating: no latency of it is observed (see vtengine/metrics.py)
    assert all(m[f"{h}_count"] == 0 for h in HISTOGRAMS)
    assert m["vtengine_requests_finished_total"] == 0


def test_each_server_counts_only_its_own_requests(served):
    """A registry per server: two servers in one process do not share (or collide on) their series."""
    _, url = served
    other = Server.from_engine(LLMEngine(EngineConfig(model="tiny", max_num_seqs=2)))
    uv = start_in_thread(other)
    try:
        for _ in range(2):
            assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                              timeout=60).status_code == 200
        _, mine = scrape(url)
        _, theirs = scrape(uv.url)
        assert mine["vtengine:time_to_first_token_seconds_count"] == 2
        assert theirs["vtengine:time_to_first_token_seconds_count"] == 0
        assert 'vtengine_http_requests_total{route="/v1/completions",status="200"}' not in theirs
    finally:
        stop_thread(uv)
        other.engine.shutdown()
