"""profile: where each arm's decode step goes, kernel by kernel, outside the timed grid (campaigns/attribution.py).

Profiler windows over the arm's decode at two concurrencies: on CUDA c1 and c8, graphed steps at ~1k context (as
the grid decodes), with each kernel's byte floor and the measured copy bandwidth recorded beside them; on CPU (the
rehearsal) c1 and c2, times only. The record's Attribution table and the PR's Residual are computed from these
windows and the grid's TPOT. Passes when every window recorded its steps and its kernels.

Fault: the lever's own kernel made slower in the arm's engine: the first of its kernels a decode step runs, or
rms_norm for a lever of prefill kernels or none (run twice per call on CUDA, in graphs captured with it; six times
on a CPU host, whose timings other processes stretch: vtengine/faults.py ``slow``). The attribution must name that
kernel as the one that grew the most for its own time (grew_most); a profile that cannot point at a planted slowdown
cannot explain a lever's.
"""
from __future__ import annotations

import time

from campaigns import attribution
from campaigns.evidence import Arm, GateResult
from campaigns.gates import GateContext, profiled_kernel, result


def _settings(ctx: GateContext) -> dict:
    if ctx.device == "cuda":
        return {"batches": [1, 8], "prompt_len": 1024, "steps": 16}
    return {"batches": [1, 2], "prompt_len": 16, "steps": 3}


def _windows(ctx: GateContext, llm, batches: list[int]) -> dict[str, dict]:
    s = _settings(ctx)
    return {str(b): attribution.profile_window(llm, b, s["prompt_len"], s["steps"]) for b in batches}


def grew_most(clean: dict, faulted: dict) -> tuple[str, float]:
    """(the kernel that grew the most for its size from the clean window to the faulted one, its growth in us).

    Growth over the kernel's own time, not in microseconds: a planted rerun doubles a small kernel, while a large
    one's window-to-window noise can outgrow that in absolute terms (H200, 2026-12-03: rms_norm's 146 us doubled,
    dense_linear's 4,137 us drifted by 232 us, and the absolute rule named dense_linear). The denominator is at
    least 1% of the window's kernel time, so a kernel of a few microseconds cannot win on jitter alone. On CPU the
    per-step medians (attribution.step_medians): one stall of a small host must not outgrow the fault."""
    key = "kernels_median" if "kernels_median" in faulted and "kernels_median" in clean else "kernels"
    before, after = clean[key], faulted[key]
    floor = 0.01 * sum(before.values())
    growth = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    if not growth:
        return "", 0.0
    named = max(growth, key=lambda k: growth[k] / max(before.get(k, 0.0), floor, 1e-9))
    return named, growth[named]


def run(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    t0 = time.perf_counter()
    s = _settings(ctx)
    key = f"profile:{arm.name}"
    if key not in ctx.cache:
        llm = ctx.engine(arm)
        ctx.cache[key] = _windows(ctx, llm, s["batches"])
    windows = ctx.cache[key]
    if fault:
        from vtengine.faults import Fault
        # twice per call on the GPU; on a CPU host, whose other processes can stretch a window by more than one run
        # of a kernel (a rehearsal beside the tests once did), six times: at four, a test run beside another worker
        # saw argmax grow more for its size than the planted rms_norm (2026-12-04)
        slow = Fault("slow", profiled_kernel(ctx.lever, ctx.quant), size=0.0 if ctx.device == "cuda" else 5.0)
        b = s["batches"][0]
        if ctx.device == "cuda":
            with ctx.graphs_captured_with(arm, slow, b) as llm:
                faulted = _windows(ctx, llm, [b])[str(b)]
        else:
            with ctx.faulted(arm, slow) as llm:
                faulted = _windows(ctx, llm, [b])[str(b)]
        named, grew = grew_most(windows[str(b)], faulted)
        caught = named == slow.kernel
        return result("profile", arm, not caught, t0, counts={"grew_us": round(grew, 3)},
                      details={"fault": f"{slow.describe()}; the attribution named {named!r} as the kernel that "
                                        "grew the most for its size", "named": named, "planted": slow.kernel})
    details: dict = {"windows": windows, "fault": ""}
    if ctx.device == "cuda":
        from vtengine.bench.common import copy_bandwidth_gbs
        cfg = ctx.engine(arm).engine.model_config
        shape = {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}
        details["copy_gbs"] = round(copy_bandwidth_gbs(), 1)
        details["floor_bytes"] = {c: attribution.floor_bytes(shape, ctx.quant, w["batch"], w["context_len"])
                                  for c, w in windows.items()}
    ok = all(w["steps"] > 0 and w["kernels"] for w in windows.values())
    counts = {f"step_us_c{c}": w["step_us"] for c, w in windows.items()}
    return result("profile", arm, ok, t0, counts=counts, details=details)
