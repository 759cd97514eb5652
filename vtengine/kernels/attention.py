"""Attention over the paged KV cache: the KV store, causal varlen prefill, split-KV decode and its LSE merge.

The contract and the oracle are vtengine/backends/torch_backend.py: k_cache, v_cache
[num_blocks, block_size, num_kv_heads, head_dim]; block_tables [B, max_blocks] int32, -1 padded; context_lens [B]
int32 = tokens in the cache per sequence, this step's included (they were stored first, by ``store_kv``).

Decode is split-KV. Stage 1 cuts each sequence's context into ``num_splits`` slices and gives each slice its own
program, which writes a partial output normalised by its own softmax sum and that sum's log-sum-exp; the merge
combines the slices (weights exp(lse_s - max lse), read in split order). By default the merge is fused into stage 1
(one launch): after storing its partials each program bumps an arrival counter for its (sequence, grid head), and
the program that arrives last zeroes the counter (so the buffer is clean again for the next launch and every CUDA
graph replay) and merges every q head that (sequence, grid head) covers. ``fused_merge=False`` launches
the merge as a second kernel instead; both call one merge function, whose sum over the splits runs in split order
(not as a tl.sum tree, whose order follows the register layout Triton picks for the kernel it is compiled into), so
the two forms are bitwise equal. With one split stage 1 writes the output directly and there is no merge.

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

Slices are per sequence, and the split rule (the lever ``split_rule``, vtengine/kernels/splits.py) fixes them:
sequence b's slice length is max(cdiv(cdiv(ctx_b, S), BLOCK_N) * BLOCK_N, MIN_SPLIT) tokens for S partial slots,
where "off" (the count rule) takes S from the split heuristic over the context bound and MIN_SPLIT = MIN_SPLIT_TILES
tiles, and "len<L>" takes S = cdiv(bound, L) and MIN_SPLIT = L (every slice L tokens). Sequence b has n_live =
cdiv(ctx_b, slice length) live slices; each is its own online softmax written to its own slot, and the merge reads
the live ones only. The grid's third dimension holds G <= S programs per (sequence, grid head), program s walking
slices s, s + G, ...: G follows the batch (about one wave of programs), and changes no bit, since a slice's
arithmetic is the same whichever program runs it. With G < S a program runs its slices as one loop over their key
tiles (_walk_slices: one software pipeline across slice boundaries, each slice's softmax restarted at its first
tile). The result depends only on (S, MIN_SPLIT, ctx_b), never on the batch: decode is batch-invariant, eager and
CUDA-graphed decode agree bitwise, and under "len<L>" the bound does not matter either.

Every launch records a counter (vtengine/counters.py): kernel, route, grid, split count and compiled variant. The
merge records ``decode_attention_merge`` in either form (so a reader sees the split outputs merged): as its own
launch with grid (B, q_heads) and the math variant, or fused with grid (B, grid heads), the merging programs, and
the variant suffixed "/fused_merge" (no launch of its own). The stage-1 variant is the math variant alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vtengine import counters
from vtengine.kernels import INTERPRET, dot_dtype
from vtengine.kernels.pdl import launch_options, pdl_launch_dependents, pdl_wait, use_pdl
from vtengine.kernels.splits import parse_cap, parse_split_rule, sm_count, split_plan, wave_programs

import triton  # noqa: E402  (after vtengine.kernels: it sets TRITON_INTERPRET on CPU hosts)
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634
# A decode slice holds at least this many KV tiles: a short context in a launch sized for a long bound gets few
# full slices instead of many one-tile ones (each slice costs a program, a partial and a merge step).
MIN_SPLIT_TILES = 2

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
def _varlen_tile(cu_seqlens_ptr, num_seqs, tile_id, TILE: tl.constexpr, BLOCK_B: tl.constexpr):
    """(sequence, tile within it) of program ``tile_id`` when every sequence's new tokens are cut into TILE-token
    tiles numbered sequence by sequence; sequence == num_seqs for a surplus program (the caller returns)."""
    offs_b = tl.arange(0, BLOCK_B)
    b_mask = offs_b < num_seqs
    lo = tl.load(cu_seqlens_ptr + offs_b, mask=b_mask, other=0)
    hi = tl.load(cu_seqlens_ptr + offs_b + 1, mask=b_mask, other=0)
    n_tiles = (hi - lo + TILE - 1) // TILE
    tiles_end = tl.cumsum(n_tiles, 0)
    seq = tl.sum((tiles_end <= tile_id).to(tl.int32), 0)
    tile = tile_id - tl.sum(tl.where(offs_b == seq, tiles_end - n_tiles, 0), 0)
    return seq, tile


@triton.jit
def _softmax_update(qk, v, m_i, l_i, acc, FAST_MATH: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    DOT_IEEE: tl.constexpr):
    """One key tile of the online softmax: scores qk [M, N] (scaled, masked) and values v [N, D] folded into the
    running max m_i, sum l_i and unnormalised output acc."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = _softmax_exp(m_i - m_new, FAST_MATH)
    p = _softmax_exp(qk - m_new[:, None], FAST_MATH)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), DOT_IEEE)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_ptr, context_lens_ptr, block_tables_ptr, out_ptr,
                    qk_scale, num_seqs,
                    stride_qt, stride_qh,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    stride_bt, stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, PAGE_SIZE: tl.constexpr,
                    FAST_MATH: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr):
    h = tl.program_id(1)
    kvh = h // GROUP
    seq, tile = _varlen_tile(cu_seqlens_ptr, num_seqs, tl.program_id(0), BLOCK_M, BLOCK_B)
    if seq >= num_seqs:
        return

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
        v = tl.load(v_cache_ptr + (page * stride_vb + in_page * stride_vt + kvh * stride_vh)[:, None]
                    + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        m_i, l_i, acc = _softmax_update(qk, v, m_i, l_i, acc, FAST_MATH, DOT_DTYPE, DOT_IEEE)

    o = _normalize(acc, tl.zeros_like(acc) + l_i[:, None], FAST_MATH)
    tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# grid (cdiv(T, BLOCK_T) + B, kv_heads): the gqa_pack route. One program holds BLOCK_T tokens x the GROUP q heads
# of one kv head as the M rows of its tiles (token-major: row r is token r // GROUP_P2, q head r % GROUP_P2, heads
# padded to a power of two and masked), so each K/V tile is loaded once per group instead of once per q head, and
# the MMA's M is BLOCK_T x GROUP_P2 (128 by default) rather than 64. The key loop runs in two parts: keys every row
# sees (below the tile's first position, whole BLOCK_N tiles) with no mask at all, then the diagonal tiles with the
# causal mask; with a long cached prefix nearly every tile is in the first part. Same arithmetic per row as the
# per-q-head kernel (online softmax over keys in the same BLOCK_N order), so the two agree to rounding.
# SPLIT (the lever prefill_splits): grid (.., .., S); program s walks slice s of the first part (whole BLOCK_N
# tiles, cdiv(keys, S) each) and slice 0's program the diagonal tiles too, each writing an fp32 partial and its
# log-sum-exp, merged in slice order by _prefill_merge_kernel. A short chunk over a long prefix fills the GPU so.
@triton.jit
def _prefill_packed_kernel(q_ptr, k_cache_ptr, v_cache_ptr, cu_seqlens_ptr, context_lens_ptr, block_tables_ptr,
                           out_ptr, o_part_ptr, lse_part_ptr, qk_scale, num_seqs, num_splits, num_q_heads,
                           stride_qt, stride_qh,
                           stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                           stride_bt, stride_ot, stride_oh,
                           GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_B: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                           FAST_MATH: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr):
    BLOCK_M: tl.constexpr = BLOCK_T * GROUP_P2
    kvh = tl.program_id(1)
    seq, tile = _varlen_tile(cu_seqlens_ptr, num_seqs, tl.program_id(0), BLOCK_T, BLOCK_B)
    if seq >= num_seqs:
        return

    q_start = tl.load(cu_seqlens_ptr + seq)
    q_len = tl.load(cu_seqlens_ptr + seq + 1) - q_start
    ctx = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    offs_t = tile * BLOCK_T + rows // GROUP_P2          # the row's token within the sequence's new tokens
    g = rows % GROUP_P2                                  # the row's q head within the group
    row_mask = (offs_t < q_len) & (g < GROUP)
    pos = ctx - q_len + offs_t
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_off = (q_start + offs_t).to(tl.int64) * stride_qt + (kvh * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :],
                other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_pos = ctx - q_len + tile * BLOCK_T                         # the tile's first query position
    kv_end = tl.minimum(ctx, first_pos + BLOCK_T)                    # one past the tile's last causal key
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N                  # keys [0, full_end): seen by every row
    lo = 0
    hi = full_end
    diag_end = kv_end
    if SPLIT:       # this program's slice of the unmasked keys; split 0 also takes the diagonal tiles
        s = tl.program_id(2)
        slice_len = tl.cdiv(tl.cdiv(full_end, num_splits), BLOCK_N) * BLOCK_N
        lo = tl.minimum(s * slice_len, full_end)
        hi = tl.minimum(lo + slice_len, full_end)
        diag_end = tl.where(s == 0, kv_end, full_end)
    bt_row = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kvh * stride_kh
    v_base = v_cache_ptr + kvh * stride_vh
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        page = tl.load(bt_row + offs_n // PAGE_SIZE).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        k = tl.load(k_base + (page * stride_kb + in_page * stride_kt)[:, None] + offs_d[None, :],
                    mask=d_mask[None, :], other=0.0)
        qk = _dot(q, tl.trans(k.to(DOT_DTYPE)), DOT_IEEE) * qk_scale
        v = tl.load(v_base + (page * stride_vb + in_page * stride_vt)[:, None] + offs_d[None, :],
                    mask=d_mask[None, :], other=0.0)
        m_i, l_i, acc = _softmax_update(qk, v, m_i, l_i, acc, FAST_MATH, DOT_DTYPE, DOT_IEEE)
    for start_n in range(full_end, diag_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_page = offs_n % PAGE_SIZE
        k = tl.load(k_base + (page * stride_kb + in_page * stride_kt)[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        qk = _dot(q, tl.trans(k.to(DOT_DTYPE)), DOT_IEEE) * qk_scale
        # key 0 is visible to every row, so each row's running max is finite after the first tile
        qk = tl.where((offs_n[None, :] <= pos[:, None]) & n_mask[None, :], qk, float("-inf"))
        v = tl.load(v_base + (page * stride_vb + in_page * stride_vt)[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        m_i, l_i, acc = _softmax_update(qk, v, m_i, l_i, acc, FAST_MATH, DOT_DTYPE, DOT_IEEE)

    if SPLIT:       # the slice's partial; an empty slice (s > 0 past full_end) writes o = 0, lse = -inf
        seen = l_i > 0
        o = _normalize(acc, tl.zeros_like(acc) + tl.where(seen, l_i, 1.0)[:, None], FAST_MATH)
        part = ((q_start + offs_t).to(tl.int64) * num_q_heads + kvh * GROUP + g) * num_splits + s
        tl.store(o_part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], o,
                 mask=row_mask[:, None] & d_mask[None, :])
        tl.store(lse_part_ptr + part, tl.where(seen, m_i + _softmax_log(tl.where(seen, l_i, 1.0), FAST_MATH),
                                               float("-inf")), mask=row_mask)
    else:
        o = _normalize(acc, tl.zeros_like(acc) + l_i[:, None], FAST_MATH)
        o_off = (q_start + offs_t).to(tl.int64) * stride_ot + (kvh * GROUP + g) * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & d_mask[None, :])


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
    PREFILL_PACKED_TILES = PREFILL_PACKED_TILES_SHORT = Tiles(block_m=16, block_n=16, num_warps=1, num_stages=1)
    DECODE_TILES = {"per_q_head": Tiles(block_n=16, num_warps=1, num_stages=1),
                    "gqa_swap": Tiles(block_n=16, num_warps=1, num_stages=1)}
else:
    PREFILL_TILES = Tiles(block_m=64, block_n=64, num_warps=4, num_stages=2)
    # gqa_pack: block_m counts rows (tokens x padded group), 128 = 32 tokens x 4 q heads for Qwen3-8B. From the tile
    # sweep of ``vtengine bench prefill-attention`` on the H200 (bench/results/prefill-attention-2026-12-01-h200.md):
    # 128 rows x 128 keys, 8 warps, 2 stages is the fastest wherever the step is long (2048 new tokens at a 30k
    # prefix: 3.32 ms, 314 TFLOP/s, against 4.84 ms for the per-q-head kernel and 2.94 ms for SDPA), but 2.3x slower
    # than 64 x 64 / 4 warps / 3 stages on a short step (512 tokens, no prefix: 0.064 against 0.028 ms), which is
    # within 4-10% of the best elsewhere: steps of at most PACKED_SHORT_TOKENS new tokens take the short tiles.
    PREFILL_PACKED_TILES = Tiles(block_m=128, block_n=128, num_warps=8, num_stages=2)
    PREFILL_PACKED_TILES_SHORT = Tiles(block_m=64, block_n=64, num_warps=4, num_stages=3)
    # Decode, measured on an H200 (bench/results/attention-explore-2026-11-30-h200.json: 6 tile configs x 7 forced
    # split counts x 6 shapes per route): BLOCK_N 64 / 4 warps / 2 stages is within a few % of the best config at
    # every shape for both routes, and the fastest split counts put ~512 programs in flight (about 4 per SM:
    # one program alone keeps too few K/V bytes in flight to stream HBM), hence programs_per_sm = 4.
    DECODE_TILES = {"per_q_head": Tiles(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4),
                    "gqa_swap": Tiles(block_n=64, num_warps=4, num_stages=2, programs_per_sm=4)}

PACKED_SHORT_TOKENS = 1024      # gqa_pack: steps of at most this many new tokens take PREFILL_PACKED_TILES_SHORT
# prefill_splits "auto": a wave is SMs x this many packed programs (the short tiles' 82,944 B of shared memory fit
# twice in the 228 KB of an SM: H100 2026-12-06, test_gpu_packed_prefill_tiles_fit_the_programs_per_sm_they_claim)
PREFILL_PROGRAMS_PER_SM = 2
# The sweep above ran with fast math off. With it on (the lever fast_math, on by default) one more stage pays at every
# step length measured (bench/results/prefill-attention-variants-2026-12-06-hbm3.md, H100, the engine's kernel at
# explicit tiles): exp2 and the approximate reciprocal leave the registers a third stage of K and V tiles needs. At
# fast math every packed step takes these: 512 new tokens after a 32k prefix 0.716 ms against 0.804 at the short
# tiles (SDPA 0.915), 2048 after 30k 2.650 against 3.151 at 2 stages, 8192 new 1.393 against 1.626. The stages
# sweep (prefill-attention-stages-2026-12-06-hbm3.md, 11 shapes) agrees but at 128 new tokens after 32k, where 64 x
# 128 / 4 warps takes 0.567 ms against 0.721 (a prompt's last partial chunk: splits over the prefix fix that shape).
# Their ~165 KB of shared memory fit once per SM, where PREFILL_PROGRAMS_PER_SM counts two (PACKED_PROGRAMS_PER_SM).
# (A block of its own: the decode tiles' block above is part of the decode levers' sources, which this must not
# stale.)
PREFILL_PACKED_TILES_FAST = PREFILL_PACKED_TILES if INTERPRET else Tiles(block_m=128, block_n=128, num_warps=8,
                                                                          num_stages=3)
# prefill_splits "auto" sizes its wave by the packed programs of a tile set one SM holds: PREFILL_PROGRAMS_PER_SM
# unless listed here (a GPU test checks each claim against the compiled kernels' shared memory and registers; on the
# H100 2026-12-06 the long tiles took 163,840 B and the fast-math ones 164,864 B, 255 registers a thread: one a SM)
PACKED_PROGRAMS_PER_SM = {} if INTERPRET else {PREFILL_PACKED_TILES: 1, PREFILL_PACKED_TILES_FAST: 1}


def packed_programs_per_sm(tiles: Tiles) -> int:
    """How many packed prefill programs of ``tiles`` one SM holds at once."""
    return PACKED_PROGRAMS_PER_SM.get(tiles, PREFILL_PROGRAMS_PER_SM)


def parse_prefill_splits(value) -> str | int:
    """The lever ``prefill_splits``: "off", "auto" or a forced split count >= 1 (an int or its digits)."""
    if isinstance(value, str) and value.strip().lower() in ("off", "auto"):
        return value.strip().lower()
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value.strip())
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"prefill_splits {value!r} is not accepted; accepted: 'off', 'auto' or a split count >= 1")


PREFILL_MAX_SPLITS = 16
# prefill_splits "auto" picks S by the wave model (wave_speedup). The H100 sweep of 2026-12-06 (bench/results/
# prefill-attention-splits-2026-12-06-hbm3.md, 128-640 new tokens after a 32k prefix, S = 2-16, fast-math tiles)
# measured x0.82-0.91 of the model's speed-up at S <= 6 and x0.73-0.85 at 8 and 16 (the merge, the partials' bytes):
# a split pays only where the model promises x1.3 or more, counts past 8 add nothing 8 does not, and of counts
# within 5% of the model's best the smallest merges least.
PREFILL_AUTO_MAX_SPLITS = 8
PREFILL_AUTO_MIN_GAIN = 1.3
PREFILL_AUTO_NEAR_BEST = 0.95


def wave_speedup(programs: int, splits: int, wave: int) -> float:
    """The wave model of splitting the keys: ``programs`` programs of equal length, each cut into ``splits`` slices,
    run in rounds of ``wave`` at once, so off takes ceil(P / W) rounds of whole walks and S slices ceil(P x S / W)
    rounds of 1/S of one: the speed-up is their ratio (the merge and the partials' bytes left out)."""
    programs, wave = max(1, programs), max(1, wave)
    return -(-programs // wave) / (-(-programs * splits // wave) / splits)


def packed_tokens_per_tile(tiles: Tiles, group: int) -> int:
    """New tokens one packed prefill program takes: its ``block_m`` rows (16 at least, for tl.dot) hold every q head
    of a token, a group padded to a power of two."""
    group_p2 = triton.next_power_of_2(group)
    return max(tiles.block_m, group_p2, 16) // group_p2


def prefill_split_count(splits, programs: int, wave: int) -> int:
    """Slices of the cached-prefix keys per (token tile, kv head) program. "auto", for a grid of at most one
    ``wave`` (SMs x the programs the tiles fit per SM) of ``programs`` (the tiles that can hold tokens, x kv heads):
    the wave model's pick, the smallest S <= PREFILL_AUTO_MAX_SPLITS within PREFILL_AUTO_NEAR_BEST of its best
    speed-up, if that best is PREFILL_AUTO_MIN_GAIN or more, else 1. A short chunk over a long prefix is the case:
    128 tokens at 32k are 32 programs on 132 SMs (S=4, x3.28 on the H100), 384 are 96 (S=4, x1.17). A grid past one
    wave is not split, though the model would gain there for a lone chunk (576 tokens after 32k: S=6, x1.46): the
    count cannot see the prefix, and past a wave at the default 512-token chunks is a whole, fresh prompt with
    nothing to split (512 new tokens, no prefix: S=2 x0.78 of off) or a chunk whose second round is the light
    programs of the prompts beside it (512 + 73 tokens: the chunk's 128 fill one round; 512 after 32k split 4 ways:
    x0.84). The rule until 2026-12-06 ("about two waves" under one) split 384 and 448 into 3 (x0.91, x0.90: slower
    than off). A count depends on the launch shape alone (T, B, heads), never on the contexts, so a CUDA-graphed
    chunk replays the split it was captured with."""
    splits = parse_prefill_splits(splits)
    if splits == "off":
        return 1
    if splits == "auto":
        if programs > wave:
            return 1
        gains = {s: wave_speedup(programs, s, wave) for s in range(1, PREFILL_AUTO_MAX_SPLITS + 1)}
        best = max(gains.values())
        if best < PREFILL_AUTO_MIN_GAIN:
            return 1
        return min(s for s, gain in gains.items() if gain >= PREFILL_AUTO_NEAR_BEST * best)
    return splits


def packed_tiles(t: int, fast_math: bool) -> Tiles:
    """The packed route's tiles for a step of ``t`` new tokens (every sequence's together)."""
    if fast_math:
        return PREFILL_PACKED_TILES_FAST
    return PREFILL_PACKED_TILES_SHORT if t <= PACKED_SHORT_TOKENS else PREFILL_PACKED_TILES


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      fast_math: bool = False, tiles: Tiles | None = None,
                      out: torch.Tensor | None = None, gqa_pack: bool = False, splits="off",
                      num_sms: int | None = None) -> torch.Tensor:
    """Causal varlen attention of the new tokens q [T, Hq, D] over the paged cache (which already holds them).
    Sequence b's new tokens are q[cu[b]:cu[b+1]]; its query i sits at position context_lens[b] - q_len_b + i.
    ``out`` [T, Hq, D] (q's dtype), if given, is written in place and returned. ``gqa_pack`` (the lever
    ``prefill_gqa_pack``): one program per (token tile, kv head) with the group's q heads packed into its rows,
    K/V loaded once per group; off: one program per (token tile, q head). ``splits`` (the lever
    ``prefill_splits``, gqa_pack only): "off" | "auto" | N slices of the keys every row of a tile sees, each its
    own program and partial (fp32 output and log-sum-exp), merged in slice order by a second launch
    (prefill_split_count; ``num_sms`` stands in for the device's SM count)."""
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
    fast_math = bool(fast_math)
    ddt = dot_dtype(q)
    splits = parse_prefill_splits(splits)
    if gqa_pack:
        meta = tiles or packed_tiles(t, fast_math)
        return _prefill_packed(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, fast_math,
                               meta, out, hkv, ddt, splits, num_sms)
    meta = tiles or PREFILL_TILES
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
    counters.record("prefill_attention", "paged_causal", grid=grid, splits=1, variant=_variant(fast_math))
    return out


def _prefill_packed(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale, fast_math, meta, out,
                    hkv, ddt, splits="off", num_sms=None) -> torch.Tensor:
    t, hq, d = q.shape
    b = cu_seqlens_q.shape[0] - 1
    group = hq // hkv
    group_p2 = triton.next_power_of_2(group)
    block_t = packed_tokens_per_tile(meta, group)
    programs = triton.cdiv(t, block_t) + b          # the launch's bound: a partial tile a sequence, one empty
    wave = (num_sms or sm_count(q.device)) * packed_programs_per_sm(meta)
    n_split = prefill_split_count(splits, (programs - 1) * hkv, wave)      # tiles with tokens: at most this many
    split = n_split > 1
    grid = (programs, hkv, n_split) if split else (programs, hkv)
    if split:
        o_part, lse_part = _split_workspace(t, hq, n_split, d, q.device)
    else:
        o_part = lse_part = out        # unused: the SPLIT=False binary never touches them
    block_d = max(16, triton.next_power_of_2(d))
    _prefill_packed_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out, o_part, lse_part,
        scale * LOG2E if fast_math else scale, b, n_split, hq,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_P2=group_p2, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_T=block_t, BLOCK_N=meta.block_n, BLOCK_B=max(2, triton.next_power_of_2(b)),
        PAGE_SIZE=k_cache.shape[1], SPLIT=split, FAST_MATH=fast_math, DOT_DTYPE=ddt, DOT_IEEE=ddt == tl.float32,
        num_warps=meta.num_warps, num_stages=meta.num_stages)
    counters.record("prefill_attention", "gqa_pack", grid=grid, splits=n_split, variant=_variant(fast_math))
    if split:
        block_s = triton.next_power_of_2(n_split)
        _prefill_merge_kernel[(t, hkv)](
            o_part, lse_part, out, n_split, hq, out.stride(0), out.stride(1),
            GROUP=group, BLOCK_R=group_p2, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s, CHUNK_S=min(block_s, 16),
            FAST_MATH=fast_math, num_warps=4 if d >= 128 else 2)
        counters.record("prefill_attention_merge", "gqa_pack", grid=(t, hkv), splits=n_split,
                        variant=_variant(fast_math))
    return out


# -- decode: slices ---------------------------------------------------------------------------------------------
@triton.jit
def _slice_len(ctx, num_splits, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    """Tokens per slice of a context of ``ctx`` tokens cut for ``num_splits`` slots: the context over the slots, in
    whole tiles, at least MIN_SPLIT. The split rule (vtengine/kernels/splits.py) picks (num_splits, MIN_SPLIT): "count"
    a slot count from the context bound and MIN_SPLIT = two tiles; "len<L>" slots = cdiv(bound, L) and MIN_SPLIT = L,
    so every slice is L tokens long whatever the bound. Either way it depends on this sequence alone."""
    return tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)


@triton.jit
def _attend(q, k_cache_ptr, v_cache_ptr, bt_row, kvh, start, end,
            stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, offs_d, d_mask,
            BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
            FAST_MATH: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr):
    """Online softmax of the tile's rows of q over keys [start, end) of one sequence: (max, sum, unnormalised acc)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, bt_row, kvh, start_n, end, m_i, l_i, acc,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                                     offs_d, d_mask, BLOCK_N, PAGE_SIZE, FAST_MATH, DOT_DTYPE, DOT_IEEE)
    return m_i, l_i, acc


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, bt_row, kvh, start_n, end, m_i, l_i, acc,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, offs_d, d_mask,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, FAST_MATH: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_IEEE: tl.constexpr):
    """One key tile [start_n, start_n + BLOCK_N) (keys from ``end`` on masked) folded into the online softmax state
    (running max m_i, sum l_i, unnormalised output acc)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_mask = offs_n < end
    page = tl.load(bt_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    in_page = offs_n % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    # V is loaded next to K, before the scores need K: both tiles are in flight together (decode is bound by the
    # bytes in flight per SM, not by the math)
    k = tl.load(k_cache_ptr + (page * stride_kb + in_page * stride_kt + kvh * stride_kh)[:, None]
                + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + (page * stride_vb + in_page * stride_vt + kvh * stride_vh)[:, None]
                + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = _dot(q, tl.trans(k.to(DOT_DTYPE)), DOT_IEEE) * qk_scale
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    return _softmax_update(qk, v, m_i, l_i, acc, FAST_MATH, DOT_DTYPE, DOT_IEEE)


@triton.jit
def _walk_slices(q, k_cache_ptr, v_cache_ptr, bt_row, kvh, ctx, s, programs, n_live, split_len, part_rows,
                 o_part_ptr, lse_part_ptr, out_mask, m_mask,
                 stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, offs_d, d_mask,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE_SIZE: tl.constexpr, FAST_MATH: tl.constexpr, DOT_DTYPE: tl.constexpr,
                 DOT_IEEE: tl.constexpr):
    """Slices s, s + programs, ... < n_live (s < n_live) as one loop over their key tiles, so the loads of a
    slice's first tiles are in flight while the slice before it finishes: looping over slices around _attend
    restarts the software pipeline at every slice, which at short contexts and large batches (two tiles per slice,
    several slices per program) leaves few bytes in flight. Each slice is still its own online softmax: the
    running max, sum and output start afresh at its first tile, its tiles are folded in the same order with the
    same arithmetic as _attend, and its partial is written at its last tile, so every bit is _attend's.
    ``part_rows``: the rows' split-0 partial slots."""
    tiles_per = split_len // BLOCK_N                     # split_len is whole tiles (_slice_len)
    mine = tl.cdiv(n_live - s, programs)                 # >= 1 slices
    last = s + (mine - 1) * programs
    total = (mine - 1) * tiles_per + tl.cdiv(tl.minimum(split_len, ctx - last * split_len), BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t in range(0, total):
        k_i = t // tiles_per
        j = t - k_i * tiles_per
        sl = s + k_i * programs
        end = tl.minimum(sl * split_len + split_len, ctx)
        first = j == 0
        m_i = tl.where(first, float("-inf"), m_i)
        l_i = tl.where(first, 0.0, l_i)
        acc = tl.where(first, 0.0, acc)
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, bt_row, kvh, sl * split_len + j * BLOCK_N, end,
                                     m_i, l_i, acc, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                                     stride_vh, qk_scale, offs_d, d_mask, BLOCK_N, PAGE_SIZE, FAST_MATH, DOT_DTYPE,
                                     DOT_IEEE)
        if (j == tiles_per - 1) | (t == total - 1):      # the slice's last tile: its partial
            o = _normalize(acc, tl.zeros_like(acc) + l_i[:, None], FAST_MATH)
            tl.store(o_part_ptr + (part_rows + sl)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
            tl.store(lse_part_ptr + part_rows + sl, m_i + _softmax_log(l_i, FAST_MATH), mask=m_mask)


# -- decode: stage 1 -------------------------------------------------------------------------------------------
# Grid (B, q_heads, G) with ROWS = 1 (per_q_head) or (B, kv_heads, G) with ROWS = GROUP (gqa_swap). Program
# (b, g, s) takes q heads g*ROWS .. g*ROWS+ROWS-1 as the rows of a Q tile [BLOCK_M = max(16, pow2(ROWS)), D]
# (rows past ROWS masked: tl.dot needs M >= 16, and FlashAttention's unswapped decode likewise pads its M tile
# around one query row), and walks slices s, s + G, s + 2G, ... of sequence
# b's live slices (n_live = cdiv(ctx, slice length), at most num_splits), each in K, V tiles [BLOCK_N, D] gathered
# through the block table: S = Q K^T [BLOCK_M, BLOCK_N], O += P V, both by tl.dot with fp32 accumulation. Each slice
# is its own online softmax written to its own partial slot, so which program computes a slice (G) never changes
# a bit of the result. A program with no live slice does nothing but exit: neither a partial nor an arrival.
# Bound: bytes. gqa_swap reads each K/V byte once per group; per_q_head once per q head (GROUP x the bytes from
# L2/HBM); when split each live slice also writes a partial (D + 1) x 4 bytes per row, read back by the merge. With
# FUSED_MERGE the last of the min(G, n_live) working programs of (b, g) to finish also merges the ROWS heads
# (_merge_splits): the merge costs no launch, but every working program one release atomic after its stores, and
# the last one per (b, g) the merge.
@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                   out_ptr, o_part_ptr, lse_part_ptr, arrivals_ptr,
                   qk_scale, num_splits, num_q_heads,
                   stride_qb, stride_qh,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   stride_bt, stride_ob, stride_oh,
                   GROUP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
                   SPLIT: tl.constexpr, FAST_MATH: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, DOT_IEEE: tl.constexpr,
                   FUSED_MERGE: tl.constexpr, MERGE_ROWS: tl.constexpr, BLOCK_S: tl.constexpr,
                   CHUNK_S: tl.constexpr, MIN_SPLIT: tl.constexpr, USE_PDL: tl.constexpr,
                   WALK: tl.constexpr = False):
    b = tl.program_id(0)
    head0 = tl.program_id(1) * ROWS
    kvh = head0 // GROUP
    s = tl.program_id(2)
    programs = tl.num_programs(2)
    pdl_wait(USE_PDL)                        # q, the cache and the lengths come from earlier kernels
    ctx = tl.load(context_lens_ptr + b)

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < ROWS
    heads = head0 + offs_m
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(DOT_DTYPE)
    bt_row = block_tables_ptr + b * stride_bt
    out_mask = m_mask[:, None] & d_mask[None, :]
    if SPLIT:
        split_len = _slice_len(ctx, num_splits, BLOCK_N, MIN_SPLIT)
        n_live = tl.cdiv(ctx, split_len)
        rows0 = (b * num_q_heads + heads) * num_splits
        if WALK:                             # fewer programs than slots: several slices each, one tile loop
            if s < n_live:
                _walk_slices(q, k_cache_ptr, v_cache_ptr, bt_row, kvh, ctx, s, programs, n_live, split_len, rows0,
                             o_part_ptr, lse_part_ptr, out_mask, m_mask,
                             stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale, offs_d,
                             d_mask, HEAD_DIM, BLOCK_M, BLOCK_D, BLOCK_N, PAGE_SIZE, FAST_MATH, DOT_DTYPE,
                             DOT_IEEE)
        else:
            for sl in range(s, n_live, programs):
                start = sl * split_len
                end = tl.minimum(start + split_len, ctx)
                m_i, l_i, acc = _attend(q, k_cache_ptr, v_cache_ptr, bt_row, kvh, start, end,
                                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                                        offs_d, d_mask, BLOCK_M, BLOCK_D, BLOCK_N, PAGE_SIZE, FAST_MATH,
                                        DOT_DTYPE, DOT_IEEE)
                o = _normalize(acc, tl.zeros_like(acc) + l_i[:, None], FAST_MATH)   # a live slice has keys
                lse = m_i + _softmax_log(l_i, FAST_MATH)
                tl.store(o_part_ptr + (rows0 + sl)[:, None] * HEAD_DIM + offs_d[None, :], o, mask=out_mask)
                tl.store(lse_part_ptr + rows0 + sl, lse, mask=m_mask)
        pdl_launch_dependents(USE_PDL)
        if FUSED_MERGE:
            if s < n_live:                   # a working program: it arrives; the last of min(G, n_live) merges
                # Memory ordering (PTX memory model; the interpreter runs programs one by one, so there it is
                # moot):
                # - Release. The partials above are stored by all of this program's threads, while a scalar atomic
                #   is issued by one thread. The barrier makes every thread's stores precede that thread's atomic
                #   (CTA scope), and the atomic's release at gpu scope is cumulative: whoever acquires a count at
                #   or after the one this atomic produced also sees those stores.
                # - Acquire, by the last arrival only. The program that reads old == arrivals - 1 swaps the
                #   counter back to 0 with acquire semantics: it reads the end of the chain of release
                #   read-modify-writes, so it synchronises with all of them and every program's partials
                #   happen-before its merge. The barrier after it extends that order from the issuing thread to
                #   the threads that load the partials. (An acq_rel add in every program would also be correct;
                #   measured on the H200 it cost the programs that do not merge about 11 µs more at batch
                #   32 x 8192, gqa_swap, 64 splits.)
                # - Caches. The merge loads bypass L1 (.cg, in _merge_splits): L2 is the GPU's point of coherence
                #   and L1 is not kept coherent with other SMs' stores, so a line of these partials left in this
                #   SM's L1 by an earlier program (one 128-byte line holds the LSEs of several heads, which other
                #   (b, g) programs on this SM may have merged) must not serve a load. A gpu-scope acquire should
                #   already invalidate L1; .cg does not rely on it, and costs nothing as each partial is read once.
                # - Reset. The swap leaves 0 for the next launch (or graph replay), which the stream starts only
                #   after this one ends; every working program of (b, g) has arrived by then, so nothing else in
                #   this launch touches the counter.
                tl.debug_barrier()
                arrival = arrivals_ptr + b * tl.num_programs(1) + tl.program_id(1)
                old = tl.atomic_add(arrival, 1, sem="release", scope="gpu")
                if old == tl.minimum(programs, n_live) - 1:
                    tl.atomic_xchg(arrival, 0, sem="acquire", scope="gpu")
                    tl.debug_barrier()
                    _merge_splits(o_part_ptr, lse_part_ptr, out_ptr, b, head0, num_q_heads, num_splits, n_live,
                                  stride_ob, stride_oh, ROWS=ROWS, BLOCK_R=MERGE_ROWS, HEAD_DIM=HEAD_DIM,
                                  BLOCK_D=BLOCK_D, BLOCK_S=BLOCK_S, CHUNK_S=CHUNK_S, FAST_MATH=FAST_MATH)
    else:
        m_i, l_i, acc = _attend(q, k_cache_ptr, v_cache_ptr, bt_row, kvh, 0, ctx,
                                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, qk_scale,
                                offs_d, d_mask, BLOCK_M, BLOCK_D, BLOCK_N, PAGE_SIZE, FAST_MATH, DOT_DTYPE, DOT_IEEE)
        pdl_launch_dependents(USE_PDL)
        o = _normalize(acc, tl.zeros_like(acc) + l_i[:, None], FAST_MATH)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)


# -- decode: LSE merge -----------------------------------------------------------------------------------------
# One function for both forms, so their arithmetic is one. Pass 1 loads each head's S log-sum-exps at once
# [BLOCK_R, BLOCK_S], takes their max (exact in any order) and writes the weights w_s = exp(lse_s - max) over the
# LSEs it read (only this program reads them). Pass 2 adds acc = acc + w_s * o_s and denom = denom + w_s for
# s = 0, 1, ..., S - 1, each element on its own: a tl.sum over splits would add in a tree whose shape follows the
# register layout Triton picks, which depends on num_warps and on the kernel around it, so the fused and the
# separate merge could round differently. The CHUNK_S splits of a chunk are unrolled and their loads independent,
# so they are in flight together; only the adds chain.
# Why the weights are precomputed: pass 2's per-split weight [BLOCK_R] then comes straight from a tiny load, which
# Triton places in the row layout of the partial tile, so w_s[:, None] * o_s needs no conversion. Computing
# exp(lse_s - max) inside the loop mixed the max's layout with the load's and cost a shared-memory conversion with
# a CTA barrier at every split, serialising the loads (measured on the H200, fused gqa_swap, 4 heads x 64 splits:
# 12 µs longer at batch 1 x 8192).
@triton.jit
def _merge_splits(o_part_ptr, lse_part_ptr, out_ptr, b, head0, num_q_heads, num_splits, n_live, stride_ob,
                  stride_oh, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, FAST_MATH: tl.constexpr):
    """Merge the n_live partials (of num_splits slots per head) of q heads head0 .. head0 + ROWS - 1 of sequence b
    into out (rows past ROWS of the [BLOCK_R, D] tile are masked). Overwrites the heads' LSEs with their weights.
    Slots past n_live hold nothing of this launch and are never read."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < ROWS
    heads = head0 + offs_r
    row0 = (b * num_q_heads + heads) * num_splits          # each head's split-0 partial row
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = r_mask[:, None] & (offs_s < n_live)[None, :]
    lse = tl.load(lse_part_ptr + row0[:, None] + offs_s[None, :], mask=s_mask, other=float("-inf"),
                  cache_modifier=".cg")
    lse_max = tl.max(lse, 1)           # finite for live heads: slice 0 always holds key 0 (context_len >= 1)
    w = _softmax_exp(lse - tl.where(r_mask, lse_max, 0.0)[:, None], FAST_MATH)
    tl.debug_barrier()                 # every thread (replicas of the tile too) has its LSEs before any is replaced
    tl.store(lse_part_ptr + row0[:, None] + offs_s[None, :], w, mask=s_mask)
    tl.debug_barrier()                 # and the weights are stored before other threads load them below

    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    denom = tl.zeros([BLOCK_R], tl.float32)
    # num_stages=1: plain register loads, never async copies staged in shared memory, which in the fused form
    # would add to every stage-1 program's footprint
    for s0 in tl.range(0, n_live, CHUNK_S, num_stages=1):
        for i in tl.static_range(CHUNK_S):
            # split s0 + i as a vector (the interpreter mis-types a vector mask & a scalar one)
            split = tl.zeros([BLOCK_R], tl.int32) + (s0 + i)
            live = r_mask & (split < n_live)           # past the last live slice: w = 0, o = 0
            w_s = tl.load(lse_part_ptr + row0 + split, mask=live, other=0.0, cache_modifier=".cg")
            o_s = tl.load(o_part_ptr + (row0 + split)[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=live[:, None] & d_mask[None, :], other=0.0, cache_modifier=".cg")
            acc = acc + w_s[:, None] * o_s
            denom = denom + w_s
    out = _normalize(acc, tl.zeros_like(acc) + denom[:, None], FAST_MATH)
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


# The merge as its own launch (fused_merge=False): grid (B, q_heads), one q head per program.
# Bound: bytes, B x Hq x n_live x (D + 1) x 4 read, B x Hq x D written; it exists only when split.
@triton.jit
def _decode_merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, context_lens_ptr, num_splits,
                         stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                         CHUNK_S: tl.constexpr, FAST_MATH: tl.constexpr, BLOCK_N: tl.constexpr,
                         MIN_SPLIT: tl.constexpr, USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    b = tl.program_id(0)
    ctx = tl.load(context_lens_ptr + b)
    n_live = tl.cdiv(ctx, _slice_len(ctx, num_splits, BLOCK_N, MIN_SPLIT))
    _merge_splits(o_part_ptr, lse_part_ptr, out_ptr, b, tl.program_id(1), tl.num_programs(1),
                  num_splits, n_live, stride_ob, stride_oh, ROWS=1, BLOCK_R=1, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
                  BLOCK_S=BLOCK_S, CHUNK_S=CHUNK_S, FAST_MATH=FAST_MATH)


# The split prefill's merge: grid (T, kv_heads), the group's q heads of one token per program, every slot live
# (an empty slice wrote weight-0 partials; slice 0 holds key 0, so each row's max is finite).
# Bound: bytes, T x Hq x S x (D + 1) x 4 read, T x Hq x D written.
@triton.jit
def _prefill_merge_kernel(o_part_ptr, lse_part_ptr, out_ptr, num_splits, num_q_heads, stride_ot, stride_oh,
                          GROUP: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, FAST_MATH: tl.constexpr):
    _merge_splits(o_part_ptr, lse_part_ptr, out_ptr, tl.program_id(0), tl.program_id(1) * GROUP, num_q_heads,
                  num_splits, num_splits, stride_ot, stride_oh, ROWS=GROUP, BLOCK_R=BLOCK_R, HEAD_DIM=HEAD_DIM,
                  BLOCK_D=BLOCK_D, BLOCK_S=BLOCK_S, CHUNK_S=CHUNK_S, FAST_MATH=FAST_MATH)


# -- decode: arrival counters of the fused merge ---------------------------------------------------------------
# One int32 per (sequence, grid head) of a launch, zero between launches: the merging program zeroes its own.
# Cached per device and only grown, outside CUDA-graph capture (the engine's warm-up runs the largest batch
# eagerly before capturing, so capture finds it large enough). A buffer that was replaced stays referenced in
# _RETIRED_ARRIVALS: graphs captured earlier still point at it, and its memory must not be handed to another
# tensor. Launches on one device share the buffer, so they must not overlap in time: calls on one stream (and
# replays of graphs captured on it) are ordered; concurrent decode calls on several streams need
# fused_merge=False.
_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_RETIRED_ARRIVALS: list[torch.Tensor] = []


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    buf = _ARRIVALS.get(device)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # Too small while capturing (a batch larger than any run eagerly before): a fresh zeroed buffer for this
        # call alone, allocated from the graph's pool; its zero fill is captured as a memset node, so every
        # replay starts from zeros. Correct, one memset dearer; not cached, since it belongs to the graph.
        return torch.zeros(n, dtype=torch.int32, device=device)
    if buf is not None:
        _RETIRED_ARRIVALS.append(buf)
    buf = torch.zeros(triton.next_power_of_2(max(n, 1024)), dtype=torch.int32, device=device)
    _ARRIVALS[device] = buf
    return buf


def _split_workspace(bsz: int, hq: int, num_splits: int, d: int, device: torch.device):
    """The partials of a split decode: o_part [B, Hq, S, D] and lse_part [B, Hq, S], fp32 (tests poison them)."""
    return (torch.empty((bsz, hq, num_splits, d), dtype=torch.float32, device=device),
            torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=device))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, gqa_swap: bool = False, nsplits_cap="off",
                     fast_math: bool = False, num_splits: int | None = None, max_context_len: int | None = None,
                     num_sms: int | None = None,
                     tiles: Tiles | None = None, out: torch.Tensor | None = None,
                     fused_merge: bool = True, pdl: bool = False, split_rule: str = "off",
                     grid_splits: int | None = None, wave_grid: bool = False) -> torch.Tensor:
    """One new token per sequence: q [B, Hq, D] attends to its whole cached context; returns [B, Hq, D].

    gqa_swap:        route, see the module docstring.
    nsplits_cap:     "off" | "auto" | N, see vtengine/kernels/splits.py.
    split_rule:      "off" (the split count from the bound) | "len<L>": how a context is cut into slices (the
                     lever split_rule, vtengine/kernels/splits.py).
    fast_math:       the exp2/approximate-reciprocal binary.
    num_splits:      force the slot count under "count" (tests, benches); None = the heuristic under nsplits_cap.
    grid_splits:     force the programs per (sequence, grid head) (tests, benches); it never changes the result,
                     only which program computes which slice. None = the split rule's choice.
    wave_grid:       the lever decode_wave_grid: under the "count" rule, about one wave of programs per launch
                     (splits.wave_programs) instead of one per slot; "len<L>" sizes its grid so already.
    num_sms:         the SM count the split heuristic assumes (None: the device's); the engine passes a small
                     virtual count under the CPU interpreter, which walks every program one by one.
    max_context_len: host-side upper bound on context_lens that sizes the heuristic; None = the block table's
                     width x block_size. It never changes which keys are read, only how many splits.
    tiles:           override the launch meta-parameters (benches).
    out:             [B, Hq, D] in q's dtype, written in place and returned (static buffers, poisoned tests).
    fused_merge:     True: the last split program of each (sequence, grid head) merges (one launch); False: the
                     merge is a second launch. Bitwise equal results; see the module docstring.
    pdl:             the lever pdl (programmatic dependent launch; sm_90+, ignored elsewhere).
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
    min_split = MIN_SPLIT_TILES * meta.block_n
    rule, _length = parse_split_rule(split_rule)
    programs = None
    if num_splits is None:
        bound = max_context_len if max_context_len is not None else block_tables.shape[1] * page_size
        # Batch-invariant either way: the slices depend on one sequence's context, its heads and the bound (under
        # "count") or L (under "len<L>"), never on the batch size, so a request's tokens do not depend on which
        # requests share its batch (the campaign's async_parity gate compares served against in-process tokens;
        # with batch-dependent splits a concurrent arrival order changed bf16 near-ties). Only the number of
        # programs that walk the slices follows the batch, and it changes no bit. Under "count" the heuristic
        # counts the bound in minimum-length slices, so the slot count never exceeds what a context at the bound
        # could fill.
        wave = (num_sms or sm_count(q.device)) * meta.programs_per_sm
        plan = split_plan(split_rule, nsplits_cap, grid_heads, bsz, int(bound), meta.block_n, wave)
        num_splits, min_split, programs = plan.slots, plan.min_split, plan.programs
        # the mechanism gate's proof of nsplits_cap: the cap applied, and "programs/uncapped" (what the rule would
        # have picked without a cap) per launch; and of split_rule: the rule, its slice floor and slots
        counters.record("decode_splits", f"cap={parse_cap(nsplits_cap)}", splits=programs,
                        variant=f"{programs}/{plan.uncapped}")
        counters.record("decode_split_rule", "off" if rule == "count" else f"len{_length}", splits=num_splits,
                        variant=f"min_split={min_split}")
        if wave_grid and rule == "count":
            programs = min(programs, wave_programs(bsz, grid_heads, wave))
        # the mechanism gate's proof of decode_wave_grid: programs per (sequence, grid head) launched / slots
        counters.record("decode_grid", "wave" if wave_grid else "slots", splits=programs,
                        variant=f"{programs}/{num_splits}")
    elif not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"decode_attention: num_splits {num_splits!r} must be a positive integer (or None)")
    elif rule == "length":
        raise ValueError(f"decode_attention: num_splits={num_splits} forces a slot count, which only the 'count' "
                         f"split rule has; split_rule {split_rule!r} fixes the slice length instead")
    if grid_splits is not None:
        if not isinstance(grid_splits, int) or isinstance(grid_splits, bool) or grid_splits < 1:
            raise ValueError(f"decode_attention: grid_splits {grid_splits!r} must be a positive integer (or None)")
        programs = grid_splits
    programs = min(num_splits, programs or num_splits)
    split = num_splits > 1
    fused = split and bool(fused_merge)
    fast_math = bool(fast_math)
    if split:
        o_part, lse_part = _split_workspace(bsz, hq, num_splits, d, q.device)
    else:
        o_part = lse_part = out        # unused: the kernel's SPLIT=False binary never touches them
    # unused unless fused (FUSED_MERGE=False never touches it)
    arrivals = _arrival_counters(q.device, bsz * grid_heads) if fused else lse_part
    qk_scale = scale * LOG2E if fast_math else scale
    block_d = max(16, triton.next_power_of_2(d))
    block_s = triton.next_power_of_2(num_splits)
    chunk_s = min(block_s, 16)
    common = (q.stride(0), q.stride(1),
              k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
              v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
              block_tables.stride(0), out.stride(0), out.stride(1))
    group = hq // hkv
    rows = group if gqa_swap else 1
    ddt = dot_dtype(q)
    grid = (bsz, grid_heads, programs if split else 1)
    on = use_pdl(pdl, "decode_attention", q.device)
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, o_part, lse_part, arrivals,
        qk_scale, num_splits, hq, *common,
        GROUP=group, ROWS=rows, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=meta.block_n, PAGE_SIZE=page_size, SPLIT=split, FAST_MATH=fast_math,
        DOT_DTYPE=ddt, DOT_IEEE=ddt == tl.float32,
        # the merge constexprs stay fixed when unused, so they add no binaries to the unfused variants
        FUSED_MERGE=fused, MERGE_ROWS=triton.next_power_of_2(rows) if fused else 1,
        BLOCK_S=block_s if fused else 1, CHUNK_S=chunk_s if fused else 1, MIN_SPLIT=min_split, USE_PDL=on,
        WALK=split and programs < num_splits, num_warps=meta.num_warps, num_stages=meta.num_stages,
        **launch_options(on))
    counters.record("decode_attention", route, grid=grid, splits=num_splits, variant=_variant(fast_math))
    if fused:
        counters.record("decode_attention_merge", route, grid=(bsz, grid_heads), splits=num_splits,
                        variant=_variant(fast_math) + "/fused_merge")
    elif split:
        merge_grid = (bsz, hq)
        _decode_merge_kernel[merge_grid](
            o_part, lse_part, out, context_lens, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=block_s, CHUNK_S=chunk_s, FAST_MATH=fast_math,
            BLOCK_N=meta.block_n, MIN_SPLIT=min_split, USE_PDL=on,
            num_warps=4 if d >= 128 else 2, **launch_options(on))
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
