"""Where the decode step goes, kernel by kernel: drive a built engine step by step under torch.profiler and
aggregate the Kineto trace by kernel name (``KernelProfile``, whose docstring defines the figures).

On a GPU the rows are device activities (kernels, memcpy, memset) inside the recorded steps; on CPU (the tests'
stand-in) they are CPU ops by self time. The sum of kernel time is below the step's wall time; the difference is
launch gaps, idle device time and host work.
"""
from __future__ import annotations

import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from vtengine.bench.common import quiet_profiler, synchronize
from vtengine.bench.decode.engine_timing import kv_bytes_per_step, random_prompts
from vtengine.bench.decode.results import ByteFloor, KernelProfile, KernelRow, KernelsOther

STEP_MARK = "vtengine_decode_step"          # record_function range around each profiled engine step
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")   # Kineto trace categories of device activity
KERNEL_NAME_MAX = 80
JSON_MAX_KERNELS = 60                       # kernel names kept in the JSON; the rest summed in kernels_other
PROFILER_WARM_STEPS = 2                     # the profiler's own warm-up steps (not recorded)


def short_kernel_name(name: str, max_len: int = KERNEL_NAME_MAX) -> str:
    """A readable kernel name: C++ kernels lose 'void', their argument list and namespace qualifiers; what is still
    too long keeps its head and tail (cuBLAS names carry the tile shape in the middle, the variant at the end)."""
    s = name.strip()
    if s.startswith("void ") or ("::" in s and re.search(r"[<( ]", s)):    # a C++ signature, not aten::mm
        s = s.removeprefix("void ")
        if s.endswith(")"):                             # drop the argument list: the ( matching the last )
            depth = 0
            for i in range(len(s) - 1, -1, -1):
                depth += {")": 1, "(": -1}.get(s[i], 0)
                if depth == 0:
                    s = s[:i] if i > 0 else s
                    break
        s = re.sub(r"\(anonymous namespace\)::|\b[A-Za-z_]\w*::", "", s)
        s = re.sub(r"\s*>\s*>", ">>", s).strip()
    s = re.sub(r"\s+", " ", s)
    if len(s) > max_len:
        tail = max_len // 3
        s = s[:max_len - tail - 1] + "…" + s[-tail:]
    return s


def _self_times_us(ops: list[dict]) -> list[float]:
    """Self time of each CPU op (its duration less that of the ops nested directly inside it, per thread)."""
    order = sorted(range(len(ops)), key=lambda i: (ops[i].get("pid"), ops[i].get("tid"), ops[i]["ts"], -ops[i]["dur"]))
    self_us = [float(op["dur"]) for op in ops]
    stack: list[int] = []
    for i in order:
        op = ops[i]
        while stack:
            top = ops[stack[-1]]
            same_thread = (top.get("pid"), top.get("tid")) == (op.get("pid"), op.get("tid"))
            if same_thread and op["ts"] < top["ts"] + top["dur"]:
                break
            stack.pop()
        if stack:
            self_us[stack[-1]] -= float(op["dur"])
        stack.append(i)
    return [max(0.0, t) for t in self_us]


def kernel_table(trace_events: list[dict], steps: int, on_device: bool) -> list[KernelRow]:
    """Aggregate Kineto trace events by kernel name: us per step, launches per step, sorted by time (longest first).

    On a GPU the "kernels" are device activities (kernels, memcpy, memset); on CPU they are CPU ops by self time."""
    own: dict[str, float] | None = None
    if on_device:
        acts = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
        times = [float(e["dur"]) for e in acts]
        own = {}
        for e, us in zip(acts, _own_times_us(acts)):
            own[e["name"]] = own.get(e["name"], 0.0) + us
    else:
        acts = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        times = _self_times_us(acts)
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e, us in zip(acts, times):
        total[e["name"]] = total.get(e["name"], 0.0) + us
        count[e["name"]] = count.get(e["name"], 0) + 1
    rows = [KernelRow(kernel=short_kernel_name(n), name_full=n, us_per_step=total[n] / steps,
                      launches_per_step=count[n] / steps,
                      own_us_per_step=None if own is None else own[n] / steps) for n in total]
    rows.sort(key=lambda r: -r.us_per_step)
    return rows


def _own_times_us(acts: list[dict]) -> list[float]:
    """Each device activity's own time: its interval less what of it lies before the end of every activity that
    started earlier. Under PDL a kernel starts while the one before it drains and waits (griddepcontrol.wait) until
    that one ends; its duration counts the wait, so duration sums count the overlap twice and charge the wait to
    the waiting kernel. Own times charge it to the kernel still running: they sum to the device's busy time (the
    union of the intervals), and a kernel's own time is the part of the step's critical path it alone holds."""
    order = sorted(range(len(acts)), key=lambda i: (float(acts[i]["ts"]), -float(acts[i]["dur"])))
    own = [0.0] * len(acts)
    reached = float("-inf")                     # the latest end among the activities started so far
    for i in order:
        start, end = float(acts[i]["ts"]), float(acts[i]["ts"]) + float(acts[i]["dur"])
        own[i] = max(0.0, end - max(start, reached))
        reached = max(reached, end)
    return own


def device_step_us(trace_events: list[dict], steps: int) -> float | None:
    """The device timeline's period per step: the span from the first device activity's start to the last one's end
    among ``trace_events`` (those of the recorded steps' window), over ``steps``. With async scheduling the host's
    step time is not the device's (the host returns while a step is in flight: kernels can sum to more than it);
    this is. Less the kernel time, it is the device's idle time per step (between kernels and between steps),
    within one step's edge over the steps recorded. None without device activity."""
    acts = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
    if not acts or steps < 1:
        return None
    return (max(float(e["ts"]) + float(e["dur"]) for e in acts) - min(float(e["ts"]) for e in acts)) / steps


STALL_STEPS = 4          # a device gap longer than this many steps' time is a stall inside the window, not a step


def device_stalls_us(trace_events: list[dict], step_scale_us: float) -> list[float]:
    """The gaps with the device idle (no kernel, copy or memset running) longer than ``STALL_STEPS`` x
    ``step_scale_us`` (a step's time: the larger of its kernel time and the host's step), in µs, in order.

    A step's own idle time (the host preparing the next step, a few hundred µs) is never one. A stall is something
    outside the engine's steady state that happened to fall inside the profiler window: on an H100 (2026-12-05) a
    gap of ~250 ms spread over 16 steps read as a 22 ms step beside a 6.4 ms one."""
    return [g for g in device_gaps_us(trace_events) if g > STALL_STEPS * step_scale_us]


def device_gaps_us(trace_events: list[dict]) -> list[float]:
    """Every gap with the device idle between two of its activities (overlapping ones merged), in µs, in order."""
    busy = _busy_intervals(trace_events)
    return [b[0] - a[1] for a, b in zip(busy, busy[1:])]


def _busy_intervals(trace_events: list[dict]) -> list[tuple[float, float]]:
    """The device's activities' intervals, overlapping ones merged (kernels under PDL overlap), in time order."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in trace_events
                       if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def timeline_warnings(kernel_us: float, step_us: float, device_us: float | None,
                      busy_us: float | None = None) -> list[str]:
    """Kernel time summed past the device's step period (or, without one, past the host's step): kernels that
    overlap (under PDL a kernel starts before the one before it ends; ``busy_us``, the union of their intervals,
    says by how much) or CUPTI's times inside graph replays are off. The host's step alone is no bound with async
    scheduling, where the host returns while a step is in flight: there only a missing device timeline is worth a
    note."""
    if device_us is not None:
        if kernel_us > 1.05 * device_us:
            overlap = f" overlap by {kernel_us - busy_us:.0f} us/step (PDL launches early) or" if busy_us else ""
            return [f"kernel time {kernel_us:.0f} us/step exceeds the device timeline ({device_us:.0f} us/step): "
                    f"kernels{overlap} the device times are not trustworthy"]
        return []
    if kernel_us > 1.05 * step_us:
        return [f"kernel time {kernel_us:.0f} us/step exceeds the host's step ({step_us:.0f} us) and the trace has "
                "no device timeline: with async scheduling that is expected, else the device times are off"]
    return []


def device_busy_us(trace_events: list[dict], steps: int) -> float | None:
    """The device's busy time per step: the union of its activities' intervals among ``trace_events`` over
    ``steps`` (kernels that overlap, as under PDL, count once). The timeline less it is the idle time. None without
    device activity."""
    busy = _busy_intervals(trace_events)
    if not busy or steps < 1:
        return None
    return sum(b - a for a, b in busy) / steps


def _decode_step(eng, batch: int) -> float:
    """One engine step, which must decode all ``batch`` sequences (no prefill, no preemption, none finishing): its
    wall time in s."""
    n0 = eng.stats()["decode_steps_total"]
    t0 = time.perf_counter()
    outs = eng.step()
    dt = time.perf_counter() - t0
    decoded, finished = eng.stats()["decode_steps_total"] == n0 + 1, sum(o.finished for o in outs)
    if not decoded or len(outs) != batch or finished:
        raise RuntimeError(f"a profiled step was not a decode of all {batch} sequences ({len(outs)} outputs, "
                           f"{finished} finished, {'a decode step' if decoded else 'not a decode step'}; "
                           f"preemptions {eng.scheduler.num_preemptions})")
    return dt


def _record_trace(eng, batch: int, steps: int) -> tuple[list[dict], list[float]]:
    """``PROFILER_WARM_STEPS`` + ``steps`` decode steps of all ``batch`` sequences under torch.profiler: the Kineto
    trace's events and each step's wall time (s)."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule
    quiet_profiler()

    trace: dict = {}

    def keep_trace(p) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "trace.json")
            p.export_chrome_trace(str(path))
            trace["events"] = json.loads(path.read_text()).get("traceEvents", [])

    on_device = eng.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    step_s = []
    with profile(activities=activities, schedule=schedule(wait=0, warmup=PROFILER_WARM_STEPS, active=steps, repeat=1),
                 on_trace_ready=keep_trace) as prof:
        for _ in range(PROFILER_WARM_STEPS + steps):
            with record_function(STEP_MARK):
                step_s.append(_decode_step(eng, batch))
            prof.step()
    synchronize(eng.device)
    events = trace.get("events")
    if not events:
        raise RuntimeError("the profiler returned no trace")
    return events, step_s


def record_decode_trace(llm, batch: int, prompt_len: int, steps: int = 16,
                        warm_steps: int = 3) -> tuple[list[dict], list[float]]:
    """The Kineto trace of ``steps`` decode steps of ``batch`` sequences at context ~``prompt_len`` on a built
    engine, and every step's wall time (s; the first PROFILER_WARM_STEPS are the profiler's own warm-up).

    The engine is driven step by step: requests are added, stepped until every sequence is past its prefill (has
    its first token and none waits), ``warm_steps`` decode steps run, then the profiler (2 of its own warm-up steps,
    then ``steps`` recorded ones). Every one of those steps must decode all ``batch`` sequences (no prefill, no
    preemption), or this raises. Leaves the engine idle (the requests are aborted, a step in flight collected)."""
    from vtengine.engine.sampling_params import SamplingParams
    eng = llm.engine
    if eng.has_unfinished_requests():
        raise RuntimeError("profiling needs an idle engine")
    ramp = 8 * batch + 8                                # most steps the prefill may take (chunked, mixed)
    # under chunked prefill the first sequences decode while the last ones still prefill: room for those tokens too
    params = SamplingParams(max_tokens=ramp + warm_steps + PROFILER_WARM_STEPS + steps + 4, temperature=0.0,
                            ignore_eos=True)
    rids = [f"profile-{i}" for i in range(batch)]
    for rid, prompt in zip(rids, random_prompts(batch, prompt_len, eng.model_config.vocab_size)):
        eng.add_request(rid, prompt, params)
    try:
        for _ in range(ramp):                           # prefill (one batch, or a few if the token budget splits it)
            # the first token read on the host (with async scheduling a decode step is in flight by then)
            if not eng.scheduler.waiting and all(eng.seqs[r].completion_token_ids for r in rids):
                break
            eng.step()
        else:
            raise RuntimeError("the sequences did not all get past prefill")
        for _ in range(warm_steps):
            _decode_step(eng, batch)
        return _record_trace(eng, batch, steps)
    finally:
        for rid in rids:
            eng.abort_request(rid)
        while eng.has_unfinished_requests():            # async scheduling: collect the step still in flight
            eng.step()


def profile_engine_decode(llm, batch: int, prompt_len: int, steps: int = 16, warm_steps: int = 3) -> KernelProfile:
    """Profile ``steps`` decode steps of ``batch`` sequences at context ~``prompt_len`` on a built engine (driven as
    ``record_decode_trace`` says) and aggregate the trace by kernel name."""
    eng = llm.engine
    on_device = eng.device.type == "cuda"
    events, step_s = record_decode_trace(llm, batch, prompt_len, steps, warm_steps)
    marks = [e for e in events if e.get("name") == STEP_MARK and e.get("cat") == "user_annotation"]
    warnings = []
    if len(marks) != steps:                             # kept, not raised: the table is still worth having
        warnings.append(f"the trace holds {len(marks)} profiled steps, {steps} were asked")
    rows: list[KernelRow] = []
    device_us = busy_us = None
    if marks:
        # only activity inside the recorded steps (a step ends on the sampler's sync, so its kernels are done);
        # Kineto puts device and host times on one clock
        lo, hi = min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)
        window = [e for e in events if lo <= e.get("ts", lo - 1) <= hi]
        rows = kernel_table(window, len(marks), on_device)      # per recorded step, as the timeline below
        device_us = device_step_us(window, len(marks)) if on_device else None
        busy_us = device_busy_us(window, len(marks)) if on_device else None
        if not rows:
            warnings.append("no activity inside the recorded steps' time window: the whole trace is counted")
    rows = rows or kernel_table(events, steps, on_device)
    if not rows:
        raise RuntimeError("no " + ("device kernels" if on_device else "CPU ops") + " in the trace (on a GPU: CUPTI "
                           "reported no kernels, e.g. none inside the CUDA-graph replays)")
    step_us = 1e6 * statistics.fmean(step_s[PROFILER_WARM_STEPS:])
    if device_us is not None:
        stalls = device_stalls_us(window, max(sum(r.us_per_step for r in rows), step_us))
        if stalls:                  # idle time no step caused: out of the device's step and its idle time
            device_us -= sum(stalls) / len(marks)
            warnings.append(f"device idle {sum(stalls) / 1e3:,.1f} ms inside the window ({len(stalls)} stall(s) "
                            f"longer than {STALL_STEPS} steps), left out of the device step")
    # a kernel's share of the device's step where the trace has one (with async scheduling the host's step is
    # shorter than the device's), else of the host's
    for r in rows:
        r.share_of_step = r.us_per_step / (device_us or step_us)
    kernel_us = sum(r.us_per_step for r in rows)
    out = KernelProfile(model=eng.config.model, quant=eng.config.quant, batch=batch,
                        activity="cuda" if on_device else "cpu", steps=len(marks), steps_asked=steps,
                        warm_steps=warm_steps, context_len=prompt_len + warm_steps + PROFILER_WARM_STEPS,
                        step_us_measured=step_us, kernel_us_per_step=kernel_us, gap_us_per_step=step_us - kernel_us,
                        device_step_us=device_us,
                        device_idle_us_per_step=None if device_us is None else device_us - busy_us,
                        share_basis="device" if device_us else "host",
                        num_kernel_names=len(rows), kernels=rows[:JSON_MAX_KERNELS])
    if len(rows) > JSON_MAX_KERNELS:
        rest = rows[JSON_MAX_KERNELS:]
        out.kernels_other = KernelsOther(names=len(rest), us_per_step=sum(r.us_per_step for r in rest))
    if on_device:
        warnings += timeline_warnings(kernel_us, step_us, device_us, busy_us)
    if warnings:
        out.warning = "; ".join(warnings)
    return out


# which bytes a kernel streams, by its name: W4A16 first (its name holds "gemm" too)
BYTE_KINDS = (("w4a16_gemm", re.compile(r"w4a16", re.I)),
              ("decode_attention", re.compile(r"_decode_kernel|_decode_merge|decode_attention", re.I)),
              ("dense_gemm", re.compile(r"nvjet|gemv|gemm|cutlass|xmma|cublas|sm90_", re.I)))


def byte_kind(kernel_name: str) -> str | None:
    """The kind of bytes a kernel streams (BYTE_KINDS), or None for kernels bound by something else (norms,
    activations, rope, argmax...)."""
    return next((kind for kind, pattern in BYTE_KINDS if pattern.search(kernel_name)), None)


def step_bytes(eng, batch: int, context: float) -> dict[str, float]:
    """Bytes a decode step must read at least once, by kind: the W4A16 projections (codes + scales), the bf16
    weights read by GEMMs (the projections of a bf16 model and the LM head), K and V at ``context`` tokens for
    ``batch`` sequences."""
    from vtengine.quant import QuantizedWeight
    model = eng.model
    out = {"w4a16_gemm": 0.0, "dense_gemm": 0.0}
    for layer in model.layers:
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if isinstance(w, QuantizedWeight):
                out["w4a16_gemm"] += w.nbytes()
            else:
                out["dense_gemm"] += w.numel() * w.element_size()
    out["dense_gemm"] += model.lm_head.numel() * model.lm_head.element_size()
    out["decode_attention"] = kv_bytes_per_step(eng, context, batch)
    return out


def byte_floors(p: KernelProfile, eng, copy_gbs: float | None) -> list[ByteFloor]:
    """Each byte kind's kernels in profile ``p`` against their floor (results.ByteFloor). Kinds with no kernel in the
    profile's named kernels are left out; the context is the profile's middle step."""
    context = (p.context_len or 0) + (p.steps or 0) / 2
    need = step_bytes(eng, p.batch, context)
    out = []
    for kind, _ in BYTE_KINDS:
        rows = [k for k in p.kernels or [] if byte_kind(k.name_full) == kind]
        if not rows or need.get(kind, 0) <= 0:
            continue
        us = sum(k.us_per_step for k in rows)
        own = None if any(k.own_us_per_step is None for k in rows) else sum(k.own_us_per_step for k in rows)
        floor_us = 1e6 * need[kind] / (copy_gbs * 1e9) if copy_gbs else None
        out.append(ByteFloor(kind=kind, kernels=[k.kernel for k in rows], us_per_step=us,
                             bytes_per_step=need[kind], floor_us=floor_us,
                             frac_of_floor=floor_us / us if floor_us and us > 0 else None, own_us_per_step=own,
                             frac_of_floor_own=floor_us / own if floor_us and own else None))
    return out

