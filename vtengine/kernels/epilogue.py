"""What the GEMMs of decode share after (and before) their K loop: the W4A16 GEMM (w4a16.py) and the bf16 GEMV
(gemv.py) tile a gate_up weight the same way for SiLU-mul (lever ``fuse_silu``), add the residual and write the
tiles' sums of squares in their epilogue and apply RMSNorm from those sums (lever ``fuse_norm``), sum split-K
partials with one set of arrival counters per device, and gather a head's sums across its tiles for the qkv
epilogue (lever ``fuse_rope``).
"""
from __future__ import annotations

from dataclasses import dataclass

import vtengine.kernels  # noqa: F401  (sets TRITON_INTERPRET on CPU hosts before triton is imported)

import torch
import triton
import triton.language as tl


@triton.jit
def _tile_rows(pid_n, N, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr):
    """The W rows of output tile pid_n and their mask. SILU_MUL: W is gate_up [N = 2I, K]; tile row j < BLOCK_N / 2
    is gate row c + j and row BLOCK_N / 2 + j the matching up row I + c + j (c = pid_n * BLOCK_N / 2), so the
    tile's epilogue holds both halves of outputs c .. c + BLOCK_N / 2 - 1."""
    if SILU_MUL:
        HALF: tl.constexpr = BLOCK_N // 2
        tile_j = tl.arange(0, BLOCK_N)
        col = pid_n * HALF + tile_j % HALF                     # the output column (gate row) of tile row j
        return tl.where(tile_j < HALF, col, N // 2 + col), col < N // 2
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        return offs_n, offs_n < N


@triton.jit
def _epilogue(acc, SILU_MUL: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """The output tile from the fp32 accumulator [R, C]: itself, or (SILU_MUL) silu(gate) * up of its two row
    halves, [R / 2, C]."""
    if SILU_MUL:
        halves = tl.permute(tl.reshape(acc, [2, R // 2, C]), (1, 2, 0))      # [R / 2, C, 2]: (gate, up)
        gate, up = tl.split(halves)
        return gate / (1.0 + tl.exp(-gate)) * up
    else:
        return acc


@triton.jit
def _sum_sq_out(ss_ptr, vals, mask, pid_n, BLOCK_M: tl.constexpr):
    """ADD_RES's second output: the tile's sum of squares of its stored (rounded) outputs per token, at
    ss[pid_n, m]; rows past M and columns past N count 0. Summed in fp64, where the squares of bf16 values (16
    significant bits) add exactly unless they span more than about 2**32: the order of the sum, which Triton's
    layout sets and the W4A16 tiles' BLOCK_M (8 or 16 by batch size) changes, then cannot change the fp32 bits, so
    a token's norm does not depend on the tokens beside it (batch invariance)."""
    v = vals.to(tl.float64)
    ss = tl.sum(tl.where(mask, v * v, 0.0), axis=0)
    tl.store(ss_ptr + pid_n * BLOCK_M + tl.arange(0, BLOCK_M), ss.to(tl.float32))


@triton.jit
def _finish(acc, y_ptrs, y_mask, res, ss_ptr, pid_n, SILU_MUL: tl.constexpr, ADD_RES: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Store the output tile from the fp32 sums: SiLU-mul (SILU_MUL), or plus the residual (ADD_RES: ``res``, the
    residual tile _residual_tile loaded before the K loop; the new residual, rounded once, and its sums of squares
    for the next GEMV's RMSNorm), or as they are."""
    if ADD_RES:
        out = (acc + res.to(tl.float32)).to(y_ptrs.dtype.element_ty)
        tl.store(y_ptrs, out, mask=y_mask)
        _sum_sq_out(ss_ptr, out, y_mask, pid_n, BLOCK_M)
    else:
        tl.store(y_ptrs, _epilogue(acc, SILU_MUL, BLOCK_N, BLOCK_M).to(y_ptrs.dtype.element_ty), mask=y_mask)


@triton.jit
def _residual_tile(res_ptrs, y_mask, ADD_RES: tl.constexpr):
    """ADD_RES's residual tile, for _finish: loaded before the K loop, so its latency hides behind the weight stream
    instead of sitting between the last sums and the store (the previous kernel wrote it: load it after any
    griddepcontrol.wait). Without ADD_RES a placeholder nothing reads."""
    if ADD_RES:
        return tl.load(res_ptrs, mask=y_mask, other=0.0)
    else:
        return 0.0


@triton.jit
def _norm_ss(ss_in_ptr, n_ss_in, offs_m, BLOCK_M: tl.constexpr, SS_BLOCK: tl.constexpr, NORM: tl.constexpr):
    """NORM's operand: the producer's n_ss_in tiles of sums of squares [SS_BLOCK, BLOCK_M], loaded before the K
    loop (after any griddepcontrol.wait) and reduced by _norm_inv after it, so the load's latency hides behind the
    weight stream instead of delaying its start. Without NORM a placeholder nothing reads."""
    if NORM:
        t = tl.arange(0, SS_BLOCK)
        return tl.load(ss_in_ptr + t[:, None] * BLOCK_M + offs_m[None, :], mask=(t < n_ss_in)[:, None], other=0.0)
    else:
        return 0.0


@triton.jit
def _norm_inv(ss, K, eps, FAST_MATH: tl.constexpr):
    """NORM's scale: rsqrt(mean(x^2) + eps) per token from _norm_ss's tiles, summed in fp64 (as _sum_sq_out:
    exact for sums within about 2**22 of each other, so the same fp32 bits whatever the layout, the batch size or
    the replay)."""
    ms = tl.sum(ss.to(tl.float64), axis=0).to(tl.float32) / K
    if FAST_MATH:
        return tl.math.rsqrt(ms + eps)
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(ms + eps))


@triton.jit
def _arrive(ws_part_ptrs, acc, lock_ptr, owner, arrivals):
    """Split-K: store this program's fp32 partial and count in on ``owner``'s arrival counter (a tile's, or a head's
    under fuse_rope); whether this program arrived last of ``arrivals``, and so finishes the owner's output. The
    barrier puts every thread's partial before the release (acq_rel: the last one sees every partial stored)."""
    tl.store(ws_part_ptrs, acc)
    tl.debug_barrier()
    return tl.atomic_add(lock_ptr + owner, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def _head_sums(ws_ptr, head, r0, SPLIT_K, HALF: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows r0 .. r0 + HALF - 1 of one head's fp32 sums, [BLOCK_M, HALF] (token, row), from the split-K workspace
    [tiles, SPLIT_K, BLOCK_N x BLOCK_M] (the swap-AB layout of both GEMMs) of the head's 2 * HALF / BLOCK_N tiles:
    each tile's splits summed in split order, as the per-tile reducer sums them (the same fp32 bits). For the last
    program of a head to arrive (lever ``fuse_rope``)."""
    r = r0 + tl.arange(0, HALF)
    tile = head * (2 * HALF // BLOCK_N) + r // BLOCK_N
    base = ws_ptr + tile.to(tl.int64) * SPLIT_K * (BLOCK_N * BLOCK_M) + (r % BLOCK_N) * BLOCK_M
    ptrs = base[None, :] + tl.arange(0, BLOCK_M)[:, None]
    total = tl.load(ptrs, cache_modifier=".cg")
    for s in range(1, SPLIT_K):
        total += tl.load(ptrs + s * (BLOCK_N * BLOCK_M), cache_modifier=".cg")
    return total


@dataclass(frozen=True)
class NormIn:
    """The RMSNorm a GEMV applies to its input (lever ``fuse_norm``): the producer's sums of squares (linear_add's
    second output, [tiles, MAX_M] fp32), the norm weight [K], eps, and the lever fast_math's rsqrt. ``gained``: the
    GEMV's x is already x * weight (gemv.linear_add_gain's third output), so its K loop does not multiply by it
    (the bf16 GEMV only; the W4A16 GEMM multiplies in its K loop)."""
    ss: torch.Tensor
    weight: torch.Tensor
    eps: float
    fast_math: bool = False
    gained: bool = False


def check_fused(what: str, m: int, n: int, k: int, bm: int, tiles: int, norm: NormIn | None,
                residual: torch.Tensor | None, ss_out: torch.Tensor | None, dtype: torch.dtype) -> None:
    """The launchers' checks of fuse_norm's operands (the kernels index them unmasked where the shapes promise):
    norm's sums of squares fp32 [producer tiles, bm] row-major and its weight [k] contiguous; the residual [m, n]
    of the output's dtype with unit column stride, with ss_out fp32 [tiles, bm] contiguous."""
    if norm is not None:
        ss, g = norm.ss, norm.weight
        if ss.dim() != 2 or ss.shape[1] != bm or ss.dtype != torch.float32 or ss.stride() != (bm, 1):
            raise ValueError(f"{what}: norm needs sums of squares fp32 [tiles, {bm}], row-major, got "
                             f"{ss.dtype} {tuple(ss.shape)} strides {tuple(ss.stride())}")
        if g.shape != (k,) or g.stride() != (1,):
            raise ValueError(f"{what}: norm needs a contiguous weight [{k}], got {tuple(g.shape)} strides "
                             f"{tuple(g.stride())}")
    if residual is not None:
        if tuple(residual.shape) != (m, n) or residual.dtype != dtype or residual.stride(1) != 1:
            raise ValueError(f"{what}: residual must be [{m}, {n}] {dtype} with unit column stride, got "
                             f"{tuple(residual.shape)} {residual.dtype} strides {tuple(residual.stride())}")
        if ss_out is None or tuple(ss_out.shape) != (tiles, bm) or ss_out.dtype != torch.float32 or \
                not ss_out.is_contiguous():
            got = "none" if ss_out is None else f"{ss_out.dtype} {tuple(ss_out.shape)}"
            raise ValueError(f"{what}: a residual needs ss_out fp32 [{tiles}, {bm}] contiguous, got {got}")


_LOCKS: dict[str, torch.Tensor] = {}
MAX_SPLIT_K_TILES = 8192


def _split_k_locks(device, tiles: int) -> torch.Tensor:
    """The split-K arrival counters of a device: zeroed once, reset to zero by the last program of each tile, so
    the buffer is reusable by every later launch (and by CUDA-graph replays). Allocated at first use: make the
    first split-K call outside graph capture."""
    if tiles > MAX_SPLIT_K_TILES:
        raise ValueError(f"split-K over {tiles} output tiles; at most {MAX_SPLIT_K_TILES} (use SPLIT_K=1)")
    key = str(device)
    locks = _LOCKS.get(key)
    if locks is None:
        locks = _LOCKS[key] = torch.zeros(MAX_SPLIT_K_TILES, dtype=torch.int32, device=device)
    return locks
