"""Fused elementwise / row kernels: RMSNorm, add + RMSNorm, SiLU-and-mul, neox RoPE, the qkv epilogue (q/k norm +
RoPE + KV store in one launch), greedy argmax.

The torch references are the methods of the same names on ``TorchBackend`` (vtengine/backends/torch_backend.py);
each launcher here returns what its reference returns, with the same rounding points (fp32 math, one rounding to
the activation dtype where the reference rounds). All of them are bound by HBM bytes (each input read once, each
output written once) except at tiny shapes, where launch latency dominates.
"""
from __future__ import annotations

from dataclasses import dataclass

import vtengine.kernels  # noqa: F401  (sets TRITON_INTERPRET on CPU hosts before triton is imported)

import torch
import triton
import triton.language as tl

from vtengine import counters
from vtengine.kernels import sm_count
from vtengine.kernels.epilogue import _head_sums
from vtengine.kernels.pdl import launch_options, pdl_launch_dependents, pdl_wait, use_pdl


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x viewed as [rows, last dim] with a unit last stride (a copy only when no such view exists)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(block: int) -> int:
    return max(1, min(16, block // 256))


# --------------------------------------------------------------------------------------------------------------
# RMSNorm and add + RMSNorm
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _inv_rms(x, H, eps, FAST_MATH: tl.constexpr):
    ms = tl.sum(x * x, axis=0) / H
    if FAST_MATH:
        return tl.math.rsqrt(ms + eps)                 # rsqrt.approx.f32
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))   # IEEE sqrt and IEEE division


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_out, eps,
                     BLOCK_H: tl.constexpr, FAST_MATH: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (rows,). One program normalizes one row of H <= BLOCK_H elements in fp32 registers; bound by HBM
    bytes (2 x H x 2 B per row) once rows fill the SMs."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)
    y = x * _inv_rms(x, H, eps, FAST_MATH) * w
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr, H, stride_x, stride_res, stride_out,
                         stride_new_res, eps, BLOCK_H: tl.constexpr, FAST_MATH: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Grid (rows,). new_residual = round(x + residual) to the activation dtype (as HF does), then RMSNorm of
    that rounded sum; one read of x and residual, one write of each output. Bound by HBM bytes."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < H
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)
    summed = (x + r).to(new_res_ptr.dtype.element_ty)
    tl.store(new_res_ptr + row * stride_new_res + offs, summed, mask=mask)
    s = summed.to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = s * _inv_rms(s, H, eps, FAST_MATH) * w
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_norm(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: weight shape {tuple(weight.shape)} does not match the last dim of x "
                         f"{tuple(x.shape)}; expected [{x.shape[-1]}]")


def _out(out: torch.Tensor | None, shape, dtype, device, name: str) -> torch.Tensor:
    """A caller-given output buffer (tests poison it, CUDA graphs reuse it) or a fresh one."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"{name}: out must be a contiguous {tuple(shape)} {dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype} contiguous={out.is_contiguous()}")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fast_math: bool = False,
             out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape); the result has x's shape and dtype."""
    _check_norm(x, weight, "rms_norm")
    x2 = _rows(x)
    out = _out(out, x.shape, x.dtype, x.device, "rms_norm").view(x2.shape)
    rows, h = x2.shape
    block = triton.next_power_of_2(h)
    grid = (rows,)
    if rows:
        on = use_pdl(pdl, "rms_norm", x.device)
        _rms_norm_kernel[grid](x2, weight, out, h, x2.stride(0), out.stride(0), eps,
                               BLOCK_H=block, FAST_MATH=bool(fast_math), USE_PDL=on, num_warps=_row_warps(block),
                               **launch_options(on))
    counters.record("rms_norm", "fast_math" if fast_math else "precise", grid=grid,
                    variant=("rms_norm", block, bool(fast_math)))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 fast_math: bool = False, out: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first, as the reference does."""
    _check_norm(x, weight, "add_rms_norm")
    if residual.shape != x.shape:
        raise ValueError(f"add_rms_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    x2, r2 = _rows(x), _rows(residual)
    out = _out(out, x.shape, x.dtype, x.device, "add_rms_norm").view(x2.shape)
    new_res = _out(residual_out, x.shape, x.dtype, x.device, "add_rms_norm").view(x2.shape)
    rows, h = x2.shape
    block = triton.next_power_of_2(h)
    grid = (rows,)
    if rows:
        on = use_pdl(pdl, "add_rms_norm", x.device)
        _add_rms_norm_kernel[grid](x2, r2, weight, out, new_res, h, x2.stride(0), r2.stride(0), out.stride(0),
                                   new_res.stride(0), eps, BLOCK_H=block, FAST_MATH=bool(fast_math), USE_PDL=on,
                                   num_warps=_row_warps(block), **launch_options(on))
    counters.record("rms_norm", "fast_math" if fast_math else "precise", grid=grid,
                    variant=("add_rms_norm", block, bool(fast_math)))
    return out.view(x.shape), new_res.view(x.shape)


# --------------------------------------------------------------------------------------------------------------
# SiLU and mul
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, stride_gu, stride_out, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (T, cdiv(I, BLOCK)). out[t, i] = silu(gate[t, i]) * up[t, i], gate = gate_up[:, :I]; fp32 math, one
    rounding. Bound by HBM bytes (3 x I x 2 B per token)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    pdl_wait(USE_PDL)
    g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + t * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul expects gate_up [T, 2I], got shape {tuple(gate_up.shape)}")
    gu = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    t, i = gu.shape[0], gu.shape[1] // 2
    out = _out(out, (t, i), gu.dtype, gu.device, "silu_mul")
    block = min(1024, triton.next_power_of_2(max(i, 16)))
    grid = (t, triton.cdiv(i, block))
    if t and i:
        on = use_pdl(pdl, "silu_mul", gu.device)
        _silu_mul_kernel[grid](gu, out, i, gu.stride(0), out.stride(0), BLOCK=block, USE_PDL=on, num_warps=4,
                               **launch_options(on))
    counters.record("silu_mul", "default", grid=grid, variant=("silu_mul", block))
    return out


# --------------------------------------------------------------------------------------------------------------
# RoPE (neox: rotate halves)
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, q_out_ptr, k_out_ptr, HQ, HK,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 stride_qot, stride_qoh, stride_kot, stride_koh,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (T,). One program rotates every q and k head of one token: cos/sin [HALF] read once, heads as rows of
    a [BLOCK_H, HALF] tile. out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin in fp32. Bound by HBM bytes."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]

    qm = h < HQ
    q1 = tl.load(q_ptr + t * stride_qt + h * stride_qh + d[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + t * stride_qt + h * stride_qh + HALF + d[None, :], mask=qm, other=0.0).to(tl.float32)
    qo = q_out_ptr + t * stride_qot + h * stride_qoh + d[None, :]
    tl.store(qo, (q1 * cos - q2 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)
    tl.store(qo + HALF, (q2 * cos + q1 * sin).to(q_out_ptr.dtype.element_ty), mask=qm)

    km = h < HK
    k1 = tl.load(k_ptr + t * stride_kt + h * stride_kh + d[None, :], mask=km, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + t * stride_kt + h * stride_kh + HALF + d[None, :], mask=km, other=0.0).to(tl.float32)
    ko = k_out_ptr + t * stride_kot + h * stride_koh + d[None, :]
    tl.store(ko, (k1 * cos - k2 * sin).to(k_out_ptr.dtype.element_ty), mask=km)
    tl.store(ko + HALF, (k2 * cos + k1 * sin).to(k_out_ptr.dtype.element_ty), mask=km)


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
         q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None):
    """Neox rotary embedding. q [T, Hq, D], k [T, Hkv, D] (views with strided tokens/heads are fine), positions [T]
    int, cos_sin [max_pos, D] (cos in [:, :D/2], sin in [:, D/2:]). Returns new (q, k)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"rope expects q [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, hq, d = q.shape
    hk = k.shape[1]
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"rope: head_dim {d} must be twice a power of two (e.g. 64, 128)")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != d:
        raise ValueError(f"rope: cos_sin shape {tuple(cos_sin.shape)} must be [max_pos, {d}]")
    if positions.shape != (t,):
        raise ValueError(f"rope: positions shape {tuple(positions.shape)} must be [{t}]")
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    cs = cos_sin if cos_sin.stride(1) == 1 else cos_sin.contiguous()
    q_out = _out(q_out, (t, hq, d), q.dtype, q.device, "rope")
    k_out = _out(k_out, (t, hk, d), k.dtype, k.device, "rope")
    block_h = triton.next_power_of_2(max(hq, hk))
    grid = (t,)
    if t:
        _rope_kernel[grid](q, k, positions, cs, q_out, k_out, hq, hk,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), cs.stride(0),
                           q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                           HALF=d // 2, BLOCK_H=block_h, num_warps=4)
    counters.record("rope", "default", grid=grid, variant=("rope", d, block_h))
    return q_out, k_out


# --------------------------------------------------------------------------------------------------------------
# qkv epilogue: Qwen3 q/k RMSNorm + RoPE + KV-cache store in one launch
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _norm_halves(x1, x2, w_ptr, d, eps, HALF: tl.constexpr, FAST_MATH: tl.constexpr):
    """RMSNorm of each row of a [heads, 2 * HALF] tile held as its two halves (fp32), then one rounding to the
    activation dtype (as the reference's rms_norm returns it) and back to fp32 for the rotation."""
    ms = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
    if FAST_MATH:
        inv = tl.math.rsqrt(ms + eps)
    else:
        inv = tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))
    w1 = tl.load(w_ptr + d).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d).to(tl.float32)[None, :]
    y1 = x1 * inv[:, None] * w1
    y2 = x2 * inv[:, None] * w2
    return y1, y2


@triton.jit
def _qkv_epilogue_kernel(qkv_ptr, qn_ptr, kn_ptr, pos_ptr, cs_ptr, slot_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                         HQ, HK, stride_t, stride_cs, stride_qot, stride_qoh,
                         stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch, eps,
                         HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                         PAGE_SIZE: tl.constexpr, HAS_NORM: tl.constexpr, FAST_MATH: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Grid (T,). One program takes one token's fused qkv row [Hq + 2 Hkv heads of 2 x HALF]: q and k heads get
    their RMSNorm (Qwen3; HAS_NORM) and the neox rotation, q goes to q_out, k and v to the paged cache at the
    token's slot (slot -1: padded graph row, nothing stored). Rounding points are the unfused path's: the normed
    head rounded to the activation dtype, the rotation in fp32 rounded once. Bound by HBM bytes (the row read once,
    q and k/v written once) and, at decode, by launch latency: it replaces up to six launches (q norm, k norm,
    their copies of strided views, RoPE, KV store)."""
    t = tl.program_id(0).to(tl.int64)
    dt = q_out_ptr.dtype.element_ty
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + d).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + d).to(tl.float32)[None, :]
    row = qkv_ptr + t * stride_t

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    qm = hq < HQ
    q1 = tl.load(row + hq * (2 * HALF) + d[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(row + hq * (2 * HALF) + HALF + d[None, :], mask=qm, other=0.0).to(tl.float32)
    if HAS_NORM:
        q1, q2 = _norm_halves(q1, q2, qn_ptr, d, eps, HALF, FAST_MATH)
        q1, q2 = q1.to(dt).to(tl.float32), q2.to(dt).to(tl.float32)
    qo = q_out_ptr + t * stride_qot + hq * stride_qoh + d[None, :]
    tl.store(qo, (q1 * cos - q2 * sin).to(dt), mask=qm)
    tl.store(qo + HALF, (q2 * cos + q1 * sin).to(dt), mask=qm)

    slot = tl.load(slot_ptr + t).to(tl.int64)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    hk = tl.arange(0, BLOCK_HK)[:, None]
    km = hk < tl.where(slot >= 0, HK, 0)              # no row of a padded token (slot -1) is stored
    krow = row + HQ * (2 * HALF)
    k1 = tl.load(krow + hk * (2 * HALF) + d[None, :], mask=km, other=0.0).to(tl.float32)
    k2 = tl.load(krow + hk * (2 * HALF) + HALF + d[None, :], mask=km, other=0.0).to(tl.float32)
    if HAS_NORM:
        k1, k2 = _norm_halves(k1, k2, kn_ptr, d, eps, HALF, FAST_MATH)
        k1, k2 = k1.to(dt).to(tl.float32), k2.to(dt).to(tl.float32)
    kc = k_cache_ptr + page * stride_kcb + off * stride_kct + hk * stride_kch + d[None, :]
    kdt = k_cache_ptr.dtype.element_ty
    tl.store(kc, (k1 * cos - k2 * sin).to(dt).to(kdt), mask=km)
    tl.store(kc + HALF, (k2 * cos + k1 * sin).to(dt).to(kdt), mask=km)

    vrow = krow + HK * (2 * HALF)
    vc = v_cache_ptr + page * stride_vcb + off * stride_vct + hk * stride_vch + d[None, :]
    vdt = v_cache_ptr.dtype.element_ty
    v1 = tl.load(vrow + hk * (2 * HALF) + d[None, :], mask=km, other=0.0)
    v2 = tl.load(vrow + hk * (2 * HALF) + HALF + d[None, :], mask=km, other=0.0)
    tl.store(vc, v1.to(vdt), mask=km)
    tl.store(vc + HALF, v2.to(vdt), mask=km)


def _check_qkv(what: str, t: int, width: int, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
               cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None) -> tuple[int, int, int]:
    """The checks of the qkv epilogue's operands, for T tokens of a qkv row ``width`` wide: (Hq, Hkv, head_dim)."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError(f"{what}: q_norm and k_norm go together (Qwen3 has both, Llama neither)")
    hq, hk = int(num_q_heads), int(num_kv_heads)
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{what}: KV cache must be two [num_blocks, block_size, Hkv, D] tensors of one "
                         f"shape; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    d = k_cache.shape[3]
    if k_cache.shape[2] != hk or width != (hq + 2 * hk) * d:
        raise ValueError(f"{what}: qkv {(t, width)} and KV cache {tuple(k_cache.shape)} do not match "
                         f"{hq} q heads, {hk} kv heads of head_dim {d}")
    if hk == 0 or hq % hk:
        raise ValueError(f"{what}: q heads {hq} must be a multiple of kv heads {hk}")
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"{what}: head_dim {d} must be twice a power of two (e.g. 64, 128)")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != d:
        raise ValueError(f"{what}: cos_sin shape {tuple(cos_sin.shape)} must be [max_pos, {d}]")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"{what}: positions {tuple(positions.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} must both be [{t}]")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and tuple(w.shape) != (d,):
            raise ValueError(f"{what}: {name} shape {tuple(w.shape)} must be [{d}]")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"{what}: KV cache head_dim must be contiguous; strides {k_cache.stride()}")
    return hq, hk, d


def qkv_epilogue(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                 cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                 fast_math: bool = False, q_out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The attention block's prologue after the qkv projection, in one launch: qkv [T, (Hq + 2 Hkv) x D] (q, k, v
    heads in that order) -> q [T, Hq, D] normed (q_norm given) and rotated; k normed (k_norm) and rotated and v
    written to the paged cache [num_blocks, block_size, Hkv, D] at slot_mapping [T] (-1 skips). The reference is
    ``TorchBackend.qkv_epilogue`` (rms_norm, rope and store_kv in sequence)."""
    if qkv.dim() != 2:
        raise ValueError(f"qkv_epilogue expects qkv [T, (Hq + 2 Hkv) x D], got shape {tuple(qkv.shape)}")
    t = qkv.shape[0]
    hq, hk, d = _check_qkv("qkv_epilogue", t, qkv.shape[1], num_q_heads, num_kv_heads, positions, cos_sin, k_cache,
                           v_cache, slot_mapping, q_norm, k_norm)
    x = qkv if qkv.stride(1) == 1 else qkv.contiguous()
    cs = cos_sin if cos_sin.stride(1) == 1 else cos_sin.contiguous()
    q_out = _out(q_out, (t, hq, d), x.dtype, x.device, "qkv_epilogue")
    has_norm = q_norm is not None
    grid = (t,)
    if t:
        on = use_pdl(pdl, "qkv_epilogue", x.device)
        _qkv_epilogue_kernel[grid](
            x, q_norm if has_norm else x, k_norm if has_norm else x, positions, cs, slot_mapping, q_out,
            k_cache, v_cache, hq, hk, x.stride(0), cs.stride(0), q_out.stride(0), q_out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), eps,
            HALF=d // 2, BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
            PAGE_SIZE=k_cache.shape[1], HAS_NORM=has_norm, FAST_MATH=bool(fast_math), USE_PDL=on, num_warps=4,
            **launch_options(on))
    counters.record("qkv_epilogue", "fast_math" if fast_math else "precise", grid=grid,
                    variant=("qkv_epilogue", d, has_norm, bool(fast_math)))
    return q_out


@dataclass(frozen=True)
class RopeOut:
    """Where a qkv projection that runs the qkv epilogue in its own epilogue (lever ``fuse_rope``) sends its heads:
    q [T, Hq, D] to a fresh tensor (or ``q_out``), k and v to the paged cache at ``slot_mapping``, with the q/k
    norms (Qwen3), eps and fast_math's rsqrt as ``qkv_epilogue`` takes them."""
    num_q_heads: int
    num_kv_heads: int
    positions: torch.Tensor
    cos_sin: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6
    fast_math: bool = False
    q_out: torch.Tensor | None = None

    def check(self, t: int, width: int, dtype: torch.dtype, device, what: str) -> torch.Tensor:
        """Checks the operands against a projection of T tokens into ``width`` outputs; returns q's buffer. The
        kernel indexes both caches with one set of strides, so they must agree."""
        hq, _, d = _check_qkv(what, t, width, self.num_q_heads, self.num_kv_heads, self.positions, self.cos_sin,
                              self.k_cache, self.v_cache, self.slot_mapping, self.q_norm, self.k_norm)
        if self.k_cache.stride() != self.v_cache.stride():
            raise ValueError(f"{what}: k_cache strides {self.k_cache.stride()} and v_cache strides "
                             f"{self.v_cache.stride()} must agree")
        if self.cos_sin.stride(1) != 1:
            raise ValueError(f"{what}: cos_sin needs a unit column stride, got strides {self.cos_sin.stride()}")
        return _out(self.q_out, (t, hq, d), dtype, device, what)

    def head_tiles(self, block_n: int, what: str) -> int:
        """The tiles of BLOCK_N rows one head spans (its last arrival runs the head); BLOCK_N must divide D."""
        d = self.k_cache.shape[3]
        if d % block_n:
            raise ValueError(f"{what}: rope needs whole heads per tile group: head_dim {d} is not a multiple of the "
                             f"config's BLOCK_N={block_n}")
        return d // block_n

    def kernel_args(self, q: torch.Tensor) -> tuple:
        """The ROPE kernels' runtime arguments, pos_ptr through rope_eps in their order; q [T, Hq, D] is q's buffer
        (the kernel's y_ptr). Both caches take the k cache's strides (check requires them equal)."""
        norm = self.q_norm is not None
        return (self.positions, self.cos_sin, self.cos_sin.stride(0), self.slot_mapping,
                self.q_norm if norm else q, self.k_norm if norm else q, self.k_cache, self.v_cache,
                self.num_q_heads, self.num_kv_heads, q.stride(0), q.stride(1), *self.k_cache.stride()[:3], self.eps)

    def constexprs(self) -> dict:
        """The ROPE kernels' constexprs: HALF is half the head dim, PAGE_SIZE the cache's block size."""
        return dict(ROPE=True, HALF=self.k_cache.shape[3] // 2, PAGE_SIZE=self.k_cache.shape[1],
                    ROPE_NORM=self.q_norm is not None, ROPE_FAST=bool(self.fast_math))


def rope_kernel_args(rope: RopeOut | None, y: torch.Tensor) -> tuple:
    """rope.kernel_args(y), or without rope the placeholders: y for every pointer, zero counts and strides (but y's
    row stride as stride_qot) and RopeOut's default eps."""
    if rope is not None:
        return rope.kernel_args(y)
    return (y, y, 0, y, y, y, y, y, 0, 0, y.stride(0), 0, 0, 0, 0, RopeOut.eps)


def rope_constexprs(rope: RopeOut | None) -> dict:
    """rope.constexprs(), or without rope ROPE off and the kernels' defaults for the rest."""
    if rope is not None:
        return rope.constexprs()
    return dict(ROPE=False, HALF=1, PAGE_SIZE=1, ROPE_NORM=False, ROPE_FAST=False)


@triton.jit
def _qkv_head(ws_ptr, head, SPLIT_K, offs_m, row_mask, pos_ptr, cs_ptr, stride_cs, slot_ptr, qn_ptr, kn_ptr,
              q_out_ptr, k_cache_ptr, v_cache_ptr, HQ, HK, stride_qot, stride_qoh, stride_cb, stride_ct, stride_ch, eps,
              HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, PAGE_SIZE: tl.constexpr,
              HAS_NORM: tl.constexpr, FAST_MATH: tl.constexpr):
    """The qkv epilogue of one head for a projection's tokens (lever ``fuse_rope``), run by the last program of the
    head's tiles and splits to arrive: the head's two halves [BLOCK_M, HALF] from the split-K workspace (each tile
    in split order, epilogue._head_sums), rounded to the activation dtype as the projection's output is, for tokens
    offs_m (row_mask: the real ones). Head ``head`` < HQ is a q head (normed with qn, rotated, stored to q_out
    [T, HQ, D]); < HQ + HK a k head (normed with kn, rotated, stored to the paged cache at the token's slot; slot -1
    stores nothing); else a v head (stored as it is). Rounding points and expressions are _qkv_epilogue_kernel's,
    one token per row instead of one head per row."""
    dt = q_out_ptr.dtype.element_ty
    x1 = _head_sums(ws_ptr, head, 0, SPLIT_K, HALF, BLOCK_N, BLOCK_M).to(dt).to(tl.float32)
    x2 = _head_sums(ws_ptr, head, HALF, SPLIT_K, HALF, BLOCK_N, BLOCK_M).to(dt).to(tl.float32)
    d = tl.arange(0, HALF)
    m = offs_m.to(tl.int64)
    if head < HQ + HK:
        pos = tl.load(pos_ptr + m, mask=row_mask, other=0).to(tl.int64)
        cs = cs_ptr + pos[:, None] * stride_cs + d[None, :]
        cos = tl.load(cs, mask=row_mask[:, None], other=0.0).to(tl.float32)
        sin = tl.load(cs + HALF, mask=row_mask[:, None], other=0.0).to(tl.float32)
        if head < HQ:
            if HAS_NORM:
                x1, x2 = _norm_halves(x1, x2, qn_ptr, d, eps, HALF, FAST_MATH)
                x1, x2 = x1.to(dt).to(tl.float32), x2.to(dt).to(tl.float32)
            qo = q_out_ptr + m[:, None] * stride_qot + head * stride_qoh + d[None, :]
            tl.store(qo, (x1 * cos - x2 * sin).to(dt), mask=row_mask[:, None])
            tl.store(qo + HALF, (x2 * cos + x1 * sin).to(dt), mask=row_mask[:, None])
        else:
            if HAS_NORM:
                x1, x2 = _norm_halves(x1, x2, kn_ptr, d, eps, HALF, FAST_MATH)
                x1, x2 = x1.to(dt).to(tl.float32), x2.to(dt).to(tl.float32)
            slot = tl.load(slot_ptr + m, mask=row_mask, other=-1).to(tl.int64)
            km = (row_mask & (slot >= 0))[:, None]
            slot = tl.where(slot >= 0, slot, 0)
            kc = k_cache_ptr + ((slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct
                                + (head - HQ) * stride_ch)[:, None] + d[None, :]
            kdt = k_cache_ptr.dtype.element_ty
            tl.store(kc, (x1 * cos - x2 * sin).to(dt).to(kdt), mask=km)
            tl.store(kc + HALF, (x2 * cos + x1 * sin).to(dt).to(kdt), mask=km)
    else:
        slot = tl.load(slot_ptr + m, mask=row_mask, other=-1).to(tl.int64)
        vm = (row_mask & (slot >= 0))[:, None]
        slot = tl.where(slot >= 0, slot, 0)
        vc = v_cache_ptr + ((slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_ct
                            + (head - HQ - HK) * stride_ch)[:, None] + d[None, :]
        vdt = v_cache_ptr.dtype.element_ty
        tl.store(vc, x1.to(vdt), mask=vm)
        tl.store(vc + HALF, x2.to(vdt), mask=vm)


# --------------------------------------------------------------------------------------------------------------
# greedy argmax
# --------------------------------------------------------------------------------------------------------------


# One program walking a 151,936-wide row took 19 us a step at c1 on the H200 (decode-2026-12-02-wave-profile.md:
# 304 KB at 16 GB/s, one SM's worth of loads in flight): rows are split across programs until about one wave
# of the device's SMs is busy, each program keeps its slice's (max, lowest index) and the last to arrive of a
# row's programs reduces them. Exact whatever the split: the maximum and the lowest index reaching it do not
# depend on how the row is cut, so the token is the same at every batch size (and so batch-invariant).
ARGMAX_SPLIT_BLOCK = 2048        # logits per load of a split program (4 warps)
ARGMAX_MAX_SPLITS = 128          # the reducer's one load: a power of two
ARGMAX_MAX_PARTIALS = 4096       # B x S of a split launch: its rows' counters and partials live in a fixed buffer
_ARGMAX_STATE: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _lowest_max(v, idx, V):
    """The (value, index) torch.argmax picks among ``v`` at indices ``idx``: a NaN if there is one (value NaN, its
    lowest index), else the max and the lowest index reaching it. ``V`` stands for "no index" (masked lanes hold
    -inf at index V or beyond)."""
    nan = v != v
    m = tl.max(tl.where(nan, -float("inf"), v), axis=0)
    i = tl.min(tl.where(v == m, idx, V), axis=0)
    i_nan = tl.min(tl.where(nan, idx, V), axis=0)
    return tl.where(i_nan < V, float("nan"), m), tl.where(i_nan < V, i_nan, i)


@triton.jit
def _argmax_kernel(logits_ptr, out_ptr, part_val_ptr, part_idx_ptr, lock_ptr, V, stride_b, CHUNK,
                   BLOCK_V: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (B, S). Program (b, s) scans logits [s x CHUNK, min(V, (s + 1) x CHUNK)) of row b in BLOCK_V chunks,
    keeping the running max and the lowest index reaching it (a later chunk replaces it only when strictly
    greater), as torch.argmax does; a NaN counts as larger than everything, +inf included, again as torch.argmax
    (the first NaN is kept). S = 1 (not SPLIT): that is the row's token. SPLIT: the slice's (max, index) goes to
    the partials [B, S] and the last of the row's S programs to arrive reduces them the same way (slices in
    order, so the lowest index on ties) and resets the row's arrival counter for the next launch and every
    CUDA-graph replay. Bound by HBM bytes (V x 2 or 4 B per row) once S x B programs keep the SMs' loads in
    flight."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    lo = s * CHUNK
    hi = tl.minimum(V, lo + CHUNK)
    offs = tl.arange(0, BLOCK_V)
    best_val = -float("inf")
    best_idx = lo
    pdl_wait(USE_PDL)
    for start in range(lo, hi, BLOCK_V):
        idx = start + offs
        v = tl.load(logits_ptr + b * stride_b + idx, mask=idx < hi, other=-float("inf")).to(tl.float32)
        m, i = _lowest_max(v, idx, V)
        # a NaN kept stays; a chunk's NaN, or a strictly larger max, replaces; the first chunk always does
        take = (best_val == best_val) & ((m != m) | (m > best_val) | (start == lo))
        best_idx = tl.where(take, i, best_idx)
        best_val = tl.where(take, m, best_val)
    pdl_launch_dependents(USE_PDL)
    if not SPLIT:
        tl.store(out_ptr + b, best_idx.to(tl.int64))
    else:
        S = tl.num_programs(1)
        tl.store(part_val_ptr + b * S + s, best_val)
        tl.store(part_idx_ptr + b * S + s, best_idx)
        # the memory order of the decode attention's fused merge (attention.py, _decode_kernel): every thread's
        # partial before one thread's release add; the last arrival's acquire swap (back to 0 for the next launch)
        # and a barrier before its threads load the partials, through L2 (.cg)
        tl.debug_barrier()
        if tl.atomic_add(lock_ptr + b, 1, sem="release", scope="gpu") == S - 1:
            tl.atomic_xchg(lock_ptr + b, 0, sem="acquire", scope="gpu")
            tl.debug_barrier()
            js = tl.arange(0, BLOCK_S)
            vals = tl.load(part_val_ptr + b * S + js, mask=js < S, other=-float("inf"), cache_modifier=".cg")
            idxs = tl.load(part_idx_ptr + b * S + js, mask=js < S, other=V, cache_modifier=".cg")
            tl.store(out_ptr + b, _lowest_max(vals, idxs, V)[1].to(tl.int64))


def argmax_splits(b: int, v: int, num_sms: int) -> int:
    """Programs per row: enough that the B x S programs fill about one wave of ``num_sms`` SMs, each with at least
    one ARGMAX_SPLIT_BLOCK of the row and none empty, at most ARGMAX_MAX_SPLITS; 1 (a row per program) once the
    batch alone fills the SMs. Depends on (B, V, SMs) alone, so a CUDA graph replays the split it captured."""
    s = min(num_sms // max(b, 1), triton.cdiv(v, ARGMAX_SPLIT_BLOCK), ARGMAX_MAX_SPLITS,
            ARGMAX_MAX_PARTIALS // max(b, 1))
    return triton.cdiv(v, _argmax_chunk(v, s)) if s > 1 else 1


def _argmax_chunk(v: int, splits: int) -> int:
    """Logits per split program: whole ARGMAX_SPLIT_BLOCK loads covering the row in ``splits`` slices."""
    return triton.cdiv(triton.cdiv(v, splits), ARGMAX_SPLIT_BLOCK) * ARGMAX_SPLIT_BLOCK


def _argmax_state(device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A device's split-argmax buffers: the rows' arrival counters (zeroed once, reset by each row's reducer, so
    every later launch and CUDA-graph replay finds them zero) and the B x S partials (max, index). Allocated at
    first use, outside graph capture (the engine samples eagerly), and reused: no allocation per step. One stream
    at a time per device: two argmax launches running at once on two streams would share them."""
    key = str(device)
    state = _ARGMAX_STATE.get(key)
    if state is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("argmax: first call on this device inside a CUDA-graph capture; call it once "
                               "eagerly first (its counters must be zeroed outside the graph)")
        state = _ARGMAX_STATE[key] = (torch.zeros(ARGMAX_MAX_PARTIALS, dtype=torch.int32, device=device),
                                      torch.empty(ARGMAX_MAX_PARTIALS, dtype=torch.float32, device=device),
                                      torch.empty(ARGMAX_MAX_PARTIALS, dtype=torch.int32, device=device))
    return state


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None, pdl: bool = False,
           num_sms: int | None = None) -> torch.Tensor:
    """Greedy token ids: argmax over the last dim of logits [B, V], lowest index on ties; int64 [B]. A row is split
    across argmax_splits programs (``num_sms`` stands in for the device's SM count)."""
    if logits.dim() != 2:
        raise ValueError(f"argmax expects logits [B, V], got shape {tuple(logits.shape)}")
    lg = logits if logits.stride(1) == 1 else logits.contiguous()
    b, v = lg.shape
    out = _out(out, (b,), torch.int64, lg.device, "argmax")
    splits = argmax_splits(b, v, sm_count(lg.device) if num_sms is None else num_sms) if b and v else 1
    if splits > 1:
        block, chunk, warps = ARGMAX_SPLIT_BLOCK, _argmax_chunk(v, splits), 4
        locks, part_val, part_idx = _argmax_state(lg.device)
    else:
        block = min(8192, triton.next_power_of_2(max(v, 16)))
        chunk, part_val, part_idx, locks, warps = v, out, out, out, 8
    grid = (b, splits)
    if b and v:
        on = use_pdl(pdl, "argmax", lg.device)
        _argmax_kernel[grid](lg, out, part_val, part_idx, locks, v, lg.stride(0), chunk, BLOCK_V=block,
                             SPLIT=splits > 1, BLOCK_S=max(16, triton.next_power_of_2(splits)), USE_PDL=on,
                             num_warps=warps, **launch_options(on))
    counters.record("argmax", "default", grid=grid, variant=("argmax", block, splits))
    return out
