"""W4A16 weight formats: MXFP4 and NVFP4, quantize-on-load (round to nearest) and the torch reference dequantizer.

Both store e2m1 values (sign bit + 3 magnitude bits; magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6), two per byte,
element 2i of a row in the low nibble and 2i+1 in the high nibble. A weight W [N, K] (nn.Linear layout,
out x in) is quantized along K:

- MXFP4: one e8m0 scale per 32 elements: a byte e meaning 2**(e - 127) (no sign, no mantissa; e = 255 is NaN
  and never produced). We pick the smallest power of two with amax / scale <= 6, so no element saturates.
- NVFP4: one e4m3 (float8_e4m3fn) scale per 16 elements times one fp32 per-tensor scale
  global = amax(W) / (448 * 6); block scale = e4m3(amax(block) / 6 / global).

Rounding to e2m1 is to nearest, ties to the even code (IEEE style).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("mxfp4", "nvfp4")
BLOCK = {"mxfp4": 32, "nvfp4": 16}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring magnitudes, and whether a tie goes up (to the even code)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)
E4M3_MAX = 448.0
E2M1_MAX = 6.0


class QuantError(ValueError):
    pass


@dataclass
class QuantizedWeight:
    """A W4A16 weight. ``packed`` uint8 [N, K//2]; ``scales`` uint8 [N, K//block] (e8m0 exponent bytes for
    MXFP4, float8_e4m3fn bit patterns for NVFP4); ``global_scale`` fp32 scalar tensor (NVFP4; 1.0 for MXFP4)."""
    fmt: str
    packed: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    shape: tuple[int, int]

    @property
    def block(self) -> int:
        return BLOCK[self.fmt]

    @property
    def device(self):
        return self.packed.device

    def to(self, device) -> "QuantizedWeight":
        return QuantizedWeight(self.fmt, self.packed.to(device), self.scales.to(device),
                               self.global_scale.to(device), self.shape)

    def nbytes(self) -> int:
        return self.packed.numel() + self.scales.numel() + 4


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise QuantError(f"quant format {fmt!r} is not supported; accepted: {list(FORMATS)} (or 'bf16')")
    return fmt


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already divided by their scale) to the nearest e2m1 code; saturates at +-6."""
    a = x.abs().float()
    # the midpoints below a, plus one where a is a tie that goes up: a few tensor ops, where a comparison per
    # midpoint took ~40 (one kernel launch each, per weight, at load and in the memcheck gate's sanitized run)
    mids = torch.tensor(_MIDPOINTS, device=a.device)
    ties_up = torch.tensor([t for t, up in zip(_MIDPOINTS, _TIE_UP) if up], device=a.device)
    code = torch.bucketize(a, mids) + torch.isin(a, ties_up)
    code = code.masked_fill(a.isnan(), 0).to(torch.uint8)                 # NaN compares below every midpoint
    sign = ((x < 0) & (code > 0)).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    # ldexp keeps 2**-127 (an fp32 subnormal) exact; going through the fp32 exponent field would not
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.to(torch.int32) - 127)


def e4m3_to_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).float()


def quantize(w: torch.Tensor, fmt: str) -> QuantizedWeight:
    """Quantize W [N, K] (any float dtype) to ``fmt``; K must be a multiple of the block size."""
    check_format(fmt)
    if w.dim() != 2:
        raise QuantError(f"quantize expects a 2-D weight [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    blk = BLOCK[fmt]
    if k % blk:
        raise QuantError(f"{fmt}: K={k} is not a multiple of the block size {blk}")
    wf = w.detach().float().reshape(n, k // blk, blk)
    amax = wf.abs().amax(dim=-1)                                             # [N, K/blk]
    if fmt == "mxfp4":
        # smallest e with 6 * 2**(e-127) >= amax; all-zero blocks get e = 127 (scale 1)
        ratio = torch.where(amax > 0, amax / E2M1_MAX, torch.ones_like(amax))
        e = torch.ceil(torch.log2(ratio)).clamp(-127, 127) + 127
        e = e.to(torch.int32)
        # guard log2 rounding: bump e where the scale still leaves amax above 6
        too_small = amax > E2M1_MAX * e8m0_to_float(e)
        e = (e + too_small.to(torch.int32)).clamp(0, 254)
        scales = e.to(torch.uint8)
        scale_f = e8m0_to_float(scales)
        global_scale = torch.ones((), dtype=torch.float32, device=w.device)
    else:
        tensor_amax = wf.abs().amax()
        g = (tensor_amax / (E4M3_MAX * E2M1_MAX)) if tensor_amax > 0 else torch.ones((), device=w.device)
        global_scale = g.float().reshape(())
        block_scale = (amax / E2M1_MAX / global_scale).clamp(max=E4M3_MAX)
        scales = block_scale.to(torch.float8_e4m3fn).view(torch.uint8)
        scale_f = e4m3_to_float(scales) * global_scale
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    codes = e2m1_encode(wf / safe[..., None]).reshape(n, k)
    return QuantizedWeight(fmt, pack_nibbles(codes).contiguous(), scales.contiguous(), global_scale, (n, k))


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The reference dequantizer: W [N, K] in ``dtype``."""
    n, k = q.shape
    vals = e2m1_decode(unpack_nibbles(q.packed)).reshape(n, k // q.block, q.block)
    if q.fmt == "mxfp4":
        s = e8m0_to_float(q.scales)
    else:
        s = e4m3_to_float(q.scales) * q.global_scale.float()
    return (vals * s[..., None]).reshape(n, k).to(dtype)
