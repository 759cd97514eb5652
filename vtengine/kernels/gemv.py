"""Dense (bf16/fp16/fp32) projections at decode sizes, M <= 16: a split-K GEMV in Triton, the lever ``triton_gemv``.

y = x @ W^T with W [N, K] in x's dtype. The torch reference is ``TorchBackend.linear`` (an fp32 matmul); the
baseline route is cuBLAS (``x @ W.t()``), which on one H200 moves 60-75% of copy bandwidth at M = 1 on the
Qwen3-8B qkv and o shapes (bench/results/w4a16-*.md, its cuBLAS column): its kernels for skinny M leave SMs
idle. This route tiles W like a GEMV: a program owns BLOCK_N rows of W and one slice of K, the tokens (padded
to 16) are the MMA's narrow side (swap-AB, as the W4A16 dense route does), and split-K with a last-arrival
reduction fills the SMs. Every byte of W is read once; the bound is HBM bandwidth.

Batch invariance: the tiles and the split count depend on (N, K) and the SM count only, never on M, and the
split partials are summed in split order, so a row's result does not depend on which other rows share the
launch (the engine's async_parity gate requires it). M > 16 (prefill) always takes cuBLAS.
"""
from __future__ import annotations

import vtengine.kernels  # noqa: F401  (sets TRITON_INTERPRET on CPU hosts before triton is imported)

import torch
import triton
import triton.language as tl

from vtengine import counters
from vtengine.kernels import INTERPRET, dot_dtype, sm_count
from vtengine.kernels.pdl import PREFETCH_BYTES  # noqa: F401  (the lever's size, named here by the benches)
from vtengine.kernels.pdl import (launch_options, pdl_launch_dependents, pdl_wait, prefetch_bytes, prefetch_l2,
                                  prefetch_steps, use_pdl)
from vtengine.kernels.epilogue import (NormIn, _arrive, _finish, _norm_inv, _norm_ss, _residual_tile,
                                       _split_k_locks, _tile_rows, check_fused)
from vtengine.kernels.fused import RopeOut, _qkv_head, rope_constexprs, rope_kernel_args

MAX_M = 16


@triton.jit
def _gain_tile(gain_ptrs, GAIN_OUT: tl.constexpr):
    """GAIN_OUT's column tile of the next norm's gain (a weight: loadable before any PDL wait), or a placeholder."""
    if GAIN_OUT:
        return tl.load(gain_ptrs).to(tl.float32)
    else:
        return 0.0


@triton.jit
def _store_gained(acc, res, gain, xg_ptrs, y_mask, GAIN_OUT: tl.constexpr):
    """GAIN_OUT's second output: round(round(acc + res) * gain), the stored residual (as _finish rounds it) times
    the next norm's gain, rounded once (exact in fp32: two 8-bit significands)."""
    if GAIN_OUT:
        out = (acc + res.to(tl.float32)).to(xg_ptrs.dtype.element_ty).to(tl.float32)
        tl.store(xg_ptrs, (out * gain[:, None]).to(xg_ptrs.dtype.element_ty), mask=y_mask)


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, lock_ptr, M, N, K, stride_xm, stride_wn, stride_ym, SPLIT_K,
                 res_ptr, stride_res, ss_out_ptr, ss_in_ptr, n_ss_in, g_ptr, eps, gain_ptr, xg_ptr,
                 pos_ptr, cs_ptr, stride_cs, slot_ptr, qn_ptr, kn_ptr, k_cache_ptr, v_cache_ptr, HQ, HK,
                 stride_qot, stride_qoh, stride_cb, stride_ct, stride_ch, rope_eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
                 SILU_MUL: tl.constexpr = False, ADD_RES: tl.constexpr = False, NORM: tl.constexpr = False,
                 SS_BLOCK: tl.constexpr = 1, FAST_MATH: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                 PREFETCH_STEPS: tl.constexpr = 4, W_BYTES: tl.constexpr = 2, GAINED: tl.constexpr = False,
                 GAIN_OUT: tl.constexpr = False, ROPE: tl.constexpr = False, HALF: tl.constexpr = 1,
                 PAGE_SIZE: tl.constexpr = 1, ROPE_NORM: tl.constexpr = False, ROPE_FAST: tl.constexpr = False):
    """Grid (cdiv(N, BLOCK_N), SPLIT_K), or (cdiv(N / 2, BLOCK_N / 2), SPLIT_K) under SILU_MUL. Accumulates
    [BLOCK_N, BLOCK_M] = W_tile @ x_tile^T over the program's K slice in fp32. SPLIT: partials go to a workspace,
    the last program of a tile to arrive (counter, acq_rel) sums them in split order and writes y, then resets the
    counter (graph-replay safe). Bound by W's bytes.

    SILU_MUL (lever ``fuse_silu``): W is gate_up [N = 2I, K] and y = silu(gate) * up [M, I]. A tile's first
    BLOCK_N / 2 rows are gate rows c.., its last the matching up rows I + c.. (as the W4A16 kernel's), so the
    epilogue (the reducer's, when split) has both halves of every output it writes, in fp32.

    The lever ``fuse_norm`` folds add + RMSNorm into the GEMVs around it. ADD_RES: y = round(x W^T + residual),
    the new residual (one rounding of the fp32 sums, where the separate kernels round the GEMV's output first),
    and ss[tile, m] the tile's sum of squares of it. NORM: x is such a residual and the GEMV multiplies
    RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * g; mean(x^2) sums the n_ss_in tiles of the producer's ss in a fixed
    order (no atomics: the same bits whatever M, on every replay), so no program reads the whole row. The K loop
    multiplies x by g alone (rounded to x's dtype, as RMSNorm's output is) and the token's rsqrt scales the fp32
    sums once: with the whole norm on every A element the qkv GEMV's K step compiled to 537 SASS instructions
    against 159 plain (sm_90, offline), and to 218 this way. The operands the previous kernel wrote (the
    producer's sums, the residual) are loaded before the K loop and used after it, so their latency hides behind
    the weights: the split-K NORM kernel's code before its loop fell from 559 instructions to 306 (plain 244).
    GAIN_OUT (with ADD_RES): the producer also stores round(y * gain) [M, N], the next norm's x * g, from the
    rounded residual it stores (the gain's column tile is loaded before the K loop). GAINED (with NORM): x is that
    product, so the K loop is the plain one and only the token's rsqrt remains, after it; the bits are those of
    NORM alone (a bf16 product of bf16 operands rounds once either way). On the H200 the x * g in the K loop cost
    the gate_up GEMV 49.2 -> 57.8 us and the qkv one 16.7 -> 17.9 us (bench/results/w4a16-2026-12-02-*).

    USE_PDL (lever ``pdl``): the program waits for the previous kernel before its first read of what that kernel
    wrote (x, the residual, the producer's sums) and lets the next kernel launch once its K loop is issued.
    PREFETCH (lever ``pdl_prefetch``, with USE_PDL): before that wait the program asks L2 for the first
    PREFETCH_STEPS K steps of its W rows (W_BYTES per element), so a GEMV launched early streams weights while the
    kernel before it drains; the launcher sizes the steps to about 16 KB per program (one step), so the programs of
    one wave prefetch well under the 50 MB L2 of an H200 (a whole gate_up slice, 512 KB per program, would not fit).

    ROPE (lever ``fuse_rope``): W is the fused qkv projection, heads of 2 * HALF rows (q heads, then k, then v), and
    the qkv epilogue runs here instead of in its own launch: every program of a head's tiles (2 * HALF / BLOCK_N)
    and splits stores its partial and counts in on the head's counter; the last to arrive sums the head from the
    workspace (each tile in split order: the bits of the unfused y), rounds it as y is rounded and writes q
    (y_ptr: q [M, HQ, 2 * HALF]) or the paged cache rows, as _qkv_epilogue_kernel does (fused._qkv_head). The
    tiles, splits and K loop are the unfused GEMV's; the head's epilogue replaces a launch and the [M, N] y."""
    EARLY: tl.constexpr = PREFETCH and USE_PDL
    if not EARLY:
        pdl_wait(USE_PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    row_mask = offs_m < M
    rows = tl.where(row_mask, offs_m, 0)
    offs_n, n_mask = _tile_rows(pid_n, N, BLOCK_N, SILU_MUL)
    offs_n_ld = tl.where(n_mask, offs_n, 0)        # out-of-range rows re-read row 0; the store is masked
    if SILU_MUL:
        out_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y_ptrs = y_ptr + rows[None, :].to(tl.int64) * stride_ym + out_n[:, None]
        y_mask = (out_n < N // 2)[:, None] & row_mask[None, :]
    else:
        y_ptrs = y_ptr + rows[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
        y_mask = n_mask[:, None] & row_mask[None, :]
    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    offs_k = tl.arange(0, BLOCK_K)
    if EARLY:
        # the program's first PREFETCH_STEPS K steps of W, asked of L2 before the wait: LINES 128-byte lines per
        # row and step (weights never depend on the kernel before; what it wrote is read only after the wait)
        LINES: tl.constexpr = (BLOCK_K * W_BYTES + 127) // 128
        # (a line's column clamped to K - 1: a last, partial K step never asks for an address past its row)
        lines = tl.arange(0, LINES) * (128 // W_BYTES)
        rows_w = w_ptr + offs_n_ld[:, None].to(tl.int64) * stride_wn
        for k0 in range(k_lo, tl.minimum(k_hi, k_lo + PREFETCH_STEPS * BLOCK_K), BLOCK_K):
            prefetch_l2(rows_w + tl.minimum(k0 + lines, K - 1)[None, :])
        pdl_wait(USE_PDL)
    # the fused operands the previous kernel wrote, loaded now and used after the K loop (latency hidden)
    res = _residual_tile(res_ptr + rows[None, :].to(tl.int64) * stride_res + offs_n[:, None], y_mask, ADD_RES)
    ss = _norm_ss(ss_in_ptr, n_ss_in, offs_m, BLOCK_M, SS_BLOCK, NORM)
    gain = _gain_tile(gain_ptr + offs_n_ld, GAIN_OUT)
    w_ptrs = w_ptr + offs_n_ld[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs)
            a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            k_ok = k0 + offs_k < k_hi
            w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
            a = tl.load(x_ptrs, mask=row_mask[:, None] & k_ok[None, :], other=0.0)
        if NORM and not GAINED:                     # x * g here, the token's rsqrt on the sums below
            a = a * tl.load(g_ptr + k0 + offs_k, mask=k0 + offs_k < k_hi, other=0.0)[None, :]
        acc = tl.dot(w.to(DOT_DTYPE), tl.trans(a.to(DOT_DTYPE)), acc, input_precision=DOT_PREC)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    pdl_launch_dependents(USE_PDL)
    if NORM:
        acc = acc * _norm_inv(ss, K, eps, FAST_MATH)[None, :]

    if not SPLIT and not ROPE:
        _finish(acc, y_ptrs, y_mask, res, ss_out_ptr, pid_n, SILU_MUL, ADD_RES, BLOCK_N, BLOCK_M)
        _store_gained(acc, res, gain, xg_ptr + rows[None, :].to(tl.int64) * stride_ym + offs_n[:, None], y_mask,
                      GAIN_OUT)
    else:
        # the partial to the workspace; the last program of the tile (ROPE: of the head) to arrive finishes it
        HEAD_TILES: tl.constexpr = 2 * HALF // BLOCK_N if ROPE else 1
        ws_tile = ws_ptr + pid_n.to(tl.int64) * SPLIT_K * (BLOCK_N * BLOCK_M)
        offs_acc = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        owner = pid_n // HEAD_TILES
        if _arrive(ws_tile + pid_k * (BLOCK_N * BLOCK_M) + offs_acc, acc, lock_ptr, owner, HEAD_TILES * SPLIT_K):
            if ROPE:                                    # y_ptr is q; the head rounded as y would be
                _qkv_head(ws_ptr, owner, SPLIT_K, offs_m, row_mask, pos_ptr, cs_ptr, stride_cs, slot_ptr, qn_ptr,
                          kn_ptr, y_ptr, k_cache_ptr, v_cache_ptr, HQ, HK, stride_qot, stride_qoh, stride_cb,
                          stride_ct, stride_ch, rope_eps, HALF, BLOCK_N, BLOCK_M, PAGE_SIZE, ROPE_NORM, ROPE_FAST)
            else:
                total = tl.load(ws_tile + offs_acc, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    total += tl.load(ws_tile + s * (BLOCK_N * BLOCK_M) + offs_acc, cache_modifier=".cg")
                _finish(total, y_ptrs, y_mask, res, ss_out_ptr, pid_n, SILU_MUL, ADD_RES, BLOCK_N, BLOCK_M)
                _store_gained(total, res, gain, xg_ptr + rows[None, :].to(tl.int64) * stride_ym + offs_n[:, None],
                              y_mask, GAIN_OUT)
            tl.atomic_xchg(lock_ptr + owner, 0, sem="relaxed", scope="gpu")


def gemv_config(n: int, k: int, num_sms: int) -> dict:
    """Tiles for one (N, K) weight, independent of M (batch invariance), from the H200 sweep of 2026-11-30
    (bench/results/gemv-bf16-*): 32 W rows x 256 K per step, 4 warps, 3 stages, split-K until about 2 programs per
    SM (the smallest split that divides the K steps, at least 2 steps each); when N alone gives 4 programs per SM
    (gate_up), 64 x 128 tiles with 4 stages and no split."""
    block_n, block_k, stages, target = 32, 256, 3, 2
    if INTERPRET:                                   # numpy per program: small but legal tiles
        block_n, block_k = 16, 32
    elif triton.cdiv(n, block_n) >= 4 * num_sms:
        block_n, block_k, stages = 64, 128, 4
    tiles = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    splits = [d for d in range(1, 17) if k_steps % d == 0 and k_steps // d >= 2] or [1]
    split = next((d for d in splits if tiles * d >= target * num_sms), splits[-1])
    return dict(BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split, num_warps=4, num_stages=stages)


def fusable(m: int, triton_gemv: bool) -> bool:
    """Whether the fused forms (silu_mul, residual add, RMSNorm) apply: the Triton GEMV's route (the lever
    triton_gemv on), 1 <= M <= 16."""
    return triton_gemv and 1 <= m <= MAX_M


def _check(x: torch.Tensor, weight: torch.Tensor, what: str) -> tuple[int, int, int]:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{what} expects x [M, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise ValueError(f"{what}: x dtype {x.dtype} != weight dtype {weight.dtype}")
    return x.shape[0], x.shape[1], weight.shape[0]


def _check_out(out: torch.Tensor | None, shape: tuple[int, int], dtype, what: str) -> None:
    if out is not None and (tuple(out.shape) != shape or out.dtype != dtype or out.stride(1) != 1):
        raise ValueError(f"{what}: out must be [{shape[0]}, {shape[1]}] {dtype} with unit column stride, got "
                         f"{tuple(out.shape)} {out.dtype} strides {tuple(out.stride())}")


def linear(x: torch.Tensor, weight: torch.Tensor, triton_gemv: bool, pdl: bool = False,
           out: torch.Tensor | None = None, config: dict | None = None, silu_mul: bool = False,
           norm: NormIn | None = None, prefetch: bool | int = False, rope: RopeOut | None = None) -> torch.Tensor:
    """y = x @ weight^T for x [M, K] and weight [N, K] of x's dtype; y [M, N].

    ``triton_gemv`` is the lever: True and M <= 16 -> the Triton split-K GEMV, otherwise cuBLAS. ``pdl``: the lever
    pdl for the Triton launch. ``out`` receives y when given (tests poison it). ``config`` overrides the tiles.
    ``silu_mul`` (the lever fuse_silu): weight is gate_up [2I, K] and y = silu(x W_gate^T) * (x W_up^T) [M, I], in
    the GEMV's epilogue. ``norm`` (the lever fuse_norm): x is a residual from linear_add and the GEMV multiplies
    RMSNorm(x) instead (``norm.gained``: x is linear_add_gain's residual * g, the norm's rsqrt alone remains). Both
    on the Triton route only (fusable says when). ``prefetch``: the lever pdl_prefetch (with PDL, the first K steps
    of W are asked of L2 before the wait; an int: about that many bytes per program, for benches). ``rope`` (the
    lever fuse_rope): weight is the fused qkv projection and the GEMV runs the qkv epilogue (q/k norm, RoPE, the KV
    store) per head in its epilogue; returns q [M, Hq, D] (in ``rope.q_out`` when given) where y would be."""
    m, k, n = _check(x, weight, "linear")
    if (silu_mul or norm is not None or rope is not None) and not fusable(m, triton_gemv):
        raise ValueError(f"linear: silu_mul, norm and rope fuse into the Triton GEMV (triton_gemv on, 1 <= M <= "
                         f"{MAX_M}); got triton_gemv={triton_gemv}, M={m}")
    if rope is not None:
        if silu_mul or out is not None:
            raise ValueError("linear: rope writes q and the KV cache; it takes neither silu_mul nor out (give "
                             "rope.q_out)")
        q = rope.check(m, n, x.dtype, x.device, "linear")
        _launch(x, weight, q, config, pdl, norm=norm, prefetch=prefetch, rope=rope)
        return q
    if silu_mul and n % 2:
        raise ValueError(f"linear: silu_mul needs a [2I, K] weight, got N={n}")
    n_out = n // 2 if silu_mul else n
    _check_out(out, (m, n_out), x.dtype, "linear")
    if not triton_gemv or m > MAX_M or m == 0:
        counters.record("dense_linear", "cublas", grid=())
        if out is not None:
            return torch.matmul(x, weight.t(), out=out)
        return x @ weight.t()
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device) if out is None else out
    _launch(x, weight, y, config, pdl, silu_mul=silu_mul, norm=norm, prefetch=prefetch)
    return y


def linear_add(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, pdl: bool = False,
               config: dict | None = None, prefetch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(round(x @ weight^T + residual), its sums of squares per output tile [tiles, MAX_M] fp32): the new residual
    and what the next GEMV's ``norm`` needs (the lever fuse_norm). The Triton route only: 1 <= M <= 16."""
    y, ss, _ = _linear_add(x, weight, residual, None, pdl, config, prefetch, "linear_add")
    return y, ss


def linear_add_gain(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, gain: torch.Tensor,
                    pdl: bool = False, config: dict | None = None,
                    prefetch: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """linear_add's (residual, sums of squares) and round(residual * gain) [M, N]: the next RMSNorm's weight
    ``gain`` [N] applied, so the next GEMV takes it with ``NormIn(..., gained=True)`` and its K loop stays plain."""
    return _linear_add(x, weight, residual, gain, pdl, config, prefetch, "linear_add_gain")


def _linear_add(x, weight, residual, gain, pdl, config, prefetch, what):
    m, k, n = _check(x, weight, what)
    if not fusable(m, True):
        raise ValueError(f"{what}: the residual add fuses into the Triton GEMV at 1 <= M <= {MAX_M}, got M={m}")
    if gain is not None and (gain.shape != (n,) or gain.stride() != (1,) or gain.dtype != x.dtype):
        raise ValueError(f"{what}: gain must be a contiguous [{n}] {x.dtype} (the next RMSNorm's weight), got "
                         f"{tuple(gain.shape)} {gain.dtype} strides {tuple(gain.stride())}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    xg = torch.empty_like(y) if gain is not None else None
    cfg = dict(config or gemv_config(n, k, sm_count(x.device)))
    ss = torch.empty((triton.cdiv(n, cfg["BLOCK_N"]), cfg["BLOCK_M"]), dtype=torch.float32, device=x.device)
    _launch(x, weight, y, cfg, pdl, residual=residual, ss_out=ss, prefetch=prefetch, gain=gain, gained_out=xg)
    return y, ss, xg


def _launch(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, config: dict | None, pdl: bool,
            silu_mul: bool = False, norm: NormIn | None = None, residual: torch.Tensor | None = None,
            ss_out: torch.Tensor | None = None, prefetch: bool = False, gain: torch.Tensor | None = None,
            gained_out: torch.Tensor | None = None, rope: RopeOut | None = None) -> None:
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    cfg = dict(config or gemv_config(n, k, sm_count(x.device)))
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["SPLIT_K"]
    if bm < m:
        raise ValueError(f"linear: config BLOCK_M={bm} is smaller than M={m}; the GEMV does not tile M (use "
                         f"BLOCK_M >= {m}, e.g. {MAX_M})")
    grid = (triton.cdiv(n // 2, bn // 2) if silu_mul else triton.cdiv(n, bn), split)
    check_fused("linear", m, n, k, bm, grid[0], norm, residual, ss_out, x.dtype)
    head_tiles = rope.head_tiles(bn, "linear") if rope is not None else 1
    if split > 1 or rope is not None:               # rope: a head's tiles meet in the workspace even unsplit
        ws = torch.empty((grid[0], split, bn * bm), dtype=torch.float32, device=x.device)
        locks = _split_k_locks(x.device, grid[0] // head_tiles)     # a counter per tile (rope: per head)
    else:
        ws, locks = y, y                                # unused pointers
    dd = dot_dtype(x)
    on = use_pdl(pdl, "dense_linear", x.device)
    pf_bytes = prefetch_bytes(prefetch)
    early = pf_bytes > 0 and on
    if on:
        counters.record("pdl_prefetch", "prefetch" if early else "wait_first", variant="dense_linear")
    res = residual if residual is not None else y       # unused pointers when a fusion is off
    ss_in = norm.ss if norm is not None else ws
    _gemv_kernel[grid](x, w, y, ws, locks, m, n, k, x.stride(0), w.stride(0), y.stride(0), split,
                       res, res.stride(0), ss_out if ss_out is not None else ws, ss_in,
                       ss_in.shape[0] if norm is not None else 0, norm.weight if norm is not None else w,
                       norm.eps if norm is not None else 0.0, gain if gain is not None else w,
                       gained_out if gained_out is not None else y, *rope_kernel_args(rope, y),
                       BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split > 1, EVEN_K=k % (bk * split) == 0,
                       DOT_DTYPE=dd, DOT_PREC="ieee" if dd == tl.float32 else "tf32", USE_PDL=on,
                       SILU_MUL=bool(silu_mul), ADD_RES=residual is not None, NORM=norm is not None,
                       SS_BLOCK=triton.next_power_of_2(max(1, ss_in.shape[0])) if norm is not None else 1,
                       FAST_MATH=bool(norm is not None and norm.fast_math), PREFETCH=early,
                       PREFETCH_STEPS=prefetch_steps(bn, bk, w.element_size(), pf_bytes),
                       W_BYTES=w.element_size(),
                       GAINED=bool(norm is not None and norm.gained), GAIN_OUT=gain is not None,
                       **rope_constexprs(rope), num_warps=cfg.get("num_warps", 4),
                       num_stages=cfg.get("num_stages", 4), **launch_options(on))
    counters.record("dense_linear", "triton_gemv", grid=grid, splits=split,
                    variant=(bn, bk, split) + (("silu_mul",) if silu_mul else ()) + (("norm",) if norm else ())
                    + (("add_residual",) if residual is not None else ()) + (("gain_out",) if gain is not None else ())
                    + (("gained",) if norm is not None and norm.gained else ())
                    + (("rope",) if rope is not None else ()))
