"""The Triton split-K GEMV (vtengine/kernels/gemv.py, lever triton_gemv) against the torch reference.

CPU hosts run it in Triton's interpreter at tiny shapes (fp32); the ``gpu`` tests add the Qwen3-8B projection
shapes in bf16. Fresh random inputs (seed printed), outputs poisoned with NaN before each run.
"""
from __future__ import annotations

import pytest
import torch

from vtengine import counters
from vtengine.backends.torch_backend import TorchBackend
from vtengine.kernels import gemv
from vtengine.testing import fresh_generator, rel_l2

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
REF = TorchBackend()
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the CPU interpreter runs the tiny-shape tests)")


def rnd(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEV)


def poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("m,k,n", [(1, 256, 48), (3, 100, 40), (16, 64, 33), (9, 512, 16)])
def test_gemv_matches_the_reference(m, k, n):
    gen, seed = fresh_generator()
    x, w = rnd(m, k, gen=gen), rnd(n, k, gen=gen)
    y = gemv.linear(x, w, triton_gemv=True, out=poisoned(m, n, x.dtype))
    assert rel_l2(y, REF.linear(x.double(), w.double())) < 2e-6, f"seed {seed}"


def test_gemv_split_k_is_used_and_counted():
    gen, seed = fresh_generator()
    x, w = rnd(2, 256, gen=gen), rnd(48, 256, gen=gen)
    cfg = gemv.gemv_config(48, 256, 132)
    assert cfg["SPLIT_K"] > 1                          # the reduction path is what this test exercises
    counters.reset()
    y = gemv.linear(x, w, triton_gemv=True)
    assert rel_l2(y, REF.linear(x.double(), w.double())) < 2e-6, f"seed {seed}"
    st = counters.snapshot()["dense_linear"]
    assert list(st) == ["triton_gemv"] and st["triton_gemv"]["splits"] == {str(cfg["SPLIT_K"]): 1}
    # a second launch reuses the arrival counters: they must have been reset by the last program
    assert torch.equal(gemv.linear(x, w, triton_gemv=True), y)


def test_gemv_rows_do_not_depend_on_the_batch():
    """Batch invariance: each row of a 13-row launch equals that row launched alone, bit for bit."""
    gen, seed = fresh_generator()
    x, w = rnd(13, 192, gen=gen), rnd(40, 192, gen=gen)
    batched = gemv.linear(x, w, triton_gemv=True)
    for i in (0, 6, 12):
        assert torch.equal(gemv.linear(x[i:i + 1], w, triton_gemv=True)[0], batched[i]), f"seed {seed} row {i}"


def test_gemv_routes_off_and_large_m_take_cublas():
    gen, _ = fresh_generator()
    w = rnd(24, 64, gen=gen)
    counters.reset()
    gemv.linear(rnd(2, 64, gen=gen), w, triton_gemv=False)
    gemv.linear(rnd(17, 64, gen=gen), w, triton_gemv=True)
    assert list(counters.snapshot()["dense_linear"]) == ["cublas"]


def test_gemv_faults_fail():
    """A wrong weight stride (the transposed storage read as if row-major) and a dropped K tail must fail."""
    gen, seed = fresh_generator()
    x, w = rnd(2, 96, gen=gen), rnd(96, 96, gen=gen)
    ref = REF.linear(x.double(), w.double())
    assert rel_l2(gemv.linear(x, w.t().contiguous(), triton_gemv=True), ref) > 0.5, f"seed {seed}"
    short = gemv.linear(x[:, :64].contiguous(), w[:, :64].contiguous(), triton_gemv=True)
    assert rel_l2(short, ref) > 1e-2, f"seed {seed}"


def test_gemv_bad_inputs_are_clear_errors():
    gen, _ = fresh_generator()
    with pytest.raises(ValueError, match=r"x \[M, K\] and weight \[N, K\]"):
        gemv.linear(rnd(2, 8, gen=gen), rnd(4, 9, gen=gen), triton_gemv=True)
    with pytest.raises(ValueError, match="dtype"):
        gemv.linear(rnd(2, 8, gen=gen), rnd(4, 8, gen=gen, dtype=torch.float64), triton_gemv=True)
    with pytest.raises(ValueError, match=r"out must be \[2, 4\]"):
        gemv.linear(rnd(2, 8, gen=gen), rnd(4, 8, gen=gen), triton_gemv=True, out=poisoned(2, 5, torch.float32))


@gpu
@needs_cuda
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)])
def test_gpu_gemv_bf16_qwen3_8b_shapes(k, n):
    gen, seed = fresh_generator()
    bf = torch.bfloat16
    w = rnd(n, k, gen=gen, dtype=bf)
    for m in (1, 3, 8, 16):
        x = rnd(m, k, gen=gen, dtype=bf)
        y = gemv.linear(x, w, triton_gemv=True, out=poisoned(m, n, bf))
        assert rel_l2(y, REF.linear(x.double(), w.double())) < 8e-3, f"seed {seed} m {m}"
    x = rnd(8, k, gen=gen, dtype=bf)
    batched = gemv.linear(x, w, triton_gemv=True)
    assert torch.equal(gemv.linear(x[3:4], w, triton_gemv=True)[0], batched[3]), f"seed {seed}: batch variance"


@gpu
@needs_cuda
def test_gpu_gemv_gate_up_silu_mul_qwen3_8b():
    """Qwen3-8B's gate_up [2 x 12,288, 4,096] in bf16 with SiLU-mul in the epilogue, at M = 1, 8, 16."""
    gen, seed = fresh_generator()
    bf, i, k = torch.bfloat16, 12288, 4096
    w = rnd(2 * i, k, gen=gen, dtype=bf)
    for m in (1, 8, 16):
        x = rnd(m, k, gen=gen, dtype=bf)
        h = x.double() @ w.double().t()
        ref = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
        y = gemv.linear(x, w, triton_gemv=True, silu_mul=True, out=poisoned(m, i, bf))
        assert rel_l2(y, ref) < 8e-3, f"seed {seed} m {m}"


def test_gemv_out_is_checked_on_both_routes_and_block_m_must_cover_m():
    gen, _ = fresh_generator()
    x, w = rnd(12, 64, gen=gen), rnd(32, 64, gen=gen)
    for route in (True, False):
        with pytest.raises(ValueError, match=r"out must be \[12, 32\]"):
            gemv.linear(x, w, triton_gemv=route, out=torch.zeros(3, 12, 32, device=DEV))
        with pytest.raises(ValueError, match=r"out must be \[12, 32\]"):
            gemv.linear(x, w, triton_gemv=route, out=torch.zeros(12, 32, dtype=torch.float64, device=DEV))
    y = gemv.linear(x, w, triton_gemv=False, out=poisoned(12, 32, x.dtype))
    assert rel_l2(y, REF.linear(x.double(), w.double())) < 2e-6
    cfg = dict(gemv.gemv_config(32, 64, 132), BLOCK_M=8)
    with pytest.raises(ValueError, match="BLOCK_M=8 is smaller than M=12"):
        gemv.linear(x, w, triton_gemv=True, config=cfg)


# -- the lever fuse_silu on the bf16 route: SiLU-mul in the GEMV's epilogue -----------------------------------------
@pytest.mark.parametrize("m", [1, 5, 16])
def test_gate_up_with_silu_mul_in_the_gemv_epilogue(m):
    """gate_up [2I, K] with I = 40 (a partial last tile), split-K 1 and 2: y = silu(g) * u of the fp32 sums
    against silu over the fp64 GEMM; gate and up rows one apart (the wrong halves paired) fail; the fused launch
    is counted; the rows stay batch-invariant."""
    gen, seed = fresh_generator()
    i, k = 40, 256
    x, w = rnd(m, k, gen=gen), rnd(2 * i, k, gen=gen) / k ** 0.5
    h = x.double() @ w.double().t()
    ref = torch.nn.functional.silu(h[:, :i]) * h[:, i:]
    base = gemv.gemv_config(2 * i, k, 132)
    for split in (1, 2):
        counters.reset()
        y = gemv.linear(x, w, triton_gemv=True, silu_mul=True, config=dict(base, SPLIT_K=split),
                        out=poisoned(m, i, x.dtype))
        assert rel_l2(y, ref) < 2e-6, f"seed {seed} M={m} split={split}"
        variants = counters.snapshot()["dense_linear"]["triton_gemv"]["variants"]
        assert list(variants) == [str((base["BLOCK_N"], base["BLOCK_K"], split, "silu_mul"))]
    rolled = gemv.linear(x, torch.roll(w, 1, dims=0), triton_gemv=True, silu_mul=True)
    assert rel_l2(rolled, ref) > 0.1
    if m > 1:
        assert torch.equal(gemv.linear(x[m - 1:], w, triton_gemv=True, silu_mul=True)[0],
                           gemv.linear(x, w, triton_gemv=True, silu_mul=True)[m - 1]), f"seed {seed}"


def test_gemv_silu_mul_needs_the_triton_route_and_an_even_n():
    gen, _ = fresh_generator()
    x, w = rnd(2, 64, gen=gen), rnd(32, 64, gen=gen)
    for kwargs, n in ((dict(triton_gemv=False), 32), (dict(triton_gemv=True), 33)):
        with pytest.raises(ValueError, match="silu_mul fuses into the Triton GEMV"):
            gemv.linear(x, rnd(n, 64, gen=gen), silu_mul=True, **kwargs)
    with pytest.raises(ValueError, match="silu_mul fuses into the Triton GEMV"):
        gemv.linear(rnd(17, 64, gen=gen), w, triton_gemv=True, silu_mul=True)
    with pytest.raises(ValueError, match=r"out must be \[2, 16\]"):
        gemv.linear(x, w, triton_gemv=True, silu_mul=True, out=poisoned(2, 32, x.dtype))
