"""What ``GET /metrics`` exposes: one prometheus-client ``CollectorRegistry`` per server (never the process-global
default: tests run several servers in one process, and each must count only its own requests).

Two kinds of series:

- Read at scrape time from the engine's stats snapshot, the kernel counters and the engine's configuration (a custom
  collector, so the values have one owner, the engine): requests running/waiting, KV blocks, token/request/step
  counters, step time, preemptions, peak GPU memory, kernel routes, and the info series ``vtengine_lever_info``
  (every lever's resolved value and source) and ``vtengine_build_info`` (model, quant, dtype, device, versions) that
  a campaign records as an arm's context. These keep the names campaigns read (``vtengine_*``).
- Observed by the serving side once per finished request, from the engine's timestamps on the request's
  ``Sequence`` (``SequenceTimes``), named as vLLM names them with ``vtengine:`` for ``vllm:``:

    vtengine:time_to_first_token_seconds   histogram  arrival -> first generated token
    vtengine:inter_token_latency_seconds   histogram  every gap between consecutive tokens of a request
    vtengine:e2e_request_latency_seconds   histogram  arrival -> last token
    vtengine:request_queue_time_seconds    histogram  arrival -> start of the first step that ran it
    vtengine:kv_cache_usage_perc           gauge      KV blocks in use / blocks in the pool (0..1), read at scrape

  "Arrival" is when the HTTP handler received the request (before parsing), so TTFT and queue time include the wait
  for the engine thread to pick the request up between two steps. Only requests that finished generating (stop or
  length, the ones ``vtengine_requests_finished_total`` counts) are observed: an aborted request's latency is its
  client's choice. Each histogram's ``_count`` therefore moves with ``vtengine_requests_finished_total`` (the ITL
  histogram by completion tokens - 1 per request).

Two counters are exposed as the ``_sum`` of a summary because their names end in ``_sum`` (prometheus-client would
append ``_total`` to a counter): ``vtengine_engine_step_time_seconds`` (``_sum`` = time in steps, ``_count`` =
steps) and ``vtengine_engine_decode_time_seconds`` (decode steps only).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, SummaryMetricFamily

from vtengine import counters
from vtengine.engine.sequence import SequenceTimes

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# No ``*_created`` timestamp series next to every counter and histogram: Prometheus detects resets itself, and they
# doubled the families a reader scans. (A process-wide switch of prometheus-client; the servers are its only users.)
disable_created_metrics()
PREFIX = "vtengine"

# vLLM's buckets (vllm/v1/metrics/loggers.py), extended below where our figures live: a decode step on an H200 takes
# a few milliseconds, and a request that finds a free slot waits well under vLLM's first 0.3 s bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                           30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The registry of one server: ``observe_finished`` per finished request, ``count_http`` per response,
    ``render()`` for GET /metrics. ``engine`` is the server's ``AsyncEngine`` (its ``stats()`` snapshot and the
    wrapped ``LLMEngine`` for the info series)."""

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.ttft = Histogram("vtengine:time_to_first_token_seconds",
                              "Time to first token: request arrival to its first generated token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vtengine:inter_token_latency_seconds",
                             "Inter-token latency: the gap between consecutive generated tokens of a request.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vtengine:e2e_request_latency_seconds",
                             "End-to-end request latency: request arrival to its last token.",
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vtengine:request_queue_time_seconds",
                               "Queue time: request arrival to the start of the first engine step that ran it.",
                               buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.http_requests = Counter(f"{PREFIX}_http_requests", "HTTP requests by route and status.",
                                     ["route", "status"], registry=r)
        r.register(_EngineCollector(engine.stats))
        r.register(_KernelCollector())
        r.register(_InfoCollector(lambda: engine.engine))

    def observe_finished(self, times: SequenceTimes | None) -> None:
        """One request that finished generating (stop or length): its TTFT, ITLs, E2E latency and queue time."""
        if times is None or times.finished is None or not times.token_times:
            return              # an engine without timing hooks, or a request that never finished generating
        self.ttft.observe(times.ttft)
        for gap in times.inter_token_latencies:
            self.itl.observe(gap)
        self.e2e.observe(times.e2e)
        if times.queue_time is not None:
            self.queue.observe(times.queue_time)

    def count_http(self, route: str, status: int) -> None:
        self.http_requests.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ---------------------------------------------------------------------------------------------------------------
# collectors read at scrape time


class _EngineCollector:
    """The engine's stats snapshot (``AsyncEngine.stats()``, refreshed after every step) as gauges and counters."""

    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self) -> Iterator:
        st = self.stats()
        total = st.get("kv_blocks_total", 0)
        free = st.get("kv_blocks_free", 0)
        p = PREFIX
        gauges = [
            ("num_requests_running", "Requests in the running batch.", st.get("num_running", 0)),
            ("num_requests_waiting", "Requests waiting for admission.", st.get("num_waiting", 0)),
            ("kv_blocks_total", "KV cache blocks in the pool.", total),
            ("kv_blocks_free", "KV cache blocks free.", free),
            ("kv_blocks_used", "KV cache blocks held by sequences.", total - free),
            ("engine_step_time_seconds_last", "Duration of the last engine step.", st.get("step_time_s_last", 0.0)),
            ("peak_gpu_memory_bytes", "Peak GPU memory allocated by the engine (0 on CPU).",
             st.get("peak_gpu_memory_bytes", 0)),
            ("engine_alive", "1 while the engine thread runs.", int(bool(st.get("engine_alive")))),
        ]
        for name, help_, value in gauges:
            yield GaugeMetricFamily(f"{p}_{name}", help_, value=value)
        yield GaugeMetricFamily("vtengine:kv_cache_usage_perc",
                                "KV cache usage: blocks held by sequences / blocks in the pool (0 to 1).",
                                value=(total - free) / total if total else 0.0)
        counts = [
            ("generation_tokens_total", "Tokens generated.", st.get("tokens_generated_total", 0)),
            ("prompt_tokens_total", "Prompt tokens prefilled.", st.get("prompt_tokens_total", 0)),
            ("requests_finished_total", "Requests that finished generating (stop or length).",
             st.get("requests_finished_total", 0)),
            ("engine_steps_total", "Engine steps.", st.get("steps_total", 0)),
            ("engine_decode_steps_total", "Engine steps that decoded (no prefill).", st.get("decode_steps_total", 0)),
            ("num_preemptions_total", "Sequences preempted (KV pool full) and recomputed later.",
             st.get("num_preemptions", 0)),
        ]
        for name, help_, value in counts:
            yield CounterMetricFamily(f"{p}_{name}", help_, value=value)
        yield SummaryMetricFamily(f"{p}_engine_step_time_seconds", "Time in engine steps (_sum) and steps (_count).",
                                  count_value=st.get("steps_total", 0), sum_value=st.get("step_time_s_sum", 0.0))
        yield SummaryMetricFamily(f"{p}_engine_decode_time_seconds",
                                  "Time in decode steps (_sum) and decode steps (_count).",
                                  count_value=st.get("decode_steps_total", 0),
                                  sum_value=st.get("decode_time_s_sum", 0.0))


class _KernelCollector:
    """The process's kernel route counters (vtengine/counters.py): which route each routed kernel took."""

    def collect(self) -> Iterator:
        launches = CounterMetricFamily(f"{PREFIX}_kernel_launches_total", "Kernel launches by kernel and route.",
                                       labels=["kernel", "route"])
        splits = CounterMetricFamily(f"{PREFIX}_kernel_splits_total",
                                     "Kernel launches by kernel, route and split count (split-K decode).",
                                     labels=["kernel", "route", "splits"])
        for kernel, routes in counters.snapshot().items():
            for route, st in routes.items():
                launches.add_metric([kernel, route], st["launches"])
                for s, n in st["splits"].items():
                    splits.add_metric([kernel, route, s], n)
        yield launches
        yield splits


class _InfoCollector:
    """Info series (value 1, the facts in labels): what a campaign records as an arm's context."""

    def __init__(self, engine: Callable[[], Any]):
        self.engine = engine

    def collect(self) -> Iterator:
        eng = self.engine()
        levers = getattr(eng, "levers", None)
        if levers is not None:
            info = InfoMetricFamily(f"{PREFIX}_lever", "Every lever's resolved value and where it came from.",
                                    labels=["lever", "value", "source"])
            for name, value in sorted(levers.values.items()):
                text = {True: "on", False: "off"}[value] if isinstance(value, bool) else str(value)
                info.add_metric([name, text, str(levers.sources[name])], {})
            yield info
        build = build_info(eng)
        if build:
            yield InfoMetricFamily(f"{PREFIX}_build", "What this server runs.", value=build)


def build_info(engine: Any) -> dict[str, str]:
    """What an engine runs, as label values: model, quant, dtype, device, torch and triton versions, backend."""
    import torch
    cfg = getattr(engine, "config", None)
    dev = getattr(engine, "device", None)
    if cfg is None or dev is None:
        return {}
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return {"model": str(getattr(engine, "model_name", cfg.model)), "quant": str(cfg.quant),
            "dtype": str(engine.dtype).replace("torch.", ""), "device": name, "torch": torch.__version__,
            "triton": triton_version, "backend": str(getattr(engine.backend, "name", "?"))}
