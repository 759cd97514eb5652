"""The serving load generator (``vtengine bench serve``): the protocol of ``vllm bench serve``, closed loop.

One leg = a fixed list of random token-id prompts of exact length, sent to ``/v1/completions`` with
``max_tokens = output_len`` (the same for all, or each request's own: ``make_output_lens``), ``ignore_eos``,
temperature 0, streaming, at most ``concurrency`` in flight (request rate infinite: a new request starts the moment
one finishes). Warm-up requests run first and are not measured.
Every prompt must have a result and every request is validated (completed, exactly the completion tokens it asked
for by ``usage`` and by chunks, and one inter-token gap fewer); failures are reported in the result,
never dropped silently, and a leg with any failure is ``valid = False``.

The metric definitions live in one place, ``LegMetrics``'s docstring, and follow vLLM's
``benchmarks/serve.py`` so figures compare across tools.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

PERCENTILES = (90, 99)


# ---------------------------------------------------------------------------------------------------------------
# prompts


def make_prompts(n: int, input_len: int, seed: int, vocab_range: tuple[int, int]) -> list[list[int]]:
    """``n`` prompts of exactly ``input_len`` token ids drawn uniformly from ``[lo, hi)`` by a seeded generator.

    Token ids, not text, so the length is exact (text would re-tokenize to a different length). ``vocab_range``
    should exclude special tokens (BOS/EOS/chat markers): ``safe_vocab_range`` picks one from the server."""
    lo, hi = int(vocab_range[0]), int(vocab_range[1])
    if not 0 <= lo < hi:
        raise ValueError(f"vocab_range must be [lo, hi) with 0 <= lo < hi, got {vocab_range!r}")
    if n < 0 or input_len < 1:
        raise ValueError(f"need n >= 0 and input_len >= 1, got n={n}, input_len={input_len}")
    rng = np.random.default_rng(seed)
    return rng.integers(lo, hi, size=(n, input_len), dtype=np.int64).tolist()


def prompts_sha256(prompts: list[list[int]]) -> str:
    """sha256 of the prompts as compact JSON (``[[1,2],[3]]``, no spaces): the id of a prompt partition."""
    return hashlib.sha256(json.dumps(prompts, separators=(",", ":")).encode()).hexdigest()


def make_output_lens(n: int, output_len: int, range_ratio: float, seed: int) -> list[int]:
    """Each request's output length: ``output_len`` for all when ``range_ratio`` is 0, else an integer drawn
    uniformly from ``[output_len * (1 - r), output_len * (1 + r)]`` by a seeded generator (vLLM's random dataset
    range ratio, applied to the outputs). Requests that end at different steps arrive at different steps: a closed
    loop of equal requests otherwise runs in lockstep, and a prefill never finds another request decoding. The
    bounds are rounded to the nearest integer (Python's round, halves to even), where vLLM truncates them: at a
    fractional bound the two ranges differ by one token at an end. Kept so, as the recorded campaigns' legs drew
    their lengths this way (a change would make new legs unlike theirs)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if range_ratio == 0.0 and n >= 0 and output_len >= 1:
        return [output_len] * n
    lo, hi = round(output_len * (1 - range_ratio)), round(output_len * (1 + range_ratio))
    if n < 0 or lo < 2:
        raise ValueError(f"need n >= 0 and output lengths >= 2 (TPOT needs two tokens), got n={n}, "
                         f"output_len={output_len}, range_ratio={range_ratio}: shortest {lo}")
    if lo == hi:
        return [output_len] * n
    return np.random.default_rng([seed, 1]).integers(lo, hi + 1, size=n).tolist()


def _per_request(output_len: int | list[int], n: int) -> list[int]:
    """One requested output length per prompt: an int for all of them, or a list of exactly ``n``."""
    if isinstance(output_len, (int, np.integer)):
        return [int(output_len)] * n
    if len(output_len) != n:
        raise ValueError(f"{len(output_len)} output lengths for {n} prompts: give one per prompt, or one int")
    return [int(x) for x in output_len]


def _nominal(output_len: int | list[int], lens: list[int]) -> int:
    """The one length every request asked for, or the mean of their own (rounded; 1 where there are none)."""
    if isinstance(output_len, (int, np.integer)):
        return int(output_len)
    return round(sum(lens) / len(lens)) if lens else 1


def safe_vocab_range(model_info: dict) -> tuple[int, int]:
    """Ids safe for random prompts: below the tokenizer's base vocabulary (added special tokens sit above it)
    and the model's, skipping the lowest ids where small vocabularies keep BOS/EOS/PAD."""
    hi = min(int(model_info.get("tokenizer_vocab_size") or model_info["vocab_size"]), int(model_info["vocab_size"]))
    lo = min(16, hi // 2)
    return lo, hi


# ---------------------------------------------------------------------------------------------------------------
# results


@dataclass
class RequestResult:
    """What one request measured, all times in seconds from ``time.perf_counter``."""
    prompt_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0                       # request start -> first content chunk
    itl: list[float] = field(default_factory=list)   # gaps between consecutive content chunks
    latency: float = 0.0                    # request start -> last content chunk (E2EL)
    output_tokens: int = 0                  # usage.completion_tokens
    server_prompt_tokens: int | None = None  # usage.prompt_tokens: what the server read (None: it did not say)
    chunk_tokens: int = 0                   # tokens counted from the chunks' token_ids
    num_chunks: int = 0                     # content chunks (chunks with a choice)


@dataclass
class LegMetrics:
    """One leg's figures, defined exactly as ``vllm bench serve`` defines them.

    Over the successful requests of the leg (warm-up excluded):

    - ``duration_s``: wall time from the first measured request's start to the last one's end.
    - ``completed`` / ``failed``: prompts whose request succeeded / did not or left no result (see ``failures``
      for why); they add up to ``num_prompts``.
    - ``total_input_tokens``: sum of prompt lengths of completed requests; ``total_output_tokens``: sum of their
      ``usage.completion_tokens``.
    - ``request_throughput`` = completed / duration_s (req/s); ``output_throughput`` = total_output_tokens /
      duration_s (tok/s); ``total_token_throughput`` = (total_input_tokens + total_output_tokens) / duration_s.
    - TTFT: time from sending the request to receiving its first content chunk (a chunk with a choice).
    - ITL: every gap between consecutive content chunks, pooled over all requests (one token per chunk, so a
      request contributes output_tokens - 1 gaps).
    - TPOT per request = (E2EL - TTFT) / (output_tokens - 1), for requests with more than one output token.
    - E2EL: time from sending the request to its last content chunk.
    - For each of ttft, tpot, itl, e2el: ``mean_*_ms``, ``median_*_ms``, ``std_*_ms``, ``p90_*_ms``,
      ``p99_*_ms`` (numpy percentiles, linear interpolation) and ``max_*_ms``, in milliseconds. The max is not a
      vLLM figure: a stall in fewer than 1% of the gaps (one per request of 128 tokens) is beyond the P99's reach,
      and the max shows it.

    ``valid`` is True only if every prompt has one result and every request completed with exactly the completion
    tokens it asked for (by usage and by chunk token ids) and one ITL fewer. ``output_len``: what every request asked
    for, or, where each asked for its own (``make_output_lens``), their mean, rounded.

    ``server`` holds the server's own figures over the leg (``SERVER_COUNTERS``: deltas of /metrics between just
    before and just after the measured requests; ``SERVER_GAUGES``: the value after), and means derived from them:
    ``mean_step_ms``, ``mean_decode_step_ms`` and, from the server's latency histograms, ``mean_ttft_ms``,
    ``mean_itl_ms``, ``mean_e2el_ms``, ``mean_queue_ms`` (server-side, so each is at most the client's figure but
    for the clock; left out when their count did not move). A metric the server does not expose (renamed, removed,
    or /metrics unreadable) is never filled with 0: its fields are left out, ``server["missing"]`` lists the metric
    names, and the leg fails (``valid = False``) with a reason naming them.
    """
    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int
    prompts_sha256: str
    completed: int = 0
    failed: int = 0
    valid: bool = False
    failures: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    total_input_tokens: int = 0
    total_output_tokens: int = 0
    request_throughput: float = 0.0
    output_throughput: float = 0.0
    total_token_throughput: float = 0.0
    mean_ttft_ms: float = 0.0
    median_ttft_ms: float = 0.0
    std_ttft_ms: float = 0.0
    p90_ttft_ms: float = 0.0
    p99_ttft_ms: float = 0.0
    max_ttft_ms: float = 0.0
    mean_tpot_ms: float = 0.0
    median_tpot_ms: float = 0.0
    std_tpot_ms: float = 0.0
    p90_tpot_ms: float = 0.0
    p99_tpot_ms: float = 0.0
    max_tpot_ms: float = 0.0
    mean_itl_ms: float = 0.0
    median_itl_ms: float = 0.0
    std_itl_ms: float = 0.0
    p90_itl_ms: float = 0.0
    p99_itl_ms: float = 0.0
    max_itl_ms: float = 0.0
    mean_e2el_ms: float = 0.0
    median_e2el_ms: float = 0.0
    std_e2el_ms: float = 0.0
    p90_e2el_ms: float = 0.0
    p99_e2el_ms: float = 0.0
    max_e2el_ms: float = 0.0
    server: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(results: list[RequestResult | None], duration_s: float, *, concurrency: int,
                    output_len: int | list[int], prompts: list[list[int]]) -> LegMetrics:
    """The LegMetrics of a leg from its per-request results, ``results[i]`` for ``prompts[i]`` (None: that request
    left no result); the definitions are in LegMetrics' docstring. ``output_len``: one for every request, or each
    request's own (``output_len`` in the metrics is then their mean, rounded)."""
    lens = _per_request(output_len, len(prompts))
    nominal = _nominal(output_len, lens)
    m = LegMetrics(concurrency=concurrency, input_len=len(prompts[0]) if prompts else 0, output_len=nominal,
                   num_prompts=len(prompts), prompts_sha256=prompts_sha256(prompts), duration_s=duration_s)
    if len(results) > len(prompts):
        m.failures.append(f"{len(results)} results for {len(prompts)} prompts: the results do not belong to this "
                          f"leg's prompts")
    ok = []
    missing = [None] * (len(prompts) - len(results))        # prompts past the end of the results have none
    for i, r in enumerate(list(results[:len(prompts)]) + missing):
        reason = _failure(r, lens[i])
        if reason:
            m.failures.append(f"request {i}: {reason}")
        else:
            ok.append(r)
    m.completed, m.failed = len(ok), len(prompts) - len(ok)
    m.valid = not m.failures and m.completed == len(prompts) > 0
    m.total_input_tokens = sum(r.prompt_len for r in ok)
    m.total_output_tokens = sum(r.output_tokens for r in ok)
    if duration_s > 0:
        m.request_throughput = m.completed / duration_s
        m.output_throughput = m.total_output_tokens / duration_s
        m.total_token_throughput = (m.total_input_tokens + m.total_output_tokens) / duration_s
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [x for r in ok for x in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name, xs in series.items():
        a = np.asarray(xs, dtype=np.float64) * 1000.0 if xs else np.zeros(1)
        setattr(m, f"mean_{name}_ms", float(a.mean()))
        setattr(m, f"median_{name}_ms", float(np.median(a)))
        setattr(m, f"std_{name}_ms", float(a.std()))
        for p in PERCENTILES:
            setattr(m, f"p{p}_{name}_ms", float(np.percentile(a, p)))
        setattr(m, f"max_{name}_ms", float(a.max()))
    return m


def _failure(r: RequestResult | None, output_len: int) -> str:
    """Why a request does not count in the leg's figures ('' when it does)."""
    if r is None:
        return "no result (the request was not sent, or its result was lost)"
    if not r.success:
        return r.error or "failed without an error message"
    return _validate(r, output_len)


def _validate(r: RequestResult, output_len: int) -> str:
    if r.server_prompt_tokens is None:
        return "usage carried no prompt_tokens: the prompt the server read is unknown"
    if r.server_prompt_tokens != r.prompt_len:
        return (f"usage.prompt_tokens = {r.server_prompt_tokens}, expected {r.prompt_len} (the server added or cut "
                "prompt tokens: the leg's token totals would be miscounted)")
    if r.output_tokens != output_len:
        return f"usage.completion_tokens = {r.output_tokens}, expected {output_len}"
    if r.chunk_tokens != output_len:
        return f"chunks carried {r.chunk_tokens} token ids, expected {output_len}"
    if len(r.itl) != output_len - 1:
        return f"{len(r.itl)} inter-token gaps ({r.num_chunks} content chunks), expected {output_len - 1}"
    return ""


# ---------------------------------------------------------------------------------------------------------------
# the client


async def _one_request(client, url: str, model: str, prompt: list[int], output_len: int,
                       timeout_s: float) -> RequestResult:
    """POST one streamed completion and time its chunks as vLLM's async_request_openai_completions does."""
    import httpx

    r = RequestResult(prompt_len=len(prompt))
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    st = time.perf_counter()
    last = st
    done = False
    try:
        async with client.stream("POST", url, json=body, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                r.error = f"HTTP {resp.status_code}: {text[:300]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                data = json.loads(payload)
                if not isinstance(data, dict):
                    r.error = f"a stream event that is no JSON object: {payload[:200]}"
                    return r
                if "error" in data:
                    err = data["error"]
                    r.error = f"in-stream error: {err.get('message') if isinstance(err, dict) else err}"
                    return r
                if data.get("choices"):
                    if r.num_chunks == 0:
                        r.ttft = now - st
                    else:
                        r.itl.append(now - last)
                    last = now
                    r.num_chunks += 1
                    r.chunk_tokens += len(data["choices"][0].get("token_ids") or [])
                elif data.get("usage"):
                    r.output_tokens = int(data["usage"].get("completion_tokens") or 0)
                    if data["usage"].get("prompt_tokens") is not None:
                        r.server_prompt_tokens = int(data["usage"]["prompt_tokens"])
    except (httpx.HTTPError, httpx.StreamError, json.JSONDecodeError, OSError, KeyError, TypeError, ValueError,
            AttributeError, IndexError) as e:
        # one request's failure, whatever the server sent: it counts as failed (and fails the leg, by name), never
        # aborts the other requests' figures
        r.error = f"{type(e).__name__}: {e}"
        return r
    r.latency = last - st
    if not done:
        r.error = "stream ended without data: [DONE]"
    elif r.num_chunks == 0:
        r.error = "no content chunks"
    else:
        r.success = True
    return r


async def _run(client, url: str, model: str, prompts: list[list[int]], output_len: int | list[int],
               concurrency: int, timeout_s: float) -> tuple[list[RequestResult | None], float]:
    """Closed loop: ``concurrency`` workers take the next prompt as soon as their previous request ends. The
    results stay in prompt order, None where a request left none, so a failure names the right request."""
    results: list[RequestResult | None] = [None] * len(prompts)
    lens = _per_request(output_len, len(prompts))
    next_i = 0

    async def worker():
        nonlocal next_i
        while next_i < len(prompts):
            i = next_i
            next_i += 1
            try:        # httpx's timeout bounds each read; this bounds the whole request, as --timeout says
                results[i] = await asyncio.wait_for(
                    _one_request(client, url, model, prompts[i], lens[i], timeout_s), timeout_s)
            except asyncio.TimeoutError:
                results[i] = RequestResult(prompt_len=len(prompts[i]),
                                           error=f"no complete response within the {timeout_s:g} s timeout")

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(prompts))))))
    return results, time.perf_counter() - t0


async def run_leg_async(base_url: str, model: str, prompts: list[list[int]], output_len: int | list[int],
                        concurrency: int, *, warmup_prompts: list[list[int]] | None = None, timeout_s: float = 600.0,
                        read_server_metrics: bool = True) -> LegMetrics:
    """One measured leg (``output_len``: one for every request, or each prompt's own); the warm-up requests ask
    for the measured lengths' mean."""
    import httpx

    lens = _per_request(output_len, len(prompts))
    warm_len = _nominal(output_len, lens)

    base_url = base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        warm_fail = []
        if warmup_prompts:
            warm, _ = await _run(client, url, model, warmup_prompts, warm_len, concurrency, timeout_s)
            warm_fail = [f"warm-up request {i}: {_failure(r, warm_len)}"
                         for i, r in enumerate(warm) if _failure(r, warm_len)]
        before = await _scrape(client, base_url) if read_server_metrics else None
        results, duration = await _run(client, url, model, prompts, output_len, concurrency, timeout_s)
        after = await _scrape(client, base_url) if read_server_metrics else None
    m = compute_metrics(results, duration, concurrency=concurrency, output_len=output_len, prompts=prompts)
    if warm_fail:       # a failing warm-up says the server is broken: the leg cannot be valid
        m.failures = warm_fail + m.failures
        m.valid = False
    if read_server_metrics:
        m.server = _server_deltas(before, after)
        problems = [p for p in (before, after) if isinstance(p, str)]
        if m.server.get("missing"):     # evidence the leg promises and does not have: fail it, by name
            m.failures.append(f"server metrics missing from {base_url}/metrics: {', '.join(m.server['missing'])}"
                              + (f" ({problems[0]})" if problems else " (renamed or removed on the server?)"))
            m.valid = False
        if m.server.get("reset"):       # a delta across a restart means nothing: fail it, by name
            m.failures.append(f"server counters went down during the leg at {base_url}/metrics (did the server "
                              f"restart?): {', '.join(m.server['reset'])}")
            m.valid = False
    return m


def run_leg(base_url: str, model: str, prompts: list[list[int]], output_len: int | list[int], concurrency: int,
            *, warmup_prompts: list[list[int]] | None = None, timeout_s: float = 600.0,
            read_server_metrics: bool = True) -> LegMetrics:
    """Run one measured leg against a running server (blocking; see run_leg_async)."""
    return asyncio.run(run_leg_async(base_url, model, prompts, output_len, concurrency,
                                     warmup_prompts=warmup_prompts, timeout_s=timeout_s,
                                     read_server_metrics=read_server_metrics))


async def _scrape(client, base_url: str) -> dict[str, float] | str:
    """The server's /metrics as parse_prometheus gives it, or why it could not be read (a string)."""
    try:
        resp = await client.get(f"{base_url}/metrics", timeout=30)
        resp.raise_for_status()
    except Exception as e:
        return f"/metrics could not be read: {type(e).__name__}: {e}"
    return parse_prometheus(resp.text)


def parse_prometheus(text: str) -> dict[str, float]:
    """{'name' or 'name{labels}': value} from Prometheus text (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


# The server's figures a leg records, by the leg's field name -> the /metrics series it comes from. One table, so a
# metric renamed on the server shows up here as missing, by name, instead of as a silent 0.
SERVER_COUNTERS = {                 # recorded as after - before
    "tokens_generated": "vtengine_generation_tokens_total",
    "prompt_tokens": "vtengine_prompt_tokens_total",
    "requests_finished": "vtengine_requests_finished_total",
    "steps": "vtengine_engine_steps_total",
    "step_time_s": "vtengine_engine_step_time_seconds_sum",
    "decode_steps": "vtengine_engine_decode_steps_total",
    "decode_time_s": "vtengine_engine_decode_time_seconds_sum",
    "ttft_s": "vtengine:time_to_first_token_seconds_sum",
    "ttft_count": "vtengine:time_to_first_token_seconds_count",
    "itl_s": "vtengine:inter_token_latency_seconds_sum",
    "itl_count": "vtengine:inter_token_latency_seconds_count",
    "e2el_s": "vtengine:e2e_request_latency_seconds_sum",
    "e2el_count": "vtengine:e2e_request_latency_seconds_count",
    "queue_s": "vtengine:request_queue_time_seconds_sum",
    "queue_count": "vtengine:request_queue_time_seconds_count",
}
SERVER_GAUGES = {                   # recorded as the value after the leg
    "peak_gpu_memory_bytes": "vtengine_peak_gpu_memory_bytes",
}
# derived means (ms): field -> (numerator field in seconds, denominator field)
SERVER_MEANS = {
    "mean_step_ms": ("step_time_s", "steps"),
    "mean_decode_step_ms": ("decode_time_s", "decode_steps"),
    "mean_ttft_ms": ("ttft_s", "ttft_count"),
    "mean_itl_ms": ("itl_s", "itl_count"),
    "mean_e2el_ms": ("e2el_s", "e2el_count"),
    "mean_queue_ms": ("queue_s", "queue_count"),
}


def _server_deltas(before: dict[str, float] | str | None, after: dict[str, float] | str | None
                   ) -> dict[str, Any]:
    """The leg's ``server`` dict from two scrapes (a scrape that failed is a string or None: everything it should
    have given is missing). Fields whose metric is absent are left out and listed under ``missing``; a counter that
    went down between the two (the server restarted) is left out and listed under ``reset``."""
    before = before if isinstance(before, dict) else {}
    after = after if isinstance(after, dict) else {}
    out: dict[str, Any] = {}
    missing: list[str] = []
    reset: list[str] = []
    for name, metric in SERVER_COUNTERS.items():
        if metric in before and metric in after and after[metric] >= before[metric]:
            out[name] = after[metric] - before[metric]
        elif metric in before and metric in after:     # a counter that went down: the server restarted mid-leg
            reset.append(f"{metric} {before[metric]:g} -> {after[metric]:g}")
        else:
            missing.append(metric)
    for name, metric in SERVER_GAUGES.items():
        if metric in after:
            out[name] = after[metric]
        else:
            missing.append(metric)
    for name, (total, count) in SERVER_MEANS.items():
        if out.get(count) and total in out:     # a mean of nothing is left out, not 0 (nor one whose sum is
            out[name] = 1000 * out[total] / out[count]     # missing: listed above)
    if missing:
        out["missing"] = missing
    if reset:
        out["reset"] = reset
    return out


def get_model_info(base_url: str, timeout_s: float = 30.0) -> dict:
    import httpx
    resp = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=timeout_s)
    resp.raise_for_status()
    return resp.json()["data"][0]


# ---------------------------------------------------------------------------------------------------------------
# CLI


def main(argv: list[str] | None = None) -> int:
    """``vtengine bench serve [--base-url URL] [--model M] [--input-len 1024] [--output-len 128]
    [--output-len-range 0] [--concurrency 1] [--num-prompts N] [--warmup W] [--seed 0] [--vocab-range LO:HI]
    [--timeout S] [--result-json PATH]``

    Runs one closed-loop leg against a running ``vtengine serve`` and prints vLLM-style figures. ``--model``
    defaults to what the server serves; ``--num-prompts`` to 4 x concurrency; ``--warmup`` to ``concurrency``
    requests on prompts disjoint from the measured ones; ``--vocab-range`` to ``safe_vocab_range`` of the
    server's /v1/models. Exit status 1 if the leg is invalid (any request failed validation)."""
    ap = argparse.ArgumentParser(prog="vtengine bench serve", description="closed-loop serving benchmark")
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--output-len-range", type=float, default=0.0, metavar="R",
                    help="each request's output length uniform in [L(1-R), L(1+R)] (default 0: all L)")
    ap.add_argument("--concurrency", "--max-concurrency", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-range", default=None, metavar="LO:HI")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    ap.add_argument("--result-json", default=None)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.concurrency < 1 or args.output_len < 1 or args.input_len < 1:
        ap.error("--concurrency, --input-len and --output-len must be >= 1")
    try:
        info = get_model_info(args.base_url)
    except Exception as e:
        print(f"vtengine bench serve: cannot reach {args.base_url}/v1/models: {e}", file=sys.stderr)
        return 2
    model = args.model or info["id"]
    if args.vocab_range:
        lo, _, hi = args.vocab_range.partition(":")
        vocab_range = (int(lo), int(hi))
    else:
        vocab_range = safe_vocab_range(info)
    n = args.num_prompts if args.num_prompts is not None else 4 * args.concurrency
    n_warm = args.warmup if args.warmup is not None else args.concurrency
    # one draw split in two, so warm-up and measured prompts are disjoint and both fixed by the seed
    allp = make_prompts(n + n_warm, args.input_len, args.seed, vocab_range)
    warm, prompts = allp[:n_warm], allp[n_warm:]
    try:
        lens = make_output_lens(n, args.output_len, args.output_len_range, args.seed)
    except ValueError as e:
        ap.error(f"--output-len-range {args.output_len_range}: {e}")
    m = run_leg(args.base_url, model, prompts, lens, args.concurrency, warmup_prompts=warm,
                timeout_s=args.timeout)
    context = server_context(args.base_url)
    print(format_summary(m))
    print(f"{'Server':<45}{context.get('error') or _describe(context)}")
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"base_url": args.base_url, "model": model, "vocab_range": list(vocab_range),
                                    "seed": args.seed, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                    "context": context, **m.to_dict()}, indent=2))
    return 0 if m.valid else 1


def server_context(base_url: str) -> dict:
    """What the server says it ran (its build: model, quant, dtype, device, versions; every lever's resolved value),
    as a campaign records it for each arm, so a leg's JSON says which GPU and settings its figures belong to. A
    server without those series (not a vtengine server) gives ``{"error": why}``: the leg is still recorded."""
    from campaigns.grid import GridError, server_info
    try:
        info = server_info(base_url.rstrip("/"))
    except GridError as e:
        return {"error": str(e)}
    return {"build": info["build"], "levers": dict(sorted(info["levers"].items()))}


def _describe(context: dict) -> str:
    b = context["build"]
    return ", ".join(f"{k} {b[k]}" for k in ("device", "model", "quant", "torch", "triton") if b.get(k))


def format_summary(m: LegMetrics) -> str:
    rows = [
        ("Valid", str(m.valid)), ("Successful requests", m.completed), ("Failed requests", m.failed),
        ("Max concurrency", m.concurrency), ("Benchmark duration (s)", f"{m.duration_s:.2f}"),
        ("Total input tokens", m.total_input_tokens), ("Total generated tokens", m.total_output_tokens),
        ("Request throughput (req/s)", f"{m.request_throughput:.2f}"),
        ("Output token throughput (tok/s)", f"{m.output_throughput:.2f}"),
        ("Total token throughput (tok/s)", f"{m.total_token_throughput:.2f}"),
    ]
    for name, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        for stat in ("mean", "median", "p90", "p99", "max"):
            rows.append((f"{stat.capitalize()} {title} (ms)", f"{getattr(m, f'{stat}_{name}_ms'):.2f}"))
    if "mean_decode_step_ms" in m.server:
        rows.append(("Server mean decode step (ms)", f"{m.server['mean_decode_step_ms']:.2f}"))
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    lines += [f"{k:<40}{v:>26}" for k, v in rows]
    lines += [f"FAILURE: {f}" for f in m.failures[:20]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
