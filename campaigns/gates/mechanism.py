"""mechanism: the kernel counters prove the lever's route ran in its arm and not in the other.

The arm's engine runs a short eager generation (prefill + decode; eager so every launch reaches the counters)
with the counters reset; each lever has a probe that reads the counter snapshot: which route ran, which compiled
variant, which split counts (with, per launch, what the split heuristic would have picked uncapped). The candidate
passes when its probe differs from the baseline's and shows the lever's own route; the baseline passes when it
shows the baseline route. Every expectation can fail, for every lever type (an ``auto`` or integer cap must show
its cap applied and no launch above the uncapped count; ``off`` must show the uncapped count everywhere).

Faults, in the arm's own engine: on the candidate an inert lever (the lever resolved to the baseline value, as if
its env were ignored), on the baseline a stuck lever (resolved to the candidate's value). The probe must fail both.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from campaigns.gates import LONG_PROMPT_LEVERS, GateContext, long_prompt_len, result
from campaigns.context import MECHANISM_KERNELS
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


def _split_pairs(snap: dict) -> list[tuple[int, int]]:
    """(splits, uncapped splits) of every decode launch whose split count the heuristic chose."""
    return sorted({tuple(int(x) for x in v.split("/")) for st in snap.get("decode_splits", {}).values()
                   for v in st["variants"]})


def _grids(snap: dict, kernel: str) -> list[str]:
    return sorted({g for st in snap.get(kernel, {}).values() for g in st["grids"]})


def _preset(lever: str) -> dict[str, Any]:
    """The levers a preset lever sets (``sets:`` in its file), else {}."""
    from vtengine import levers
    return levers.get(lever).sets


def family(lever: str) -> set[str]:
    """The lever and, for a preset, the levers it sets: the probe's set-up follows all of them."""
    return {lever, *_preset(lever)}


def probe(lever: str, snap: dict) -> dict[str, Any]:
    """What the counters say about the lever's mechanism (a preset's: each of its levers' probes)."""
    if _preset(lever):
        return {name: probe(name, snap) for name in sorted(_preset(lever))}
    if lever == "gqa_swap":
        return {"routes": _routes(snap, "decode_attention"), "grids": _grids(snap, "decode_attention")}
    if lever == "marlin_dense":
        return {"routes": _routes(snap, "w4a16_gemm"), "grids": _grids(snap, "w4a16_gemm")[:8]}
    if lever == "w4a16_rot":     # the decode name inside each launch's compiled-variant tuple
        from vtengine.kernels.w4a16 import DECODE_NAMES
        return {"decodes": sorted({d for v in _variants(snap, "w4a16_gemm") for d in DECODE_NAMES.values()
                                   if f"'{d}'" in v})}
    if lever == "w4a16_mid_m":      # launches that took the mid-M tiles (the variant's tile family, dense_config)
        return {"mid_tiles": sum(n for st in snap.get("w4a16_gemm", {}).values() for v, n in st["variants"].items()
                                 if "'mid'" in v)}
    if lever == "nsplits_cap":
        return {"splits": _splits(snap, "decode_attention"), "caps": _routes(snap, "decode_splits"),
                "split_vs_uncapped": [f"{s}/{u}" for s, u in _split_pairs(snap)],
                "grids": _grids(snap, "decode_attention")}
    if lever == "decode_wave_grid":     # launches whose grid held fewer programs than slots ("programs/slots")
        fewer = sum(n for st in snap.get("decode_grid", {}).values() for v, n in st["variants"].items()
                    if int(v.split("/")[0]) < int(v.split("/")[1]))
        return {"grids": _routes(snap, "decode_grid"), "fewer_than_slots": fewer}
    if lever == "split_rule":
        return {"rules": _routes(snap, "decode_split_rule"), "floors": _variants(snap, "decode_split_rule"),
                "grids": _grids(snap, "decode_attention")}
    if lever == "prefill_gqa_pack":
        return {"routes": _routes(snap, "prefill_attention"), "grids": _grids(snap, "prefill_attention")[:8]}
    if lever == "prefill_splits":   # launches by split count, and the merges the split launches need
        return {"routes": _routes(snap, "prefill_attention"), "splits": _splits(snap, "prefill_attention"),
                "merges": sum(st["launches"] for st in snap.get("prefill_attention_merge", {}).values())}
    if lever == "mixed_steps":
        return {"mixed_steps": sum(st["launches"] for st in snap.get("mixed_step", {}).values()),
                "prefill_steps": _routes(snap, "prefill_step")}
    if lever == "chunked_prefill":
        return {"prefill_steps": _routes(snap, "prefill_step"), "tokens": _grids(snap, "prefill_step")}
    if lever == "chunk_above":      # prompts longer than the chunk admitted whole (at most T) or chunked (past T)
        routes = {r: st["launches"] for r, st in snap.get("chunk_above", {}).items()}
        return {"whole": routes.get("whole", 0), "chunked": routes.get("chunked", 0)}
    if lever == "whole_first":      # steps that prefilled whole prompts while decoding sequences waited
        return {"waited_steps": sum(st["launches"] for st in snap.get("whole_first", {}).values())}
    if lever == "chunk_graphs":     # full chunks replayed from graphs (on the CPU: their static buffers run eagerly)
        return {"chunk_steps": sum(st["launches"] for st in snap.get("chunk_step", {}).values()),
                "shapes": _grids(snap, "chunk_step")[:8]}
    if lever == "fast_math":
        return {"variants": _variants(snap, "decode_attention") + _variants(snap, "prefill_attention")}
    if lever == "triton_gemv":
        return {"routes": _routes(snap, "dense_linear"), "grids": _grids(snap, "dense_linear")[:8]}
    if lever == "pdl_prefetch":     # PDL launches of the W4A16 GEMM and the bf16 GEMV: prefetch first, or wait first
        return {"launches": _routes(snap, "pdl_prefetch"),
                "kernels": {k: sorted(r for r, st in snap.get("pdl_prefetch", {}).items() if k in st["variants"])
                            for k in _variants(snap, "pdl_prefetch")}}
    if lever == "fuse_silu":        # fused gate_up launches (W4A16 GEMM or bf16 GEMV), the separate silu_mul kernel's
        fused = sum(n for kernel in ("w4a16_gemm", "dense_linear") for st in snap.get(kernel, {}).values()
                    for v, n in st["variants"].items() if "'silu_mul'" in v)
        return {"fused_gemms": fused, "silu_mul_launches": sum(st["launches"] for st in
                                                               snap.get("silu_mul", {}).values())}
    if lever == "fuse_norm":        # GEMVs that added the residual or applied RMSNorm; add_rms_norm launches left
        fused = sum(n for kernel in ("dense_linear", "w4a16_gemm") for st in snap.get(kernel, {}).values()
                    for v, n in st["variants"].items() if "'norm'" in v or "'add_residual'" in v)
        return {"fused_gemvs": fused, "add_rms_norm_launches": sum(
            n for st in snap.get("rms_norm", {}).values() for v, n in st["variants"].items() if "add_rms_norm" in v)}
    if lever == "fuse_rope":        # qkv projections (GEMV or W4A16 GEMM) that ran the qkv epilogue; kernels left
        return {"fused_gemvs": sum(n for kernel in ("dense_linear", "w4a16_gemm")
                                   for st in snap.get(kernel, {}).values()
                                   for v, n in st["variants"].items() if "'rope'" in v),
                "qkv_epilogue_launches": sum(st["launches"] for st in snap.get("qkv_epilogue", {}).values())}
    if lever == "pdl":
        return {"launches": _routes(snap, "launch"), "kernels": _variants(snap, "launch")}
    if lever == "async_scheduling":
        # steps launched while the previous step's ids were not read yet: the overlap itself
        ahead = snap.get("async_steps", {}).get("launched_ahead", {}).get("launches", 0)
        return {"launched_ahead": ahead, "async_steps": sum(st["launches"] for st in
                                                            snap.get("async_steps", {}).values())}
    if lever == "async_device_mirror":
        return {"decode_inputs": _routes(snap, "async_inputs")}
    raise ValueError(f"no mechanism probe for lever {lever!r}")


def _some_or_none(n: int, value: Any, what: str) -> tuple[bool, str]:
    """An ON arm must count some of ``what``, an OFF arm none."""
    if value:
        return n > 0, f"{n} {what}, expected some"
    return n == 0, f"{n} {what}, expected none"


def expected(lever: str, value: Any, pr: dict, resolved: dict[str, Any] | None = None,
             quant: str | None = None, pins: dict[str, Any] | None = None) -> tuple[bool, str]:
    """Does the probe show the route that ``value`` selects? A preset: every lever it sets shows the route of the
    value it resolves to (on: the preset's values where the campaign's ``pins`` do not set them, as the engine
    resolves them; off: their defaults). ``resolved``: every lever's value in the arm, for a route that rides on
    another lever (pdl_prefetch on pdl); a preset passes its own resolution."""
    if _preset(lever):
        from vtengine import levers
        values = levers.resolve({**(pins or {}), lever: value}, environ={}, quant=quant).values
        checks = [(name, *expected(name, values[name], pr[name], values)) for name in sorted(_preset(lever))]
        return all(ok for _, ok, _ in checks), "; ".join(f"{name}: {why}" for name, _, why in checks)
    if lever == "gqa_swap":
        want = ["gqa_swap"] if value else ["per_q_head"]
        return pr["routes"] == want, f"decode_attention routes {pr['routes']}, expected {want}"
    if lever == "marlin_dense":
        want = ["dense"] if value else ["grouped"]
        return pr["routes"] == want, f"w4a16_gemm routes {pr['routes']}, expected {want}"
    if lever == "w4a16_rot":
        want = ["bf16_rot"] if value else ["bf16_asm"]
        return pr["decodes"] == want, (f"w4a16_gemm decodes {pr['decodes']}, expected {want} (the PTX decodes run on "
                                       "a GPU only: the interpreter and MXFP4 scales above 2**1 take 'wide')")
    if lever == "decode_wave_grid":
        want = ["wave"] if value else ["slots"]
        ok, why = _some_or_none(pr["fewer_than_slots"], value, "decode attention launches with fewer programs "
                                                                   "than slots (the count rule split nothing here?)")
        return ok and pr["grids"] == want, f"decode attention grids {pr['grids']}, expected {want}; {why}"
    if lever == "split_rule":
        want = [str(value)]
        return pr["rules"] == want, f"decode split rules {pr['rules']} (slice floors {pr['floors']}), expected {want}"
    if lever == "prefill_gqa_pack":
        want = ["gqa_pack"] if value else ["paged_causal"]
        return pr["routes"] == want, f"prefill_attention routes {pr['routes']}, expected {want}"
    if lever == "prefill_splits":
        # on: some launch split (a forced N: every launch, N ways), each split launch merged once; off: none split
        split = sum(n for s, n in pr["splits"].items() if int(s) > 1)
        got = (f"prefill_attention launches by split count {pr['splits']}, {pr['merges']} merges, routes "
               f"{pr['routes']}")
        if value == "off":
            return split == 0 and pr["merges"] == 0, f"{got}; expected no split and no merge"
        every = isinstance(value, int) and not isinstance(value, bool)
        ok = pr["routes"] == ["gqa_pack"] and split > 0 and pr["merges"] == split
        ok = ok and (not every or list(pr["splits"]) == [str(value)])
        return ok, (f"{got}; expected {f'every launch split {value} ways' if every else 'some launch split'}, one "
                    "merge per split launch, on the gqa_pack route (needs prefill_gqa_pack on)")
    if lever == "mixed_steps":
        return _some_or_none(pr["mixed_steps"], value, "steps carried decode rows beside a prefill chunk")
    if lever == "chunk_above":
        from vtengine.levers import OFF_VALUES
        if value in OFF_VALUES:
            return pr["whole"] == 0 and pr["chunked"] == 0, (f"{pr['whole']} prompts longer than the chunk went "
                                                             f"whole, {pr['chunked']} chunked past T: expected none")
        return pr["whole"] > 0 and pr["chunked"] > 0, (f"{pr['whole']} prompts longer than the chunk but at most "
                                                       f"{value} went whole, {pr['chunked']} past {value} were "
                                                       "chunked: expected some of each (needs chunked_prefill on)")
    if lever == "whole_first":
        return _some_or_none(pr["waited_steps"], value, "steps prefilled whole prompts while the decoding sequences "
                                                        "waited (needs mixed_steps on)")
    if lever == "chunk_graphs":
        return _some_or_none(pr["chunk_steps"], value, "full prefill chunks replayed from captured graphs")
    if lever == "w4a16_mid_m":
        return _some_or_none(pr["mid_tiles"], value, "W4A16 launches of 17-128 tokens took the mid-M tiles")
    if lever == "chunked_prefill":
        # the policy's label, and, on, a step of exactly N prompt tokens: the probe's long prompt (2N + 9 tokens, or
        # past a pinned chunk_above) was cut into chunks, not merely scheduled under a chunk setting
        from vtengine.levers import OFF_VALUES
        want = ["prefill_first"] if value in OFF_VALUES else [f"chunk={value}"]
        full = value in OFF_VALUES or str(value) in pr["tokens"]
        return pr["prefill_steps"] == want and full, (
            f"prefill steps shaped by {pr['prefill_steps']}, expected {want}"
            + ("" if value in OFF_VALUES else f"; step sizes {pr['tokens']}, expected a full {value}-token chunk"))
    if lever == "fast_math":
        want = ["fast_math"] if value else ["precise"]
        got = sorted(set(pr["variants"]))
        return got == want, f"attention variants {got}, expected {want}"
    if lever == "triton_gemv":
        # prefill (M > 16) takes cuBLAS in both arms; decode takes the GEMV only in the ON arm
        ok = ("triton_gemv" in pr["routes"]) if value else pr["routes"] == ["cublas"]
        return ok, f"dense_linear routes {pr['routes']}, expected {'triton_gemv among them' if value else ['cublas']}"
    if lever == "fuse_silu":
        return _some_or_none(pr["fused_gemms"], value, "gate_up GEMMs applied SiLU-mul in their epilogue")
    if lever == "fuse_norm":
        return _some_or_none(pr["fused_gemvs"], value, "GEMVs added the residual or applied RMSNorm "
                                                       f"({pr['add_rms_norm_launches']} add_rms_norm launches)")
    if lever == "fuse_rope":
        return _some_or_none(pr["fused_gemvs"], value, "qkv projections ran the qkv epilogue in their own epilogue "
                                                       f"({pr['qkv_epilogue_launches']} qkv_epilogue launches)")
    if lever == "pdl_prefetch":
        if not value and resolved is not None and not resolved.get("pdl"):     # a preset's off arm: no PDL at all
            return pr["launches"] == [], (f"PDL launches {pr['launches']} by kernel {pr['kernels']}, expected none "
                                          "(pdl is off in this arm: nothing launches early to prefetch in)")
        want = ["prefetch"] if value else ["wait_first"]
        return pr["launches"] == want, (f"PDL launches by kernel {pr['kernels']}, expected {want} for each (needs "
                                        "pdl on, on sm_90+: the interpreter has no PDL)")
    if lever == "pdl":
        want = ["pdl"] if value else ["plain"]
        return pr["launches"] == want, f"kernel launches {pr['launches']} (kernels {pr['kernels']}), expected {want}"
    if lever == "async_scheduling":
        if value:
            return pr["launched_ahead"] > 0, (f"{pr['launched_ahead']} of {pr['async_steps']} steps launched before the "
                                              "previous step's ids were read (expected some)")
        return pr["async_steps"] == 0, f"{pr['async_steps']} asynchronous steps (expected none)"
    if lever == "async_device_mirror":
        want = ["device_mirror"] if value else ["host_copy"]
        return pr["decode_inputs"] == want, (f"decode inputs of in-flight tokens read from {pr['decode_inputs']}, "
                                             f"expected {want} (needs async_scheduling on)")
    if lever == "nsplits_cap":
        pairs = [tuple(int(x) for x in p.split("/")) for p in pr["split_vs_uncapped"]]
        want = [f"cap={value}"]
        if not pairs:
            return False, "no decode_attention launch chose its split count (nothing to prove the cap on)"
        if pr["caps"] != want:
            return False, f"decode split caps {pr['caps']}, expected {want}"
        if value == "off":
            wrong = [f"{s}/{u}" for s, u in pairs if s != u]
            return not wrong, (f"uncapped, yet split counts differ from the heuristic's at {wrong}" if wrong else
                               f"uncapped: split counts equal the heuristic's everywhere (splits/uncapped {pairs})")
        limit = value if isinstance(value, int) else None
        wrong = [f"{s}/{u}" for s, u in pairs if s > u or (limit is not None and s > limit)]
        shown = [f"{s}/{u}" for s, u in pairs]
        if wrong:
            return False, f"cap {value}: splits/uncapped {shown}; above the cap or the heuristic: {wrong}"
        if not any(s < u for s, u in pairs):      # the label says capped, every launch split as uncapped
            return False, (f"cap {value} bound no launch: splits/uncapped {shown} (the heuristic's count "
                           "everywhere: an inert cap at these batches and contexts)")
        return True, f"cap {value}: splits/uncapped {shown}"
    raise ValueError(f"no mechanism expectation for lever {lever!r}: add one beside its probe (or mark mechanism "
                     "inapplicable in its lever file, with the reason)")


# probe keys that name the arm's lever value (the decode_splits route "cap=<value>", the split rule's name): they
# differ between arms whatever the kernels did, so whether the arms' counters differ is read without them
LABELS = {"nsplits_cap": ("caps",), "split_rule": ("rules",)}
GRAPH_LEVERS = ("chunk_graphs",)         # levers that are CUDA graphs: their probe runs with graphs on
WIDE_BATCH_LEVERS = ("w4a16_mid_m",)     # levers whose mechanism needs decode steps of more than 16 sequences
# levers whose mechanism needs a prompt arriving while another decodes
STAGGERED = ("mixed_steps", "chunk_graphs", "whole_first")


def _staggered(eng, prompts: list[list[int]], params: SamplingParams) -> None:
    """The first prompt alone for two steps, then the others: they prefill while it decodes."""
    eng.add_request("probe-0", prompts[0], params)
    for _ in range(2):
        eng.step()
    for i, p in enumerate(prompts[1:], 1):
        eng.add_request(f"probe-{i}", p, params)
    while eng.has_unfinished_requests():
        eng.step()


def _run_probe(ctx: GateContext, arm: Arm, value: Any = None) -> tuple[dict[str, Any], dict]:
    """The probe of the arm's engine, with the lever resolved to ``value`` instead of the arm's own when given (the
    faults: an inert or a stuck lever)."""
    key = f"mechanism:{arm.name}" + ("" if value is None else f"#{value}")
    if key not in ctx.cache:
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 23, 40, 64)]
        if ctx.lever in WIDE_BATCH_LEVERS:      # 24 prompts: decode steps of 17-24 sequences
            prompts = [torch.randint(3, 250, (5 + i,), generator=g).tolist() for i in range(24)]
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        with ctx.lever_set_to(arm, ctx.lever_values(arm)[ctx.lever] if value is None else value) as llm:
            if family(ctx.lever) & set(GRAPH_LEVERS):
                # lever_set_to decodes eagerly (graphs captured under the arm's own value would hide the fault);
                # this lever is graphs itself: replay where the engine has them (CUDA), captured at this value
                llm.engine.runner.use_graphs = bool(llm.engine.runner.graphs)
            chunk, above = llm.engine.scheduler.prefill_chunk, llm.engine.scheduler.chunk_above
            if family(ctx.lever) & set(LONG_PROMPT_LEVERS) and chunk:
                # a prompt of full chunks (2N + 9, or T + 9: chunked past chunk_above's T) and one of N + 9 (whole
                # under chunk_above, chunked without it)
                lens = (long_prompt_len(chunk, above) + 9, chunk + 9)
                prompts[1:3] = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
            if "whole_first" in family(ctx.lever):
                # the short prompts first: whole_first holds the decode tokens back only while no chunk is under way
                prompts[1:] = sorted(prompts[1:], key=len)
            counters.reset()
            if family(ctx.lever) & set(STAGGERED):
                _staggered(llm.engine, prompts, params)
            else:
                llm.generate(prompts, params)
            snap = counters.snapshot()
        ctx.cache[key] = (probe(ctx.lever, snap), snap)
    return ctx.cache[key]


def run(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    t0 = time.perf_counter()
    cand = next(a for a in ctx.arms if a.role == "candidate")
    broken = None
    if fault:       # the candidate's lever inert (at the baseline's value), the baseline's stuck (at the candidate's)
        broken = ctx.baseline.value if arm.role == "candidate" else cand.value
    pr, snap = _run_probe(ctx, arm, broken)
    from vtengine import levers
    # the arm's own resolution (the campaign's pins with it: mixed_prefill with chunked_prefill=256 pinned chunks at
    # 256, not the preset's 512), with the lever at the arm's value: what the probe must show
    pins = dict(ctx.with_levers)
    resolved = dict(levers.resolve({**pins, ctx.lever: arm.value}, environ={}, quant=ctx.quant).values)
    ok, why = expected(ctx.lever, arm.value, pr, resolved, quant=ctx.quant, pins=pins)
    note = ""
    if fault:
        note = ("inert lever (resolved to the baseline value)" if arm.role == "candidate"
                else "stuck lever (resolved to the candidate's value)")
    details = {"probe": pr, "why": why, "fault": note}
    if arm.role == "candidate":
        base, _ = _run_probe(ctx, ctx.baseline)
        labels = LABELS.get(ctx.lever, ())      # counter routes named after the lever value: differ by construction
        differs = {k: v for k, v in pr.items() if k not in labels} != {k: v for k, v in base.items() if k not in labels}
        ok = ok and differs
        details["baseline_probe"] = base
        details["differs_from_baseline"] = differs
        if not differs:
            details["why"] = f"{why}; identical to the baseline's counters: the lever is inert here"
    counts = {k: (len(v) if isinstance(v, (list, dict)) else v) for k, v in pr.items()}
    if not fault:
        details["counters"] = {k: v for k, v in snap.items() if k in (*MECHANISM_KERNELS, "launch")}
    return result("mechanism", arm, ok, t0, counts=counts, details=details)
