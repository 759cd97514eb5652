"""The lever fuse_rope: the qkv epilogue (q/k RMSNorm, RoPE, the paged KV store) in the qkv projection's own epilogue
(ROPE: the bf16 Triton GEMV, vtengine/kernels/gemv.py, and the W4A16 GEMM's dense route, w4a16.py), against the pair
it replaces (the projection, then fused.qkv_epilogue) and the fp64 torch reference.

CPU hosts run it in Triton's interpreter at tiny shapes (fp32: the fused and unfused pair must agree to the bit);
the ``gpu`` tests take Qwen3-8B's qkv shape in bf16, eagerly and replayed from a CUDA graph. q and the caches are
poisoned with NaN before each run, so a slot written that should not be (or not written that should) shows.
"""
from __future__ import annotations

import pytest
import torch

from vtengine import counters
from vtengine.backends.torch_backend import TorchBackend, rope_cos_sin
from vtengine.kernels import fused, gemv, w4a16
from vtengine.kernels.epilogue import NormIn
from vtengine.quant import dequantize, quantize
from vtengine.testing import fresh_generator, rel_l2

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
REF = TorchBackend()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the CPU interpreter runs the tiny-shape tests)")


class Case:
    """A qkv projection's operands: x [M, K], the fused weight [(Hq + 2 Hkv) D, K], positions, slots (token 1 a
    padded graph row, slot -1, when M > 2), q/k norm weights, cos/sin, and NaN caches of 16 pages of 4."""

    def __init__(self, m, k, hq, hkv, d, gen, dtype=torch.float32, norm=True, pages=16, page=4):
        self.hq, self.hkv, self.d = hq, hkv, d
        self.x = torch.randn(m, k, generator=gen).to(DEV, dtype)
        self.w = (torch.randn((hq + 2 * hkv) * d, k, generator=gen) / k ** 0.5).to(DEV, dtype)
        self.pos = torch.randint(0, 1000, (m,), generator=gen).to(DEV)
        self.slots = torch.randperm(pages * page, generator=gen)[:m].to(DEV)
        if m > 2:
            self.slots[1] = -1
        self.qn = (1 + 0.2 * torch.randn(d, generator=gen)).to(DEV, dtype) if norm else None
        self.kn = (1 + 0.2 * torch.randn(d, generator=gen)).to(DEV, dtype) if norm else None
        self.cs = rope_cos_sin(d, 1024, 1e6, device=DEV)
        self.shape = (pages, page, hkv, d)
        self.dtype = dtype
        self.qw = None                  # a W4A16 copy of w: the projection runs the W4A16 GEMM's dense route

    def project(self, config=None, **kw):
        if self.qw is not None:
            return w4a16.w4a16_linear(self.x, self.qw, dense=True, rot=True, config=config, **kw)
        return gemv.linear(self.x, self.w, triton_gemv=True, config=config, **kw)

    def caches(self):
        return [torch.full(self.shape, float("nan"), dtype=self.dtype, device=DEV) for _ in range(2)]

    def rope(self, kc, vc, **kw):
        return fused.RopeOut(self.hq, self.hkv, self.pos, self.cs, kc, vc, self.slots, self.qn, self.kn, 1e-6, **kw)

    def fused(self, config=None, fast_math=False, **kw):
        kc, vc = self.caches()
        q_out = torch.full((self.x.shape[0], self.hq, self.d), float("nan"), dtype=self.dtype, device=DEV)
        q = self.project(config, rope=self.rope(kc, vc, q_out=q_out, fast_math=fast_math), **kw)
        assert q.data_ptr() == q_out.data_ptr()
        return q, kc, vc

    def unfused(self, config=None, fast_math=False, **kw):
        kc, vc = self.caches()
        qkv = self.project(config, **kw)
        return fused.qkv_epilogue(qkv, self.hq, self.hkv, self.pos, self.cs, kc, vc, self.slots, self.qn, self.kn,
                                  1e-6, fast_math=fast_math), kc, vc

    def reference(self):
        kc, vc = (torch.full(self.shape, float("nan"), dtype=torch.float64, device=DEV) for _ in range(2))
        w = self.w if self.qw is None else dequantize(self.qw, dtype=torch.float32)
        qkv = REF.linear(self.x.double(), w.double())
        q = REF.qkv_epilogue(qkv, self.hq, self.hkv, self.pos, self.cs.double(), kc, vc, self.slots,
                             None if self.qn is None else self.qn.double(),
                             None if self.kn is None else self.kn.double(), 1e-6)
        return q, kc, vc


def same_bits(a, b):
    """Equal to the bit, NaN where the other is NaN (the untouched cache slots)."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def cfg(block_n, split):
    return dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=16, SPLIT_K=split, num_warps=4, num_stages=2)


@pytest.mark.parametrize("m,block_n,split,norm", [(1, 32, 1, True), (3, 16, 2, True), (16, 8, 4, False),
                                                   (5, 16, 1, False), (9, 32, 4, True)])
def test_the_gemv_writes_q_and_the_cache_the_unfused_pair_writes(m, block_n, split, norm):
    """One to four tiles a head, one to four splits: q and every cache slot to the bit of the GEMV then the
    qkv_epilogue kernel (one head's tiles each summed in split order, rounded once, the epilogue's expressions), the
    padded token's slot and every other slot untouched, and both near the fp64 reference."""
    gen, seed = fresh_generator()
    c = Case(m, 64, 4, 2, 32, gen, norm=norm)
    got, want = c.fused(cfg(block_n, split)), c.unfused(cfg(block_n, split))
    for name, a, b in zip("q k v".split(), got, want):
        assert same_bits(a, b), f"seed {seed}: {name} differs from the unfused pair"
    ref = c.reference()
    assert not torch.isnan(got[0]).any(), f"seed {seed}: a q row left unwritten"
    for a, b in zip(got, ref):
        assert torch.equal(torch.isnan(a), torch.isnan(b)), f"seed {seed}: a slot written or missed"
        ok = ~torch.isnan(b)
        assert rel_l2(a[ok].double(), b[ok]) < 2e-6, f"seed {seed}"


def test_the_engine_form_with_fuse_norm_and_fast_math_keeps_the_bits():
    """What the decoder runs with fuse_norm and fast_math on (their defaults): the norm GEMV on linear_add_gain's x *
    g, the head's rsqrt the fast one, the GEMV's default tiles; and pdl (a no-op under the interpreter) set."""
    gen, seed = fresh_generator()
    c = Case(4, 64, 4, 2, 32, gen)
    res, xo = (torch.randn(4, 64, generator=gen).to(DEV) for _ in range(2))
    wo = torch.randn(64, 64, generator=gen).to(DEV) / 8
    g = (1 + 0.1 * torch.randn(64, generator=gen)).to(DEV)
    r, ss, xg = gemv.linear_add_gain(xo, wo, res, g)
    norm = NormIn(ss, g, 1e-6, fast_math=True, gained=True)
    kc, vc = c.caches()
    q = gemv.linear(xg, c.w, triton_gemv=True, norm=norm, pdl=True, rope=c.rope(kc, vc, fast_math=True))
    kc2, vc2 = c.caches()
    qkv = gemv.linear(xg, c.w, triton_gemv=True, norm=norm, pdl=True)
    q2 = fused.qkv_epilogue(qkv, 4, 2, c.pos, c.cs, kc2, vc2, c.slots, c.qn, c.kn, 1e-6, fast_math=True)
    for a, b in ((q, q2), (kc, kc2), (vc, vc2)):
        assert same_bits(a, b), f"seed {seed}"


def test_faults_in_the_head_epilogue_are_seen():
    """The comparison can fail: a position one off (the rotation), a k norm weight scaled (the norm), the slots of two
    tokens swapped (the store) each change what the GEMV writes; the case itself is deterministic."""
    gen, seed = fresh_generator()
    c = Case(4, 64, 4, 2, 32, gen)
    want = c.fused()
    pos, kn, slots = c.pos, c.kn, c.slots
    c.pos = pos + 1
    assert not same_bits(c.fused()[0], want[0]), f"seed {seed}: an off-by-one position passed"
    c.pos, c.kn = pos, kn * 1.5
    assert not same_bits(c.fused()[1], want[1]), f"seed {seed}: a wrong k_norm passed"
    c.kn, c.slots = kn, slots[[2, 1, 0, 3]]
    assert not same_bits(c.fused()[1], want[1]), f"seed {seed}: swapped slots passed"
    c.slots = slots
    assert all(same_bits(a, b) for a, b in zip(c.fused(), want)), f"seed {seed}: the case is not deterministic"


def w4a16_cfg(m, n, k, fmt, block_n, split):
    cfg = dict(w4a16.dense_config(m, n, k, fmt))
    cfg.update(BLOCK_N=block_n, BLOCK_K=64, SPLIT_K=split)
    return cfg


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
@pytest.mark.parametrize("m,block_n,split", [(1, 16, 1), (3, 16, 2), (9, 32, 2)])
def test_the_w4a16_gemm_writes_q_and_the_cache_the_unfused_pair_writes(fmt, m, block_n, split):
    """The W4A16 GEMM's dense swap-AB tiles with ROPE: the same bits as the GEMM then the qkv_epilogue kernel (NVFP4's
    global scale applied before the partials meet), near the reference of the dequantized weight."""
    gen, seed = fresh_generator()
    c = Case(m, 128, 4, 2, 32, gen)
    c.qw = quantize(c.w, fmt)
    cfg = w4a16_cfg(m, c.w.shape[0], 128, fmt, block_n, split)
    got, want = c.fused(cfg), c.unfused(cfg)
    for name, a, b in zip("q k v".split(), got, want):
        assert same_bits(a, b), f"seed {seed}: {name} differs from the unfused pair ({fmt})"
    for a, b in zip(got, c.reference()):
        ok = ~torch.isnan(b)
        assert torch.equal(torch.isnan(a), ~ok) and rel_l2(a[ok].double(), b[ok]) < 2e-6, f"seed {seed} ({fmt})"


def test_bad_rope_operands_are_clear_errors():
    gen, _ = fresh_generator()
    c = Case(3, 64, 4, 2, 32, gen)
    kc, vc = c.caches()
    with pytest.raises(ValueError, match="rope needs whole heads per tile group: head_dim 32 is not a multiple"):
        gemv.linear(c.x, c.w, triton_gemv=True, config=cfg(64, 1), rope=c.rope(kc, vc))
    with pytest.raises(ValueError, match="takes neither silu_mul nor out"):
        gemv.linear(c.x, c.w, triton_gemv=True, silu_mul=True, rope=c.rope(kc, vc))
    with pytest.raises(ValueError, match=r"silu_mul, norm and rope fuse into the Triton GEMV .* got triton_gemv=False"):
        gemv.linear(c.x, c.w, triton_gemv=False, rope=c.rope(kc, vc))
    with pytest.raises(ValueError, match="do not match 4 q heads, 1 kv heads"):
        gemv.linear(c.x, c.w, triton_gemv=True, rope=fused.RopeOut(4, 1, c.pos, c.cs, kc[:, :, :1], vc[:, :, :1],
                                                                  c.slots))
    with pytest.raises(ValueError, match="strides .* must agree"):
        gemv.linear(c.x, c.w, triton_gemv=True, rope=c.rope(kc, vc.transpose(0, 1).contiguous().transpose(0, 1)))
    with pytest.raises(ValueError, match=r"must both be \[3\]"):
        gemv.linear(c.x, c.w, triton_gemv=True, rope=fused.RopeOut(4, 2, c.pos[:2], c.cs, kc, vc, c.slots))
    qw = quantize(c.w, "mxfp4")
    with pytest.raises(ValueError, match="norm, residual and rope fuse into the dense swap-AB tiles"):
        w4a16.w4a16_linear(c.x, qw, dense=False, rope=c.rope(kc, vc))
    with pytest.raises(ValueError, match="takes neither silu_mul, residual nor out"):
        w4a16.w4a16_linear(c.x, qw, dense=True, out=torch.empty(3, 256), rope=c.rope(kc, vc))
    with pytest.raises(ValueError, match="head_dim 32 is not a multiple of the config's BLOCK_N=64"):
        w4a16.w4a16_linear(c.x, qw, dense=True, config=w4a16_cfg(3, 256, 64, "mxfp4", 64, 1), rope=c.rope(kc, vc))


def test_the_counters_name_the_fused_launch():
    gen, _ = fresh_generator()
    c = Case(2, 64, 4, 2, 32, gen)
    counters.reset()
    c.fused()
    snap = counters.snapshot()
    assert any("'rope'" in v for st in snap["dense_linear"].values() for v in st["variants"]), snap
    assert "qkv_epilogue" not in snap


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_gpu_qwen3_8b_qkv_with_its_epilogue_eager_and_graphed(fmt):
    """Qwen3-8B's qkv [6,144, 4,096], 32 q heads and 8 kv heads of 128, at M = 1, 8, 16, through the bf16 GEMV or
    the W4A16 GEMM (MXFP4, the default rotation decode): v to the bit of the unfused pair (no norm: the same sums,
    rounded once), q and k within a rounding of it (the norm's sum of squares may reduce in another order), and the
    same bits again from a CUDA-graph replay with pdl_prefetch (the head counters reset themselves)."""
    gen, seed = fresh_generator()
    for m in (1, 8, 16):
        c = Case(m, 4096, 32, 8, 128, gen, dtype=torch.bfloat16, pages=64, page=16)
        if fmt == "mxfp4":
            c.qw = quantize(c.w, "mxfp4")
        got, want = c.fused(fast_math=False), c.unfused()
        assert same_bits(got[2], want[2]), f"seed {seed} m {m}: v differs from the unfused pair"
        for name, a, b in (("q", got[0], want[0]), ("k", got[1], want[1])):
            ok = ~torch.isnan(b)
            assert torch.equal(torch.isnan(a), ~ok), f"seed {seed} m {m}: {name} slots written or missed"
            assert rel_l2(a[ok].float(), b[ok].float()) < 4e-3, f"seed {seed} m {m}: {name}"
        ref = c.reference()
        for a, b in zip(got, ref):
            ok = ~torch.isnan(b)
            assert rel_l2(a[ok].double(), b[ok]) < 8e-3, f"seed {seed} m {m}"
        kc, vc = c.caches()
        q_out = torch.empty((m, 32, 128), dtype=torch.bfloat16, device=DEV)
        rope = c.rope(kc, vc, q_out=q_out)
        c.project(pdl=True, prefetch=True, rope=rope)           # compile (and build the weight's copy) first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c.project(pdl=True, prefetch=True, rope=rope)
        for _ in range(2):
            q_out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert same_bits(q_out, got[0]) and same_bits(kc, got[1]) and same_bits(vc, got[2]), \
                f"seed {seed} m {m}: a replay (with pdl_prefetch) changed the bits"


def test_the_backend_offers_rope_only_where_it_applies():
    """TritonBackend.rope_out: a RopeOut at decode sizes with the lever on, on either projection route, and None
    with the lever off, past 16 tokens, on the grouped W4A16 route, or where a head would straddle tile groups (the
    launch's own tiles: the interpreter's 16-row GEMV and 32-row W4A16 tiles on a CPU host)."""
    from vtengine.backends.triton_backend import TritonBackend
    from vtengine.kernels import sm_count
    from vtengine.levers import resolve
    gen, _ = fresh_generator()
    on = TritonBackend(resolve({"fuse_rope": True}))
    grouped = TritonBackend(resolve({"fuse_rope": True, "marlin_dense": False}))
    off = TritonBackend(resolve({"fuse_rope": False}))

    def offer(be, tokens, weight, d):
        cache = torch.zeros(4, 4, 1, d, device=DEV)
        return be.rope_out(tokens, weight, 1, 1, torch.zeros(tokens, dtype=torch.long, device=DEV),
                           rope_cos_sin(d, 64, 1e4, device=DEV), cache, cache.clone(),
                           torch.zeros(tokens, dtype=torch.int32, device=DEV))
    for d in (16, 32):
        w = torch.randn(3 * d, 64, generator=gen).to(DEV)
        qw = quantize(w, "mxfp4")
        got = offer(on, 3, w, d)
        whole = d % gemv.gemv_config(3 * d, 64, sm_count(DEV))["BLOCK_N"] == 0
        assert (isinstance(got, fused.RopeOut) and got.fast_math == on.levers.on("fast_math")) == whole, d
        assert offer(off, 3, w, d) is None and offer(on, 17, w, d) is None, d
        assert (offer(on, 3, qw, d) is not None) == (d % w4a16.launch_config(3, qw, dense=True)["BLOCK_N"] == 0), d
        assert offer(grouped, 3, qw, d) is None, d
    w = torch.randn(24, 64, generator=gen).to(DEV)
    assert offer(on, 3, w, 8) is None              # an 8-wide head in the GEMV's 16-row tiles
