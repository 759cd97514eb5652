"""What the benchmarks share: the copy bandwidth every "% of floor" and "% of copy" figure is divided by, and the
small chores of a long run (an error as one line, a device sync, freeing the device between configurations).

Copy bandwidth, as measured by ``copy_bandwidth_gbs`` (the only place it is measured):

- the copy: ``dst.copy_(src)`` between two buffers on the same device (torch issues a device-to-device
  ``cudaMemcpyAsync``), outside any CUDA graph;
- the buffer: ``copy_buffer_bytes(L2)`` = max(1 GiB, 8 x the device's L2 cache), so the copy streams from and to
  HBM (an L2-resident part would inflate the figure) and lasts long enough (~0.5 ms on an H200) that the launch
  is noise;
- the bytes: read + written, 2 x the buffer: a kernel's achieved bandwidth counts the bytes it reads and writes,
  so the ceiling counts both too;
- the time: ``triton.testing.do_bench`` median over the reps it fits into ``COPY_REP_MS`` (CUDA events around
  each rep, the L2 flushed before each), after ``COPY_WARMUP_MS`` of warm-up;
- the figure: GB/s = 2 x buffer bytes / median seconds / 1e9.

Why one definition: decode, attention and w4a16 each measured it their own way (2 GiB, 1 GiB, and the best of three
copies incl. a graphed memcpy and an SM kernel, with different rep counts), so a "% of copy" in one report did not
compare with another's. With one function the ceiling is the same number wherever a kernel or a decode step is set
against it, and changing how it is measured is a change in this file alone. (On the H200 the old eager copies
happened to agree, 4241-4249 GB/s in bench/results/*-2026-11-30*; nothing kept them agreeing elsewhere.)
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

COPY_MIN_BYTES = 2**30          # a floor on the buffer: the copy must dwarf its launch
COPY_L2_MULTIPLE = 8            # the buffer is at least this many times the L2
COPY_WARMUP_MS = 50
COPY_REP_MS = 300
COPY_BANDWIDTH_DEFINITION = ("device-to-device copy of max(1 GiB, 8 x L2), bytes read + written, do_bench median; "
                             "vtengine/bench/common.py")


def copy_buffer_bytes(l2_bytes: int) -> int:
    """Bytes of the buffer copied: max(``COPY_MIN_BYTES``, ``COPY_L2_MULTIPLE`` x the L2), a whole number of
    int16 elements."""
    n = max(COPY_MIN_BYTES, COPY_L2_MULTIPLE * int(l2_bytes))
    return n - n % 2


def median_ms(fn: Callable[[], object]) -> float:
    """``triton.testing.do_bench`` median of ``fn`` in ms (CUDA events per rep, L2 flushed before each)."""
    import triton.testing        # late: vtengine.kernels picks the interpreter switch before triton is imported
    return triton.testing.do_bench(fn, warmup=COPY_WARMUP_MS, rep=COPY_REP_MS, return_mode="median")


def copy_bandwidth_gbs(nbytes: int | None = None, *, device: str | torch.device = "cuda",
                       timer: Callable[[Callable[[], object]], float] = median_ms) -> float:
    """Device-to-device copy bandwidth in GB/s, bytes read + written (the module docstring gives the definition).

    ``nbytes``: the buffer; None sizes it from the device's L2 (``copy_buffer_bytes``). ``timer`` takes the copy
    and returns its median time in ms (tests pass a stand-in)."""
    device = torch.device(device)
    if nbytes is None:
        if device.type != "cuda":
            raise ValueError(f"copy_bandwidth_gbs sizes its buffer from a CUDA device's L2; got device {device}, "
                             "pass nbytes")
        nbytes = copy_buffer_bytes(torch.cuda.get_device_properties(device).L2_cache_size)
    if nbytes < 2 or nbytes % 2:
        raise ValueError(f"nbytes must be a positive even number of bytes (int16 elements), got {nbytes}")
    src = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    if not ms > 0:
        raise RuntimeError(f"the copy of {nbytes} bytes timed at {ms} ms")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def captured(fn):
    """``fn`` (called once first: compiled, allocated) captured in a CUDA graph; returns the graph's ``replay``.
    Timing the replay leaves the host's launch cost out: what a graphed step pays, and what an eager step pays
    while its launches run ahead of the GPU (a ~0.1 ms kernel behind a ~0.1 ms Python launcher times as the
    launcher under do_bench)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def graph_us(graph, per_replay: int, reps: int) -> float:
    """Median over ``reps`` replays of a captured CUDA graph, in us per item of the ``per_replay`` it holds (a
    kernel launched that many times, or that many iterations), timed with CUDA events around each replay."""
    import statistics
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / per_replay)
    return statistics.median(times)


# -- chores of a long run --------------------------------------------------------------------------------------
def quiet_profiler() -> None:
    """Silence Kineto's own log lines before a torch.profiler session starts. Since torch 2.13 every session prints
    "USDT: ... profiler_start" and "profiler_stop" to stderr at Kineto's highest level (5), so a campaign's profile
    gate filled the console with them; level 6 is above every message. A level the user set is kept."""
    import os
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def error_text(e: BaseException, limit: int = 400) -> str:
    """An exception as one line of at most ``limit`` characters, for a result's ``error`` field."""
    return f"{type(e).__name__}: {e}"[:limit]


def synchronize(device: str | torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """Drop what Python and torch's CUDA cache still hold, before the next configuration takes the device."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cuda_env() -> dict:
    """The run's environment for a CUDA benchmark's report: device, SMs, L2, versions, UTC date and time."""
    import datetime
    import platform

    import triton
    props = torch.cuda.get_device_properties(0)
    now = datetime.datetime.now(datetime.timezone.utc)
    return dict(device=props.name, sms=props.multi_processor_count, l2_mb=props.L2_cache_size / 2 ** 20,
                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), date=now.strftime("%Y-%m-%d"), time_utc=now.isoformat())


def unique_stem(out_dir, base: str) -> str:
    """``base``, or ``base-2``, ``base-3``...: the first whose .json and .md are both absent from ``out_dir``. Every
    bench names its dated files through it, once at its start: a second run the same day (another machine, a
    re-check) never overwrites the figures of the first, which notes and tests cite."""
    from pathlib import Path
    out = Path(out_dir)
    stem, n = base, 1
    while (out / f"{stem}.json").exists() or (out / f"{stem}.md").exists():
        n += 1
        stem = f"{base}-{n}"
    return stem


def write_result(out_dir, stem: str, result: dict, markdown: str) -> None:
    """A benchmark's JSON and its Markdown report, written side by side (after each shape, so a run cut short
    keeps what it measured)."""
    import json
    from pathlib import Path
    out = Path(out_dir)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str))
    (out / f"{stem}.md").write_text(markdown)
