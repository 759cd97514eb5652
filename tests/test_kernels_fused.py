"""The fused kernels (vtengine/kernels/fused.py) against the torch reference backend.

CPU hosts run them in Triton's interpreter with fp32 activations (its fp32 -> bf16 conversion truncates instead
of rounding to nearest, so bf16 is only bounded loosely there); CUDA hosts run the same tests compiled, and the
``gpu`` tests add real shapes in bf16, where the rounding points must match the reference exactly. Inputs are
fresh random draws (seed printed), outputs are poisoned with NaN before each run.
"""
from __future__ import annotations

import math

import pytest
import torch

from vtengine import counters
from vtengine.backends.torch_backend import TorchBackend, rope_cos_sin
from vtengine.kernels import fused
from vtengine.testing import fresh_generator, rel_l2

REF = TorchBackend()
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BOUND = {torch.float32: 2e-6, torch.bfloat16: 8e-3}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the CPU interpreter runs the tiny-shape tests)")


def rnd(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEV)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


# -- RMSNorm ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fast_math", [False, True])
@pytest.mark.parametrize("shape", [(5, 96), (3, 4, 64), (1, 1000)])
def test_rms_norm(shape, fast_math):
    gen, seed = fresh_generator()
    x, w = rnd(*shape, gen=gen, scale=3.0), rnd(shape[-1], gen=gen)
    out = fused.rms_norm(x, w, 1e-6, fast_math=fast_math, out=poisoned(shape, x.dtype))
    assert out.shape == x.shape
    assert rel_l2(out, REF.rms_norm(x.double(), w.double(), 1e-6)) < BOUND[x.dtype], f"seed {seed}"


@pytest.mark.parametrize("fast_math", [False, True])
def test_add_rms_norm(fast_math):
    gen, seed = fresh_generator()
    x, r, w = rnd(6, 128, gen=gen), rnd(6, 128, gen=gen, scale=10.0), rnd(128, gen=gen)
    out, new_res = fused.add_rms_norm(x, r, w, 1e-5, fast_math=fast_math, out=poisoned((6, 128), x.dtype),
                                      residual_out=poisoned((6, 128), x.dtype))
    ref_out, ref_res = REF.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(new_res, ref_res), f"seed {seed}: the rounded sum differs from the reference"
    assert rel_l2(out, ref_out) < BOUND[x.dtype], f"seed {seed}"


def test_rms_norm_counters_name_the_variant():
    gen, _ = fresh_generator()
    x, w = rnd(4, 64, gen=gen), rnd(64, gen=gen)
    counters.reset()
    fused.rms_norm(x, w, 1e-6, fast_math=False)
    fused.add_rms_norm(x, x, w, 1e-6, fast_math=True)
    fused.add_rms_norm(x, x, w, 1e-6, fast_math=True)
    snap = counters.snapshot()["rms_norm"]
    assert snap["precise"]["launches"] == 1 and snap["fast_math"]["launches"] == 2
    assert snap["precise"]["grids"] == {"4": 1}
    assert snap["fast_math"]["variants"] == {"('add_rms_norm', 64, True)": 2}


# -- SiLU and mul ----------------------------------------------------------------------------------------------
def test_silu_mul():
    gen, seed = fresh_generator()
    gu = rnd(7, 2 * 1500, gen=gen, scale=4.0)            # I = 1500: two column blocks, the second partial
    out = fused.silu_mul(gu, out=poisoned((7, 1500), gu.dtype))
    assert rel_l2(out, REF.silu_mul(gu.double())) < BOUND[gu.dtype], f"seed {seed}"


# -- RoPE ------------------------------------------------------------------------------------------------------
def qk_views(t, hq, hkv, d, gen, dtype=torch.float32):
    """q and k as strided views of one fused qkv row, the way the model hands them over."""
    qkv = rnd(t, (hq + 2 * hkv) * d, gen=gen, dtype=dtype)
    return qkv[:, :hq * d].view(t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)


def test_rope_matches_the_reference_on_strided_views():
    gen, seed = fresh_generator()
    q, k = qk_views(6, 4, 2, 64, gen)
    pos = torch.tensor([0, 5, 3, 900, 100, 2], device=DEV)
    cs = rope_cos_sin(64, 1024, 1e6, device=DEV)
    qo, ko = fused.rope(q, k, pos, cs, q_out=poisoned(q.shape, q.dtype), k_out=poisoned(k.shape, k.dtype))
    rq, rk = REF.rope(q.double(), k.double(), pos, cs.double())
    assert rel_l2(qo, rq) < BOUND[q.dtype] and rel_l2(ko, rk) < BOUND[k.dtype], f"seed {seed}"


def test_rope_fault_wrong_positions_fail():
    gen, seed = fresh_generator()
    q, k = qk_views(4, 2, 1, 32, gen)
    pos = torch.tensor([1, 2, 3, 4], device=DEV)
    cs = rope_cos_sin(32, 64, 1e4, device=DEV)
    rq, _ = REF.rope(q, k, pos, cs)
    assert rel_l2(fused.rope(q, k, pos, cs)[0], rq) < BOUND[q.dtype]
    assert rel_l2(fused.rope(q, k, pos + 1, cs)[0], rq) > 1e-2, f"seed {seed}: an off-by-one position passed"


# -- qkv epilogue: q/k norm + RoPE + KV store ------------------------------------------------------------------
def epilogue_case(t, hq, hkv, d, gen, dtype=torch.float32, norm=True, block_size=4, num_blocks=16):
    qkv = rnd(t, (hq + 2 * hkv) * d, gen=gen, dtype=dtype, scale=2.0)
    pos = torch.randint(0, 1000, (t,), generator=gen).to(DEV)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:t].to(DEV)
    if t > 2:
        slots[1] = -1                                   # a padded graph row: nothing may be stored for it
    qn = rnd(d, gen=gen, dtype=dtype) if norm else None
    kn = rnd(d, gen=gen, dtype=dtype) if norm else None
    cache = [poisoned((num_blocks, block_size, hkv, d), dtype) for _ in range(2)]
    return qkv, pos, slots, qn, kn, cache


def run_epilogue(be_fn, qkv, hq, hkv, pos, cs, slots, qn, kn, cache, **kw):
    kc, vc = cache[0].clone(), cache[1].clone()
    q = be_fn(qkv, hq, hkv, pos, cs, kc, vc, slots, qn, kn, 1e-6, **kw)
    return q, kc, vc


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("fast_math", [False, True])
def test_qkv_epilogue_matches_the_unfused_reference(norm, fast_math):
    gen, seed = fresh_generator()
    t, hq, hkv, d = 5, 4, 2, 32
    qkv, pos, slots, qn, kn, cache = epilogue_case(t, hq, hkv, d, gen, norm=norm)
    cs = rope_cos_sin(d, 1024, 1e6, device=DEV)
    q, kc, vc = run_epilogue(fused.qkv_epilogue, qkv, hq, hkv, pos, cs, slots, qn, kn, cache, fast_math=fast_math,
                             q_out=poisoned((t, hq, d), qkv.dtype))
    rq, rkc, rvc = run_epilogue(REF.qkv_epilogue, qkv.double(), hq, hkv, pos, cs.double(), slots,
                                None if qn is None else qn.double(), None if kn is None else kn.double(),
                                [c.double() for c in cache])
    assert rel_l2(q, rq) < BOUND[qkv.dtype], f"seed {seed}"
    stored = slots >= 0
    nb, bs = cache[0].shape[:2]
    for got, want in ((kc, rkc), (vc, rvc)):
        got, want = got.view(nb * bs, hkv, d), want.view(nb * bs, hkv, d)
        assert rel_l2(got[slots[stored]], want[slots[stored]]) < BOUND[qkv.dtype], f"seed {seed}"
        untouched = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
        untouched[slots[stored]] = False
        assert torch.isnan(got[untouched]).all(), f"seed {seed}: a slot outside slot_mapping was written"


def test_qkv_epilogue_backend_routes_and_subsets_agree():
    """The Triton backend's fused launch, its unfused composition (a kernel subset without rope) and the torch
    backend give the same q and cache on one input; the counters show which ran."""
    from vtengine.backends.triton_backend import TritonBackend
    gen, seed = fresh_generator()
    t, hq, hkv, d = 3, 4, 1, 16
    qkv, pos, slots, qn, kn, cache = epilogue_case(t, hq, hkv, d, gen)
    cs = rope_cos_sin(d, 1024, 1e4, device=DEV)
    counters.reset()
    fused_out = run_epilogue(TritonBackend().qkv_epilogue, qkv, hq, hkv, pos, cs, slots, qn, kn, cache)
    assert counters.launches("qkv_epilogue") == 1              # under either math variant (fast_math's default)
    counters.reset()
    subset = TritonBackend(kernels=["rms_norm", "store_kv"])
    assert not subset.fuse_qkv_epilogue
    unfused_out = run_epilogue(subset.qkv_epilogue, qkv, hq, hkv, pos, cs, slots, qn, kn, cache)
    snap = counters.snapshot()
    assert "qkv_epilogue" not in snap and counters.launches("rms_norm") == 2
    ref_out = run_epilogue(REF.qkv_epilogue, qkv, hq, hkv, pos, cs, slots, qn, kn, cache)
    for a, b, c in zip(fused_out, unfused_out, ref_out):
        ok = ~torch.isnan(c)
        assert torch.equal(torch.isnan(a), ~ok) and torch.equal(torch.isnan(b), ~ok), f"seed {seed}"
        assert rel_l2(a[ok], c[ok]) < BOUND[qkv.dtype] and rel_l2(b[ok], c[ok]) < BOUND[qkv.dtype], f"seed {seed}"


def test_qkv_epilogue_faults_fail():
    """Each part can fail the comparison: a wrong k_norm, a shifted position, a swapped slot."""
    gen, seed = fresh_generator()
    t, hq, hkv, d = 4, 2, 2, 16
    qkv, pos, slots, qn, kn, cache = epilogue_case(t, hq, hkv, d, gen)
    cs = rope_cos_sin(d, 2048, 1e4, device=DEV)
    rq, rkc, _ = run_epilogue(REF.qkv_epilogue, qkv, hq, hkv, pos, cs, slots, qn, kn, cache)
    ok = ~torch.isnan(rkc)
    _, kc, _ = run_epilogue(fused.qkv_epilogue, qkv, hq, hkv, pos, cs, slots, qn, kn * 1.5, cache)
    assert rel_l2(kc[ok], rkc[ok]) > 1e-2, f"seed {seed}: a wrong k_norm passed"
    q, _, _ = run_epilogue(fused.qkv_epilogue, qkv, hq, hkv, pos + 1, cs, slots, qn, kn, cache)
    assert rel_l2(q, rq) > 1e-2, f"seed {seed}: an off-by-one position passed"
    _, kc, _ = run_epilogue(fused.qkv_epilogue, qkv, hq, hkv, pos, cs, slots.flip(0), qn, kn, cache)
    assert not torch.equal(torch.isnan(kc), torch.isnan(rkc)) or rel_l2(kc[ok], rkc[ok]) > 1e-2, f"seed {seed}"


def test_qkv_epilogue_bad_inputs_are_clear_errors():
    gen, _ = fresh_generator()
    qkv, pos, slots, qn, kn, cache = epilogue_case(3, 4, 2, 16, gen)
    cs = rope_cos_sin(16, 64, 1e4, device=DEV)
    with pytest.raises(ValueError, match="do not match 3 q heads"):
        fused.qkv_epilogue(qkv, 3, 2, pos, cs, *cache, slots, qn, kn)
    with pytest.raises(ValueError, match="go together"):
        fused.qkv_epilogue(qkv, 4, 2, pos, cs, *cache, slots, qn, None)
    with pytest.raises(ValueError, match=r"must both be \[3\]"):
        fused.qkv_epilogue(qkv, 4, 2, pos[:2], cs, *cache, slots, qn, kn)


# -- argmax ----------------------------------------------------------------------------------------------------
def test_argmax_lowest_index_on_ties_across_chunks():
    gen, seed = fresh_generator()
    v = 20000                                          # one program a row (1 SM): three 8192-wide loads
    lg = rnd(5, v, gen=gen)
    lg[0, 100] = lg[0, 9000] = 50.0                    # tie across chunks: the first wins
    lg[1, 19999] = 50.0                                # the maximum in the tail
    lg[2, 8191] = lg[2, 8192] = 50.0                   # tie across a chunk boundary
    lg[3] = float("-inf")                              # all -inf: index 0, like torch
    lg[4, 7] = lg[4, 3] = 50.0                         # tie inside a chunk
    out = fused.argmax(lg, out=torch.full((5,), -1, dtype=torch.int64, device=DEV), num_sms=1)
    assert out.tolist() == REF.greedy(lg).tolist() == [100, 19999, 8191, 0, 3], f"seed {seed}"


def test_argmax_random_rows_and_fault():
    gen, seed = fresh_generator()
    lg = rnd(9, 3000, gen=gen, dtype=torch.bfloat16)    # bf16 makes ties likely
    assert torch.equal(fused.argmax(lg), REF.greedy(lg)), f"seed {seed}"
    # a fault (reading every row from row 0) must not go unnoticed
    bad = fused.argmax(lg[:1].expand(9, -1))
    assert not torch.equal(bad, REF.greedy(lg)) or REF.greedy(lg).unique().numel() == 1


@pytest.mark.parametrize("num_sms", [132, 7])
def test_argmax_split_rows_equal_one_program_per_row(num_sms):
    """A row cut across programs (slices of whole 2,048-logit loads, the last program reducing) gives the token one
    program per row gives, at every cut: ties across a slice boundary go to the lower index, all -inf gives 0, NaN
    wins at its lowest index, and the arrival counters are reset for the next launch (the same call twice)."""
    gen, seed = fresh_generator()
    v = 3 * fused.ARGMAX_SPLIT_BLOCK + 100             # 4 slices at most, the last partial
    b = 7
    splits = fused.argmax_splits(b, v, num_sms)
    assert splits == (4 if num_sms == 132 else 1), splits
    lg = rnd(b, v, gen=gen, dtype=torch.bfloat16)
    edge = fused.ARGMAX_SPLIT_BLOCK
    lg[0, 5] = lg[0, v - 1] = 50.0                     # tie between the first and the last slice: the first wins
    lg[1, edge - 1] = lg[1, edge] = 50.0               # tie across a slice boundary
    lg[2] = float("-inf")                              # all -inf: index 0, like torch
    lg[3, 2 * edge + 3] = float("nan")                 # NaN wins, in a middle slice
    lg[3, 3 * edge + 1] = float("nan")
    lg[4, v - 1] = 50.0                                # the maximum in the tail of the last slice
    lg[5, 2 * edge + 9] = lg[5, 2 * edge + 4] = 50.0   # tie inside a slice
    ref = REF.greedy(lg)
    assert ref[:6].tolist() == [5, edge - 1, 0, 2 * edge + 3, v - 1, 2 * edge + 4]
    counters.reset()
    for _ in range(2):
        out = fused.argmax(lg, out=torch.full((b,), -1, dtype=torch.int64, device=DEV), num_sms=num_sms)
        assert torch.equal(out, ref), f"seed {seed}: {out.tolist()} != {ref.tolist()}"
    assert counters.snapshot()["argmax"]["default"]["grids"] == {f"{b}x{splits}": 2}
    if splits > 1:
        assert not fused._argmax_state(lg.device)[0].any(), "an arrival counter was left set"


@pytest.mark.parametrize("num_sms", [1, 4, 132])
def test_argmax_slices_of_several_loads_and_nan_over_inf(num_sms):
    """Slices of three 2,048-logit loads each (4 SMs, 2 rows: 2 slices a row), one load each (132) and one program
    a row (1): ties across a load and across a slice boundary go to the lower index; a NaN beats a +inf before it
    (torch counts NaN as the largest), the first NaN wins, and a NaN row's later chunks cannot displace it."""
    gen, seed = fresh_generator()
    edge = fused.ARGMAX_SPLIT_BLOCK
    v = 5 * edge + 100
    lg = rnd(4, v, gen=gen)
    lg[0, edge - 1] = lg[0, edge] = 50.0               # tie across a load inside the first slice
    lg[0, 3 * edge - 1] = lg[0, 3 * edge] = 60.0       # tie across the slice boundary (4 SMs: 6,144-logit slices)
    lg[1, 3] = float("inf")
    lg[1, 4000] = lg[1, 4 * edge + 7] = float("nan")   # NaN beats the +inf before it; the first NaN wins
    lg[1, 5 * edge + 1] = float("inf")
    lg[2, 3 * edge + 5] = float("inf")                 # +inf alone, in the second slice
    lg[2, 5 * edge + 50] = float("inf")
    lg[3, 2 * edge + 1] = float("nan")                 # a NaN in a later load than a large finite value
    lg[3, 0] = 1e30
    ref = REF.greedy(lg)
    assert ref.tolist() == [3 * edge - 1, 4000, 3 * edge + 5, 2 * edge + 1], ref.tolist()
    out = fused.argmax(lg, out=torch.full((4,), -1, dtype=torch.int64, device=DEV), num_sms=num_sms)
    assert torch.equal(out, ref), f"seed {seed}, {num_sms} SMs: {out.tolist()} != {ref.tolist()}"
    if num_sms == 4:
        assert fused.argmax_splits(4, v, num_sms) == 1 and fused.argmax_splits(2, v, num_sms) == 2
        two = fused.argmax(lg[:2].contiguous(), num_sms=num_sms)
        assert torch.equal(two, ref[:2]), f"seed {seed}: {two.tolist()}"


def test_argmax_splits_fill_one_wave_of_whole_loads():
    """The split count: about one wave (B x S <= SMs), whole 2,048-logit loads per slice, no empty slice; one
    program per row once the batch fills the SMs."""
    v = 151936                                         # Qwen3's vocabulary
    for b in (1, 2, 3, 8, 33, 131, 132, 5000):
        s = fused.argmax_splits(b, v, 132)
        assert 1 <= s <= fused.ARGMAX_MAX_SPLITS and (s == 1 or b * s <= 132), (b, s)
        if s > 1:
            chunk = math.ceil(math.ceil(v / s) / fused.ARGMAX_SPLIT_BLOCK) * fused.ARGMAX_SPLIT_BLOCK
            assert (s - 1) * chunk < v <= s * chunk, (b, s, chunk)      # every slice holds logits
    assert fused.argmax_splits(1, v, 132) == 75 and fused.argmax_splits(8, v, 132) == 15
    assert fused.argmax_splits(132, v, 132) == 1 and fused.argmax_splits(2, 100, 132) == 1


# -- faults in the norms and SiLU ------------------------------------------------------------------------------
def test_norm_and_silu_faults_fail_the_comparison():
    gen, seed = fresh_generator()
    x, w = rnd(4, 64, gen=gen), rnd(64, gen=gen)
    ref = REF.rms_norm(x, w, 1e-6)
    assert rel_l2(fused.rms_norm(x, w.flip(0), 1e-6), ref) > 1e-2, f"seed {seed}: a reversed weight passed"
    gu = rnd(3, 64, gen=gen)
    swapped = torch.cat(gu.chunk(2, dim=-1)[::-1], dim=-1)                    # up first instead of gate
    assert rel_l2(fused.silu_mul(swapped), REF.silu_mul(gu)) > 1e-2, f"seed {seed}: gate/up swap passed"


def test_bad_inputs_are_clear_errors():
    x = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError, match=r"weight shape \(4,\) does not match the last dim"):
        fused.rms_norm(x, torch.ones(4, device=DEV), 1e-6)
    with pytest.raises(ValueError, match=r"gate_up \[T, 2I\]"):
        fused.silu_mul(torch.zeros(2, 7, device=DEV))
    with pytest.raises(ValueError, match=r"head_dim 24 must be twice a power of two"):
        fused.rope(torch.zeros(1, 1, 24, device=DEV), torch.zeros(1, 1, 24, device=DEV),
                   torch.zeros(1, dtype=torch.int64, device=DEV), torch.zeros(4, 24, device=DEV))


# -- GPU: real shapes in bf16 ----------------------------------------------------------------------------------
@gpu
@needs_cuda
@pytest.mark.parametrize("fast_math", [False, True])
def test_gpu_norms_bf16_real_shapes(fast_math):
    gen, seed = fresh_generator()
    bf = torch.bfloat16
    x, r, w = rnd(64, 4096, gen=gen, dtype=bf), rnd(64, 4096, gen=gen, dtype=bf, scale=8), rnd(4096, gen=gen, dtype=bf)
    out, res = fused.add_rms_norm(x, r, w, 1e-6, fast_math=fast_math, out=poisoned((64, 4096), bf),
                                  residual_out=poisoned((64, 4096), bf))
    ref_out, ref_res = REF.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(res, ref_res), f"seed {seed}"
    assert rel_l2(out, REF.rms_norm(ref_res.double(), w.double(), 1e-6)) < BOUND[bf], f"seed {seed}"
    q = rnd(64, 32, 128, gen=gen, dtype=bf)            # Qwen3 q-norm over head_dim
    qw = rnd(128, gen=gen, dtype=bf)
    qn = fused.rms_norm(q, qw, 1e-6, fast_math=fast_math, out=poisoned(q.shape, bf))
    assert rel_l2(qn, REF.rms_norm(q.double(), qw.double(), 1e-6)) < BOUND[bf], f"seed {seed}"


@gpu
@needs_cuda
@pytest.mark.parametrize("b", [1, 8, 200])
def test_gpu_argmax_split_rows_over_graph_replays(b):
    """Qwen3's 151,936-wide rows, split across programs at B = 1 and 8 (one per row at 200): the token equals
    torch's eagerly and over 20 CUDA-graph replays with fresh logits each time, ties planted across a slice boundary
    (a counter left set, or a reducer reading a partial before it lands, gives a wrong or stale token)."""
    gen, seed = fresh_generator()
    v, edge = 151936, fused.ARGMAX_SPLIT_BLOCK
    lg = rnd(b, v, gen=gen, dtype=torch.bfloat16, scale=5)
    assert torch.equal(fused.argmax(lg), REF.greedy(lg)), f"seed {seed}"
    out = torch.empty(b, dtype=torch.int64, device=DEV)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused.argmax(lg, out=out)
    for r in range(20):
        lg.copy_(rnd(b, v, gen=gen, dtype=torch.bfloat16, scale=5))
        lg[0, (r + 1) * edge - 1] = lg[0, (r + 1) * edge] = 100.0
        out.fill_(-1)
        graph.replay()
        assert torch.equal(out, REF.greedy(lg)), f"seed {seed}, replay {r}"


@gpu
@needs_cuda
def test_gpu_silu_rope_argmax_bf16_real_shapes():
    gen, seed = fresh_generator()
    bf = torch.bfloat16
    gu = rnd(64, 2 * 12288, gen=gen, dtype=bf, scale=3)
    assert rel_l2(fused.silu_mul(gu, out=poisoned((64, 12288), bf)), REF.silu_mul(gu.double())) < BOUND[bf]
    q, k = qk_views(64, 32, 8, 128, gen, dtype=bf)
    pos = torch.randint(0, 4096, (64,), generator=gen).to(DEV)
    cs = rope_cos_sin(128, 4096, 1e6, device=DEV)
    qo, ko = fused.rope(q, k, pos, cs)
    rq, rk = REF.rope(q.double(), k.double(), pos, cs.double())
    assert rel_l2(qo, rq) < BOUND[bf] and rel_l2(ko, rk) < BOUND[bf], f"seed {seed}"
    lg = rnd(8, 151936, gen=gen, dtype=bf, scale=5)
    assert torch.equal(fused.argmax(lg), REF.greedy(lg)), f"seed {seed}"


@gpu
@needs_cuda
@pytest.mark.parametrize("fast_math", [False, True])
def test_gpu_qkv_epilogue_bf16_real_shapes(fast_math):
    """Qwen3-8B heads (32 q / 8 kv, d 128) in bf16: the fused launch against the torch backend's composition in
    bf16 (same rounding points) and fp64; the bf16 k cache must match the composition's bit for bit but for the
    norm's summation order (bounded)."""
    gen, seed = fresh_generator()
    bf = torch.bfloat16
    t, hq, hkv, d = 64, 32, 8, 128
    qkv, pos, slots, qn, kn, cache = epilogue_case(t, hq, hkv, d, gen, dtype=bf, block_size=16, num_blocks=64)
    cs = rope_cos_sin(d, 4096, 1e6, device=DEV)
    q, kc, vc = run_epilogue(fused.qkv_epilogue, qkv, hq, hkv, pos, cs, slots, qn, kn, cache, fast_math=fast_math)
    rq, rkc, rvc = run_epilogue(REF.qkv_epilogue, qkv.double(), hq, hkv, pos, cs.double(), slots, qn.double(),
                                kn.double(), [c.double() for c in cache])
    ok = ~torch.isnan(rkc)
    assert rel_l2(q, rq) < BOUND[bf] and rel_l2(kc[ok], rkc[ok]) < BOUND[bf], f"seed {seed}"
    assert torch.equal(vc[ok], rvc[ok].to(bf)), f"seed {seed}: v must be copied exactly"


# -- pdl: programmatic dependent launch ------------------------------------------------------------------------
def _chain(x, res, w_norm, qw_up, qw_down, pdl):
    """A decode layer's MLP half as the engine chains it: every output feeds the next launch."""
    from vtengine.kernels import w4a16
    h, res = fused.add_rms_norm(x, res, w_norm, 1e-6, pdl=pdl)
    gu = w4a16.w4a16_linear(h, qw_up, dense=True, pdl=pdl)
    act = fused.silu_mul(gu, pdl=pdl)
    y = w4a16.w4a16_linear(act, qw_down, dense=True, pdl=pdl)
    out = fused.rms_norm(y, w_norm, 1e-6, pdl=pdl)
    return out, fused.argmax(out, pdl=pdl)


def test_pdl_is_inert_and_recorded_plain_where_unsupported():
    """Without sm_90 (here: the interpreter) the lever cannot act; the launch counter must say so rather than
    claim PDL ran (the mechanism gate reads it)."""
    from vtengine.kernels.pdl import pdl_supported
    gen, _ = fresh_generator()
    x = rnd(3, 64, gen=gen)
    counters.reset()
    fused.rms_norm(x, rnd(64, gen=gen), 1e-6, pdl=True)
    routes = counters.snapshot()["launch"]
    assert list(routes) == (["pdl"] if pdl_supported(x.device) else ["plain"])
    assert routes[next(iter(routes))]["variants"] == {"rms_norm": 1}


@gpu
@needs_cuda
def test_gpu_pdl_chain_bitwise_equal_eager_and_graphed():
    """The lever pdl changes when kernels start, never what they compute: the chain with PDL equals the chain
    without it bit for bit, eagerly and over 50 CUDA-graph replays with fresh inputs each time (a missing
    griddepcontrol.wait would read a half-written input and show up here)."""
    from vtengine.kernels.pdl import pdl_supported
    from vtengine.quant import quantize
    if not pdl_supported():
        pytest.skip("PDL needs sm_90 or newer")
    gen, seed = fresh_generator()
    bf = torch.bfloat16
    hidden, inter = 4096, 12288
    qw_up = quantize(torch.randn(2 * inter, hidden, generator=gen).to(DEV), "mxfp4")
    qw_down = quantize(torch.randn(hidden, inter, generator=gen).to(DEV), "mxfp4")
    w_norm = rnd(hidden, gen=gen, dtype=bf)
    x, res = rnd(1, hidden, gen=gen, dtype=bf), rnd(1, hidden, gen=gen, dtype=bf)
    want = _chain(x, res, w_norm, qw_up, qw_down, pdl=False)
    got = _chain(x, res, w_norm, qw_up, qw_down, pdl=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"seed {seed}: eager PDL differs"
    sx, sres = x.clone(), res.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = _chain(sx, sres, w_norm, qw_up, qw_down, pdl=True)
    for i in range(50):
        sx.copy_(rnd(1, hidden, gen=gen, dtype=bf))
        sres.copy_(rnd(1, hidden, gen=gen, dtype=bf))
        graph.replay()
        ref = _chain(sx, sres, w_norm, qw_up, qw_down, pdl=False)
        assert all(torch.equal(a, b) for a, b in zip(g_out, ref)), f"seed {seed}: replay {i} differs"



@gpu
@needs_cuda
def test_gpu_pdl_attention_chain_bitwise_equal_graphed():
    """qkv epilogue -> split decode attention (fused merge) -> its consumer, with and without PDL, in a graph."""
    from vtengine.kernels import attention
    from vtengine.kernels.pdl import pdl_supported
    if not pdl_supported():
        pytest.skip("PDL needs sm_90 or newer")
    gen, seed = fresh_generator()
    bf = torch.bfloat16
    b, hq, hkv, d, page, ctx = 4, 32, 8, 128, 16, 3000
    nblocks = b * (ctx // page + 2)
    kc, vc = rnd(nblocks, page, hkv, d, gen=gen, dtype=bf), rnd(nblocks, page, hkv, d, gen=gen, dtype=bf)
    bt = torch.randperm(nblocks, generator=gen)[:b * (ctx // page + 1)].view(b, -1).int().to(DEV)
    lens = torch.tensor([ctx, ctx - 700, 17, ctx - 1], dtype=torch.int32, device=DEV)
    pos = (lens - 1).long()
    slots = (bt.gather(1, (pos // page)[:, None].int())[:, 0].long() * page + pos % page)
    cs = rope_cos_sin(d, 4096, 1e6, device=DEV)
    qn, kn = rnd(d, gen=gen, dtype=bf), rnd(d, gen=gen, dtype=bf)
    qkv = rnd(b, (hq + 2 * hkv) * d, gen=gen, dtype=bf)

    def step(pdl, kcache, vcache):
        q = fused.qkv_epilogue(qkv, hq, hkv, pos, cs, kcache, vcache, slots, qn, kn, pdl=pdl)
        o = attention.decode_attention(q, kcache, vcache, bt, lens, d ** -0.5, gqa_swap=True, max_context_len=ctx,
                                       pdl=pdl)
        return fused.rms_norm(o, qn, 1e-6, pdl=pdl)

    want = step(False, kc.clone(), vc.clone())
    k2, v2 = kc.clone(), vc.clone()
    assert torch.equal(step(True, k2, v2), want), f"seed {seed}: eager PDL differs"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_out = step(True, k2, v2)
    for i in range(50):
        qkv.copy_(rnd(b, (hq + 2 * hkv) * d, gen=gen, dtype=bf))
        graph.replay()
        assert torch.equal(g_out, step(False, kc.clone(), vc.clone())), f"seed {seed}: replay {i} differs"
