"""W4A16 GEMM: y = x @ W^T with W [N, K] stored as MXFP4 or NVFP4 (vtengine/quant.py), dequantized in-kernel.

The torch reference is ``TorchBackend.linear`` (``quant.dequantize`` + an fp32 matmul). Neither route below ever
materializes W in bf16: each program loads packed bytes and scale bytes and turns them into bf16 in registers.

Two routes, chosen by the lever ``marlin_dense`` (conf/lever/marlin_dense.yaml):

- ``dense`` (ON): A rows are read directly. For M <= 16 the tiles are swapped (swap-AB): a BLOCK_N slice of W is
  the MMA's M side and the tokens, padded to 8 or 16, are its N side, so a program streams its W rows once over
  K, as a GEMV does; split-K (a counter per tile, the last program reduces) adds programs when N / BLOCK_N leaves
  the SMs idle. For M > 16 (prefill) plain [BLOCK_M, BLOCK_N] output tiles.
- ``grouped`` (OFF): the route a fused-MoE kernel takes with one expert (E = 1). An align step writes
  sorted_token_ids padded to a multiple of BLOCK_M (vLLM's moe_align_block_size with one expert: every token goes
  to expert 0, pads carry the sentinel M), then the GEMM gathers its A rows through it, masking rows past M.

Decoding e2m1 in registers (why the bit tricks): a code is sign | e1 e0 | m. Moving e1 e0 m to bf16 bits 8..6
and the sign to bit 15 gives a bf16 equal to value * 2**-126 (exponent-0 codes land on bf16 subnormals, exactly
e2m1's own subnormal 0.5), with no table and no branch. The 2**126 is folded into the scale:
MXFP4 scale 2**(e-127) becomes the bf16 2**(e-1) (bits (e+126) << 7), exact while e <= 128 (block amax <= 12);
NVFP4 scale e4m3 becomes e4m3 * 2**117 (exact, at most 2**126) and the remaining 2**9 * global is applied once to
the fp32 accumulator. A weight with an MXFP4 exponent byte above 128 takes the ``wide`` decode (codes as fp16,
value * 2**-14, scaled in fp32); the launcher checks that once per weight and caches the answer.

The kernel reads a repacked copy of the codes (repacked_words: nibble slots e0 e2 e4 e6 e1 e3 e5 e7 per 32-bit
word), built once per weight: the decode's bf16x2 pairs are then consecutive K elements, so neither the W tile nor
the A tile is permuted (5-18% faster on H200 than the quant layout with A permuted, REPACKED=False).

Measured on one H200 (bench/results/w4a16-NVIDIA_H200-2026-11-30.md, M = 1..8): the dense route moves 26-61% of
copy bandwidth (small shapes pay launch/ramp, large ones ~3.7 issued instructions per weight, 2.6 of them the
decode), 1.6-3.5x faster than the grouped route and at or above torch's int4 tinygemm.
"""
from __future__ import annotations

import vtengine.kernels  # noqa: F401  (sets TRITON_INTERPRET on CPU hosts before triton is imported)

import torch
import triton
import triton.language as tl

from vtengine import counters
from vtengine.kernels import H200_SMS, dot_dtype, sm_count
from vtengine.kernels.epilogue import (NormIn, _arrive, _finish, _norm_inv, _norm_ss, _residual_tile,
                                       _split_k_locks, _tile_rows, check_fused)
from vtengine.kernels.fused import RopeOut, _qkv_head, rope_constexprs, rope_kernel_args
from vtengine.kernels.pdl import (launch_options, pdl_launch_dependents, pdl_wait, prefetch_bytes, prefetch_l2,
                                  prefetch_steps, use_pdl)
from vtengine.quant import BLOCK, QuantizedWeight

# --------------------------------------------------------------------------------------------------------------
# decode helpers
# --------------------------------------------------------------------------------------------------------------


# PTX for one 32-bit word of packed codes (elements e0..e7 in nibbles 0..7, little-endian bytes) -> 8 bf16.
# bf16x2 pair j holds (e_j, e_j+4): both sit 16 bits apart in the word, so one shift moves a pair's magnitude bits
# (3) to bf16 bits 8..6 / 24..22 and a second shift its sign bits to 15 / 31; an fma by the duplicated scale
# (plus -0, so zero signs survive) applies the block scale. 15 integer ops + 4 fma per 8 weights.
_DECODE_WORD_ASM = tl.constexpr("""
{
.reg .b32 s2, m, g, o, z;
mov.b32 s2, {$9, $9};
mov.b32 z, 0x80008000;
shl.b32 m, $8, 6;
shl.b32 g, $8, 12;
and.b32 m, m, 0x01C001C0;
and.b32 g, g, 0x80008000;
or.b32 o, m, g;
fma.rn.bf16x2 o, o, s2, z;
mov.b32 {$0, $4}, o;
shl.b32 m, $8, 2;
shl.b32 g, $8, 8;
and.b32 m, m, 0x01C001C0;
and.b32 g, g, 0x80008000;
or.b32 o, m, g;
fma.rn.bf16x2 o, o, s2, z;
mov.b32 {$1, $5}, o;
shr.b32 m, $8, 2;
shl.b32 g, $8, 4;
and.b32 m, m, 0x01C001C0;
and.b32 g, g, 0x80008000;
or.b32 o, m, g;
fma.rn.bf16x2 o, o, s2, z;
mov.b32 {$2, $6}, o;
shr.b32 m, $8, 6;
and.b32 m, m, 0x01C001C0;
and.b32 g, $8, 0x80008000;
or.b32 o, m, g;
fma.rn.bf16x2 o, o, s2, z;
mov.b32 {$3, $7}, o;
}
""")


# The rotation layout (DECODE_ROT, lever ``w4a16_rot``). A word's bf16x2 pair j is (e_2j, e_2j+1) with its
# bits where the pair needs them: sign at 15 / 31, e1 e0 m at 8..6 / 24..22 (ROT_MASK), built as
#   pair 0 = w & ROT_MASK,  pair 1 = rotl(w, 12) & ROT_MASK,
#   pair 2 = (rotl(w, 2) ^ rotl(w, 6)) & ROT_MASK,  pair 3 = (rotl(w, 2) ^ rotl(w, 8)) & ROT_MASK:
# four rotations (one SHF each) and four LOP3s per 8 weights, against 15 integer ops for the nibble layout. Each
# stored bit reaches the pairs through GF(2)-linear maps; these rotations make the 32 x 32 map invertible, so the
# packer solves for the stored word (rot_words). No shift-only layout exists: each source (w or one rotation)
# carries 8 of a word's 32 bits into the masked positions, four disjoint copies of the mask pattern would have to
# tile the word, and none does (checked exhaustively), so five sources and XOR are the fewest.
ROT_MASK = 0x81C081C0
ROT_PAIRS = ((0,), (12,), (2, 6), (2, 8))       # pair j = XOR over d of rotl(w, d), masked
_ROT_POS = [q for q in range(32) if ROT_MASK >> q & 1]          # the 8 bit positions of a pair


def _rot_system() -> list[int]:
    """Row i: which of the 32 target bits (pair j, position _ROT_POS[p] -> bit 8j + p) XOR to stored bit i."""
    rows = []                                   # target bit -> the stored bits it XORs
    for pair in ROT_PAIRS:
        for q in _ROT_POS:
            rows.append(sum(1 << ((q - d) % 32) for d in pair))
    # invert over GF(2): augment each row with its target bit, eliminate
    aug = [(r, 1 << i) for i, r in enumerate(rows)]
    for col in range(32):
        piv = next(i for i in range(col, 32) if aug[i][0] >> col & 1)
        aug[col], aug[piv] = aug[piv], aug[col]
        for i in range(32):
            if i != col and aug[i][0] >> col & 1:
                aug[i] = (aug[i][0] ^ aug[col][0], aug[i][1] ^ aug[col][1])
    return [aug[i][1] for i in range(32)]        # aug[i][0] is now 1 << i


_ROT_INVERSE = _rot_system()

_DECODE_ROT_ASM = tl.constexpr("""
{
.reg .b32 s2, z, o, r2, r6, r8, r12;
mov.b32 s2, {$9, $9};
mov.b32 z, 0x80008000;
and.b32 o, $8, 0x81C081C0;
fma.rn.bf16x2 o, o, s2, z;
mov.b32 {$0, $4}, o;
shf.l.wrap.b32 r12, $8, $8, 12;
and.b32 o, r12, 0x81C081C0;
fma.rn.bf16x2 o, o, s2, z;
mov.b32 {$1, $5}, o;
shf.l.wrap.b32 r2, $8, $8, 2;
shf.l.wrap.b32 r6, $8, $8, 6;
xor.b32 o, r2, r6;
and.b32 o, o, 0x81C081C0;
fma.rn.bf16x2 o, o, s2, z;
mov.b32 {$2, $6}, o;
shf.l.wrap.b32 r8, $8, $8, 8;
xor.b32 o, r2, r8;
and.b32 o, o, 0x81C081C0;
fma.rn.bf16x2 o, o, s2, z;
mov.b32 {$3, $7}, o;
}
""")


def _parity(x: torch.Tensor) -> torch.Tensor:
    for s in (16, 8, 4, 2, 1):
        x = x ^ (x >> s)
    return x & 1


def _rot_solve(t: torch.Tensor) -> torch.Tensor:
    """Target words t (int64; pair j's 8 target bits, in _ROT_POS order, at bits 8j..8j+7) -> the stored words
    (int64, 0..2**32-1) whose rotations give them: stored bit i is the parity of t & _ROT_INVERSE[i]."""
    w = torch.zeros_like(t)
    for i, row in enumerate(_ROT_INVERSE):
        w |= _parity(t & row) << i
    return w


_ROT_TABLES: dict[torch.device, torch.Tensor] = {}


def _rot_tables(device: torch.device) -> torch.Tensor:
    """[4, 256] int64: entry [j, b] is the stored word of a target word whose byte j is b and other bytes 0.
    The map from target to stored word is GF(2)-linear, so a word's stored form is the XOR of its four bytes'."""
    if device not in _ROT_TABLES:
        b = torch.arange(256, dtype=torch.int64)
        _ROT_TABLES[device] = torch.stack([_rot_solve(b << (8 * j)) for j in range(4)]).to(device)
    return _ROT_TABLES[device]


def rot_pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., 8] (e2m1 nibbles, K order) -> the rotation layout's words [...] int32 (see ROT_PAIRS).

    Pair j's target bits (_ROT_POS = 6 7 8 15 22 23 24 31: lo's m, e0, e1 at 6, 7, 8 and sign at 15; hi's at 22,
    23, 24 and 31) are the byte lo | hi << 4, so a word is four lookups XORed (_rot_tables), about a dozen tensor
    ops. Solving the 32 rows per word (_rot_solve) took ~450, one kernel launch each on the GPU."""
    c = codes.to(torch.int64)
    return _rot_pack_bytes(c[..., 0::2] | (c[..., 1::2] << 4))


def _rot_pack_bytes(b: torch.Tensor) -> torch.Tensor:
    """Bytes [..., 4] (byte j: codes 2j low, 2j + 1 high, as quant packs them) -> the rotation words [...] int32."""
    b = b.to(torch.int64)
    tables = _rot_tables(b.device)
    w = tables[0][b[..., 0]]
    for j in range(1, 4):
        w ^= tables[j][b[..., j]]
    return (w - ((w >> 31) << 32)).to(torch.int32)      # as a signed 32-bit value


def rot_decode_bits(words: torch.Tensor) -> torch.Tensor:
    """The PTX of the rotation decode, emulated on integers: words [...] -> bf16 bit patterns [..., 8] (value *
    2**-126, K order) before the scale. The CPU tests check it against quant's own decode."""
    w = words.to(torch.int64) & 0xFFFFFFFF

    def rotl(x, d):
        return ((x << d) | (x >> (32 - d))) & 0xFFFFFFFF if d else x
    out = []
    for pair in ROT_PAIRS:
        o = torch.zeros_like(w)
        for d in pair:
            o ^= rotl(w, d)
        o &= ROT_MASK
        out += [o & 0xFFFF, o >> 16]
    return torch.stack(out, dim=-1)


@triton.jit
def _interleave8(e0, e1, e2, e3, e4, e5, e6, e7):
    """Eight [R, C] tensors (the code in nibble slot k of each word) -> [R, C*8] with position 2j + h taken from
    slot 4h + j, so each bf16x2 pair (slot j, slot j+4) the word decode produces stays one 32-bit MMA operand
    register. With the repacked words (slots e0 e2 e4 e6 e1 e3 e5 e7) that is natural K order; with the quant
    layout it is e0 e4 e1 e5 ..., and A is permuted the same way (_pair_order). tl.join appends a minor dim: the
    last join supplies the least significant bit of the position."""
    r: tl.constexpr = e0.shape[0]
    c: tl.constexpr = e0.shape[1]
    lo = tl.join(tl.join(e0, e2), tl.join(e1, e3))
    hi = tl.join(tl.join(e4, e6), tl.join(e5, e7))
    return tl.reshape(tl.join(lo, hi), [r, c * 8])


@triton.jit
def _pair_order(a, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile [BLOCK_M, BLOCK_K] in natural K order -> the kernel's K order (see _interleave8): within each group
    of 8, position 2j + h holds element 4h + j."""
    a = tl.reshape(a, [BLOCK_M, BLOCK_K // 8, 2, 4])
    return tl.reshape(tl.permute(a, (0, 1, 3, 2)), [BLOCK_M, BLOCK_K])


@triton.jit
def _dequant_tile(words, sc, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
                  NVFP4: tl.constexpr, DECODE: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """words [BLOCK_N, BLOCK_K/8] int32 (8 codes each), sc [BLOCK_N, BLOCK_K/SCALE_BLOCK] uint8 scale bytes ->
    W tile [BLOCK_N, BLOCK_K] in OUT_DTYPE, K in the order of _interleave8 (at most a permutation inside each
    8-code word, so a scale block, a whole number of words, keeps its columns).

    DECODE 0 (wide): codes as fp16 (value * 2**-14, exact through the fp16->fp32 conversion) times fp32 scales;
    any scale, and the only path the interpreter runs. DECODE 1: bf16 (value * 2**-126) per element times the
    bf16-folded scale. DECODE 2: the same bits built per 32-bit word in PTX (_DECODE_WORD_ASM); GPU only.
    DECODE 3: the same bits from words in the rotation layout (_DECODE_ROT_ASM, rot_words); GPU only. 2 and 3
    produce bit-identical tiles."""
    NSB: tl.constexpr = BLOCK_K // SCALE_BLOCK
    WPB: tl.constexpr = SCALE_BLOCK // 8
    if DECODE == 0:
        if NVFP4:
            s = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
        else:
            # 2**(e-127) * 2**14 as fp32 bits; normal for every e in [0, 240]
            s = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        u = words.to(tl.uint32, bitcast=True)
        e0 = (((u & 0x8) << 12) | ((u & 0x7) << 9)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        e1 = (((u & 0x80) << 8) | ((u & 0x70) << 5)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        e2 = (((u & 0x800) << 4) | ((u & 0x700) << 1)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        e3 = ((u & 0x8000) | ((u & 0x7000) >> 3)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        u = u >> 16
        e4 = (((u & 0x8) << 12) | ((u & 0x7) << 9)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        e5 = (((u & 0x80) << 8) | ((u & 0x70) << 5)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        e6 = (((u & 0x800) << 4) | ((u & 0x700) << 1)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        e7 = ((u & 0x8000) | ((u & 0x7000) >> 3)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        w = tl.reshape(_interleave8(e0, e1, e2, e3, e4, e5, e6, e7), [BLOCK_N, NSB, SCALE_BLOCK])
        w = w * s[:, :, None]
        return tl.reshape(w, [BLOCK_N, BLOCK_K]).to(OUT_DTYPE)
    else:
        if NVFP4:
            s = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 1.6615349947311448e35).to(tl.bfloat16)
        else:
            s = ((sc.to(tl.uint16) + 126) << 7).to(tl.bfloat16, bitcast=True)
        if DECODE == 1:
            u = words.to(tl.uint32, bitcast=True)
            e0 = (((u & 0x8) << 12) | ((u & 0x7) << 6)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            e1 = (((u & 0x80) << 8) | ((u & 0x70) << 2)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            e2 = (((u & 0x800) << 4) | ((u & 0x700) >> 2)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            e3 = ((u & 0x8000) | ((u & 0x7000) >> 6)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            u = u >> 16
            e4 = (((u & 0x8) << 12) | ((u & 0x7) << 6)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            e5 = (((u & 0x80) << 8) | ((u & 0x70) << 2)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            e6 = (((u & 0x800) << 4) | ((u & 0x700) >> 2)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            e7 = ((u & 0x8000) | ((u & 0x7000) >> 6)).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            w = tl.reshape(_interleave8(e0, e1, e2, e3, e4, e5, e6, e7), [BLOCK_N, NSB, SCALE_BLOCK])
            w = w * s[:, :, None]
            return tl.reshape(w, [BLOCK_N, BLOCK_K]).to(OUT_DTYPE)
        elif DECODE == 2:
            s_w = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, NSB, WPB]), [BLOCK_N, BLOCK_K // 8])
            e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
                _DECODE_WORD_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, s_w],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
            return _interleave8(e0, e1, e2, e3, e4, e5, e6, e7).to(OUT_DTYPE)
        else:
            s_w = tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_N, NSB, WPB]), [BLOCK_N, BLOCK_K // 8])
            e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
                _DECODE_ROT_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,h", [words, s_w],
                dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
            return _interleave8(e0, e1, e2, e3, e4, e5, e6, e7).to(OUT_DTYPE)


# --------------------------------------------------------------------------------------------------------------
# the GEMM
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["M"])
def _w4a16_gemm_kernel(
    x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, sorted_ids_ptr, num_post_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_ym, SPLIT_K,
    res_ptr, stride_res, ss_out_ptr, ss_in_ptr, n_ss_in, g_ptr, eps,
    pos_ptr, cs_ptr, stride_cs, slot_ptr, qn_ptr, kn_ptr, k_cache_ptr, v_cache_ptr, HQ, HK,
    stride_qot, stride_qoh, stride_cb, stride_ct, stride_ch, rope_eps,
    NVFP4: tl.constexpr, DECODE: tl.constexpr, GATHER: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PREC: tl.constexpr, REPACKED: tl.constexpr,
    USE_PDL: tl.constexpr, PREFETCH: tl.constexpr = False, SILU_MUL: tl.constexpr = False,
    ADD_RES: tl.constexpr = False, NORM: tl.constexpr = False, SS_BLOCK: tl.constexpr = 1,
    FAST_MATH: tl.constexpr = False, PREFETCH_STEPS: tl.constexpr = 1, ROPE: tl.constexpr = False,
    HALF: tl.constexpr = 1, PAGE_SIZE: tl.constexpr = 1, ROPE_NORM: tl.constexpr = False,
    ROPE_FAST: tl.constexpr = False,
):
    """Grid (cdiv(rows, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K); rows = M (dense) or the padded sorted length
    (grouped). M is axis 0 so programs running together share a W tile in L2 (prefill re-reads W per M block).
    Per K step a program loads W [BLOCK_N, BLOCK_K/2] packed bytes + [BLOCK_N, BLOCK_K/block] scale bytes and
    A [BLOCK_M, BLOCK_K]. SWAP_AB accumulates [BLOCK_N, BLOCK_M] = W @ A^T (decode, M <= 16: the floor is W's
    bytes, 0.53 B/weight for MXFP4 and 0.56 for NVFP4, but on H200 the issue rate binds first: ~3.7 instructions
    per weight, 2.6 of them the decode); otherwise [BLOCK_M, BLOCK_N] = A @ W^T (prefill, bound by the MMA rate
    once M is a few hundred).

    SPLIT (SPLIT_K > 1; SPLIT_K itself is a runtime value, so every split count shares one binary): each program
    stores its fp32 partial tile to a workspace and bumps the tile's counter; the last one to arrive sums the
    SPLIT_K partials in split order (so the result does not depend on arrival order), writes y and resets the
    counter for the next launch. One launch, no zero-fill, graph-replay safe; two launches must not share the
    counters concurrently (one stream).

    USE_PDL (lever ``pdl``): the program waits for the previous kernel before its first read and lets the next
    kernel launch once its K loop is done. PREFETCH (lever ``pdl_prefetch``, with USE_PDL, dense route): before
    that wait the program asks L2 for the first PREFETCH_STEPS K steps of its W rows (one prefetch per 128-byte
    line; the launcher sizes them to about 16 KB per program, as the GEMV's), so the weights stream in while the
    previous kernel drains; activations and the grouped route's sorted ids still wait. With the whole W slice asked
    for, PDL and the prefetch cost the MXFP4 decode step 17% (H200, 2026-12-04: pdl_stack's profile windows, c1
    2.42 -> 2.84 ms; the grid's TPOT x0.81) where PDL alone cost 2.6%: the early programs of one layer's gate_up
    alone asked for more than the 50 MB L2 holds.

    SILU_MUL (lever ``fuse_silu``, dense SWAP_AB only): W is gate_up [N = 2I, K] and y is silu(gate) * up [M, I].
    A program's tile holds BLOCK_N / 2 gate rows and the matching up rows (row j of the tile is gate row
    c + j for j < BLOCK_N / 2, up row I + c + j - BLOCK_N / 2 after), so its epilogue (the split-K reducer's, when
    split) has both halves of every output it writes; the SiLU runs on the fp32 sums, not on bf16 roundings.

    ADD_RES and NORM (lever ``fuse_norm``, dense SWAP_AB only): the residual add in the epilogue, with each tile's
    sums of squares, and RMSNorm of A from the producer's sums: g as A is loaded, the token's rsqrt on the
    fp32 sums after the K loop (epilogue.py; as the GEMV does).

    ROPE (lever ``fuse_rope``, dense SWAP_AB with one M block): W is the fused qkv projection and the qkv epilogue
    runs in the last program of each head's tiles and splits to arrive, writing q (y_ptr: [M, HQ, 2 * HALF]) and the
    paged cache rows, as the bf16 GEMV's ROPE form does (gemv.py)."""
    SCALE_BLOCK: tl.constexpr = 16 if NVFP4 else 32
    EARLY: tl.constexpr = PREFETCH and USE_PDL and not GATHER
    if not EARLY:
        pdl_wait(USE_PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if GATHER:
        if pid_m * BLOCK_M >= tl.load(num_post_ptr):
            return
        rows = tl.load(sorted_ids_ptr + offs_m)
        row_mask = rows < M
    else:
        rows = offs_m
        row_mask = offs_m < M
    rows_ld = tl.where(row_mask, rows, 0)
    offs_n, n_mask = _tile_rows(pid_n, N, BLOCK_N, SILU_MUL)
    # out-of-range W rows read row 0 instead of being masked: the loads stay unpredicated, the store is masked
    offs_n_ld = tl.where(n_mask, offs_n, 0)

    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    # a split's first K is a whole number of K steps: saying so lets the compiler keep W, scale and A loads wide
    # (statically 474 -> 470 instructions per K step of the word decode, 362 -> 358 of the rotation decode)
    k_lo = tl.multiple_of(pid_k * k_per_split, BLOCK_K)
    k_hi = tl.minimum(K, k_lo + k_per_split)

    offs_b = tl.arange(0, BLOCK_K // 8)
    offs_s = tl.arange(0, BLOCK_K // SCALE_BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = (w_ptr + offs_n_ld[:, None].to(tl.int64) * stride_wn
              + tl.multiple_of(k_lo // 8, BLOCK_K // 8) + offs_b[None, :])
    s_ptrs = (s_ptr + offs_n_ld[:, None].to(tl.int64) * stride_sn
              + tl.multiple_of(k_lo // SCALE_BLOCK, BLOCK_K // SCALE_BLOCK) + offs_s[None, :])
    x_ptrs = x_ptr + rows_ld[:, None].to(tl.int64) * stride_xm + k_lo + offs_k[None, :]
    if EARLY:
        # a row's W words of one K step are BLOCK_K / 2 bytes: LINES lines of 128 bytes (32 words) each
        LINES: tl.constexpr = (BLOCK_K // 2 + 127) // 128
        lines = tl.arange(0, LINES) * 32
        row_base = w_ptr + offs_n_ld[:, None].to(tl.int64) * stride_wn + lines[None, :]
        for k0 in range(k_lo, tl.minimum(k_hi, k_lo + PREFETCH_STEPS * BLOCK_K), BLOCK_K):
            prefetch_l2(row_base + k0 // 8)
        pdl_wait(USE_PDL)

    if SILU_MUL:
        out_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        y_ptrs = y_ptr + rows_ld[None, :].to(tl.int64) * stride_ym + out_n[:, None]
        y_mask = (out_n < N // 2)[:, None] & row_mask[None, :]
    elif SWAP_AB:
        y_ptrs = y_ptr + rows_ld[None, :].to(tl.int64) * stride_ym + offs_n[:, None]
        y_mask = n_mask[:, None] & row_mask[None, :]
    else:
        y_ptrs = y_ptr + rows_ld[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        y_mask = row_mask[:, None] & n_mask[None, :]
    # the fused operands the previous kernel wrote, loaded now and used after the K loop (latency hidden)
    res = _residual_tile(res_ptr + rows_ld[None, :].to(tl.int64) * stride_res + offs_n[:, None], y_mask, ADD_RES)
    ss = _norm_ss(ss_in_ptr, n_ss_in, offs_m, BLOCK_M, SS_BLOCK, NORM)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            p = tl.load(w_ptrs)
            sc = tl.load(s_ptrs)
            a = tl.load(x_ptrs, mask=row_mask[:, None], other=0.0)
        else:
            kb = k0 + 8 * offs_b < k_hi
            p = tl.load(w_ptrs, mask=kb[None, :], other=0)
            sc = tl.load(s_ptrs, mask=(k0 + offs_s * SCALE_BLOCK < k_hi)[None, :], other=0)
            a = tl.load(x_ptrs, mask=row_mask[:, None] & (k0 + offs_k < k_hi)[None, :], other=0.0)
        if NORM:                                # x * g here, the token's rsqrt on the sums below (see gemv.py)
            a = a * tl.load(g_ptr + k0 + offs_k, mask=k0 + offs_k < k_hi, other=0.0)[None, :]
        w = _dequant_tile(p, sc, BLOCK_N, BLOCK_K, SCALE_BLOCK, NVFP4, DECODE, DOT_DTYPE)
        if not REPACKED:
            a = _pair_order(a, BLOCK_M, BLOCK_K)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a.to(DOT_DTYPE)), acc, input_precision=DOT_PREC)
        else:
            acc = tl.dot(a.to(DOT_DTYPE), tl.trans(w), acc, input_precision=DOT_PREC)
        w_ptrs += BLOCK_K // 8
        s_ptrs += BLOCK_K // SCALE_BLOCK
        x_ptrs += BLOCK_K
    pdl_launch_dependents(USE_PDL)
    if NORM:
        acc = acc * _norm_inv(ss, K, eps, FAST_MATH)[None, :]

    if NVFP4:
        if DECODE == 0:
            acc = acc * tl.load(gs_ptr)
        else:
            acc = acc * (tl.load(gs_ptr) * 512.0)   # the 2**9 left over from the 2**117 folded into the scales
    if not SPLIT and not ROPE:
        _finish(acc, y_ptrs, y_mask, res, ss_out_ptr, pid_n, SILU_MUL, ADD_RES, BLOCK_N, BLOCK_M)
    else:
        # the partial to the workspace; the last program of the tile (ROPE: of the head) to arrive finishes it
        ACC0: tl.constexpr = BLOCK_N if SWAP_AB else BLOCK_M
        ACC1: tl.constexpr = BLOCK_M if SWAP_AB else BLOCK_N
        HEAD_TILES: tl.constexpr = 2 * HALF // BLOCK_N if ROPE else 1
        tile = pid_m * tl.num_programs(1) + pid_n
        ws_tile = ws_ptr + tile.to(tl.int64) * SPLIT_K * (ACC0 * ACC1)
        offs_acc = tl.arange(0, ACC0)[:, None] * ACC1 + tl.arange(0, ACC1)[None, :]
        owner = tile // HEAD_TILES
        if _arrive(ws_tile + pid_k * (ACC0 * ACC1) + offs_acc, acc, lock_ptr, owner, HEAD_TILES * SPLIT_K):
            if ROPE:                            # one M block (pid_m 0): the workspace's tiles are the heads' rows
                _qkv_head(ws_ptr, owner, SPLIT_K, offs_m, row_mask, pos_ptr, cs_ptr, stride_cs, slot_ptr, qn_ptr,
                          kn_ptr, y_ptr, k_cache_ptr, v_cache_ptr, HQ, HK, stride_qot, stride_qoh, stride_cb,
                          stride_ct, stride_ch, rope_eps, HALF, BLOCK_N, BLOCK_M, PAGE_SIZE, ROPE_NORM, ROPE_FAST)
            else:
                total = tl.load(ws_tile + offs_acc, cache_modifier=".cg")
                for s in range(1, SPLIT_K):
                    total += tl.load(ws_tile + s * (ACC0 * ACC1) + offs_acc, cache_modifier=".cg")
                _finish(total, y_ptrs, y_mask, res, ss_out_ptr, pid_n, SILU_MUL, ADD_RES, ACC0, ACC1)
            tl.atomic_xchg(lock_ptr + owner, 0, sem="relaxed", scope="gpu")


# --------------------------------------------------------------------------------------------------------------
# the align step of the grouped route
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _moe_align_e1_kernel(sorted_ids_ptr, expert_ids_ptr, num_post_ptr, M, BLOCK_M: tl.constexpr,
                         CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (1,). With one expert every token is routed to expert 0, so vLLM's moe_align_block_size reduces to:
    sorted_token_ids = [0, 1, ..., M-1] followed by the sentinel M up to a multiple of BLOCK_M, expert_ids = 0
    per BLOCK_M block, num_tokens_post_padded = that multiple. Bound by launch latency (a few KB written)."""
    padded = tl.cdiv(M, BLOCK_M) * BLOCK_M
    pdl_wait(USE_PDL)                     # its buffers may be memory a previous kernel still reads
    pdl_launch_dependents(USE_PDL)
    for start in range(0, padded, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        tl.store(sorted_ids_ptr + offs, tl.where(offs < M, offs, M), mask=offs < padded)
        blk = start // BLOCK_M + tl.arange(0, CHUNK // BLOCK_M)
        tl.store(expert_ids_ptr + blk, tl.zeros_like(blk), mask=blk < padded // BLOCK_M)
    tl.store(num_post_ptr, padded)


def moe_align_e1(m: int, block_m: int, device, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids [padded] int32, expert_ids [padded / block_m] int32, num_tokens_post_padded [1] int32)."""
    padded = triton.cdiv(m, block_m) * block_m
    sorted_ids = torch.empty(padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(padded // block_m, dtype=torch.int32, device=device)
    num_post = torch.empty(1, dtype=torch.int32, device=device)
    chunk = max(block_m, min(1024, triton.next_power_of_2(padded)))
    on = use_pdl(pdl, "moe_align", device)
    _moe_align_e1_kernel[(1,)](sorted_ids, expert_ids, num_post, m, BLOCK_M=block_m, CHUNK=chunk, USE_PDL=on,
                               **launch_options(on))
    counters.record("moe_align", "grouped", grid=(1,))
    return sorted_ids, expert_ids, num_post


# --------------------------------------------------------------------------------------------------------------
# tile choice
# --------------------------------------------------------------------------------------------------------------

MID_M = 128     # the lever w4a16_mid_m: decode tiles up to this many tokens (a decode step of up to 128 sequences)


def _swap_split(n: int, k: int, block_n: int, block_k: int, num_sms: int) -> int:
    """Split-K for swap-AB tiles: the first count (dividing the K steps evenly, >= 2 steps each) that gives about
    3.5 programs per SM, else the largest such count."""
    programs = triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, block_k)
    splits = [d for d in range(1, 9) if k_steps % d == 0 and k_steps // d >= 2] or [1]
    return next((d for d in splits if programs * d >= 3.5 * num_sms), splits[-1])


def _tile_split(programs: int, k: int, block_k: int, num_sms: int) -> int:
    """Split-K for the mid-M plain tiles: the largest count up to 4 (dividing the K steps evenly, >= 2 steps each)
    that keeps the grid within about 3 programs per SM."""
    k_steps = triton.cdiv(k, block_k)
    splits = [d for d in (1, 2, 4) if k_steps % d == 0 and k_steps // d >= 2] or [1]
    return max([d for d in splits if programs * d <= 3 * num_sms] or [1])


def dense_config(m: int, n: int, k: int, fmt: str, num_sms: int = H200_SMS, mid: bool = False) -> dict:
    """Tiles of the dense route (lever ON), from the H200 sweeps in bench/results/w4a16-*.md.

    M <= 16: swap-AB GEMV tiles: 32 rows of W per 2-warp program (mma.sync; 64-row wgmma tiles measured 2-3x
    slower: their register-A operand serializes), the tokens padded to 8 or 16 (the MMA's N side: padding costs
    MMA and A-tile work, not W bytes), split-K until there are about 3.5 programs per SM, with split counts that
    divide the K steps evenly. M > 16: the prefill tiles (128 W rows per program, no split: at N = 4,096 that is
    32-64 programs for 132 SMs, each walking the whole K), unless ``mid`` (the lever w4a16_mid_m) and M <= MID_M,
    as measured at Qwen3-8B's four projections (w4a16-mid-NVIDIA_H200-2026-12-02): up to 32 tokens the swap-AB
    tiles with the tokens padded to 32 (2.1-5.3x the prefill tiles); up to 64 a plain 64 x 64 tile with split-K up
    to ~3 programs per SM (20-37% faster than swap-AB tiles padded to 64, and than the prefill tiles on gate_up,
    whose N already fills the SMs); past 64 the swap-AB tiles padded to 128 where the prefill tiles would leave SMs
    idle (qkv, o, down: 1.2-2.1x), else the prefill tiles (gate_up: swap-AB tiles were 1.7x slower)."""
    if m <= 16:
        block_n, block_k = 32, 256
        return dict(BLOCK_M=8 if m <= 8 else 16, BLOCK_N=block_n, BLOCK_K=block_k,
                    SPLIT_K=_swap_split(n, k, block_n, block_k, num_sms), SWAP_AB=True, num_warps=2, num_stages=3,
                    TILES="decode")
    block_m = 64 if m <= 64 else 128
    prefill = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, SWAP_AB=False,
                   num_warps=4 if block_m == 64 else 8, num_stages=3, TILES="prefill")
    if not mid or m > MID_M:
        return prefill
    if 32 < m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=_tile_split(triton.cdiv(n, 64), k, 128, num_sms),
                    SWAP_AB=False, num_warps=4, num_stages=3, TILES="mid")
    if m > 64 and triton.cdiv(n, 128) >= num_sms:          # the prefill tiles fill the SMs already
        return prefill
    block_m = 32 if m <= 32 else 128
    block_n, block_k = 32, 256 if block_m == 32 else 128
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                SPLIT_K=_swap_split(n, k, block_n, block_k, num_sms), SWAP_AB=True,
                num_warps=2 if block_m == 32 else 4, num_stages=3, TILES="mid")


def grouped_config(m: int, n: int, k: int, fmt: str, num_sms: int = H200_SMS) -> dict:
    """Tiles of the grouped route (lever OFF), as a tuned fused-MoE kernel picks them for one expert."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, SWAP_AB=False, num_warps=4, num_stages=4,
                    TILES="grouped")
    if m <= 64:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, SPLIT_K=1, SWAP_AB=False, num_warps=4, num_stages=4,
                    TILES="grouped")
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, SWAP_AB=False, num_warps=4, num_stages=3,
                TILES="grouped")


def _interpreter_config(cfg: dict, k: int, block: int) -> dict:
    # the interpreter runs numpy per program: keep tiles tiny but legal (tl.dot needs >= 16 per side)
    cfg = dict(cfg)
    cfg["BLOCK_K"] = max(2 * block, min(cfg["BLOCK_K"], 64))
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], 32)
    return cfg


# --------------------------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------------------------


def _refuse_during_capture(q: QuantizedWeight, what: str) -> None:
    if q.packed.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"w4a16: {what} for a [{q.shape[0]}, {q.shape[1]}] {q.fmt} weight would be built inside "
                           "CUDA-graph capture (it would be captured, not run); call the layer once before capturing")


DECODE_WIDE, DECODE_BF16, DECODE_ASM, DECODE_ROT = 0, 1, 2, 3
DECODE_NAMES = {DECODE_WIDE: "wide", DECODE_BF16: "bf16", DECODE_ASM: "bf16_asm", DECODE_ROT: "bf16_rot"}


def decode_path(q: QuantizedWeight, rot: bool = False) -> int:
    """The e2m1 decode a weight takes (see _dequant_tile). Wide under the interpreter, whose bf16 arithmetic works
    on raw bit patterns like its tl.dot (triton issue #11584), and for MXFP4 exponent bytes above 128, which
    overflow the bf16-folded scale; that check costs one device sync at a weight's first use (warm up before
    CUDA-graph capture) and is cached on the object. Otherwise the PTX word decode: over the rotation layout with
    ``rot`` (the lever w4a16_rot), else over the nibble layout."""
    if vtengine.kernels.INTERPRET:
        return DECODE_WIDE
    wide = getattr(q, "_w4a16_wide", None)
    if wide is None:
        _refuse_during_capture(q, "the one-time scale check")
        wide = bool(q.fmt == "mxfp4" and q.scales.numel() and int(q.scales.max()) > 128)
        q._w4a16_wide = wide
    if wide:
        return DECODE_WIDE
    return DECODE_ROT if rot else DECODE_ASM


def repacked_words(q: QuantizedWeight) -> torch.Tensor:
    """The kernel-friendly copy of the codes, int32 words [N, K/8] with nibble slots (e0 e2 e4 e6 e1 e3 e5 e7): the
    word decode's bf16x2 pair j = (slot j, slot j+4) is then (e_2j, e_2j+1), two consecutive K elements, which is
    what an MMA operand register holds, so neither the W tile nor the A tile needs a permutation. Built once per
    weight (a few elementwise ops; one more packed-size buffer) and cached on the object: the first call must not
    be inside CUDA-graph capture. quant's packed format stays the oracle."""
    def build():
        n, k = q.shape
        p = q.packed.reshape(n, k // 8, 4)
        p0, p1, p2, p3 = p.unbind(-1)
        new = torch.stack(((p0 & 15) | ((p1 & 15) << 4), (p2 & 15) | ((p3 & 15) << 4),
                           (p0 >> 4) | (p1 & 0xF0), (p2 >> 4) | (p3 & 0xF0)), dim=-1)
        return new.reshape(n, k // 2).contiguous().view(torch.int32)
    return _cached_copy(q, "_w4a16_pairs", "the repacked copy of the weight", build)


def _cached_copy(q: QuantizedWeight, attr: str, what: str, build) -> torch.Tensor:
    """A kernel-side copy of a weight's codes, built once (outside CUDA-graph capture) and kept on the object."""
    cached = getattr(q, attr, None)
    if cached is not None and cached.device == q.packed.device:
        return cached
    _refuse_during_capture(q, what)
    words = build()
    setattr(q, attr, words)
    return words


def launch_config(m: int, qweight: QuantizedWeight, dense: bool, mid: bool = False) -> dict:
    """The tiles w4a16_linear launches a weight with when no config is given (the interpreter's small ones on a CPU
    host): what a caller sizing work to the tiles (fuse_rope's whole heads per tile group) must read."""
    n, k = qweight.shape
    sms = sm_count(qweight.device)
    cfg = dense_config(m, n, k, qweight.fmt, sms, mid=mid) if dense else grouped_config(m, n, k, qweight.fmt, sms)
    return _interpreter_config(cfg, k, BLOCK[qweight.fmt]) if vtengine.kernels.INTERPRET else cfg


def fusable(m: int, dense: bool) -> bool:
    """Whether the fused forms of w4a16_linear apply (silu_mul, and the residual add and norm of fuse_norm): the
    dense route's swap-AB tiles, 1 <= M <= 16 (decode); gemv.fusable is the GEMV's."""
    return dense and 1 <= m <= 16


def rot_words(q: QuantizedWeight) -> torch.Tensor:
    """The rotation layout's copy of the codes (DECODE_ROT), int32 words [N, K/8], each the solution of its 8 codes'
    GF(2) system (rot_pack). Built once per weight and cached on the object, like repacked_words."""
    def build():
        n, k = q.shape
        return _rot_pack_bytes(q.packed.reshape(n, k // 8, 4)).contiguous()    # the packed bytes are the targets
    return _cached_copy(q, "_w4a16_rot", "the rotation-layout copy of the weight", build)


def packed_words(q: QuantizedWeight) -> torch.Tensor:
    """The packed codes as int32 words [N, K/8] (a view: 8 codes per word, element 8i+j in nibble j)."""
    p = q.packed
    if p.stride(1) != 1 or p.stride(0) % 4 or p.data_ptr() % 4:
        raise ValueError(f"w4a16: packed weight must be row-contiguous and 4-byte aligned, got strides "
                         f"{tuple(p.stride())} at offset {p.data_ptr() % 16} mod 16")
    return p.view(torch.int32)


def w4a16_linear(x: torch.Tensor, qweight: QuantizedWeight, dense: bool, config: dict | None = None,
                 out: torch.Tensor | None = None, pdl: bool = False, rot: bool = False,
                 prefetch: bool | int = False, silu_mul: bool = False, mid: bool = False, norm: NormIn | None = None,
                 residual: torch.Tensor | None = None, ss_out: torch.Tensor | None = None,
                 rope: RopeOut | None = None) -> torch.Tensor:
    """y = x @ W^T for x [M, K] and a W4A16 weight W [N, K]; y [M, N] in x's dtype.

    ``dense`` is the lever marlin_dense: True -> dense route, False -> grouped (E = 1) route. ``config`` overrides
    the tile choice (benchmarks and tests); keys as returned by dense_config(), plus DECODE (0 wide, 1 bf16,
    2 PTX word decode). ``out`` [M, N] (x's dtype) receives y when given (tests poison it; graphs reuse it).
    ``pdl``: the lever pdl (programmatic dependent launch, sm_90+; ignored elsewhere). ``rot``: the lever w4a16_rot
    (the rotation layout and its decode, DECODE 3, where the PTX decode runs; bit-identical output). ``prefetch``:
    the lever pdl_prefetch (with PDL on the dense route, about 16 KB of each program's W rows is asked of L2
    before the wait); an int asks for that many bytes per program (the benches' sizes).
    ``silu_mul`` (the lever fuse_silu): W is a gate_up weight [2I, K] and y = silu(x W_gate^T) * (x W_up^T) [M, I],
    in the GEMM's epilogue; the dense route at M <= 16 only (fusable says when). ``mid``: the lever
    w4a16_mid_m (the dense route's decode tiles for 16 < M <= MID_M, see dense_config). ``norm``, ``residual`` and
    ``ss_out`` (the lever fuse_norm, the same tiles as silu_mul): x is RMSNorm'ed from the
    producer's sums of squares; y = round(x W^T + residual) and ss_out [tiles, BLOCK_M] its sums of squares
    (w4a16_linear_add allocates them). ``rope`` (the lever fuse_rope, the same tiles): W is the fused qkv projection
    and the GEMM runs the qkv epilogue per head in its epilogue; returns q [M, Hq, D] (in ``rope.q_out`` when given)
    and writes k and v to the paged cache."""
    if not isinstance(qweight, QuantizedWeight):
        raise TypeError(f"w4a16_linear expects a QuantizedWeight, got {type(qweight).__name__}")
    if x.dim() != 2:
        raise ValueError(f"w4a16_linear expects x [M, K], got shape {tuple(x.shape)}")
    n, k = qweight.shape
    if x.shape[1] != k:
        raise ValueError(f"w4a16_linear: x has K={x.shape[1]} but the weight is [N={n}, K={k}]")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w4a16_linear: x dtype {x.dtype} is not supported; accepted: bf16, fp16, fp32")
    if x.device != qweight.device:
        raise ValueError(f"w4a16_linear: x on {x.device} but the weight on {qweight.device}")
    x = x if x.stride(1) == 1 else x.contiguous()
    m = x.shape[0]
    block = BLOCK[qweight.fmt]
    decode = decode_path(qweight, rot)
    route = "dense" if dense else "grouped"
    cfg = dict(config if config is not None else launch_config(m, qweight, dense, mid))
    bm, bn, bk, split = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg.get("SPLIT_K", 1)
    if silu_mul and not (dense and cfg["SWAP_AB"] and n % 2 == 0 and bn % 2 == 0):
        raise ValueError(f"w4a16_linear: silu_mul fuses into the dense swap-AB tiles (M <= 16) of a [2I, K] weight; "
                         f"got dense={dense}, M={m}, N={n}, SWAP_AB={cfg['SWAP_AB']}, BLOCK_N={bn}")
    fused = norm is not None or residual is not None or rope is not None
    if fused and not (dense and cfg["SWAP_AB"] and 1 <= m <= bm):
        raise ValueError(f"w4a16_linear: norm, residual and rope fuse into the dense swap-AB tiles (M <= 16); got "
                         f"dense={dense}, M={m}, SWAP_AB={cfg['SWAP_AB']}")
    if rope is not None and (silu_mul or residual is not None or out is not None):
        raise ValueError("w4a16_linear: rope writes q and the KV cache; it takes neither silu_mul, residual nor out "
                         "(give rope.q_out)")
    head_tiles = rope.head_tiles(bn, "w4a16_linear") if rope is not None else 1
    if norm is not None and norm.gained:
        raise ValueError("w4a16_linear: norm.gained=True is the bf16 GEMV's form (gemv.linear_add_gain); the W4A16 "
                         "GEMM applies the norm weight in its K loop: pass the residual with gained=False")
    check_fused("w4a16_linear", m, n, k, bm, triton.cdiv(n, bn), norm, residual, ss_out, x.dtype)
    n_out = n // 2 if silu_mul else n
    if bk % block or bk < 2 * block:
        raise ValueError(f"w4a16_linear: BLOCK_K={bk} must be a multiple of 2 x the {qweight.fmt} block ({block})")
    if not dense and split != 1:
        raise ValueError("w4a16_linear: the grouped route does not split K")
    decode = cfg.get("DECODE", decode)
    if decode != DECODE_WIDE and qweight.fmt == "mxfp4" and decode_path(qweight) == DECODE_WIDE:
        raise ValueError("w4a16_linear: this MXFP4 weight has scales above 2**1 (or runs in the interpreter); "
                         "only the wide decode (DECODE=0) handles it")
    repacked = bool(cfg.get("REPACKED", True)) or decode == DECODE_ROT      # rotation words are in K order
    if decode == DECODE_ROT:
        words = rot_words(qweight)
    else:
        words = repacked_words(qweight) if repacked else packed_words(qweight)
    if rope is not None:
        y = rope.check(m, n, x.dtype, x.device, "w4a16_linear")
    elif out is None:
        y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    else:
        if out.shape != (m, n_out) or out.dtype != x.dtype or out.stride(1) != 1:
            raise ValueError(f"w4a16_linear: out must be [{m}, {n_out}] {x.dtype} with unit column stride, got "
                             f"{tuple(out.shape)} {out.dtype} strides {tuple(out.stride())}")
        y = out
    if m == 0:
        return y
    if dense:
        rows, sorted_ids, num_post = m, y, y          # unused pointers when GATHER is off
    else:
        sorted_ids, _expert_ids, num_post = moe_align_e1(m, bm, x.device, pdl=pdl)
        rows = sorted_ids.numel()
    dd = dot_dtype(x)
    grid = (triton.cdiv(rows, bm), triton.cdiv(n_out, bn // 2) if silu_mul else triton.cdiv(n, bn), split)
    if split > 1 or rope is not None:               # rope: a head's tiles meet in the workspace even unsplit
        tiles = grid[0] * grid[1]
        ws = torch.empty((tiles, split, bm * bn), dtype=torch.float32, device=x.device)
        locks = _split_k_locks(x.device, tiles // head_tiles)       # a counter per tile (rope: per head)
    else:
        ws, locks = y, y                                # unused pointers
    even_k = k % (bk * split) == 0
    on = use_pdl(pdl, "w4a16_gemm", x.device)
    pf_bytes = prefetch_bytes(prefetch)
    early = pf_bytes > 0 and on and dense
    if on:
        counters.record("pdl_prefetch", "prefetch" if early else "wait_first", variant="w4a16_gemm")
    res = residual if residual is not None else y       # unused pointers when a fusion is off
    ss_in = norm.ss if norm is not None else ws
    _w4a16_gemm_kernel[grid](
        x, words, qweight.scales, qweight.global_scale, y, sorted_ids, num_post, ws, locks,
        m, n, k, x.stride(0), words.stride(0), qweight.scales.stride(0), y.stride(0), split,
        res, res.stride(0), ss_out if ss_out is not None else ws, ss_in, ss_in.shape[0] if norm is not None else 0,
        norm.weight if norm is not None else x, norm.eps if norm is not None else 0.0, *rope_kernel_args(rope, y),
        NVFP4=qweight.fmt == "nvfp4", DECODE=decode, GATHER=not dense, SWAP_AB=cfg["SWAP_AB"],
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split > 1, EVEN_K=even_k, DOT_DTYPE=dd,
        DOT_PREC="ieee" if dd == tl.float32 else "tf32", REPACKED=repacked,
        USE_PDL=on, PREFETCH=early, SILU_MUL=bool(silu_mul), ADD_RES=residual is not None, NORM=norm is not None,
        SS_BLOCK=triton.next_power_of_2(max(1, ss_in.shape[0])) if norm is not None else 1,
        FAST_MATH=bool(norm is not None and norm.fast_math),
        PREFETCH_STEPS=prefetch_steps(bn, bk // 2, 1, pf_bytes) if early else 1,     # bk // 2 bytes per row and step
        **rope_constexprs(rope),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3), **launch_options(on),
    )
    counters.record("w4a16_gemm", route, grid=grid, splits=split,
                    variant=(qweight.fmt, bm, bn, bk, split, "swap_ab" if cfg["SWAP_AB"] else "tile",
                             DECODE_NAMES[decode], cfg.get("num_warps", 4), cfg.get("num_stages", 3),
                             cfg.get("TILES", "custom"))
                    + (("silu_mul",) if silu_mul else ()) + (("norm",) if norm is not None else ())
                    + (("add_residual",) if residual is not None else ()) + (("rope",) if rope is not None else ()))
    return y


def w4a16_linear_add(x: torch.Tensor, qweight: QuantizedWeight, residual: torch.Tensor,
                     **levers) -> tuple[torch.Tensor, torch.Tensor]:
    """(round(x W^T + residual), its sums of squares per output tile [tiles, BLOCK_M] fp32) on the dense route's
    decode tiles (the lever fuse_norm; ``levers`` as w4a16_linear takes them, dense on)."""
    m, n, k = x.shape[0], qweight.shape[0], qweight.shape[1]
    cfg = levers.pop("config", None)
    if cfg is None:
        cfg = dense_config(m, n, k, qweight.fmt, sm_count(x.device), mid=levers.get("mid", False))
        if vtengine.kernels.INTERPRET:
            cfg = _interpreter_config(cfg, k, BLOCK[qweight.fmt])
    ss = torch.empty((triton.cdiv(n, cfg["BLOCK_N"]), cfg["BLOCK_M"]), dtype=torch.float32, device=x.device)
    y = w4a16_linear(x, qweight, config=cfg, residual=residual, ss_out=ss, **levers)
    return y, ss
