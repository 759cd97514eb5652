"""What bounds the dense W4A16 GEMM at M = 1: the engine's call beside kernels that do only part of its work.

    python -m vtengine.bench.w4a16_bound OUT_DIR

At Qwen3-8B's four projection shapes (MXFP4, the default route: dense, rotation layout, the launcher's tiles) it
times, in one run and by one protocol (vtengine.bench.w4a16's: CUDA-graph medians over rotating weight sets, so
every call reads cold weights):

- ``gemm``: the engine's call (vtengine.kernels.w4a16.w4a16_linear, dense, rot);
- ``gemm_split1``: the same tiles without split-K (no partial-tile workspace, no counter, no reduction);
- ``gemm_wide``: the same kernel on wider programs with more warps each (BLOCK_N 64 or 128, 4 or 8 warps, the split
  counts that give 1-4 programs per SM), each checked against the engine's tiles' output before it is timed;
- ``read_grid``: a kernel that reads exactly the words and scale bytes the GEMM's programs read, on the GEMM's grid,
  tiles, warps and stages, and folds them with XOR (no decode, no MMA, no activations): what streaming the weights
  costs on this grid;
- ``read_best``: the same read on the best of a few wider grids: what streaming them costs at all;
- ``empty_grid``: the GEMM's grid of programs that store one word each: the launch and ramp of that many programs.

So ``gemm - read_grid`` is the decode, the MMA and the split-K epilogue; ``read_grid - read_best`` is the grid's
shape; ``empty_grid`` is the floor no kernel of that grid goes below. Each read kernel's fold is checked against a
torch reference before timing (a kernel that skipped bytes would time less and fail the check).

Writes OUT_DIR/w4a16-bound-<device>-<date>.json and .md; returns the JSON dict.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

from vtengine.bench import common

SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]       # K -> N: qkv, o, gate_up, down
SHAPE_NAMES = {(4096, 6144): "qkv_proj", (4096, 4096): "o_proj", (4096, 24576): "gate_up_proj",
               (12288, 4096): "down_proj"}
SCALE_BLOCK = 32                                                           # MXFP4
WIDE_TOL = 1e-2            # rel L2 of a wider tile's output against the engine's tiles (split-K sums in another order)
READ_TILES = [(32, 2, 4), (64, 4, 4), (128, 4, 3), (64, 8, 4)]           # (BLOCK_N, num_warps, num_stages)


@triton.jit
def _read_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, SPLIT_K,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K), as the dense GEMM's at M <= 16: each program reads its BLOCK_N rows' int32
    words (8 codes each) and scale bytes over its K range, BLOCK_K at a time, XOR-folds them per row, and stores
    one int32 per (split, row): out[pid_k, row]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ld = tl.where(rows < N, rows, 0)
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_hi = tl.minimum(K, k_lo + k_per_split)
    offs_b = tl.arange(0, BLOCK_K // 8)
    offs_s = tl.arange(0, BLOCK_K // SCALE_BLOCK)
    w_ptrs = (w_ptr + rows_ld[:, None].to(tl.int64) * stride_wn
              + tl.multiple_of(k_lo // 8, BLOCK_K // 8) + offs_b[None, :])
    s_ptrs = (s_ptr + rows_ld[:, None].to(tl.int64) * stride_sn
              + tl.multiple_of(k_lo // SCALE_BLOCK, BLOCK_K // SCALE_BLOCK) + offs_s[None, :])
    acc = tl.zeros([BLOCK_N, BLOCK_K // 8], dtype=tl.int32)
    sacc = tl.zeros([BLOCK_N, BLOCK_K // SCALE_BLOCK], dtype=tl.int32)
    for _ in range(k_lo, k_hi, BLOCK_K):
        acc = acc ^ tl.load(w_ptrs)
        sacc = sacc ^ tl.load(s_ptrs).to(tl.int32)
        w_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // SCALE_BLOCK
    fold = tl.xor_sum(acc, axis=1) ^ tl.xor_sum(sacc, axis=1)
    tl.store(out_ptr + pid_k * N + rows, fold, mask=rows < N)


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), 1)


def read_fold(words: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int, split: int,
              num_warps: int = 4, num_stages: int = 3, out: torch.Tensor | None = None) -> torch.Tensor:
    """The read kernel's [split, N] folds of ``words`` (int32 [N, K/8]) and ``scales`` (uint8 [N, K/32])."""
    n, k = words.shape[0], words.shape[1] * 8
    if k % (block_k * split):
        raise ValueError(f"read_fold: K={k} is not a whole number of BLOCK_K={block_k} steps per split={split}")
    out = torch.empty(split, n, dtype=torch.int32, device=words.device) if out is None else out
    _read_kernel[(triton.cdiv(n, block_n), split)](
        words, scales, out, n, k, words.stride(0), scales.stride(0), split,
        BLOCK_N=block_n, BLOCK_K=block_k, SCALE_BLOCK=SCALE_BLOCK, num_warps=num_warps, num_stages=num_stages)
    return out


def reference_fold(words: torch.Tensor, scales: torch.Tensor, split: int) -> torch.Tensor:
    """What read_fold must give: per split and row, the XOR of the row's words and scale bytes in that split's K."""
    w = words.cpu().numpy().reshape(words.shape[0], split, -1)
    s = scales.cpu().numpy().astype(np.int32).reshape(scales.shape[0], split, -1)
    fold = np.bitwise_xor.reduce(w, axis=2) ^ np.bitwise_xor.reduce(s, axis=2)
    return torch.from_numpy(np.ascontiguousarray(fold.T))


def read_configs(n: int, k: int, gemm_cfg: dict, num_sms: int) -> list[dict]:
    """The GEMM's own grid first, then wider tiles at split counts that give 1-4 programs per SM."""
    out = [dict(BLOCK_N=gemm_cfg["BLOCK_N"], BLOCK_K=gemm_cfg["BLOCK_K"], SPLIT_K=gemm_cfg["SPLIT_K"],
                num_warps=gemm_cfg["num_warps"], num_stages=gemm_cfg["num_stages"], grid="gemm")]
    for block_n, warps, stages in READ_TILES:
        for block_k in (256, 512):
            for split in (1, 2, 4, 8):
                programs = triton.cdiv(n, block_n) * split
                if k % (block_k * split) or not num_sms <= programs <= 4 * num_sms:
                    continue
                out.append(dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=warps,
                                num_stages=stages, grid="wide"))
    return out


def wide_configs(n: int, k: int, gemm_cfg: dict, num_sms: int) -> list[dict]:
    """The GEMM's tiles on wider programs with more warps each (the read's best grids: BLOCK_N 64, 8 warps), at the
    split counts that give 1-4 programs per SM."""
    k_steps = k // gemm_cfg["BLOCK_K"]
    out = []
    for block_n, warps in ((64, 4), (64, 8), (128, 8)):
        programs = triton.cdiv(n, block_n)
        for split in (1, 2, 4, 8):
            if k_steps % split or k_steps // split < 2 or not num_sms <= programs * split <= 4 * num_sms:
                continue
            out += [dict(gemm_cfg, BLOCK_N=block_n, num_warps=warps, num_stages=stages, SPLIT_K=split)
                    for stages in (3, 4)]
    return out


def read_method(rc: dict) -> str:
    """A read row's method: ``read_grid`` on the GEMM's own grid, ``read_wide`` on a wider one."""
    return "read_grid" if rc["grid"] == "gemm" else "read_wide"


def bench_shape(k: int, n: int, copy_gbs: float, l2: int, num_sms: int, gen) -> dict:
    from vtengine import quant
    from vtengine.bench.w4a16 import n_sets, rotating, time_us
    from vtengine.kernels import w4a16
    cfg = w4a16.dense_config(1, n, k, "mxfp4", num_sms)
    qs = []
    per_set = n * k // 2 + n * k // SCALE_BLOCK
    for _ in range(n_sets(per_set, l2)):
        qs.append(quant.quantize(torch.randn(n, k, device="cuda", generator=gen) * 0.02, "mxfp4"))
    words = [w4a16.rot_words(q) for q in qs]
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    nbytes = per_set + 2 * k + 2 * n
    res = dict(K=k, N=n, name=SHAPE_NAMES.get((k, n), f"{k}x{n}"), gemm_config=cfg, bytes=nbytes, rows=[],
               errors=[])

    def row(method: str, fn, **extra):
        try:
            us = time_us(fn)
        except Exception as exc:                    # noqa: BLE001
            res["errors"].append(f"{method}: {common.error_text(exc)}")
            return
        res["rows"].append(dict(method=method, us=us, frac_copy=nbytes / (us * 1e-6) / (copy_gbs * 1e9), **extra))

    split1 = dict(cfg, SPLIT_K=1)
    for q in qs:                                    # the one-time per-weight setup runs eagerly, not in capture
        w4a16.w4a16_linear(x, q, dense=True, rot=True)
        w4a16.w4a16_linear(x, q, dense=True, rot=True, config=split1)
    row("gemm", rotating([lambda q=q: w4a16.w4a16_linear(x, q, dense=True, rot=True) for q in qs]))
    row("gemm_split1", rotating([lambda q=q: w4a16.w4a16_linear(x, q, dense=True, rot=True, config=split1)
                                 for q in qs]), config=split1)
    want = w4a16.w4a16_linear(x, qs[0], dense=True, rot=True).float()
    for wc in wide_configs(n, k, cfg, num_sms):
        try:
            got = w4a16.w4a16_linear(x, qs[0], dense=True, rot=True, config=wc).float()
        except Exception as exc:                    # noqa: BLE001
            res["errors"].append(f"gemm_wide {wc}: {common.error_text(exc)}")
            continue
        err = float((got - want).norm() / want.norm())
        if not err < WIDE_TOL:
            res["errors"].append(f"gemm_wide {wc}: rel L2 {err:.2e} against the engine's tiles; not timed")
            continue
        for q in qs[1:]:
            w4a16.w4a16_linear(x, q, dense=True, rot=True, config=wc)
        row("gemm_wide", rotating([lambda q=q, wc=wc: w4a16.w4a16_linear(x, q, dense=True, rot=True, config=wc)
                                   for q in qs]), config=wc)
    for rc in read_configs(n, k, cfg, num_sms):
        got = read_fold(words[0], qs[0].scales, rc["BLOCK_N"], rc["BLOCK_K"], rc["SPLIT_K"], rc["num_warps"],
                        rc["num_stages"])
        if not torch.equal(reference_fold(words[0], qs[0].scales, rc["SPLIT_K"]), got.cpu()):
            res["errors"].append(f"read {rc}: its fold differs from the reference; not timed")
            continue
        outs = [torch.empty(rc["SPLIT_K"], n, dtype=torch.int32, device="cuda") for _ in qs]
        row(read_method(rc), rotating([
            lambda w=w, q=q, o=o, rc=rc: read_fold(w, q.scales, rc["BLOCK_N"], rc["BLOCK_K"], rc["SPLIT_K"],
                                                   rc["num_warps"], rc["num_stages"], out=o)
            for w, q, o in zip(words, qs, outs)]), config=rc)
    grid = (triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    sink = torch.empty(grid[0] * grid[1], dtype=torch.int32, device="cuda")
    row("empty_grid", lambda: _empty_kernel[grid](sink, num_warps=cfg["num_warps"]), grid=list(grid))
    return res


def summary(shp: dict) -> dict:
    """The shape's figures by name: the GEMM, its split-free form, its best wider tiles, the read on the GEMM's
    grid, the best read, the empty grid (µs; None where not measured)."""
    by: dict[str, float] = {}
    for r in shp["rows"]:
        key = "read_best" if r["method"] == "read_wide" else r["method"]
        by[key] = min(by.get(key, float("inf")), r["us"])
    if "read_grid" in by:
        by["read_best"] = min(by.get("read_best", float("inf")), by["read_grid"])
    names = ("gemm", "gemm_split1", "gemm_wide", "read_grid", "read_best", "empty_grid")
    return {name: by.get(name) for name in names}


def markdown(result: dict) -> str:
    env = result["env"]
    floor = f"copy bandwidth {result['copy_gbs']:.0f} GB/s ({result['copy_bw_method']})"
    lines = [f"# What bounds the dense W4A16 GEMM at M = 1 — {env['device']} ({env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}; {floor}; L2 {env['l2_mb']:.0f} MB, {env['sms']} SMs.",
             "MXFP4, the engine's default route (dense, rotation layout, the launcher's tiles). Cells: median µs "
             "(CUDA graph over rotating weight sets) and the weight + activation bytes as % of copy bandwidth. "
             "gemm - read_grid: decode, MMA and split-K epilogue; read_grid - read_best: the grid's shape; "
             "empty_grid: the launch and ramp of the GEMM's grid (vtengine/bench/w4a16_bound.py).", "",
             "| projection | MB | byte floor | gemm | gemm, no split | gemm, best wider tiles | read, gemm's grid | "
             "read, best grid | empty grid | decode + MMA + epilogue | grid shape |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for shp in result["shapes"]:
        s = summary(shp)
        floor_us = shp["bytes"] / (result["copy_gbs"] * 1e3)

        def cell(us):
            return "—" if us is None else f"{us:.1f} µs ({100 * floor_us / us:.0f}%)"

        def diff(a, b):
            return "—" if a is None or b is None else f"{a - b:+.1f} µs"
        empty = "—" if s["empty_grid"] is None else f"{s['empty_grid']:.1f} µs"
        lines.append(f"| {shp['name']} | {shp['bytes'] / 1e6:.1f} | {floor_us:.1f} µs | {cell(s['gemm'])} | "
                     f"{cell(s['gemm_split1'])} | {cell(s['gemm_wide'])} | {cell(s['read_grid'])} | "
                     f"{cell(s['read_best'])} | {empty} | "
                     f"{diff(s['gemm'], s['read_grid'])} | {diff(s['read_grid'], s['read_best'])} |")
    lines.append("")
    for shp in result["shapes"]:
        def tiles(c):
            return (f"BLOCK_N={c['BLOCK_N']} BLOCK_K={c['BLOCK_K']} split={c['SPLIT_K']} warps={c['num_warps']} "
                    f"stages={c['num_stages']}")

        def best(method):
            return min((r for r in shp["rows"] if r["method"] == method), key=lambda r: r["us"], default=None)
        lines.append(f"- {shp['name']}: the GEMM's tiles {tiles(shp['gemm_config'])}"
                     + "".join(f"; {label} {tiles(b['config'])}" for label, b in
                               (("best wider GEMM tiles", best("gemm_wide")), ("best read", best("read_wide")))
                               if b is not None))
        lines += [f"  - error: {e}" for e in shp["errors"]]
    return "\n".join(lines) + "\n"


def main(out_dir: str, shapes=SHAPES) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("vtengine.bench.w4a16_bound needs a CUDA GPU")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    env = common.cuda_env()
    t0 = time.time()
    copy_gbs = common.copy_bandwidth_gbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = dict(env=env, copy_gbs=copy_gbs, copy_bw_method=common.COPY_BANDWIDTH_DEFINITION, shapes=[])
    stem = common.unique_stem(out, f"w4a16-bound-{props.name.replace(' ', '_')}-{env['date']}")
    for k, n in shapes:
        result["shapes"].append(bench_shape(k, n, copy_gbs, props.L2_cache_size, props.multi_processor_count, gen))
        print(json.dumps(summary(result["shapes"][-1])), file=sys.stderr, flush=True)
        common.write_result(out, stem, result, markdown(result))
    result["wall_s"] = time.time() - t0
    common.write_result(out, stem, result, markdown(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m vtengine.bench.w4a16_bound OUT_DIR")
    print(markdown(main(sys.argv[1])))
