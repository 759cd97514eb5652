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
@pytest.mark.parametrize("k,n", [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096),
                                 (4160, 4096)])   # K not a multiple of BLOCK_K: the prefetch's last step is partial
def test_gpu_gemv_bf16_qwen3_8b_shapes(k, n):
    gen, seed = fresh_generator()
    bf = torch.bfloat16
    w = rnd(n, k, gen=gen, dtype=bf)
    for m in (1, 3, 8, 16):
        x = rnd(m, k, gen=gen, dtype=bf)
        y = gemv.linear(x, w, triton_gemv=True, out=poisoned(m, n, bf))
        assert rel_l2(y, REF.linear(x.double(), w.double())) < 8e-3, f"seed {seed} m {m}"
        # the levers pdl and pdl_prefetch move when a program waits and what it asks of L2 first: same bits
        for pf in (False, True):
            y_pdl = gemv.linear(x, w, triton_gemv=True, pdl=True, prefetch=pf, out=poisoned(m, n, bf))
            assert torch.equal(y_pdl, y), f"seed {seed} m {m}: pdl (prefetch={pf}) changed the output"
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
        y_pf = gemv.linear(x, w, triton_gemv=True, silu_mul=True, pdl=True, prefetch=True, out=poisoned(m, i, bf))
        assert torch.equal(y_pf, y), f"seed {seed} m {m}: pdl_prefetch changed the SiLU-mul output"
        for size in (8 * 1024, 64 * 1024):          # the bench's other prefetches: the same bits
            y_pf = gemv.linear(x, w, triton_gemv=True, silu_mul=True, pdl=True, prefetch=size,
                               out=poisoned(m, i, bf))
            assert torch.equal(y_pf, y), f"seed {seed} m {m}: a {size}-byte prefetch changed the output"


def test_prefetch_sizes_and_their_checks():
    """pdl_prefetch's bytes per program: the lever's 16 KB is one K step of a 32 x 256 bf16 tile, 64 KB four, a
    smaller size at least one step; anything but a bool or a byte count >= 0 is refused with the value named."""
    assert gemv.prefetch_steps(32, 256, 2) == 1 and gemv.prefetch_steps(64, 128, 2) == 1
    assert gemv.prefetch_steps(32, 256, 2, 64 * 1024) == 4 and gemv.prefetch_steps(32, 256, 2, 8 * 1024) == 1
    gen, _ = fresh_generator()
    x, w = rnd(2, 64, gen=gen), rnd(32, 64, gen=gen)
    for bad in (-1, 1.5, "64k"):
        with pytest.raises(ValueError, match=f"prefetch must be a bool or a byte count >= 0, got {bad!r}"):
            gemv.linear(x, w, triton_gemv=True, pdl=True, prefetch=bad)


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
    with pytest.raises(ValueError, match="silu_mul, norm and rope fuse into the Triton GEMV"):
        gemv.linear(x, w, silu_mul=True, triton_gemv=False)
    with pytest.raises(ValueError, match="silu_mul needs a \\[2I, K\\] weight, got N=33"):
        gemv.linear(x, rnd(33, 64, gen=gen), silu_mul=True, triton_gemv=True)
    with pytest.raises(ValueError, match="silu_mul, norm and rope fuse into the Triton GEMV"):
        gemv.linear(rnd(17, 64, gen=gen), w, triton_gemv=True, silu_mul=True)
    with pytest.raises(ValueError, match=r"out must be \[2, 16\]"):
        gemv.linear(x, w, triton_gemv=True, silu_mul=True, out=poisoned(2, 32, x.dtype))


# -- the lever fuse_norm: the residual add in one GEMV's epilogue, RMSNorm in the next one's prologue ---------------
@pytest.mark.parametrize("m", [1, 6, 16])
def test_residual_add_then_rmsnorm_across_two_gemvs(m):
    """o-like GEMV + residual -> (r, per-tile sums of squares); the next GEMV multiplies RMSNorm(r) * g, plain and
    with SiLU-mul, split-K 1 and 2: against fp64 references; the sums of squares of the tiles add up to each row's;
    wrong sums (a fault) fail; a row alone gives the bits it gives in the batch."""
    gen, seed = fresh_generator()
    k, n, i, eps = 96, 80, 24, 1e-6
    x, res = rnd(m, k, gen=gen), rnd(m, n, gen=gen)
    w1, g = rnd(n, k, gen=gen) / k ** 0.5, 1 + 0.1 * rnd(n, gen=gen)
    w2, w3 = rnd(40, n, gen=gen) / n ** 0.5, rnd(2 * i, n, gen=gen) / n ** 0.5
    r_ref = x.double() @ w1.double().t() + res.double()
    normed = r_ref * torch.rsqrt((r_ref ** 2).mean(-1, keepdim=True) + eps) * g.double()
    h3 = normed @ w3.double().t()
    for split in (1, 2):
        cfg = dict(gemv.gemv_config(n, k, 132), SPLIT_K=split)
        r, ss = gemv.linear_add(x, w1, res, config=cfg)
        assert rel_l2(r, r_ref) < 2e-6, f"seed {seed} split {split}"
        assert ss.shape == (triton_cdiv(n, cfg["BLOCK_N"]), gemv.MAX_M)
        assert torch.allclose(ss.sum(0)[:m].double(), (r.double() ** 2).sum(-1), rtol=1e-5), f"seed {seed}"
        norm = gemv.NormIn(ss, g, eps)
        for c2 in (dict(gemv.gemv_config(40, n, 132), SPLIT_K=split), None):
            y = gemv.linear(r, w2, triton_gemv=True, norm=norm, config=c2, out=poisoned(m, 40, x.dtype))
            assert rel_l2(y, normed @ w2.double().t()) < 2e-6, f"seed {seed} split {split}"
        y3 = gemv.linear(r, w3, triton_gemv=True, norm=norm, silu_mul=True)
        assert rel_l2(y3, torch.nn.functional.silu(h3[:, :i]) * h3[:, i:]) < 2e-6, f"seed {seed}"
        bad = gemv.linear(r, w2, triton_gemv=True, norm=gemv.NormIn(4 * ss, g, eps))
        assert rel_l2(bad, normed @ w2.double().t()) > 0.3
    if m > 1:
        r1, ss1 = gemv.linear_add(x[m - 1:], w1, res[m - 1:])
        assert torch.equal(r1[0], r[m - 1])
        assert torch.equal(gemv.linear(r1, w2, triton_gemv=True, norm=gemv.NormIn(ss1, g, eps))[0],
                           gemv.linear(r, w2, triton_gemv=True, norm=gemv.NormIn(ss, g, eps))[m - 1]), f"seed {seed}"



@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=[gpu, needs_cuda])])
@pytest.mark.parametrize("m", [1, 5])
def test_gained_handoff_gives_the_norm_forms_bits(m, dtype):
    """linear_add_gain hands the next GEMV round(r * g): its residual and sums are linear_add's bits, its third
    output is r * g rounded once, and the next GEMV (gained: no multiply in its K loop) gives the bits of the norm
    form that multiplies in the loop, split-K 1 and 2, plain and SiLU-mul; the wrong gain handed on (a fault) fails.
    bf16 on the GPU only: Triton's CPU interpreter gets bf16 arithmetic wrong (the in-loop product gives ~1e36)."""
    gen, seed = fresh_generator()
    k, n, eps = 96, 80, 1e-6
    x, res = rnd(m, k, gen=gen, dtype=dtype), rnd(m, n, gen=gen, dtype=dtype)
    w1 = (rnd(n, k, gen=gen) / k ** 0.5).to(dtype)
    g = (1 + 0.1 * rnd(n, gen=gen)).to(dtype)
    w2, w3 = (rnd(40, n, gen=gen) / n ** 0.5).to(dtype), (rnd(48, n, gen=gen) / n ** 0.5).to(dtype)
    for split in (1, 2):
        cfg = dict(gemv.gemv_config(n, k, 132), SPLIT_K=split)
        r, ss = gemv.linear_add(x, w1, res, config=cfg)
        r_g, ss_g, xg = gemv.linear_add_gain(x, w1, res, g, config=cfg)
        assert torch.equal(r_g, r) and torch.equal(ss_g, ss), f"seed {seed} split {split}"
        assert torch.equal(xg, (r.float() * g.float()).to(dtype)), f"seed {seed} split {split}"
        for w, silu in ((w2, False), (w3, True)):
            c2 = dict(gemv.gemv_config(w.shape[0], n, 132), SPLIT_K=split)
            y = gemv.linear(r, w, triton_gemv=True, norm=gemv.NormIn(ss, g, eps), silu_mul=silu, config=c2)
            y_g = gemv.linear(xg, w, triton_gemv=True, norm=gemv.NormIn(ss, g, eps, gained=True), silu_mul=silu,
                              config=c2, out=poisoned(m, w.shape[0] // (2 if silu else 1), dtype))
            assert torch.equal(y_g, y), f"seed {seed} split {split} silu {silu}: the gained form changed the bits"
        _, _, xg_bad = gemv.linear_add_gain(x, w1, res, torch.flip(g, (0,)).contiguous(), config=cfg)
        bad = gemv.linear(xg_bad, w2, triton_gemv=True, norm=gemv.NormIn(ss, g, eps, gained=True))
        good = gemv.linear(r, w2, triton_gemv=True, norm=gemv.NormIn(ss, g, eps))
        assert rel_l2(bad, good) > 0.02, f"seed {seed}: a wrong gain handed on went unseen"
    with pytest.raises(ValueError, match=r"gain must be a contiguous \[80\]"):
        gemv.linear_add_gain(x, w1, res, g[:40])

@gpu
@needs_cuda
def test_gpu_residual_add_then_rmsnorm_qwen3_8b():
    """Qwen3-8B's o [4,096, 4,096] with the residual, then RMSNorm into qkv [6,144, 4,096], bf16, M = 1, 8, 16."""
    gen, seed = fresh_generator()
    bf, h, eps = torch.bfloat16, 4096, 1e-6
    w_o, w_qkv = rnd(h, h, gen=gen, dtype=bf) / 64, rnd(6144, h, gen=gen, dtype=bf) / 64
    g = (1 + 0.1 * rnd(h, gen=gen)).to(bf)
    for m in (1, 8, 16):
        x, res = rnd(m, h, gen=gen, dtype=bf), rnd(m, h, gen=gen, dtype=bf)
        r, ss = gemv.linear_add(x, w_o, res)
        r_ref = x.double() @ w_o.double().t() + res.double()
        assert rel_l2(r, r_ref) < 8e-3, f"seed {seed} m {m}"
        y = gemv.linear(r, w_qkv, triton_gemv=True, norm=gemv.NormIn(ss, g, eps))
        # the engine's hand-off (the add writes r * g, the qkv K loop stays plain): the same bits
        _, _, xg = gemv.linear_add_gain(x, w_o, res, g)
        assert torch.equal(gemv.linear(xg, w_qkv, triton_gemv=True, norm=gemv.NormIn(ss, g, eps, gained=True)),
                           y), f"seed {seed} m {m}: the gained form changed the bits"
        # pdl_prefetch moves only the weights' first touch before the wait: the fused forms keep their bits
        r_pf, ss_pf = gemv.linear_add(x, w_o, res, pdl=True, prefetch=True)
        assert torch.equal(r_pf, r) and torch.equal(ss_pf, ss), f"seed {seed} m {m}: prefetch changed linear_add"
        assert torch.equal(gemv.linear(r, w_qkv, triton_gemv=True, norm=gemv.NormIn(ss, g, eps), pdl=True,
                                       prefetch=True), y), f"seed {seed} m {m}: prefetch changed the norm form"
        rd = r.double()
        normed = rd * torch.rsqrt((rd ** 2).mean(-1, keepdim=True) + eps) * g.double()
        assert rel_l2(y, normed @ w_qkv.double().t()) < 8e-3, f"seed {seed} m {m}"


def test_fused_norm_inputs_are_checked():
    gen, _ = fresh_generator()
    x, w = rnd(2, 64, gen=gen), rnd(32, 64, gen=gen)
    with pytest.raises(ValueError, match=r"residual must be \[2, 32\]"):
        gemv.linear_add(x, w, rnd(2, 31, gen=gen))
    with pytest.raises(ValueError, match="the residual add fuses into the Triton GEMV at 1 <= M <= 16, got M=17"):
        gemv.linear_add(rnd(17, 64, gen=gen), w, rnd(17, 32, gen=gen))
    with pytest.raises(ValueError, match=r"norm needs sums of squares fp32 \[tiles, 16\], row-major, got "
                                         r"torch.float32 \(4, 8\)"):
        gemv.linear(x, w, triton_gemv=True, norm=gemv.NormIn(torch.zeros(4, 8, device=DEV), rnd(64, gen=gen), 1e-6))
    with pytest.raises(ValueError, match=r"row-major, got torch.float32 \(4, 16\) strides \(1, 4\)"):
        gemv.linear(x, w, triton_gemv=True, norm=gemv.NormIn(torch.zeros(16, 4, device=DEV).t(), rnd(64, gen=gen),
                                                             1e-6))
    with pytest.raises(ValueError, match=r"norm needs a contiguous weight \[64\], got \(64,\) strides \(2,\)"):
        gemv.linear(x, w, triton_gemv=True, norm=gemv.NormIn(torch.zeros(4, 16, device=DEV),
                                                             rnd(128, gen=gen)[::2], 1e-6))
    with pytest.raises(ValueError, match=r"residual must be \[2, 32\] .* got \(2, 32\) torch.float64"):
        gemv.linear_add(x, w, rnd(2, 32, gen=gen).double())
    with pytest.raises(ValueError, match="silu_mul, norm and rope fuse into the Triton GEMV"):
        gemv.linear(x, w, triton_gemv=False, norm=gemv.NormIn(torch.zeros(4, 16, device=DEV), rnd(64, gen=gen), 1e-6))


def triton_cdiv(a, b):
    return -(-a // b)


@pytest.fixture(scope="module")
def gemv_sass(tmp_path_factory):
    """`vtengine bench fused-sass` run once: the GEMV compiled for sm_90 on this host (no GPU), cut at its loop."""
    from helpers import static_sass
    return static_sass("vtengine.bench.fused_sass", tmp_path_factory.mktemp("fused_sass"))


def test_fused_operands_load_before_the_k_loop_and_sum_after(gemv_sass):
    """NORM's producer sums and ADD_RES's residual are loaded before the K loop, NORM's fp64 sum runs after it (on
    the H200 the sum before the loop and the residual load after it made the fused GEMVs slower than the kernels
    they replace), and the plain kernel has neither."""
    rows = {(x["form"], x["split"]): x for x in gemv_sass["rows"]}
    for split in (False, True):
        plain, norm, add = rows[("plain", split)], rows[("norm", split)], rows[("add_res", split)]
        assert norm["pre_loads"] > plain["pre_loads"] and add["pre_loads"] > plain["pre_loads"], (split, rows)
        assert norm["pre"] < plain["pre"] + 120, ("the fp64 sum moved before the K loop", norm, plain)
        assert norm["post"] > plain["post"] + 150, ("the fp64 sum is not after the K loop", norm, plain)
        assert add["post_loads"] == plain["post_loads"], ("the residual is loaded after the K loop", add, plain)
        # what the engine runs: the add hands on x * g, so the norm GEMV's K loop is the plain one
        gained, gain = rows[("norm_gained", split)], rows[("add_res_gain", split)]
        # (same loads; the instruction count moves by a dozen with the scheduling around it, the norm's by 26-57)
        assert gained["loop_loads"] == plain["loop_loads"] < norm["loop_loads"], ("g is read in the K loop", rows)
        assert abs(gained["loop"] - plain["loop"]) <= 15 and gained["loop"] < norm["loop"], rows
        assert gained["post"] >= plain["post"] + 150 and gain["pre_loads"] > add["pre_loads"], rows
        assert abs(gain["loop"] - plain["loop"]) <= 15 and gain["post_loads"] == plain["post_loads"], rows
        # the lever fuse_rope: the qkv epilogue after the K loop only (its loads, the head's sums, cos/sin, slots)
        rope = rows[("norm_gained_rope", split)]
        assert rope["pre_loads"] == gained["pre_loads"] and rope["loop_loads"] == gained["loop_loads"], rows
        assert abs(rope["loop"] - gained["loop"]) <= 25 and rope["post_loads"] > gained["post_loads"], rows


def test_pdl_prefetch_asks_l2_for_weights_before_the_wait_and_loads_nothing_there(gemv_sass):
    """The lever pdl_prefetch on the GEMV: L2 prefetches of W sit before griddepcontrol.wait, and no global load
    does (x, the residual and the producer's sums are the previous kernel's output); plain PDL has neither."""
    pdl = gemv_sass["pdl"]
    assert pdl["pdl_prefetch"]["waits"] >= 1 and pdl["pdl_prefetch"]["prefetches"] > 0, pdl
    assert pdl["pdl_prefetch"]["loads"] == 0 and pdl["pdl"]["prefetches"] == 0 and pdl["pdl"]["loads"] == 0, pdl


def test_the_bench_fused_forms_compute_what_the_engine_does():
    """`python -m vtengine.bench.w4a16 OUT --bf16-only` times fuse_norm's GEMV forms beside the plain one: their
    operands must pass the kernels' checks and the forms compute RMSNorm-then-GEMV and GEMV-plus-residual."""
    from vtengine.bench.w4a16 import fused_gemv_forms
    gen = torch.Generator().manual_seed(0)
    m, k, n = 3, 64, 48
    forms = fused_gemv_forms(m, k, n, torch.device("cpu"), gen, dtype=torch.float32)    # the interpreter: fp32
    norm, residual, gain = forms["operands"]
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    inv = (norm.ss[:, :m].double().sum(0) / k + norm.eps).rsqrt()
    want = ((x.double() * norm.weight.double()) @ w.double().t()) * inv[:, None]
    assert rel_l2(forms["norm"][0](x, w)(), want) < 1e-5
    assert rel_l2(forms["add_res"][0](x, w)(), x.double() @ w.double().t() + residual.double()) < 1e-5
    assert forms["norm"][1] == k * 2 + norm.ss.numel() * 4 and forms["add_res"][1] > m * n * 2
    # the engine's forms: x already times g (only the rsqrt left), and the add that also writes residual * gain
    assert rel_l2(forms["norm_gained"][0](x, w)(), (x.double() @ w.double().t()) * inv[:, None]) < 1e-5
    r = x.double() @ w.double().t() + residual.double()
    assert rel_l2(forms["add_res_gain"][0](x, w)(), r) < 1e-5
    _, _, xg = gemv.linear_add_gain(x, w, residual, gain)
    assert rel_l2(xg, r * gain.double()) < 1e-5
    # the lever fuse_rope's pair at a qkv shape (1 q head, 1 kv head of 16): the kernel after the GEMV, and the GEMV
    # running it, write the same q and cache rows
    forms = fused_gemv_forms(m, k, n, torch.device("cpu"), gen, dtype=torch.float32, heads=(1, 1, 16))
    kc, vc = forms["rope_cache"]
    q1 = forms["norm_gained_epilogue"][0](x, w)()
    caches = kc.clone(), vc.clone()
    assert caches[0].abs().sum() > 0 and caches[1].abs().sum() > 0
    kc.zero_(), vc.zero_()
    q2 = forms["norm_gained_rope"][0](x, w)()
    assert torch.equal(q1, q2) and torch.equal(kc, caches[0]) and torch.equal(vc, caches[1])
    assert forms["norm_gained_epilogue"][1] == forms["norm_gained_rope"][1] + m * n * 2
    with pytest.raises(ValueError, match=r"heads \(2, 1, 16\) do not make a qkv weight of N=48"):
        fused_gemv_forms(m, k, n, torch.device("cpu"), gen, heads=(2, 1, 16))
