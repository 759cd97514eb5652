"""The W4A16 formats (vtengine/quant.py) against hand-computed values.

e2m1 magnitudes are 0, .5, 1, 1.5, 2, 3, 4, 6 (codes 0..7, bit 3 the sign). MXFP4: one e8m0 byte e per 32
elements, scale 2**(e-127), the smallest power of two with amax / scale <= 6. NVFP4: global = amax(W) / (448 * 6),
one e4m3 scale per 16 elements = e4m3(amax(block) / 6 / global). Two codes per byte, element 2i in the low nibble.
"""
from __future__ import annotations

import os

import pytest
import torch

from vtengine import quant
from vtengine.quant import QuantError, QuantizedWeight, dequantize, quantize


def codes(values):
    return quant.e2m1_encode(torch.tensor(values, dtype=torch.float32)).tolist()


def fresh_generator():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


# -- e2m1 rounding ---------------------------------------------------------------------------------------------
def test_e2m1_exact_values_and_nearest():
    assert codes([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert codes([0.2, 0.3, 0.9, 1.3, 2.6, 3.4, 4.9, 5.1]) == [0, 1, 2, 3, 5, 5, 6, 7]


def test_e2m1_ties_go_to_the_even_code():
    # midpoints 0.25 (0|1), 0.75 (1|2), 1.25 (2|3), 1.75 (3|4), 2.5 (4|5), 3.5 (5|6), 5 (6|7): the even code wins
    assert codes([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) == [0, 2, 2, 4, 4, 6, 6]
    assert codes([-0.75, -2.5, -5.0]) == [8 | 2, 8 | 4, 8 | 6]


def test_e2m1_saturates_and_has_no_negative_zero():
    assert codes([6.5, 7.0, 100.0, float("inf"), -6.5, -1e30]) == [7, 7, 7, 7, 15, 15]
    assert codes([-0.1, -0.25, -0.0]) == [0, 0, 0]
    assert codes([float("nan"), -float("nan")]) == [0, 0]           # as a comparison per midpoint gave it
    assert quant.e2m1_decode(torch.tensor([9, 15, 7])).tolist() == [-0.5, -6.0, 6.0]


# -- packing ---------------------------------------------------------------------------------------------------
def test_packing_puts_element_2i_in_the_low_nibble():
    c = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = quant.pack_nibbles(c)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(quant.unpack_nibbles(packed), c)


def test_quantize_packs_the_first_element_low():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1], w[0, 2], w[0, 3] = 6.0, 0.5, -1.0, 3.0       # amax 6 -> scale 1 (e = 127)
    q = quantize(w, "mxfp4")
    assert q.packed[0, :2].tolist() == [0x17, 0x5A]                  # (7 | 1 << 4), (8|2 | 5 << 4)
    assert q.scales.tolist() == [[127]]


# -- MXFP4 scales ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("amax, e", [(6.0, 127), (6.01, 128), (12.0, 128), (3.0, 126), (0.75, 124), (1.0, 125),
                                     (6.0 * 2.0 ** 100, 227), (6.0 * 2.0 ** -127, 0)])
def test_mxfp4_scale_is_the_smallest_power_of_two_that_fits(amax, e):
    w = torch.zeros(2, 64)
    w[1, 40] = -amax                       # the second block of row 1; every other block is all zero
    w[1, 33] = amax / 7                    # a smaller value in the same block
    q = quantize(w, "mxfp4")
    assert q.scales.tolist() == [[127, 127], [127, e]]
    assert q.scales.dtype == torch.uint8 and q.packed.shape == (2, 32)
    # amax lands on code 7 (6) or, when it is not exactly 6 x scale, on the code nearest amax / scale
    assert dequantize(q)[1, 40].item() == -float(quant.e2m1_decode(quant.e2m1_encode(
        torch.tensor([amax / 2.0 ** (e - 127)])))[0]) * 2.0 ** (e - 127)


def test_mxfp4_all_zero_block():
    q = quantize(torch.zeros(3, 32), "mxfp4")
    assert q.scales.tolist() == [[127]] * 3 and q.packed.eq(0).all()
    assert dequantize(q).eq(0).all()


def test_mxfp4_max_magnitude():
    # the largest e2m1 x e8m0 value fp32 holds: 6 x 2**125 (e = 252, code 7); 3 x 2**126 is the same number
    w = torch.zeros(1, 32)
    w[0, 5], w[0, 6], w[0, 7] = 6.0 * 2.0 ** 125, -6.0 * 2.0 ** 125, 2.0 ** 124
    q = quantize(w, "mxfp4")
    assert q.scales.tolist() == [[252]]
    assert dequantize(q)[0, 5:8].tolist() == [6.0 * 2.0 ** 125, -6.0 * 2.0 ** 125, 2.0 ** 124]
    # element 5 is the high nibble of byte 2, elements 6 and 7 share byte 3 (2**124 = .5 x 2**125: code 1)
    assert q.packed[0, 2].item() == 0x7 << 4 and q.packed[0, 3].item() == 0xF | (0x1 << 4)


def test_e8m0_exponent_byte_zero_is_exactly_two_to_minus_127():
    packed = torch.tensor([[0x12] + [0] * 15], dtype=torch.uint8)   # element 0 code 2 (1.0), element 1 code 1 (.5)
    q = QuantizedWeight("mxfp4", packed, torch.tensor([[0]], dtype=torch.uint8), torch.tensor(1.0), (1, 32))
    dq = dequantize(q)
    assert dq[0, 0].item() == 2.0 ** -127 and dq[0, 1].item() == 2.0 ** -128
    assert quant.e8m0_to_float(torch.tensor([0, 1, 127, 254], dtype=torch.uint8)).tolist() == [
        2.0 ** -127, 2.0 ** -126, 1.0, 2.0 ** 127]


# -- NVFP4 scales ----------------------------------------------------------------------------------------------
def test_nvfp4_tensor_scale_and_e4m3_block_scales():
    w = torch.zeros(1, 64)
    w[0, 0] = 2688.0          # tensor amax 2688 = 448 * 6 -> global 1.0; block 0 scale 448 (e4m3 0x7E)
    w[0, 16] = 6.0            # block 1: scale 1.0 (e4m3 0x38)
    w[0, 32] = -12.0          # block 2: scale 2.0 (e4m3 0x40)
    w[0, 48] = 0.75           # block 3: scale 0.125 = 2**-3 (e4m3 exponent field 7 - 3 = 4: 0x20)
    q = quantize(w, "nvfp4")
    assert q.global_scale.item() == 1.0
    assert q.scales.tolist() == [[0x7E, 0x38, 0x40, 0x20]]
    dq = dequantize(q)
    assert dq[0, [0, 16, 32, 48]].tolist() == [2688.0, 6.0, -12.0, 0.75]
    assert dq[0, [1, 17, 33, 49]].eq(0).all()


def test_nvfp4_global_scale_follows_the_tensor_amax():
    w = torch.zeros(2, 16)
    w[1, 3] = 1.0
    q = quantize(w, "nvfp4")
    assert q.global_scale.item() == pytest.approx(1.0 / 2688.0, rel=1e-7)
    assert q.scales[0].tolist() == [0] and q.scales[1].tolist() == [0x7E]       # 1.0 / 6 / (1 / 2688) = 448
    assert dequantize(q)[1, 3].item() == pytest.approx(1.0, rel=1e-6)
    z = quantize(torch.zeros(2, 16), "nvfp4")
    assert z.global_scale.item() == 1.0 and dequantize(z).eq(0).all()


# -- round trip ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_round_trip_error_bounds_on_random_data(fmt):
    gen = fresh_generator()
    w = torch.randn(64, 256, generator=gen) * torch.rand(64, 1, generator=gen) * 3
    q = quantize(w, fmt)
    dq = dequantize(q)
    blk = quant.BLOCK[fmt]
    if fmt == "mxfp4":
        scale = quant.e8m0_to_float(q.scales)
    else:
        scale = quant.e4m3_to_float(q.scales) * q.global_scale
    scale = scale.repeat_interleave(blk, dim=1)
    # each element is within half an e2m1 gap of its scaled value (gaps .5, 1, 2 x scale below 2, 4, 6);
    # NVFP4's rounded e4m3 scale can leave amax up to 6.375 x scale, which saturates to 6 (error .375 x scale)
    a = (w / scale).abs()
    half_gap = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)) * scale
    assert ((w - dq).abs() <= half_gap * (1 + 1e-6)).all()
    rel = ((w - dq).norm() / w.norm()).item()
    assert 0.02 < rel < 0.15, rel          # 4-bit: clearly lossy, clearly not garbage
    if fmt == "mxfp4":     # power-of-two scales: dequantized values are fixed points (NVFP4's global moves)
        assert torch.equal(dequantize(quantize(dq, fmt)), dq)


# -- errors ----------------------------------------------------------------------------------------------------
def test_k_not_a_multiple_of_the_block_names_the_values():
    with pytest.raises(QuantError, match=r"K=48 is not a multiple of the block size 32"):
        quantize(torch.randn(4, 48), "mxfp4")
    with pytest.raises(QuantError, match=r"K=24 is not a multiple of the block size 16"):
        quantize(torch.randn(4, 24), "nvfp4")


def test_bad_format_and_shape_are_clear_errors():
    with pytest.raises(QuantError, match=r"'fp4'.*accepted: \['mxfp4', 'nvfp4'\]"):
        quantize(torch.randn(4, 32), "fp4")
    with pytest.raises(QuantError, match=r"2-D weight"):
        quantize(torch.randn(32), "mxfp4")
