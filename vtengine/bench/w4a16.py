"""W4A16 GEMV benchmark: the two routes of lever marlin_dense at Qwen3-8B projection shapes, MXFP4 and NVFP4,
against cuBLAS bf16 (x @ W^T) and torch's int4 tinygemm (torch._weight_int4pack_mm), all measured in one run.

    python -m vtengine.bench.w4a16 OUT_DIR [--sweep] [--bf16-only]

Protocol (every method the same way): triton.testing.do_bench_cudagraph medians of a CUDA graph of back-to-back
calls that rotate over enough weight sets to exceed 3x the L2 cache (each call reads cold weights, as a decode step
does), so launch gaps are the graph's, as in the engine's graphed decode. Each time is turned into achieved
bandwidth over the bytes the call must move (weights incl. scales + activations + output) and reported as a
fraction of the copy bandwidth measured in the same run: vtengine/bench/common.py's, the ceiling every benchmark
uses (an eager device-to-device copy of max(1 GiB, 8 x L2), bytes read + written, do_bench median; a memcpy node
inside a CUDA graph measured only 2.7 TB/s on H200, so the ceiling is taken eagerly). Before timing, each route is
checked at the real shape against quant.dequantize + an fp64 matmul (vtengine.testing.rel_l2, bf16 output).
``--sweep`` also times a grid of dense-route tiles and split counts, to pick the launcher's table.
The bf16 weights also run through the lever triton_gemv's split-K GEMV (vtengine/kernels/gemv.py) beside cuBLAS,
with a small tile sweep at M = 1; ``--bf16-only`` runs just that comparison (a short run). ``--mid`` times decode
batches of 24-128 tokens instead (the lever w4a16_mid_m's tiles against the prefill tiles, the grouped route and
cuBLAS; with ``--sweep`` the tiles around the lever's).

Writes OUT_DIR/w4a16-<device>-<date>.json and .md; returns the JSON dict.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from vtengine.bench import common
from vtengine.testing import rel_l2

SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]       # K -> N: qkv, o, gate_up, down
SHAPE_NAMES = {(4096, 6144): "qkv_proj", (4096, 4096): "o_proj", (4096, 24576): "gate_up_proj",
               (12288, 4096): "down_proj"}
MS = (1, 2, 4, 8, 16)
FORMATS = ("mxfp4", "nvfp4")
TINYGEMM_GROUP = 128
REP_MS = 10
OLD_COPY_BW_METHOD = "D2D, read + write"        # files without copy_bw_method: the best of three copies

# dense-route variants around the default tile (M <= 16), and the best alternates of the 2026-11-30 sweeps
def sweep_variants(n: int, k: int, fmt: str) -> list:
    from vtengine.kernels import w4a16
    base = w4a16.dense_config(1, n, k, fmt)
    out = []
    for decode in (w4a16.DECODE_ASM, w4a16.DECODE_ROT):
        for stages in (2, 3, 4):
            for split in sorted({max(1, base["SPLIT_K"] // 2), base["SPLIT_K"], base["SPLIT_K"] * 2}):
                if k % (base["BLOCK_K"] * split) == 0 and k // (base["BLOCK_K"] * split) >= 2:
                    out.append(dict(base, DECODE=decode, num_stages=stages, SPLIT_K=split))
    out.append(dict(base, BLOCK_M=16))
    out.append(dict(base, DECODE=w4a16.DECODE_BF16))
    out.append(dict(base, BLOCK_N=64, BLOCK_K=128, num_stages=4))
    # statically the fewest instructions per weight of the rotation decode (vtengine bench w4a16-sass, 2026-12-01:
    # 2.59 against 2.80 at the default 32 x 256 / 2 warps; 105 registers, no spills): time it
    out.append(dict(base, DECODE=w4a16.DECODE_ROT, BLOCK_N=64, BLOCK_K=256, num_warps=2, num_stages=3))
    out.append(dict(base, DECODE=w4a16.DECODE_ROT, BLOCK_K=512, num_stages=2))
    out.append(dict(base, SWAP_AB=False, BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3))
    return out




def _log(msg: str) -> None:
    print(msg, flush=True)


# -- inputs ----------------------------------------------------------------------------------------------------
def random_weight(fmt: str, n: int, k: int, gen: torch.Generator):
    """A random but valid W4A16 weight without running the quantizer (fast at real shapes): any byte is two valid
    e2m1 codes; scales are drawn in the range real weights use (MXFP4 e <= 128 keeps the fast decode)."""
    from vtengine.quant import BLOCK, QuantizedWeight
    dev = "cuda"
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev, generator=gen)
    if fmt == "mxfp4":
        scales = torch.randint(118, 127, (n, k // BLOCK[fmt]), dtype=torch.uint8, device=dev, generator=gen)
        gs = torch.ones((), device=dev)
    else:
        scales = torch.randint(0x20, 0x60, (n, k // BLOCK[fmt]), dtype=torch.uint8, device=dev, generator=gen)
        gs = torch.full((), 1e-3, device=dev)
    return QuantizedWeight(fmt, packed, scales, gs, (n, k))


def tinygemm_weight(n: int, k: int, gen: torch.Generator):
    """torch's int4 tinygemm layout: 4-bit codes packed by _convert_weight_to_int4pack (8 inner k-tiles), bf16
    [K/group, N, 2] scales and zeros. Returns (packed, scales_and_zeros, dequantized fp32 W for the check)."""
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda", generator=gen)
    u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(u8, 8)
    groups = k // TINYGEMM_GROUP
    scales = (torch.rand(groups, n, device="cuda", generator=gen) * 0.01 + 0.001).to(torch.bfloat16)
    zeros = ((torch.rand(groups, n, device="cuda", generator=gen) - 0.5) * 0.01).to(torch.bfloat16)
    sz = torch.stack((scales, zeros), dim=-1).contiguous()
    s = scales.float().t().repeat_interleave(TINYGEMM_GROUP, dim=1)
    z = zeros.float().t().repeat_interleave(TINYGEMM_GROUP, dim=1)
    w = (codes.float() - 8.0) * s + z
    return packed, sz, w


def n_sets(bytes_per_set: int, l2_bytes: int) -> int:
    return max(2, math.ceil(3 * l2_bytes / bytes_per_set))


def rotating(fns):
    state = {"i": 0}

    def call():
        fns[state["i"] % len(fns)]()
        state["i"] += 1
    return call


def time_us(fn) -> float:
    import triton.testing
    return triton.testing.do_bench_cudagraph(fn, rep=REP_MS, return_mode="median") * 1e3


# -- the measurements ------------------------------------------------------------------------------------------
def w4a16_bytes(q, m: int) -> int:
    n, k = q.shape
    return q.packed.numel() + q.scales.numel() + 4 + m * k * 2 + m * n * 2


def check_routes(k: int, n: int, fmt: str, gen, w4a16, quant) -> dict:
    """Relative L2 of each route (and decode path) vs dequantize + fp64 at the real shape; a variant that fails
    to run records its error instead of a number."""
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    q = quant.quantize(w, fmt)
    wd = quant.dequantize(q, torch.float64)
    out = {}

    def one(name, x, ref, **kw):
        try:
            y = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
            w4a16.w4a16_linear(x, q, out=y, **kw)
            out[name] = rel_l2(y, ref)
        except Exception as exc:                   # noqa: BLE001
            out[name] = f"{type(exc).__name__}: {str(exc)[:200]}"

    for m in (1, 3, 16, 64):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        ref = x.double() @ wd.t()
        for dense in (True, False):
            one(f"M{m}_{'dense' if dense else 'grouped'}", x, ref, dense=dense)
        if m <= 16:
            for decode, name in ((w4a16.DECODE_BF16, "bf16"), (w4a16.DECODE_WIDE, "wide")):
                one(f"M{m}_dense_{name}", x, ref, dense=True,
                    config=dict(w4a16.dense_config(m, n, k, fmt), DECODE=decode))
            one(f"M{m}_dense_rot", x, ref, dense=True, rot=True)
            try:                                    # the rotation layout must give the nibble layout's bits
                out[f"M{m}_dense_rot_bitwise"] = bool(torch.equal(w4a16.w4a16_linear(x, q, dense=True, rot=True),
                                                                  w4a16.w4a16_linear(x, q, dense=True)))
            except Exception as exc:               # noqa: BLE001
                out[f"M{m}_dense_rot_bitwise"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return out


def _try(errors: list, label: str, fn):
    """Run one measurement; a variant that fails is recorded and skipped instead of ending the run."""
    try:
        return fn()
    except Exception as exc:                       # noqa: BLE001
        errors.append(f"{label}: {type(exc).__name__}: {str(exc)[:300]}")
        _log(f"ERROR {errors[-1]}")
        return None


def gemv_variants(n: int, k: int, num_sms: int) -> list:
    """Triton GEMV tiles around the launcher's default (split counts are runtime values: one binary each)."""
    from vtengine.kernels import gemv
    base = gemv.gemv_config(n, k, num_sms)
    out = []
    for bn, bk, warps, stages in ((32, 256, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 8, 3),
                                  (128, 64, 4, 4)):
        k_steps = -(-k // bk)
        tiles = -(-n // bn)
        splits = [d for d in range(1, 17) if k_steps % d == 0 and k_steps // d >= 2] or [1]
        for target in (2, 3, 4):
            split = next((d for d in splits if tiles * d >= target * num_sms), splits[-1])
            cfg = dict(base, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, SPLIT_K=split)
            if cfg not in out:
                out.append(cfg)
    return out


# where the engine uses each fuse_norm form: RMSNorm into qkv and gate_up, the residual add in o and down
# (the _gain forms are what the engine runs on bf16: the add hands the norm GEMV x * g, so its K loop is the plain one)
# (and for qkv the lever fuse_rope: the engine's norm_gained GEMV then the qkv_epilogue kernel, against the GEMV that
# runs the epilogue itself)
FUSED_FORMS = {"qkv_proj": ("norm", "norm_gained", "norm_gained_epilogue", "norm_gained_rope"),
               "gate_up_proj": ("norm", "norm_gained"),
               "o_proj": ("add_res", "add_res_gain"), "down_proj": ("add_res", "add_res_gain")}


# the GEMV with PDL: no prefetch, and the bytes per program asked of L2 before the wait
PDL_GEMV_ROWS = {"pdl": 0, "pdl_pf8k": 8 * 1024, "pdl_pf16k": 16 * 1024, "pdl_pf64k": 64 * 1024}
# the W4A16 dense route with PDL: no prefetch, the lever's 16 KB per program, and the whole W slice (1 GB asks all)
PDL_W4A16_ROWS = {"pdl": 0, "pdl_pf16k": 16 * 1024, "pdl_pfall": 1 << 30}


# Qwen3-8B's qkv heads (q, kv, head_dim): the shape whose rope forms the bench times
QKV_HEADS = (32, 8, 128)


def fused_gemv_forms(m: int, k: int, n: int, device, gen, dtype=torch.bfloat16,
                     heads: tuple[int, int, int] | None = None) -> dict:
    """The lever fuse_norm's two GEMV forms at one shape, to time beside the plain one: ``norm`` (RMSNorm of x from a
    producer's sums of squares, the norm weight loaded with x) and ``add_res`` (plus a residual, writing its sums of
    squares), each as (fn_for(x, w) -> call, bytes moved beyond the plain call's), for x and weights of ``dtype``;
    ``operands`` holds (NormIn, residual) for references. The operands pass the kernels' checks. The decode bench
    says the fused step's GEMVs cost 9% more than the plain ones on bf16 (2026-12-02); these say which form. The
    engine's forms: ``norm_gained`` (x is already x * g: only the rsqrt after the K loop) and ``add_res_gain`` (also
    writing round(residual * gain) for it). With ``heads`` (q heads, kv heads, head_dim of a qkv weight [N, K]), the
    lever fuse_rope's pair: ``norm_gained_epilogue`` (that GEMV, then the qkv_epilogue kernel: what the engine runs
    without the lever) and ``norm_gained_rope`` (the GEMV running the epilogue); ``rope_cache`` holds their KV
    cache (k, v), which both write."""
    from vtengine.kernels import gemv, sm_count
    from vtengine.kernels.epilogue import NormIn
    prod_tiles = -(-k // 32)                           # the producer's output tiles (its N = this K), 32 rows each
    ss = (torch.rand(prod_tiles, gemv.MAX_M, device=device, generator=gen) + 0.5) * (32 / 3)
    g = (torch.rand(k, device=device, generator=gen) + 0.5).to(dtype)
    norm = NormIn(ss, g, 1e-6)
    gained = NormIn(ss, g, 1e-6, gained=True)
    residual = torch.randn(m, n, device=device, generator=gen).to(dtype)
    gain = (torch.rand(n, device=device, generator=gen) + 0.5).to(dtype)
    tiles = -(-n // gemv.gemv_config(n, k, sm_count(device))["BLOCK_N"])
    forms = {
        "norm": (lambda x, w: lambda: gemv.linear(x, w, triton_gemv=True, norm=norm),
                 k * 2 + ss.numel() * 4),
        "add_res": (lambda x, w: lambda: gemv.linear_add(x, w, residual)[0],
                    m * n * 2 + tiles * gemv.MAX_M * 4),
        "norm_gained": (lambda x, w: lambda: gemv.linear(x, w, triton_gemv=True, norm=gained),
                        ss.numel() * 4),
        "add_res_gain": (lambda x, w: lambda: gemv.linear_add_gain(x, w, residual, gain)[0],
                         2 * m * n * 2 + n * 2 + tiles * gemv.MAX_M * 4),
        "operands": (norm, residual, gain),
    }
    if heads is not None:
        from vtengine.backends.torch_backend import rope_cos_sin
        from vtengine.kernels import fused
        hq, hkv, d = heads
        if (hq + 2 * hkv) * d != n:
            raise ValueError(f"fused_gemv_forms: heads {heads} do not make a qkv weight of N={n}")
        pos = torch.randint(0, 4096, (m,), device=device, generator=gen)
        slots = (torch.arange(m, device=device) * 7).to(torch.int32)
        cs = rope_cos_sin(d, 4096, 1e6, device=device)
        qn, kn = ((torch.rand(d, device=device, generator=gen) + 0.5).to(dtype) for _ in range(2))
        kc, vc = (torch.zeros(-(-7 * m // 16) + 1, 16, hkv, d, dtype=dtype, device=device) for _ in range(2))
        rope = fused.RopeOut(hq, hkv, pos, cs, kc, vc, slots, qn, kn, 1e-6, fast_math=True)
        forms["norm_gained_epilogue"] = (
            lambda x, w: lambda: fused.qkv_epilogue(gemv.linear(x, w, triton_gemv=True, norm=gained), hq, hkv, pos,
                                                    cs, kc, vc, slots, qn, kn, 1e-6, fast_math=True),
            ss.numel() * 4 + m * n * 2)         # the epilogue kernel reads qkv back
        forms["norm_gained_rope"] = (lambda x, w: lambda: gemv.linear(x, w, triton_gemv=True, norm=gained, rope=rope),
                                     ss.numel() * 4)
        forms["rope_cache"] = (kc, vc)
    return forms


def bench_bf16(res: dict, k: int, n: int, copy_gbs: float, l2: int, gen, sweep: bool) -> None:
    """cuBLAS bf16 and the Triton GEMV (lever triton_gemv) on the same rotating weight sets."""
    from vtengine.kernels import gemv
    errs = res["errors"]
    wb = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
    sets = [wb] + [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
                   for _ in range(n_sets(wb.numel() * 2, l2) - 1)]
    for m in (1, 3, 16):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        res["checks"][f"triton_gemv_M{m}"] = _try(errs, f"gemv check M={m}", lambda: rel_l2(
            gemv.linear(x, wb, triton_gemv=True), x.double() @ wb.double().t()))

    def timed(method, m, fn_for, extra_bytes=0):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        for w in sets:                             # compile + split-K counters outside graph capture
            fn_for(x, w)()
        t = time_us(rotating([fn_for(x, w) for w in sets]))
        b = n * k * 2 + m * k * 2 + m * n * 2 + extra_bytes
        return dict(method=method, M=m, us=t, gbs=b / (t * 1e-6) / 1e9, frac_copy=b / (t * 1e-6) / 1e9 / copy_gbs)

    for m in MS:
        r = _try(errs, f"cublas M={m}", lambda: timed("cublas_bf16", m, lambda x, w: lambda: x @ w.t()))
        if r:
            res["rows"].append(r)
        r = _try(errs, f"triton_gemv M={m}", lambda: timed(
            "triton_gemv_bf16", m, lambda x, w: lambda: gemv.linear(x, w, triton_gemv=True)))
        if r:
            r["config"] = gemv.gemv_config(n, k, torch.cuda.get_device_properties(0).multi_processor_count)
            res["rows"].append(r)
        # PDL between the back-to-back GEMVs of the graph, and pdl_prefetch's L2 prefetch of W before the wait at
        # three sizes per program (the lever's is gemv.PREFETCH_BYTES, 16 KB; 64 KB lost PDL's gain on the decode step)
        for name, pf in PDL_GEMV_ROWS.items():
            r = _try(errs, f"triton_gemv {name} M={m}", lambda: timed(
                f"triton_gemv_{name}_bf16", m,
                lambda x, w: lambda: gemv.linear(x, w, triton_gemv=True, pdl=True, prefetch=pf)))
            if r:
                res["rows"].append(r)
        forms = fused_gemv_forms(m, k, n, torch.device("cuda"), gen,
                                 heads=QKV_HEADS if SHAPE_NAMES.get((k, n)) == "qkv_proj" else None)
        for form in FUSED_FORMS.get(SHAPE_NAMES.get((k, n)), ()):
            fn_for, extra = forms[form]
            r = _try(errs, f"triton_gemv {form} M={m}", lambda: timed(f"triton_gemv_{form}_bf16", m, fn_for, extra))
            if r:
                res["rows"].append(r)
    if sweep:
        for cfg in gemv_variants(n, k, torch.cuda.get_device_properties(0).multi_processor_count):
            r = _try(errs, f"gemv sweep {cfg}", lambda: timed(
                "triton_gemv_sweep", 1, lambda x, w: lambda: gemv.linear(x, w, triton_gemv=True, config=cfg)))
            if r:
                res["sweep"].append(dict(r, fmt="bf16", config=cfg))


def bench_shape(k: int, n: int, copy_gbs: float, l2: int, gen, sweep: bool, bf16_only: bool = False) -> dict:
    from vtengine.kernels import w4a16
    from vtengine import quant
    res = {"K": k, "N": n, "name": SHAPE_NAMES.get((k, n), ""), "checks": {}, "rows": [], "sweep": [],
           "errors": []}
    errs = res["errors"]
    if bf16_only:
        bench_bf16(res, k, n, copy_gbs, l2, gen, sweep)
        torch.cuda.empty_cache()
        return res
    for fmt in FORMATS:
        res["checks"][fmt] = _try(errs, f"check {fmt}", lambda: check_routes(k, n, fmt, gen, w4a16, quant)) or {}
    # ours
    for fmt in FORMATS:
        probe = random_weight(fmt, n, k, gen)
        sets = [probe] + [random_weight(fmt, n, k, gen) for _ in range(n_sets(w4a16_bytes(probe, 0), l2) - 1)]
        for q in sets:                             # one-time work per weight stays out of graph capture
            w4a16.decode_path(q)
            w4a16.repacked_words(q)
            w4a16.rot_words(q)
        wbytes = w4a16_bytes(probe, 0)

        def timed(m, dense, cfg=None, rot=False, pdl=False, prefetch=False):
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            t = time_us(rotating([lambda q=q: w4a16.w4a16_linear(x, q, dense=dense, config=cfg, rot=rot, pdl=pdl,
                                                                 prefetch=prefetch) for q in sets]))
            gbs = (wbytes + m * k * 2 + m * n * 2) / (t * 1e-6) / 1e9
            return t, gbs / copy_gbs

        for m in MS:
            for dense in (True, False):
                cfg = (w4a16.dense_config if dense else w4a16.grouped_config)(m, n, k, fmt)
                r = _try(errs, f"{fmt} dense={dense} M={m}", lambda: timed(m, dense))
                if r:
                    res["rows"].append(dict(method=f"{fmt}_{'dense' if dense else 'grouped'}", M=m, us=r[0],
                                            gbs=r[1] * copy_gbs, frac_copy=r[1], config=cfg))
            cfg = w4a16.dense_config(m, n, k, fmt)          # the lever w4a16_rot: the rotation layout's decode
            r = _try(errs, f"{fmt} dense rot M={m}", lambda: timed(m, True, rot=True))
            if r:
                res["rows"].append(dict(method=f"{fmt}_dense_rot", M=m, us=r[0], gbs=r[1] * copy_gbs,
                                        frac_copy=r[1], config=cfg))
            # PDL between the back-to-back GEMMs of the graph, and pdl_prefetch's L2 prefetch of W before the wait:
            # the lever's 16 KB per program, and the whole slice it asked for before (a 17% slower MXFP4 step)
            for name, pf in PDL_W4A16_ROWS.items():
                r = _try(errs, f"{fmt} dense {name} M={m}", lambda: timed(m, True, pdl=True, prefetch=pf))
                if r:
                    res["rows"].append(dict(method=f"{fmt}_dense_{name}", M=m, us=r[0], gbs=r[1] * copy_gbs,
                                            frac_copy=r[1], config=cfg))
        if sweep:
            variants = sweep_variants(n, k, fmt)
            timed_m1 = []
            for cfg in variants:
                r = _try(errs, f"sweep {fmt} {cfg}", lambda: timed(1, True, cfg))
                if r:
                    res["sweep"].append(dict(fmt=fmt, M=1, us=r[0], frac_copy=r[1], config=cfg))
                    timed_m1.append((r[0], cfg))
            timed_m1.sort(key=lambda tc: tc[0])
            for _, cfg in timed_m1[:5]:
                r = _try(errs, f"sweep {fmt} M=16 {cfg}", lambda: timed(16, True, cfg))
                if r:
                    res["sweep"].append(dict(fmt=fmt, M=16, us=r[0], frac_copy=r[1], config=cfg))
            if timed_m1:
                best = timed_m1[0][1]
                res.setdefault("tuned", {})[fmt] = best
                for m in MS:
                    r = _try(errs, f"{fmt} tuned M={m}", lambda: timed(m, True, best))
                    if r:
                        res["rows"].append(dict(method=f"{fmt}_dense_tuned", M=m, us=r[0], gbs=r[1] * copy_gbs,
                                                frac_copy=r[1], config=best))
        del sets
    # cuBLAS bf16 and the Triton GEMV
    bench_bf16(res, k, n, copy_gbs, l2, gen, sweep=False)
    # torch int4 tinygemm
    try:
        packed, sz, wdq = tinygemm_weight(n, k, gen)
        x = torch.randn(4, k, device="cuda", generator=gen).to(torch.bfloat16)
        y = torch._weight_int4pack_mm(x, packed, TINYGEMM_GROUP, sz)
        res["checks"]["tinygemm_int4_M4"] = rel_l2(y, x.double() @ wdq.double().t())
        del wdq
        tsets = [(packed, sz)] + [tinygemm_weight(n, k, gen)[:2] for _ in range(n_sets(n * k // 2, l2) - 1)]
        for m in MS:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            t = time_us(rotating([lambda p=p, s=s: torch._weight_int4pack_mm(x, p, TINYGEMM_GROUP, s)
                                  for p, s in tsets]))
            b = n * k // 2 + sz.numel() * 2 + m * k * 2 + m * n * 2
            res["rows"].append(dict(method=f"tinygemm_int4_g{TINYGEMM_GROUP}", M=m, us=t, gbs=b / (t * 1e-6) / 1e9,
                                    frac_copy=b / (t * 1e-6) / 1e9 / copy_gbs))
        del tsets
    except Exception as exc:                       # noqa: BLE001 (a baseline that cannot run is recorded, not fatal)
        res["tinygemm_error"] = f"{type(exc).__name__}: {exc}"
    torch.cuda.empty_cache()
    return res


def _compile_worker(jobs):
    """Compile (by launching once at a small N with the real K) the variants main() will time, in a subprocess:
    Triton's on-disk cache then serves the main process, so compilation runs in parallel."""
    from vtengine.kernels import w4a16
    gen = torch.Generator(device="cuda").manual_seed(1)
    errors = []
    for fmt, k, dense, cfg in jobs:
        q = random_weight(fmt, 256, k, gen)
        x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
        _try(errors, f"compile {fmt} K={k} dense={dense} {cfg}",
             lambda: w4a16.w4a16_linear(x, q, dense=dense, config=cfg))
    torch.cuda.synchronize()
    return errors


def precompile(shapes, sweep: bool, workers: int = 15) -> list:
    import concurrent.futures as cf
    import multiprocessing as mp
    from vtengine.kernels import w4a16
    jobs = set()
    for k, n in shapes:
        for fmt in FORMATS:
            for m in MS:
                jobs.add((fmt, k, True, json.dumps(w4a16.dense_config(m, n, k, fmt), sort_keys=True)))
                jobs.add((fmt, k, False, json.dumps(w4a16.grouped_config(m, n, k, fmt), sort_keys=True)))
            for m in (64,):
                jobs.add((fmt, k, True, json.dumps(w4a16.dense_config(m, n, k, fmt), sort_keys=True)))
                jobs.add((fmt, k, False, json.dumps(w4a16.grouped_config(m, n, k, fmt), sort_keys=True)))
            for decode in (w4a16.DECODE_BF16, w4a16.DECODE_WIDE, w4a16.DECODE_ROT):
                for m in (1, 16):
                    jobs.add((fmt, k, True, json.dumps(dict(w4a16.dense_config(m, n, k, fmt), DECODE=decode),
                                                       sort_keys=True)))
            if sweep:
                for cfg in sweep_variants(n, k, fmt):
                    jobs.add((fmt, k, True, json.dumps(cfg, sort_keys=True)))
    # one binary serves every split count > 1 and both K values (EVEN_K holds for all of them): compile once
    norm = set()
    for fmt, k, dense, c in jobs:
        cfg = json.loads(c)
        cfg["SPLIT_K"] = min(cfg.get("SPLIT_K", 1), 2)
        norm.add((fmt, 4096, dense, json.dumps(cfg, sort_keys=True)))
    jobs = sorted(norm)
    chunks = [[(f, k, d, json.loads(c)) for f, k, d, c in jobs[i::workers]] for i in range(workers)]
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        errors = [e for errs in pool.map(_compile_worker, chunks) for e in errs]
    _log(f"precompiled {len(jobs)} variants in {time.time() - t0:.0f} s ({len(errors)} errors)")
    return errors


MID_MS = (24, 32, 64, 128)      # decode batches past 16 (the lever w4a16_mid_m)
SWEEP_MID_MS = (64, 128)        # --mid --sweep: the tiles around the lever's at these M, MXFP4 (~30 per shape and M)


def mid_variants(m: int, n: int, k: int, fmt: str) -> list:
    """Tiles for M tokens past 16: swap-AB tiles with the tokens padded to a power of two (W rows per program, K
    step, warps, stages; split for ~3.5 programs per SM), and plain tiles (A @ W^T) of 32 or 64 tokens with split-K
    1, 2 or 4, the other way to fill the SMs. The lever w4a16_mid_m's own tile is among them."""
    from vtengine.kernels import w4a16
    bm = max(32, 1 << (m - 1).bit_length())
    out = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=st, SWAP_AB=True,
                SPLIT_K=w4a16._swap_split(n, k, bn, bk, w4a16.H200_SMS))
           for bn in (32, 64) for bk in (128, 256) for nw in (2, 4, 8) for st in (2, 3)
           if bn * bk * bm <= 64 * 256 * 128 and not (bn == 64 and nw == 2)]
    for tm in (32, 64):
        for split in (1, 2, 4):
            if k % (128 * split) == 0:
                out.append(dict(BLOCK_M=tm, BLOCK_N=64, BLOCK_K=128, SPLIT_K=split, SWAP_AB=False, num_warps=4,
                                num_stages=3))
    return out


def bench_mid(k: int, n: int, copy_gbs: float, l2: int, gen, sweep: bool) -> dict:
    """MXFP4 and NVFP4 at decode batches of 24-128 tokens: the dense route's prefill tiles (the lever w4a16_mid_m
    off), its decode tiles (on), the grouped route and cuBLAS bf16; with ``sweep``, the tiles around the lever's
    (mid_variants) for MXFP4 at SWEEP_MID_MS. The rotation layout (default on) in every W4A16 row."""
    from vtengine import quant
    from vtengine.kernels import w4a16
    res = {"K": k, "N": n, "name": SHAPE_NAMES.get((k, n), ""), "checks": {}, "rows": [], "sweep": [], "errors": []}
    errs = res["errors"]
    for fmt in FORMATS:
        probe = random_weight(fmt, n, k, gen)
        sets = [probe] + [random_weight(fmt, n, k, gen) for _ in range(n_sets(w4a16_bytes(probe, 0), l2) - 1)]
        for q in sets:
            w4a16.decode_path(q)
            w4a16.rot_words(q)
        wbytes = w4a16_bytes(probe, 0)
        wd = quant.dequantize(probe, torch.float64)
        for m in MID_MS:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = x.double() @ wd.t()

            def timed(cfg=None, dense=True, mid=False):
                fns = [lambda q=q: w4a16.w4a16_linear(x, q, dense=dense, config=cfg, rot=True, mid=mid)
                       for q in sets]
                fns[0]()
                t = time_us(rotating(fns))
                return t, (wbytes + m * k * 2 + m * n * 2) / (t * 1e-6) / 1e9 / copy_gbs

            for label, kw in (("dense", {}), ("dense_mid", {"mid": True}), ("grouped", {"dense": False})):
                err = _try(errs, f"check {fmt} {label} M={m}", lambda: rel_l2(
                    w4a16.w4a16_linear(x, probe, rot=True, **{"dense": True, **kw}), ref))
                res["checks"][f"{fmt}_{label}_M{m}"] = err
                r = _try(errs, f"{fmt} {label} M={m}", lambda: timed(**kw))
                if r:
                    res["rows"].append(dict(method=f"{fmt}_{label}", M=m, us=r[0], frac_copy=r[1]))
            if sweep and fmt == "mxfp4" and m in SWEEP_MID_MS:
                for cfg in mid_variants(m, n, k, fmt):
                    r = _try(errs, f"sweep {fmt} M={m} {cfg}", lambda: timed(cfg))
                    if r:
                        res["sweep"].append(dict(fmt=fmt, M=m, us=r[0], frac_copy=r[1], config=cfg))
        del sets, wd
    wb = torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
    bsets = [wb] + [torch.randn(n, k, device="cuda", generator=gen).to(torch.bfloat16)
                    for _ in range(n_sets(wb.numel() * 2, l2) - 1)]
    for m in MID_MS:
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        t = _try(errs, f"cublas M={m}", lambda: time_us(rotating([lambda w=w: x @ w.t() for w in bsets])))
        if t:
            b = n * k * 2 + m * k * 2 + m * n * 2
            res["rows"].append(dict(method="cublas_bf16", M=m, us=t, frac_copy=b / (t * 1e-6) / 1e9 / copy_gbs))
    del bsets
    torch.cuda.empty_cache()
    return res


def mid_markdown(result: dict) -> str:
    env = result["env"]
    methods = [f"{f}_{r}" for f in FORMATS for r in ("dense", "dense_mid", "grouped")] + ["cublas_bf16"]
    lines = [f"# W4A16 at decode batches of 24-128 tokens — {env['device']} ({env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; copy bandwidth {result['copy_gbs']:.0f} GB/s. `dense`: "
             "the dense route's tiles with the lever w4a16_mid_m off (prefill tiles), `dense_mid`: on (its mid-M "
             "tiles, split-K: see dense_config); rotation layout on. Cells: median µs per call (CUDA graph over "
             "rotating weight sets) and bytes moved as % of copy bandwidth.", ""]
    for shp in result["shapes"]:
        lines += _shape_table(shp, methods, MID_MS)
        worst = max((v for v in shp["checks"].values() if isinstance(v, float)), default=float("nan"))
        lines += ["", f"Max rel L2 against dequantize + fp64 over every row: {worst:.2e}", ""]
        for fmt in FORMATS:
            for m in MID_MS:
                lines += _sweep_lines(shp, fmt, m, 3)
        if shp["errors"]:
            lines += ["", "Errors:", ""] + [f"- {e}" for e in shp["errors"]]
        lines.append("")
    return "\n".join(lines) + "\n"


# -- report ----------------------------------------------------------------------------------------------------
METHODS = ["mxfp4_dense", "mxfp4_dense_rot", "mxfp4_grouped", "nvfp4_dense", "nvfp4_dense_rot", "nvfp4_grouped",
           "mxfp4_dense_tuned", "nvfp4_dense_tuned", "mxfp4_dense_pdl", "mxfp4_dense_pdl_pf16k",
           "mxfp4_dense_pdl_pfall", "nvfp4_dense_pdl", "nvfp4_dense_pdl_pf16k", "nvfp4_dense_pdl_pfall",
           "cublas_bf16", "triton_gemv_bf16", "triton_gemv_norm_bf16", "triton_gemv_norm_gained_bf16",
           "triton_gemv_add_res_bf16", "triton_gemv_add_res_gain_bf16", "triton_gemv_norm_gained_epilogue_bf16",
           "triton_gemv_norm_gained_rope_bf16", "triton_gemv_pdl_bf16",
           "triton_gemv_pdl_pf8k_bf16", "triton_gemv_pdl_pf16k_bf16", "triton_gemv_pdl_pf64k_bf16",
           f"tinygemm_int4_g{TINYGEMM_GROUP}"]


def _shape_table(shp: dict, methods: list[str], ms) -> list[str]:
    """A shape's heading and its table: one row per M, one cell per method (µs and % of copy bandwidth)."""
    lines = [f"## {shp['name']}: K={shp['K']} -> N={shp['N']}", "", "| M | " + " | ".join(methods) + " |",
             "|---|" + "---|" * len(methods)]
    for m in ms:
        cells = []
        for meth in methods:
            row = next((r for r in shp["rows"] if r["method"] == meth and r["M"] == m), None)
            cells.append(f"{row['us']:.1f} µs ({100 * row['frac_copy']:.0f}%)" if row else "—")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _sweep_lines(shp: dict, fmt: str, m: int, top: int) -> list[str]:
    """The ``top`` fastest sweep rows of a format at M tokens, one line each with its tile."""
    rows = sorted((r for r in shp["sweep"] if r["fmt"] == fmt and r["M"] == m), key=lambda r: r["us"])
    out = []
    for r in rows[:top]:
        c = r["config"]
        out.append(f"- {fmt} M={m}: {r['us']:.1f} µs ({100 * r['frac_copy']:.0f}%) BLOCK_M={c['BLOCK_M']} "
                   f"BLOCK_N={c['BLOCK_N']} BLOCK_K={c['BLOCK_K']} warps={c['num_warps']} stages={c['num_stages']} "
                   f"split={c['SPLIT_K']} decode={c.get('DECODE', 'default')} {'swap_ab' if c['SWAP_AB'] else 'tile'}"
                   f"{'' if c.get('REPACKED', True) else ' natural-words'}")
    return out


def check_summary(checks: dict) -> str:
    """One format's route checks in words: the worst rel L2, how many rotation-layout results had the nibble
    layout's bits, and each variant that failed to run or differed, by name. (A bool or an error is never folded into
    the worst number: the 2026-12-04 run printed "inf" for checks that had all passed.)"""
    l2 = [v for v in checks.values() if isinstance(v, float)]
    bits = {k: v for k, v in checks.items() if isinstance(v, bool)}
    failed = sorted(k for k, v in checks.items() if isinstance(v, str)) + sorted(k for k, v in bits.items() if not v)
    text = f"{max(l2):.2e}" if l2 else "no route measured"
    if bits:
        text += f" (rotation layout bit-exact in {sum(bits.values())}/{len(bits)})"
    return text + (f", FAILED: {', '.join(failed)}" if failed else "")


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# W4A16 GEMV benchmark — {env['device']} ({env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; copy bandwidth "
             f"{result['copy_gbs']:.0f} GB/s ({result.get('copy_bw_method', OLD_COPY_BW_METHOD)}); "
             f"L2 {env['l2_mb']:.0f} MB, {env['sms']} SMs.",
             "Cells: median µs per call (CUDA graph of back-to-back calls over rotating weight sets) and achieved "
             "bandwidth as % of copy bandwidth (bytes = weights incl. scales + activations + output; cuBLAS counts "
             "bf16 weight bytes, tinygemm int4 + bf16 scales/zeros).", ""]
    for shp in result["shapes"]:
        lines += _shape_table(shp, METHODS, MS)
        checks = shp["checks"]
        lines += ["", "Correctness at this shape (max rel L2 vs dequantize + fp64 over routes, decode paths, "
                  f"M in 1/3/16/64): mxfp4 {check_summary(checks.get('mxfp4', {}))}, "
                  f"nvfp4 {check_summary(checks.get('nvfp4', {}))}"
                  + (f"; tinygemm self-check {checks['tinygemm_int4_M4']:.2e}" if "tinygemm_int4_M4" in checks
                     else f"; tinygemm: {shp.get('tinygemm_error', 'not run')}"), ""]
        if shp["sweep"]:
            lines += ["Sweep (dense route, best 5 per format at M = 1, and those five at M = 16):", ""]
            gemv_rows = sorted((r for r in shp["sweep"] if r.get("fmt") == "bf16"), key=lambda r: r["us"])
            for r in gemv_rows[:5]:
                c = r["config"]
                lines.append(f"- triton_gemv bf16 M=1: {r['us']:.1f} µs ({100 * r['frac_copy']:.0f}%) BLOCK_N="
                             f"{c['BLOCK_N']} BLOCK_K={c['BLOCK_K']} warps={c['num_warps']} "
                             f"stages={c['num_stages']} split={c['SPLIT_K']}")
            for fmt in FORMATS:
                for m in (1, 16):
                    lines += _sweep_lines(shp, fmt, m, 5)
            lines.append("")
        if shp.get("errors"):
            lines += ["Errors:", ""] + [f"- {e}" for e in shp["errors"]] + [""]
    return "\n".join(lines) + "\n"


def main(out_dir: str, sweep: bool = False, shapes=SHAPES, precompile_workers: int = 15,
         bf16_only: bool = False, mid: bool = False) -> dict:
    import triton
    if not torch.cuda.is_available():
        raise SystemExit("vtengine.bench.w4a16 needs a CUDA GPU")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    env = common.cuda_env()
    t0 = time.time()
    compile_errors = (precompile(shapes, sweep, precompile_workers) if precompile_workers and not (bf16_only or mid)
                      else [])
    copy_gbs = common.copy_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    _log(f"copy bandwidth {copy_gbs:.0f} GB/s ({common.COPY_BANDWIDTH_DEFINITION})")
    result = dict(env=env, copy_gbs=copy_gbs, copy_bw_method=common.COPY_BANDWIDTH_DEFINITION,
                  protocol=__doc__.split("\n\n")[2].strip(),
                  shapes=[], compile_errors=compile_errors)
    kind = "gemv-bf16" if bf16_only else "w4a16-mid" if mid else "w4a16"
    stem = common.unique_stem(out, f"{kind}-{props.name.replace(' ', '_')}-{env['date']}")
    report = mid_markdown if mid else markdown
    for k, n in shapes:
        if mid:
            result["shapes"].append(bench_mid(k, n, copy_gbs, props.L2_cache_size, gen, sweep))
        else:
            result["shapes"].append(bench_shape(k, n, copy_gbs, props.L2_cache_size, gen, sweep, bf16_only))
        shp = result["shapes"][-1]
        for r in shp["rows"]:
            if r["M"] in (1, 8, 64):
                _log(f"K={k} N={n} M={r['M']} {r['method']}: {r['us']:.1f} us {100 * r['frac_copy']:.0f}%")
        common.write_result(out, stem, result, report(result))
    result["wall_s"] = time.time() - t0
    common.write_result(out, stem, result, report(result))
    return result


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 1:
        raise SystemExit("usage: python -m vtengine.bench.w4a16 OUT_DIR [--sweep] [--bf16-only | --mid]")
    mid = "--mid" in sys.argv
    res = main(args[0], sweep="--sweep" in sys.argv, bf16_only="--bf16-only" in sys.argv, mid=mid)
    print((mid_markdown if mid else markdown)(res))
