"""Attention over the paged KV cache: the KV store, causal varlen prefill, split-KV decode and its LSE merge.

The contract and the oracle are vtengine/backends/torch_backend.py: k_cache, v_cache
[num_blocks, block_size, num_kv_heads, head_dim]; block_tables [B, max_blocks] int32, -1 padded; context_lens [B]
int32 = tokens in the cache per sequence, this step's included (they were stored first, by ``store_kv``).

Decode is two stages. Stage 1 cuts each sequence's context into ``num_splits`` slices and gives each slice its own
program, which writes a partial output normalised by its own softmax sum and that sum's log-sum-exp; stage 2 merges
the slices (weights exp(lse_s - max lse)). With one split stage 1 writes the output directly and stage 2 is skipped.
Three levers shape it:

- ``gqa_swap`` (route): one kernel, two grids. OFF "per_q_head": grid (B, q_heads, splits), one q head per
  program (the M tile of tl.dot padded around it, as FlashAttention's unswapped decode pads its M block), so a
  kv group's K/V is read by each of its q heads (L2 may absorb some of that). ON "gqa_swap": grid
  (B, kv_heads, splits), the group's q heads are the M rows of the tile (padded to 16, masked), K/V read once per
  group (FlashAttention's seqlenq_ngroups_swapped).
- ``nsplits_cap``: the split count, vtengine/kernels/splits.py.
- ``fast_math`` (a constexpr, its own binary): ON = scores scaled by scale*log2(e) and exponentiated with exp2
  (``ex2.approx``), the normalisation by an approximate reciprocal (``rcp.approx``); OFF = libdevice's precise
  ``expf``/``logf`` and IEEE round-to-nearest division. Under the interpreter both use numpy (there are no
  approximate instructions there), so the two variants differ only by the log2(e) folding.

Slices are per sequence: sequence b's slice length is cdiv(cdiv(ctx_b, S), BLOCK_N) * BLOCK_N tokens, so every
split of a long sequence has work whatever the batch's other lengths; trailing slices of a short sequence can be
empty and are skipped (partial = 0, lse = -inf). The result depends only on (S, ctx_b), and S depends only on host
shapes (B, heads, ``max_context_len`` or the block table width), so eager and CUDA-graphed decode agree bitwise.

Every launch records a counter (vtengine/counters.py): kernel, route, grid, split count and compiled variant.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vtengine import counters
from vtengine.kernels import INTERPRET, dot_dtype
from vtengine.kernels.splits import decode_num_splits, sm_count

import triton  # noqa: E402  (after vtengine.kernels: it sets TRITON_INTERPRET on CPU hosts)
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634

# -- math variants (fast_math) ---------------------------------------------------------------------------------
# tl.exp/tl.log on fp32 lower to ex2.approx/lg2.approx on NVIDIA, so the precise variant calls libdevice. The
# interpreter cannot run libdevice or inline PTX; there numpy's exp/log/divide stand in for both variants.
if INTERPRET:
    @triton.jit
    def _exp(x):
        return tl.exp(x)

    @triton.jit
    def _log(x):
        return tl.log(x)

    @triton.jit
    def _rcp_approx(x):
        return 1.0 / x
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)

    @triton.jit
    def _log(x):
        return libdevice.log(x)

    @triton.jit
    def _rcp_approx(x):
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _softmax_exp(x, FAST_MATH: tl.constexpr):
    """exp of a (scaled, max-subtracted) score: exp2 when the scale already carries log2(e)."""
    if FAST_MATH:
        return tl.exp2(x)
    else:
        return _exp(x)


@triton.jit
def _softmax_log(x, FAST_MATH: tl.constexpr):
    """The log that matches _softmax_exp (log2 in the fast variant: the LSE lives in base-2 units there)."""
    if FAST_MATH:
        return tl.log2(x)
    else:
        return _log(x)


@triton.jit
def _normalize(acc, denom, FAST_MATH: tl.constexpr):
    """acc / denom, denom already broadcast to acc's shape."""
    if FAST_MATH:
        return acc * _rcp_approx(denom)
    else:
        return tl.math.div_rn(acc, denom)


@triton.jit
def _dot(a, b, DOT_IEEE: tl.constexpr):
    # fp32 operands on a GPU would default to tf32; the engine's fp32 configurations want fp32 products
    if DOT_IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# -- KV store --------------------------------------------------------------------------------------------------
# grid (T, num_kv_heads); one program copies one head_dim row of k and of v into its slot.
# Bound: bytes, 2 x T x Hkv x D x elt read and written; a no-op program for slot -1 (padded graph rows).
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs_d, mask=d_mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs_d, mask=d_mask)
    tl.store(k_cache_ptr + page * stride_kcb + off * stride_kct + h * stride_kch + offs_d,
             k.to(k_cache_ptr.dtype.element_ty), mask=d_mask)
    tl.store(v_cache_ptr + page * stride_vcb + off * stride_vct + h * stride_vch + offs_d,
             v.to(v_cache_ptr.dtype.element_ty), mask=d_mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the paged cache at flat slots (block * block_size + offset); slot -1 skips."""
    t, hkv, d = k.shape
    _check_cache(k_cache, v_cache, hkv, d)
    if v.shape != k.shape or slot_mapping.shape != (t,):
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} must be [T, Hkv, D], [T, Hkv, D] and [T]")
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    if t == 0:
        return
    grid = (t, hkv)
    _store_kv_kernel[grid](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), PAGE_SIZE=k_cache.shape[1],
        num_warps=1 if d <= 128 else 2)
    counters.record("store_kv", "paged", grid=grid)


# -- prefill ---------------------------------------------------------------------------------------------------
# grid (cdiv(T, BLOCK_M) + B, q_heads): the first axis enumerates (sequence, BLOCK_M-row tile) pairs of the varlen
# batch; sum_b cdiv(q_len_b, BLOCK_M) <= cdiv(T, BLOCK_M) + B, and each program finds its pair from cu_seqlens on
# the device (a cumsum over the B tile counts), so the launch needs no host sync; surplus programs exit at once.
# Tiles: Q [BLOCK_M, D] kept in registers, K/V [BLOCK_N, D] gathered through the block table; keys up to the
# tile's last causal position (a cached prefix included). Bound: FLOPs for long prompts (4 x q_len x ctx x D per
# head, halved by causality), K/V re-read once per Q tile.
@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_ptr, context_lens_ptr, block_tables_ptr, out_ptr,
                    qk_scale, num_seqs,
                    stride_qt, stride_qh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    FAST_MATH: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr):
    tile_id = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP

    # which (sequence, tile) this program is: tiles are numbered sequence by sequence
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < num_seqs
    lo = tl.load(cu_seqlens_ptr + offs_b, mask=b_mask, other=0)
    hi = tl.load(cu_seqlens_ptr + offs_b + 1, mask=b_mask, other=0)
    n_tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(n_tiles, 0)
    seq = tl.sum((tiles_end <= tile_id).to(tl.int32), 0)
    if seq >= num_seqs:
        return
    tile = tile_id - tl.sum(tl.where(offs_b == seq, tiles_end - n_tiles, 0), 0)

    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    pos = ctx - q_len + offs_m                      # absolute position of each query row
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = tl.minimum(ctx, ctx - q_len + (tile + 1) * BLOCK_M)    # one past the tile's last causal key
    bt_row = block_tables_ptr + seq * stride_bt
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        k = tl.load(k_cache_ptr + (page * stride_kb + in_page * stride_kt + kvh * stride_kh)[:, None]
                    + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        qk = _dot(q, tl.trans(k.to(DOT_DTYPE)), DOT_IEEE) * qk_scale
        # key 0 is visible to every row, so each row's running max is finite after the first tile
        qk = tl.where((offs_n[None, :] <= pos[:, None]) & n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = _softmax_exp(m_i - m_new, FAST_MATH)
        p = _softmax_exp(qk - m_new[:, None], FAST_MATH)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + (page * stride_vb + in_page * stride_vt + kvh * stride_vh)[:, None]
                    + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), DOT_IEEE)
        m_i = m_new

    o = _normalize(acc, tl.zeros_like(acc) + l_i[:, None], FAST_MATH)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@dataclass(frozen=True)
class Tiles:
    """Launch meta-parameters of one kernel: BLOCK_M rows (prefill), BLOCK_N KV tokens per step, warps, stages.

    programs_per_sm (decode): how many programs of this configuration one SM must hold to keep enough K/V bytes
    in flight; the split heuristic's wave is SMs x programs_per_sm (FlashAttention-2 passes 2 x SMs for its
    128-thread split-KV blocks for the same reason)."""
    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 16
    programs_per_sm: int = 1


if INTERPRET:   # the interpreter runs every program in numpy: few, large-ish tiles keep it fast
    PREFILL_TILES = Tiles(block_m=16, block_n=16, num_warps=1, num_stages=1)
    DECODE_TILES = {"per_q_head": Tiles(block_n=16, num_warps=1, num_stages=1),
                    "gqa_swap": Tiles(block_n=16, num_warps=1, num_stages=1)}
else:
    PREFILL_TILES = Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2)
    # Decode, measured on an H200 (bench/results/attention-explore-2026-11-30-h200.json: 6 tile configs x 7 forced
    # split counts x 6 shapes per route): BLOCK_N 64 / 4 warps / 2 stages is within a few % of the best config at
    # every shape for both routes, and the fastest split counts put ~512 programs in flight (about 4 per SM:
    # one program alone keeps too few K/V bytes in flight to stream HBM), hence programs_per_sm = 4.
    DECODE_TILES = {"per_q_head": Tiles(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4),
                    "gqa_swap": Tiles(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4)}


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      fast_math: bool = False, tiles: Tiles | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal varlen attention of the new tokens q [T, Hq, D] over the paged cache (which already holds them).
    Sequence b's new tokens are q[cu[b]:cu[b+1]]; its query i sits at position context_lens[b] - q_len_b + i.
    ``out`` [T, Hq, D] (q's dtype), if given, is written in place and returned."""
    t, hq, d = q.shape
    b = cu_seqlens_q.shape[0] - 1
    hkv = _check_cache(k_cache, v_cache, None, d)
    _check_heads(hq, hkv)
    if context_lens.shape != (b,) or block_tables.shape[0] != b:
        raise ValueError(f"prefill_attention: cu_seqlens_q {tuple(cu_seqlens_q.shape)} gives {b} sequences but "
                         f"context_lens is {tuple(context_lens.shape)} and block_tables {tuple(block_tables.shape)}")
    q = _last_dim_contiguous(q)
    out = _output(out, q, "prefill_attention")
    if t == 0 or b == 0:
        return out
    meta = tiles or PREFILL_TILES
    fast_math = bool(fast_math)
    ddt = dot_dtype(q)
    grid = (triton.cdiv(t, meta.block_m) + b, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out,
        scale * LOG2E if fast_math else scale, b,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=meta.block_m, BLOCK_N=meta.block_n, BLOCK_B=max(2, triton.next_power_of_2(b)),
        PAGE_SIZE=k_cache.shape[1], FAST_MATH=fast_math, DOT_DTYPE=ddt, DOT_IEEE=ddt == tl.float32,
        num_warps=meta.num_warps, num_stages=meta.num_stages)
    counters.record("prefill_attention", "paged_causal", grid=grid, variant=_variant(fast_math))
    return out


# -- decode stage 1 (both routes) ----------------------------------------------------------------------------
# grid (B, q_heads, S) with ROWS = 1 (per_q_head) or (B, kv_heads, S) with ROWS = GROUP (gqa_swap). Program
# (b, g, s) takes q heads g*ROWS .. g*ROWS+ROWS-1 as the rows of a Q tile [BLOCK_M = max(16, pow2(ROWS)), D]
# (rows past ROWS masked: tl.dot needs M >= 16, and FlashAttention's unswapped decode likewise pads its M tile
# around one query row), and walks slice s of sequence b's context in K, V tiles [BLOCK_N, D] gathered through
# the block table: S = Q K^T [BLOCK_M, BLOCK_N], O += P V, both by tl.dot with fp32 accumulation.
# Bound: bytes. gqa_swap reads each K/V byte once per group; per_q_head once per q head (GROUP x the bytes from
# L2/HBM); when S > 1 each row also writes a partial (D + 1) x 4 bytes, read back by the merge.
@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                   out_ptr, o_part_ptr, lse_part_ptr,
                   qk_scale, num_splits, num_q_heads,
                   stride_qb, stride_qh,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_bt, stride_ob, stride_oh,
                   GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   SPLIT: tl.constexpr, FAST_MATH: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr):
    b = tl.program_id(0)
    head0 = tl.program_id(1) * ROWS
    kvh = head0 // GROUP
    s = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
    start = s * split_len
    end = tl.minimum(start + split_len, ctx)

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < ROWS
    heads = head0 + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        # V is loaded next to K, before the scores need K: both tiles are in flight together (decode is bound
        # by the bytes in flight per SM, not by the math)
        k = tl.load(k_cache_ptr + (page * stride_kb + in_page * stride_kt + kvh * stride_kh)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + (page * stride_vb + in_page * stride_vt + kvh * stride_vh)[:, None]
                    + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = _dot(q, tl.trans(k.to(DOT_DTYPE)), DOT_IEEE) * qk_scale
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = _softmax_exp(m_i - m_new, FAST_MATH)
        p = _softmax_exp(qk - m_new[:, None], FAST_MATH)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), DOT_IEEE)
        m_i = m_new

    out_mask = m_mask[:, None] & d_mask[None, :]
    if SPLIT:
        has_keys = l_i > 0.0                 # an empty trailing slice: partial 0 with weight exp(-inf) = 0
        l_safe = tl.where(has_keys, l_i, 1.0)
        o = _normalize(acc, tl.zeros_like(acc) + l_safe[:, None], FAST_MATH)
        lse = tl.where(has_keys, m_i + _softmax_log(l_safe, FAST_MATH), float("-inf"))
        rows = (b * num_q_heads + heads) * num_splits + s
        tl.store(o_part_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
        tl.store(lse_part_ptr + rows, lse, mask=m_mask)
    else:
        o = _normalize(acc, tl.zeros_like(acc) + l_i[:, None], FAST_MATH)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)


# -- decode stage 2: LSE merge -------------------------------------------------------------------------------
# grid (B, q_heads). Tiles: the S log-sum-exps [BLOCK_S] once for their max, then partials [CHUNK_S, D] in chunks.
# Bound: bytes, B x Hq x S x (D + 1) x 4 read, B x Hq x D written; it exists only when S > 1.
@triton.jit
def _decode_merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, num_splits,
                         stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         CHUNK_S: tl.constexpr, FAST_MATH: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(lse_part_ptr + row0 + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    lse_max = tl.max(lse_all, 0)       # finite: slice 0 always holds key 0 (context_len >= 1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_D], tl.float32)
    denom = 0.0
    for s0 in range(0, num_splits, CHUNK_S):
        offs_c = s0 + tl.arange(0, CHUNK_S)
        c_mask = offs_c < num_splits
        lse = tl.load(lse_part_ptr + row0 + offs_c, mask=c_mask, other=float("-inf"))
        w = _softmax_exp(lse - lse_max, FAST_MATH)
        o = tl.load(o_part_ptr + (row0 + offs_c)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=c_mask[:, None] & d_mask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
        denom += tl.sum(w, 0)
    out = _normalize(acc, tl.zeros_like(acc) + denom, FAST_MATH)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, gqa_swap: bool = False, nsplits_cap="off",
                     fast_math: bool = False, num_splits: int | None = None, max_context_len: int | None = None,
                     num_sms: int | None = None,
                     tiles: Tiles | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One new token per sequence: q [B, Hq, D] attends to its whole cached context; returns [B, Hq, D].

    gqa_swap:        route, see the module docstring.
    nsplits_cap:     "off" | "auto" | N, see vtengine/kernels/splits.py.
    fast_math:       the exp2/approximate-reciprocal binary.
    num_splits:      force the split count (tests, benches); None = the heuristic under nsplits_cap.
    num_sms:         the SM count the split heuristic assumes (None: the device's); the engine passes a small
                     virtual count under the CPU interpreter, which walks every program one by one.
    max_context_len: host-side upper bound on context_lens that sizes the heuristic; None = the block table's
                     width x block_size. It never changes which keys are read, only how many splits.
    tiles:           override the launch meta-parameters (benches).
    out:             [B, Hq, D] in q's dtype, written in place and returned (static buffers, poisoned tests).
    """
    bsz, hq, d = q.shape
    hkv = _check_cache(k_cache, v_cache, None, d)
    _check_heads(hq, hkv)
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or context_lens.shape != (bsz,):
        raise ValueError(f"decode_attention: q is {tuple(q.shape)}, so block_tables must be [{bsz}, max_blocks] and "
                         f"context_lens [{bsz}]; got {tuple(block_tables.shape)} and {tuple(context_lens.shape)}")
    q = _last_dim_contiguous(q)
    out = _output(out, q, "decode_attention")
    if bsz == 0:
        return out
    route = "gqa_swap" if gqa_swap else "per_q_head"
    meta = tiles or DECODE_TILES[route]
    grid_heads = hkv if gqa_swap else hq
    page_size = k_cache.shape[1]
    if num_splits is None:
        bound = max_context_len if max_context_len is not None else block_tables.shape[1] * page_size
        # Batch-invariant: the split count depends on one sequence's programs (its heads) and the context bound,
        # never on the batch size, so a request's tokens do not depend on which requests share its batch (the
        # campaign's async_parity gate compares served against in-process tokens; with batch-dependent splits a
        # concurrent arrival order changed bf16 near-ties). Larger batches pay in more, smaller split programs.
        num_splits = decode_num_splits(grid_heads, triton.cdiv(max(1, int(bound)), meta.block_n), nsplits_cap,
                                       num_sms=(num_sms or sm_count(q.device)) * meta.programs_per_sm)
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"decode_attention: num_splits {num_splits!r} must be a positive integer (or None)")
    split = num_splits > 1
    fast_math = bool(fast_math)
    if split:
        o_part = torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=q.device)
        lse_part = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out        # unused: the kernel's SPLIT=False binary never touches them
    qk_scale = scale * LOG2E if fast_math else scale
    block_d = max(16, triton.next_power_of_2(d))
    common = (q.stride(0), q.stride(1),
              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
              block_tables.stride(0), out.stride(0), out.stride(1))
    group = hq // hkv
    rows = group if gqa_swap else 1
    ddt = dot_dtype(q)
    grid = (bsz, grid_heads, num_splits)
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, o_part, lse_part,
        qk_scale, num_splits, hq, *common,
        GROUP=group, ROWS=rows, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=meta.block_n, PAGE_SIZE=page_size, SPLIT=split, FAST_MATH=fast_math,
        DOT_DTYPE=ddt, DOT_IEEE=ddt == tl.float32,
        num_warps=meta.num_warps, num_stages=meta.num_stages)
    counters.record("decode_attention", route, grid=grid, splits=num_splits, variant=_variant(fast_math))
    if split:
        block_s = triton.next_power_of_2(num_splits)
        merge_grid = (bsz, hq)
        _decode_merge_kernel[merge_grid](
            o_part, lse_part, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s, CHUNK_S=min(block_s, 16), FAST_MATH=fast_math,
            num_warps=4 if d >= 128 else 2)
        counters.record("decode_attention_merge", route, grid=merge_grid, splits=num_splits,
                        variant=_variant(fast_math))
    return out


# -- launch helpers --------------------------------------------------------------------------------------------
def _variant(fast_math: bool) -> str:
    return "fast_math" if fast_math else "precise"


def _output(out: torch.Tensor | None, q: torch.Tensor, op: str) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"{op}: out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous last dim; "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device} strides {out.stride()}")
    return out


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, num_kv_heads: int | None, head_dim: int) -> int:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"KV cache must be two [num_blocks, block_size, num_kv_heads, head_dim] tensors of one "
                         f"shape; got k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)}")
    if k_cache.shape[3] != head_dim or (num_kv_heads is not None and k_cache.shape[2] != num_kv_heads):
        raise ValueError(f"KV cache {tuple(k_cache.shape)} does not match head_dim {head_dim}"
                         + (f" and num_kv_heads {num_kv_heads}" if num_kv_heads is not None else ""))
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError(f"KV cache head_dim must be contiguous; strides are {k_cache.stride()} and "
                         f"{v_cache.stride()}")
    return k_cache.shape[2]


def _check_heads(hq: int, hkv: int) -> None:
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads {hq} must be a multiple of kv heads {hkv}")
