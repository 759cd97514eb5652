"""Prefill attention, kernel-body variants of the packed (``gqa_pack``) route, timed against the engine's kernel.

An experiment, not wired into the engine. Question: the packed prefill kernel runs at 37% of the bf16 matmul rate
on a 512-token chunk after a 32k prefix (0.91 ms a layer on the H100, bench/results/chunk-sweep-notes-2026-12-05.md),
about what SDPA's kernel reaches; that chunk's attention is most of the mixed step whose P99 ITL made mixed_prefill a
KEEP. Tile sweeps (prefill-attention-2026-12-01-h200.md) found nothing past ~300 TFLOP/s. This bench asks whether
the loop body is what holds it, with three changes of the FlashAttention-2 tutorial kind, alone and together:

- ``acc_dot``: the P·V product accumulates into the rescaled accumulator (``tl.dot(p, v, acc * alpha)``, one MMA
  chain) instead of a separate product added to it (an extra [M, D] fp32 add per key tile, and the MMA cannot
  accumulate in place).
- ``late_scale``: the scores stay unscaled; the running max is taken on the raw scores times the scale and the
  exponent is one fused multiply-add (``exp2(qk * c - m)``), instead of scaling the [M, N] tile and then
  subtracting the max (two passes over it).
- ``kt``: K is loaded straight as [D, N] (the pointer tile transposed) instead of [N, D] and ``tl.trans``.
- ``all_ws``: the three, with Triton's warp specialisation asked for on the unmasked key loop (producer warps
  loading, consumer warps computing; a compile error there is recorded as the arm's result).

Same grid, same tiles, same page walk as the engine's ``_prefill_packed_kernel`` (vtengine/kernels/attention.py),
unsplit, fast-math (exp2) only. Each variant's output is checked against the engine kernel's before it is timed
(rel_l2; a variant that disagrees is reported, not timed).

``python -m vtengine.bench.prefill_attention_variants [OUT_DIR]`` (CUDA). On CPU, ``check()`` runs every variant
under the Triton interpreter at a tiny shape against the engine's kernel (tests/test_prefill_attention_variants.py).
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch

from vtengine.bench import common
from vtengine.kernels import attention as attn
from vtengine.kernels.attention import LOG2E, _softmax_exp, _varlen_tile

import triton  # noqa: E402  (after vtengine.kernels: it sets TRITON_INTERPRET on CPU hosts)
import triton.language as tl  # noqa: E402

VARIANTS = {"engine": None, "acc_dot": dict(ACC_DOT=True), "late_scale": dict(LATE_SCALE=True),
            "kt": dict(KT=True), "all": dict(ACC_DOT=True, LATE_SCALE=True, KT=True),
            "all_ws": dict(ACC_DOT=True, LATE_SCALE=True, KT=True, WS=True)}
TILES = [attn.Tiles(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in (
    (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3))]
SHAPES = [(512, 32000), (256, 32000), (2048, 30000), (8192, 0), (512, 0)]


@triton.jit
def _tile(q, k_base, v_base, bt_row, start_n, kv_end, pos, m_i, l_i, acc, qk_scale, offs_d, d_mask,
          stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
          MASK: tl.constexpr, ACC_DOT: tl.constexpr, LATE_SCALE: tl.constexpr, KT: tl.constexpr):
    """One key tile of the online softmax (MASK: the diagonal tiles, causal and end masks applied)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    if MASK:
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        kt_mask = n_mask[None, :] & d_mask[:, None]
    else:           # every key of the tile is visible to every row: only the head_dim padding is masked
        page = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
        kt_mask = d_mask[:, None]
    in_page = offs_n % PAGE_SIZE
    if KT:
        kt = tl.load(k_base + (page * stride_kb + in_page * stride_kt)[None, :] + offs_d[:, None], mask=kt_mask,
                     other=0.0)
        qk = tl.dot(q, kt)
    else:
        k = tl.load(k_base + (page * stride_kb + in_page * stride_kt)[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0)
        qk = tl.dot(q, tl.trans(k))
    if not LATE_SCALE:
        qk = qk * qk_scale
    if MASK:
        qk = tl.where((offs_n[None, :] <= pos[:, None]) & n_mask[None, :], qk, float("-inf"))
    v = tl.load(v_base + (page * stride_vb + in_page * stride_vt)[:, None] + offs_d[None, :], mask=kv_mask,
                other=0.0)
    if LATE_SCALE:
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = _softmax_exp(qk - m_new[:, None], True)
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if ACC_DOT:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _packed_variant_kernel(q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_ptr, context_lens_ptr, block_tables_ptr,
                           out_ptr, qk_scale, num_seqs,
                           stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                           stride_bt, stride_ot, stride_oh,
                           GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_B: tl.constexpr, PAGE_SIZE: tl.constexpr,
                           ACC_DOT: tl.constexpr, LATE_SCALE: tl.constexpr, KT: tl.constexpr,
                           WS: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_P2
    kvh = tl.program_id(1)
    seq, tile = _varlen_tile(cu_seqlens_ptr, num_seqs, tl.program_id(0), BLOCK_T, BLOCK_B)
    if seq >= num_seqs:
        return
    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    offs_t = tile * BLOCK_T + rows // GROUP_P2
    g = rows % GROUP_P2
    row_mask = (offs_t < q_len) & (g < GROUP)
    pos = ctx - q_len + offs_t
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_off = (q_start + offs_t).to(tl.int64) * stride_qt + (kvh * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_pos = ctx - q_len + tile * BLOCK_T
    kv_end = tl.minimum(ctx, first_pos + BLOCK_T)
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    bt_row = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WS):
        m_i, l_i, acc = _tile(q, k_base, v_base, bt_row, start_n, kv_end, pos, m_i, l_i, acc, qk_scale, offs_d,
                              d_mask, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N, PAGE_SIZE, False,
                              ACC_DOT, LATE_SCALE, KT)
    for start_n in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _tile(q, k_base, v_base, bt_row, start_n, kv_end, pos, m_i, l_i, acc, qk_scale, offs_d,
                              d_mask, stride_kb, stride_kt, stride_vb, stride_vt, BLOCK_N, PAGE_SIZE, True,
                              ACC_DOT, LATE_SCALE, KT)
    o = acc / l_i[:, None]
    o_off = (q_start + offs_t).to(tl.int64) * stride_ot + (kvh * GROUP + g) * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & d_mask[None, :])


def variant_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, tiles: attn.Tiles,
                      flags: dict, out=None) -> torch.Tensor:
    """The packed route's causal varlen prefill with one variant's loop body (fast-math, unsplit)."""
    t, hq, d = q.shape
    b = cu_seqlens_q.shape[0] - 1
    hkv = k_cache.shape[2]
    group = hq // hkv
    group_p2 = triton.next_power_of_2(group)
    block_t = max(tiles.block_m, group_p2, 16) // group_p2
    out = torch.empty_like(q) if out is None else out
    grid = (triton.cdiv(t, block_t) + b, hkv)
    _packed_variant_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out, scale * LOG2E, b,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), out.stride(0),
        out.stride(1), GROUP=group, GROUP_P2=group_p2, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_T=block_t, BLOCK_N=tiles.block_n, BLOCK_B=max(2, triton.next_power_of_2(b)),
        PAGE_SIZE=k_cache.shape[1], ACC_DOT=flags.get("ACC_DOT", False),
        LATE_SCALE=flags.get("LATE_SCALE", False), KT=flags.get("KT", False), WS=flags.get("WS", False),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def engine_attention(q, k_cache, v_cache, cu, cl, bt, scale, tiles, out=None):
    return attn.prefill_attention(q, k_cache, v_cache, cu, cl, bt, scale, fast_math=True, tiles=tiles, out=out,
                                  gqa_pack=True, splits="off")


def check(device: str = "cpu", dtype=torch.float32) -> dict[str, float]:
    """Every variant against the engine's packed kernel on a small two-sequence case with a cached prefix (a
    shuffled block table); returns each variant's largest absolute difference."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    hq, hkv, d, page = 4, 2, 16, 4                   # a group of 2 q heads per kv head
    q_lens, ctxs = [5, 3], [13, 3]
    nb = [triton.cdiv(c, page) for c in ctxs]
    bt = torch.randperm(sum(nb), generator=gen).to(torch.int32)
    tables = torch.zeros(2, max(nb), dtype=torch.int32)
    tables[0, :nb[0]], tables[1, :nb[1]] = bt[:nb[0]], bt[nb[0]:]
    kc = torch.randn(sum(nb), page, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(sum(nb), page, hkv, d, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    cu = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    cl = torch.tensor(ctxs, dtype=torch.int32)
    args = [x.to(device) for x in (q, kc, vc, cu, cl, tables)]
    tiles = attn.Tiles(block_m=16, block_n=4, num_warps=1, num_stages=1)
    ref = engine_attention(*args, d ** -0.5, tiles)
    return {name: float((variant_attention(*args, d ** -0.5, tiles, flags) - ref).abs().max())
            for name, flags in VARIANTS.items() if flags is not None}


def main(out_dir: str = "bench/results") -> dict:
    from vtengine.bench.prefill_attention import causal_flops, make_case, matmul_tflops, sdpa_call, time_ms
    from vtengine.testing import rel_l2
    if not torch.cuda.is_available():
        print("prefill attention variants: needs a CUDA GPU; nothing measured")
        return {"skipped": "needs a CUDA GPU"}
    props = torch.cuda.get_device_properties(0)
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"bench": "prefill_attention_variants", "device": props.name, "torch": torch.__version__,
              "triton": triton.__version__, "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
              "matmul_tflops": round(matmul_tflops(), 1), "rows": []}
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    stem = Path(out_dir) / common.unique_stem(
        out_dir, f"prefill-attention-variants-{now.strftime('%Y-%m-%d')}-{props.name.split()[-1].lower()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    scale = 128 ** -0.5
    for q_len, prefix in SHAPES:
        q, k, v, kc, vc, bt, cu, cl = make_case(q_len, prefix, gen)
        flops = causal_flops(q_len, prefix)
        row = {"q_len": q_len, "prefix": prefix, "arms": {}}
        sd = sdpa_call(q, k, v, prefix)
        ms = time_ms(sd)
        row["arms"]["sdpa"] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        for tiles in TILES:
            tag = f"m{tiles.block_m}n{tiles.block_n}w{tiles.num_warps}s{tiles.num_stages}"
            ref = engine_attention(q, kc, vc, cu, cl, bt, scale, tiles)
            for name, flags in VARIANTS.items():
                try:
                    buf = torch.full_like(q, float("nan"))
                    if flags is None:
                        def fn(tiles=tiles, buf=buf):
                            return engine_attention(q, kc, vc, cu, cl, bt, scale, tiles, out=buf)
                    else:
                        def fn(tiles=tiles, buf=buf, flags=flags):
                            return variant_attention(q, kc, vc, cu, cl, bt, scale, tiles, flags, out=buf)
                    err = rel_l2(fn(), ref)
                    entry = {"rel_l2_vs_engine": float(f"{err:.2e}")}
                    if not err < 2e-2:
                        entry["error"] = "output disagrees with the engine kernel: not timed"
                    else:
                        ms = time_ms(fn)
                        entry.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
                except Exception as e:
                    entry = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                row["arms"][f"{name}/{tag}"] = entry
        best = min((a["ms"], n) for n, a in row["arms"].items() if "ms" in a and n != "sdpa")
        eng = min((a["ms"], n) for n, a in row["arms"].items() if "ms" in a and n.startswith("engine/"))
        row["best"], row["best_engine"] = best[1], eng[1]
        row["best_vs_best_engine"] = round(eng[0] / best[0], 3)
        result["rows"].append(row)
        print(json.dumps({k: row[k] for k in ("q_len", "prefix", "best", "best_engine", "best_vs_best_engine")}),
              flush=True)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        del q, k, v, kc, vc
        torch.cuda.empty_cache()
    stem.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return result


def markdown(result: dict) -> str:
    lines = [f"# Prefill attention loop-body variants, {result['device']}, {result['date_utc']}",
             f"torch {result['torch']}, triton {result['triton']}; bf16 matmul {result['matmul_tflops']} TFLOP/s "
             "(this run). Cells: ms / TFLOP/s; (x) = the engine kernel's time at the same tiles / this one's.", ""]
    for r in result["rows"]:
        lines += [f"## {r['q_len']} new tokens after {r['prefix']} (SDPA {r['arms']['sdpa']['ms']} ms / "
                  f"{r['arms']['sdpa']['tflops']}); best {r['best']} x{r['best_vs_best_engine']} vs the engine's "
                  f"best tiles ({r['best_engine']})", "",
                  "| tiles | " + " | ".join(VARIANTS) + " |", "|---" * (1 + len(VARIANTS)) + "|"]
        for tiles in TILES:
            tag = f"m{tiles.block_m}n{tiles.block_n}w{tiles.num_warps}s{tiles.num_stages}"
            base = r["arms"].get(f"engine/{tag}", {}).get("ms")
            cells = []
            for name in VARIANTS:
                a = r["arms"].get(f"{name}/{tag}", {})
                cells.append(f"{a['ms']} / {a['tflops']}" + (f" (x{base / a['ms']:.3f})" if base else "")
                             if "ms" in a else a.get("error", "-")[:40])
            lines.append(f"| {tag} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main(*sys.argv[1:2])
