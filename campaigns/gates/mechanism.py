"""mechanism: the kernel counters prove the lever's route ran in its arm and not in the other.

The arm's engine runs a short eager generation (prefill + decode; eager so every launch reaches the counters)
with the counters reset; each lever has a probe that reads the counter snapshot: which route ran, which compiled
variant, which split counts. The candidate passes when its probe differs from the baseline's and shows the lever's
own route; the baseline passes when it shows the baseline route. Fault: an inert lever, i.e. the candidate's
engine built with the lever forced to the baseline value (as if the env were ignored): the probe must then fail.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from campaigns.gates import GateContext, result
from campaigns.evidence import Arm, GateResult
from vtengine import counters
from vtengine.engine.sampling_params import SamplingParams


def _routes(snap: dict, kernel: str) -> list[str]:
    return sorted(r for r, st in snap.get(kernel, {}).items() if st["launches"] > 0)


def _variants(snap: dict, kernel: str) -> list[str]:
    return sorted({v for st in snap.get(kernel, {}).values() for v in st["variants"]})


def _splits(snap: dict, kernel: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for st in snap.get(kernel, {}).values():
        for s, n in st["splits"].items():
            out[s] = out.get(s, 0) + n
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _grids(snap: dict, kernel: str) -> list[str]:
    return sorted({g for st in snap.get(kernel, {}).values() for g in st["grids"]})


def probe(lever: str, snap: dict) -> dict[str, Any]:
    """What the counters say about the lever's mechanism."""
    if lever == "gqa_swap":
        return {"routes": _routes(snap, "decode_attention"), "grids": _grids(snap, "decode_attention")}
    if lever == "marlin_dense":
        return {"routes": _routes(snap, "w4a16_gemm"), "grids": _grids(snap, "w4a16_gemm")[:8]}
    if lever == "nsplits_cap":
        return {"splits": _splits(snap, "decode_attention"), "grids": _grids(snap, "decode_attention")}
    if lever == "fast_math":
        return {"variants": _variants(snap, "decode_attention") + _variants(snap, "prefill_attention")}
    if lever == "triton_gemv":
        return {"routes": _routes(snap, "dense_linear"), "grids": _grids(snap, "dense_linear")[:8]}
    if lever == "pdl":
        return {"launches": _routes(snap, "launch"), "kernels": _variants(snap, "launch")}
    raise ValueError(f"no mechanism probe for lever {lever!r}")


def expected(lever: str, value: Any, pr: dict) -> tuple[bool, str]:
    """Does the probe show the route that ``value`` selects?"""
    if lever == "gqa_swap":
        want = ["gqa_swap"] if value else ["per_q_head"]
        return pr["routes"] == want, f"decode_attention routes {pr['routes']}, expected {want}"
    if lever == "marlin_dense":
        want = ["dense"] if value else ["grouped"]
        return pr["routes"] == want, f"w4a16_gemm routes {pr['routes']}, expected {want}"
    if lever == "fast_math":
        want = ["fast_math"] if value else ["precise"]
        got = sorted(set(pr["variants"]))
        return got == want, f"attention variants {got}, expected {want}"
    if lever == "triton_gemv":
        # prefill (M > 16) takes cuBLAS in both arms; decode takes the GEMV only in the ON arm
        ok = ("triton_gemv" in pr["routes"]) if value else pr["routes"] == ["cublas"]
        return ok, f"dense_linear routes {pr['routes']}, expected {'triton_gemv among them' if value else ['cublas']}"
    if lever == "pdl":
        want = ["pdl"] if value else ["plain"]
        return pr["launches"] == want, f"kernel launches {pr['launches']} (kernels {pr['kernels']}), expected {want}"
    if lever == "nsplits_cap":
        splits = [int(s) for s in pr["splits"]]
        if not splits:
            return False, "no decode_attention launch recorded"
        if isinstance(value, int) and not isinstance(value, bool):
            return max(splits) <= value, f"split counts {splits}, cap {value}"
        return True, f"split counts {splits} ({value})"
    raise ValueError(lever)


def _run_probe(ctx: GateContext, arm: Arm, inert: bool) -> dict[str, Any]:
    key = f"mechanism:{arm.name}{'#inert' if inert else ''}"
    if key not in ctx.cache:
        llm = ctx.engine(arm, inert=inert)
        runner = llm.engine.runner
        use_graphs, runner.use_graphs = runner.use_graphs, False
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 23, 40, 64)]
        try:
            counters.reset()
            llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
            ctx.cache[key] = (probe(ctx.lever, counters.snapshot()), counters.snapshot())
        finally:
            runner.use_graphs = use_graphs
    return ctx.cache[key]


def run(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    t0 = time.perf_counter()
    if fault and arm.role == "baseline":
        # the baseline's fault: read the baseline's counters as if they were the candidate's route
        cand = next(a for a in ctx.arms if a.role == "candidate")
        pr, _ = _run_probe(ctx, arm, inert=False)
        cand_pr, _ = _run_probe(ctx, cand, inert=False)
        ok, why = expected(ctx.lever, cand.value, pr)
        ok = ok and pr == cand_pr
        return result("mechanism", arm, ok, t0, details={"fault": "baseline counters taken for the candidate's "
                                                               "route", "probe": pr, "why": why})
    pr, snap = _run_probe(ctx, arm, inert=fault)
    ok, why = expected(ctx.lever, arm.value, pr)
    details = {"probe": pr, "why": why, "fault": "inert lever (forced to the baseline value)" if fault else ""}
    if arm.role == "candidate":
        base, _ = _run_probe(ctx, ctx.baseline, inert=False)
        differs = pr != base
        ok = ok and differs
        details["baseline_probe"] = base
        details["differs_from_baseline"] = differs
        if not differs:
            details["why"] = f"{why}; identical to the baseline's counters: the lever is inert here"
    counts = {k: (len(v) if isinstance(v, (list, dict)) else v) for k, v in pr.items()}
    if not fault:
        details["counters"] = {k: v for k, v in snap.items()
                               if k in ("decode_attention", "w4a16_gemm", "prefill_attention", "rms_norm")}
    return result("mechanism", arm, ok, t0, counts=counts, details=details)
