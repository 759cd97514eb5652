"""Why a lever wins: per-kernel time of each arm's decode step, and where the measured TPOT delta went.

The ``profile`` gate (campaigns/gates/profile.py) records, for each arm and outside the timed grid, a profiler window
over decode steps at two concurrencies (graphed steps on CUDA). This module turns such a window into time per step
per *engine kernel* (the names lever files use: decode_attention, w4a16_gemm, dense_linear, rms_norm, ...):

- on CUDA from device activity: each kernel's name maps to the engine kernel that launched it (our Triton kernels
  by their function names, cuBLAS to dense_linear); a CUDA-graph replay has no per-kernel host range, but device
  kernels keep their names;
- on CPU (the rehearsal) from the wall time inside ``vt::<kernel>`` ranges that ``annotated`` puts around every
  backend op while profiling (times only: a byte floor means nothing there).

``table`` then lines the arms up: per concurrency, each kernel's baseline and candidate µs/step, the delta, its share
of the grid's measured TPOT delta, and (CUDA) its fraction of its byte floor (bytes it must move per step over the
measured copy bandwidth); the unattributed remainder is host time and the gaps between kernels. ``residual`` says
what bounds the candidate's step now: its top kernels by time and how far each is from its floor.
"""
from __future__ import annotations

import re
import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from vtengine.backends import KERNEL_OPS, WEIGHT_OPS, kernel_ops, weight_kernel

ANNOTATION = "vt::"                     # record_function prefix of an engine kernel's range
# device kernel name (prefix or pattern) -> engine kernel; the first match wins
DEVICE_KERNELS = (
    (r"^_decode_kernel|^_decode_merge_kernel", "decode_attention"),
    (r"^_prefill_kernel", "prefill_attention"),
    (r"^_store_kv_kernel", "store_kv"),
    (r"^_add_rms_norm_kernel|^_rms_norm_kernel", "rms_norm"),
    (r"^_silu_mul_kernel", "silu_mul"),
    (r"^_rope_kernel", "rope"),
    (r"^_qkv_epilogue_kernel", "qkv_epilogue"),
    (r"^_argmax_kernel", "argmax"),
    (r"^_gemv_kernel", "dense_linear"),
    (r"^_w4a16_gemm_kernel|^_moe_align_e1_kernel", "w4a16_gemm"),
    (r"nvjet|gemm|gemv|cutlass|xmma|cublas", "dense_linear"),
    (r"^Memcpy|^Memset|memcpy|memset", "memcpy/memset"),
)
OTHER = "other device kernels"


def engine_kernel(device_name: str) -> str:
    for pattern, kernel in DEVICE_KERNELS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return kernel
    return OTHER


@contextmanager
def annotated(backend):
    """Every backend op of an engine kernel inside a ``vt::<kernel>`` profiler range while this holds (the CPU
    attribution groups CPU ops by these; off the profile window the hot path pays nothing)."""
    from torch.profiler import record_function
    saved = {}

    def wrap(fn, kernel):
        def op(*args, **kwargs):
            with record_function(ANNOTATION + kernel):
                return fn(*args, **kwargs)
        return op

    def wrap_weighted(fn, name):        # a projection method serves two kernels: named by its weight per call
        def op(*args, **kwargs):
            with record_function(ANNOTATION + weight_kernel(name, args, kwargs)):
                return fn(*args, **kwargs)
        return op
    for kernel in KERNEL_OPS:
        for name in kernel_ops(kernel):
            if name in saved or not hasattr(backend, name):
                continue
            saved[name] = backend.__dict__.get(name)
            fn = getattr(backend, name)
            setattr(backend, name, wrap_weighted(fn, name) if name in WEIGHT_OPS else wrap(fn, kernel))
    try:
        yield backend
    finally:
        for name, fn in saved.items():
            if fn is None:
                backend.__dict__.pop(name, None)
            else:
                setattr(backend, name, fn)


def _self_times(ops: list[dict]) -> list[float]:
    from vtengine.bench.decode.kernel_profile import _self_times_us
    return _self_times_us(ops)


def group(events: list[dict], steps: int, on_device: bool) -> dict[str, float]:
    """µs per step per engine kernel from a Kineto trace (restricted to the recorded steps by the caller). On the
    device, each activity's own time (``_own_times_us``): where PDL overlaps kernels, durations would count the
    overlap twice (sums past the step: a step "less its kernels" read -1,009 µs in a pdl_stack record) and charge a
    kernel's wait for the one before it to the waiting kernel."""
    out: dict[str, float] = {}
    if on_device:               # own times: under PDL a kernel's wait for the one before is that one's time
        from vtengine.bench.decode.kernel_profile import _own_times_us
        acts = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
        for e, us in zip(acts, _own_times_us(acts)):
            k = engine_kernel(e.get("name", ""))
            out[k] = out.get(k, 0.0) + us / steps
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))
    # CPU: the wall time inside each vt::<kernel> range (less the vt:: ranges nested in it). Under Triton's
    # interpreter a kernel is Python, not aten ops, so CPU ops' self time would miss nearly all of it.
    ranges = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
              and str(e.get("name", "")).startswith(ANNOTATION)]
    for r, us in zip(ranges, _self_times(ranges)):
        k = r["name"][len(ANNOTATION):]
        out[k] = out.get(k, 0.0) + us / steps
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def profile_window(llm, batch: int, prompt_len: int, steps: int, warm_steps: int = 2) -> dict[str, Any]:
    """One profiler window of the engine's decode at ``batch`` sequences (see ``window_from_trace``)."""
    from vtengine.bench.decode.kernel_profile import record_decode_trace
    eng = llm.engine
    on_device = eng.device.type == "cuda"
    with annotated(eng.backend) if not on_device else _nothing():
        events, step_s = record_decode_trace(llm, batch, prompt_len, steps, warm_steps)
    return window_from_trace(events, step_s, batch, prompt_len + warm_steps, steps, on_device)


LONGEST_GAPS = 3       # a window keeps its longest device-idle gaps: what a disturbance of it looked like


def window_from_trace(events: list[dict], step_s: list[float], batch: int, context_len: int, steps: int,
                      on_device: bool) -> dict[str, Any]:
    """{batch, context_len, step_us, host_step_us, kernels: {engine kernel: µs/step}, unattributed_us} from a
    profiler trace of decode steps and the host's time in each ``engine.step()`` (the first PROFILER_WARM_STEPS
    are the profiler's warm-up). ``context_len``: the context when the profiler started.

    step_us is the device timeline's period per step where the trace has one (CUDA), else the host's mean step.
    With async scheduling the host's step is not the device's: engine.step() returns once the step before is
    read, and the host work between two calls overlaps the device. On the H200 (2026-12-04, bf16 c1) the host
    read 4,054 µs a step under the profiler while the device timeline and the timed run read 4,640 and 4,609:
    async_scheduling's profile gate had put the step at 4.28 ms, and the served loop at 4.66 looked slower for no
    reason. unattributed_us: the step less its kernels' (own) time: the device's idle time in a step (windows
    recorded before 2026-12-08 summed durations, negative where PDL overlapped kernels). stalls_us (only
    where there were any): device-idle gaps too long to be a step's (``device_stalls_us``), left out of step_us.
    longest_gaps_us (CUDA): the window's LONGEST_GAPS longest device-idle gaps, stalls or not: whether idle time a
    window gained was one gap (something outside the steps) or spread over its steps."""
    from vtengine.bench.decode.kernel_profile import (PROFILER_WARM_STEPS, STEP_MARK, device_gaps_us,
                                                      device_stalls_us, device_step_us)
    marks = [e for e in events if e.get("name") == STEP_MARK and e.get("cat") == "user_annotation"]
    if marks:
        lo, hi = min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)
        events = [e for e in events if lo <= e.get("ts", lo - 1) <= hi]
    kernels = group(events, max(1, len(marks) or steps), on_device)
    host_us = 1e6 * statistics.fmean(step_s[PROFILER_WARM_STEPS:])
    device_us = device_step_us(events, len(marks)) if on_device and marks else None
    stalls = [] if device_us is None else device_stalls_us(events, max(sum(kernels.values()), host_us))
    if stalls:                      # idle time no step caused: left out of the period, kept in the window
        device_us -= sum(stalls) / len(marks)
    step_us = host_us if device_us is None else device_us
    window = {"batch": batch, "context_len": context_len + PROFILER_WARM_STEPS, "steps": len(marks),
              "activity": "cuda" if on_device else "cpu", "step_us": round(step_us, 3),
              "step_source": "host" if device_us is None else "device_timeline", "host_step_us": round(host_us, 3),
              "kernels": {k: round(v, 3) for k, v in kernels.items()},
              "unattributed_us": round(step_us - sum(kernels.values()), 3)}
    if stalls:
        window["stalls_us"] = [round(x) for x in stalls]
    if device_us is not None:       # the window's longest device-idle gaps: one long gap, or a step's own gaps?
        window["longest_gaps_us"] = [round(g) for g in sorted(device_gaps_us(events), reverse=True)[:LONGEST_GAPS]]
    if not on_device and marks:
        window["kernels_median"] = step_medians(events, marks)
    return window


def step_medians(events: list[dict], marks: list[dict]) -> dict[str, float]:
    """CPU: each engine kernel's median over the recorded steps of its µs in a step. A mean over three steps of a
    2-core host carries any one stall (66 ms once, in a rehearsal) into every kernel it lands in; the median does
    not. (On CUDA the device's kernels run behind the host's step marks, so steps cannot be cut by time there.)"""
    per_step = [group([e for e in events if m["ts"] <= e.get("ts", -1) <= m["ts"] + m["dur"]], 1, False)
                for m in marks]
    names = {k for step in per_step for k in step}
    return {k: round(statistics.median(step.get(k, 0.0) for step in per_step), 3) for k in sorted(names)}


@contextmanager
def _nothing():
    yield None


# ----------------------------------------------------------------------------------------------- byte floors


def floor_bytes(model_cfg: dict, quant: str, batch: int, context_len: int) -> dict[str, float]:
    """Bytes each engine kernel must move per decode step at least (weights once, each sequence's K/V once)."""
    h, inter, layers = model_cfg["hidden_size"], model_cfg["intermediate_size"], model_cfg["num_hidden_layers"]
    hq, hkv, d, vocab = (model_cfg["num_attention_heads"], model_cfg["num_key_value_heads"], model_cfg["head_dim"],
                         model_cfg["vocab_size"])
    per_layer = h * (hq + 2 * hkv) * d + hq * d * h + 2 * h * inter + inter * h        # qkv, o, gate_up, down
    wbytes = {"bf16": 2.0, "mxfp4": 0.5 + 1 / 32, "nvfp4": 0.5 + 1 / 16}[quant]
    out = {"decode_attention": 2.0 * 2 * layers * hkv * d * context_len * batch,
           "dense_linear": 2.0 * h * vocab + (per_layer * layers * 2.0 if quant == "bf16" else 0.0),
           "rms_norm": 2.0 * 2 * (2 * layers + 1) * h * batch}
    if quant != "bf16":
        out["w4a16_gemm"] = per_layer * layers * wbytes
    return out


@dataclass
class Row:
    kernel: str
    base_us: float
    cand_us: float
    delta_us: float                     # candidate - baseline (negative: the candidate is faster here)
    share: float | None                 # of the measured TPOT delta (None when that delta is ~0)
    floor: float | None                 # candidate's fraction of this kernel's byte floor (CUDA only)


def table(base: dict, cand: dict, tpot_base_ms: float | None, tpot_cand_ms: float | None,
          floors: dict[str, float] | None = None, copy_gbs: float | None = None) -> tuple[list[Row], dict]:
    """Per engine kernel: baseline and candidate µs/step, delta, share of the measured TPOT delta, fraction of the
    byte floor; plus a summary {measured_delta_us, kernels_delta_us, unattributed_us}. CPU windows are compared by
    their per-step medians (``step_medians``): a mean over three steps carries one host stall into the kernel it lands
    in (a 3 ms stall in a baseline's rms_norm once hid a 6x planted slowdown of it)."""
    key = "kernels_median" if "kernels_median" in base and "kernels_median" in cand else "kernels"
    bk, ck = base[key], cand[key]
    kernels = sorted(set(bk) | set(ck), key=lambda k: -max(bk.get(k, 0.0), ck.get(k, 0.0)))
    measured = None
    if tpot_base_ms is not None and tpot_cand_ms is not None:
        measured = 1000.0 * (tpot_cand_ms - tpot_base_ms)
    rows = []
    for k in kernels:
        b, c = bk.get(k, 0.0), ck.get(k, 0.0)
        delta = c - b
        share = delta / measured if measured is not None and abs(measured) > 1e-6 else None
        floor = None
        if floors and copy_gbs and k in floors and c > 0:
            floor = (floors[k] / (copy_gbs * 1e9) * 1e6) / c
        rows.append(Row(k, round(b, 3), round(c, 3), round(delta, 3),
                        None if share is None else round(share, 4), None if floor is None else round(floor, 4)))
    kd = sum(r.delta_us for r in rows)
    summary = {"measured_delta_us": None if measured is None else round(measured, 3), "kernels_delta_us": round(kd, 3),
               "unattributed_us": None if measured is None else round(measured - kd, 3),
               "profiled_step_delta_us": round(cand["step_us"] - base["step_us"], 3)}
    return rows, summary


# A change in the profiled windows' device idle time is read as a disturbance of a window, not the lever's, when it
# is larger than the larger of these, the grid's TPOT delta is about the kernels' (within as much, and under a third
# of the window's idle change: the grid saw no such change) and the window's step differs from the grid's by as much.
# On the H100 (2026-12-06, prefill_splits, a decode window the lever does not touch) one arm's c1 window read 7,082
# µs against 6,026 with kernels -10.8 µs and the grid's TPOT -4.2 µs: idle time in the window, shorter than a stall
# (STALL_STEPS). Where the grid's TPOT moved beyond the kernels too (host time: async_scheduling off; PDL's gaps;
# triton_gemv off's cuBLAS: kernels +106 µs, TPOT +376, window +580), the idle is the lever's. Only device
# timelines count: a host step (a CPU window, or evidence from before device periods) is not device idle time.
DISTURBED_US, DISTURBED_FRACTION = 200.0, 0.05


def window_disturbance(summary: dict, base: dict, cand: dict) -> float | None:
    """The profiled step's change in device idle time (µs/step: its delta less the kernels') where it disturbs a
    profiler window rather than measures the lever (the rule above), from ``table``'s summary and the two windows;
    None otherwise, where either window's step is not a device timeline's, or where the grid has no TPOT delta."""
    measured, kernels = summary.get("measured_delta_us"), summary["kernels_delta_us"]
    if measured is None or any(w.get("activity") != "cuda" or w.get("step_source") != "device_timeline"
                               for w in (base, cand)):
        return None
    step = summary["profiled_step_delta_us"]
    idle, grid = step - kernels, measured - kernels
    tol = max(DISTURBED_US, DISTURBED_FRACTION * base["step_us"])
    if abs(idle) > tol and abs(step - measured) > tol and abs(grid) <= tol and 3 * abs(grid) < abs(idle):
        return round(idle, 3)
    return None


def residual(cand: dict, rows: list[Row], top: int = 3) -> str:
    """What bounds the candidate's step now: its top kernels by time, each with its share of the step and (CUDA)
    how far it is from its byte floor."""
    step = cand["step_us"]
    by_time = sorted(rows, key=lambda r: -r.cand_us)[:top]
    parts = []
    for r in by_time:
        floor = f", {r.floor:.0%} of its byte floor" if r.floor is not None else ""
        parts.append(f"{r.kernel} {r.cand_us:.0f} µs/step ({r.cand_us / step:.0%} of the step{floor})")
    gap = cand.get("unattributed_us")
    tail = "" if gap is None else f"; {gap:.0f} µs/step outside kernels (host time and gaps)"
    if gap is not None and gap < 0:     # a window that summed durations (PDL's overlap counted twice) or a host step
        tail = (f"; the kernels' durations sum {-gap:.0f} µs/step past the step (kernels that overlap, or a step "
                "timed on the host), so no time outside kernels is measured")
    return f"at batch {cand['batch']} the step ({step:.0f} µs) is bound by " + ", ".join(parts) + tail + "."
