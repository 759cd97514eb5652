"""The Triton attention kernels (vtengine/kernels/attention.py) and the split heuristic (vtengine/kernels/splits.py)
against the torch reference backend.

On a CPU host the kernels run in Triton's interpreter at tiny shapes (fp32, and one bf16 case); on a CUDA host
the same tests run compiled, and the ``gpu`` tests add the real shapes (32 q / 8 kv heads, d=128, bf16).
Every check draws fresh random inputs (the seed is printed on failure), poisons the output with NaN, and compares
by relative L2 against the reference computed in fp32 from fp64-upcast inputs. Whether two lever arms agree
bitwise is measured and printed (run with -s to see it), not asserted.
"""
from __future__ import annotations


import pytest
import torch

from vtengine import counters
from vtengine.backends.torch_backend import TorchBackend
from vtengine.kernels import INTERPRET
from vtengine.kernels import attention as attn
from vtengine.kernels import splits
from vtengine.testing import fresh_generator, rel_l2

REF = TorchBackend()
BOUND = {torch.float32: 2e-5, torch.bfloat16: 1e-2}
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the CPU interpreter runs the tiny-shape tests)")


# -- helpers ---------------------------------------------------------------------------------------------------



def make_paged(ctx_lens, hkv, d, page, dtype, gen, spare_blocks=3, extra_cols=2, strided=False):
    """A paged cache holding random K/V for each sequence in shuffled (non-contiguous) blocks, -1 padded tables.
    strided=True makes the caches views with a gap between kv heads (non-packed token and block strides)."""
    need = [(n + page - 1) // page for n in ctx_lens]
    nb = sum(need) + spare_blocks
    heads = hkv + 1 if strided else hkv
    kc = torch.randn(nb, page, heads, d, generator=gen).to(dtype)
    vc = torch.randn(nb, page, heads, d, generator=gen).to(dtype)
    if strided:
        kc, vc = kc[:, :, :hkv], vc[:, :, :hkv]
    perm = torch.randperm(nb, generator=gen)
    bt = torch.full((len(ctx_lens), max(need) + extra_cols), -1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    return kc.to(DEV), vc.to(DEV), bt.to(DEV), ctx.to(DEV)


def make_q(bsz, hq, d, dtype, gen):
    """q as a strided view (the q part of a fused qkv row), the way the model hands it over."""
    fused = torch.randn(bsz, hq * d + 2 * d, generator=gen).to(dtype).to(DEV)
    return fused[:, :hq * d].view(bsz, hq, d)


def ref_decode(q, kc, vc, bt, ctx, scale):
    return REF.decode_attention(q.double(), kc.double(), vc.double(), bt, ctx, scale)


def ref_prefill(q, kc, vc, cu, ctx, bt, scale):
    return REF.prefill_attention(q.double(), kc.double(), vc.double(), cu, ctx, bt, scale)


def poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, float("nan"), dtype=like.dtype, device=like.device)


def bitwise_report(name: str, a: torch.Tensor, b: torch.Tensor) -> bool:
    equal = torch.equal(a, b)
    diff = (a.double() - b.double()).abs().max().item()
    print(f"[measured] {name}: bitwise_equal={equal} max_abs_diff={diff:.3e}")
    return equal


def decode_grid(route, bsz, hq, hkv, s):
    return (bsz, hkv if route == "gqa_swap" else hq, s)


# -- the split heuristic (hand-worked cases, 132 SMs) --------------------------------------------------------
def test_heuristic_one_split_when_the_grid_fills_80_percent():
    # 0.8 x 132 = 105.6: 106 programs take 1 split
    assert splits.num_splits_heuristic(106, 132, 128, 128) == 1
    assert splits.num_splits_heuristic(256, 132, 128, 128) == 1
    # 105 programs: efficiency 105s/132 / ceil(.) is 0.795 for s = 1..4 and 525/660 = 0.994 at s = 5; the best is
    # >= 0.994, so the first s with >= 0.85 x best is 5
    assert splits.num_splits_heuristic(105, 132, 128, 128) == 5


def test_heuristic_smallest_split_within_85_percent_of_the_best():
    # batch 1 x 32 q heads: s = 1, 2, 3, 4 give 32/132 = .24, .48, .73, .97; the best is <= 1, so 4 is the first
    # >= 0.85 x best (3 at .73 is not)
    assert splits.num_splits_heuristic(32, 132, 128, 128) == 4
    # batch 1 x 8 kv heads over 16 KV tiles: eligible s = 1, 2, 3, 4, 6, 8, 16; 8 x 16 / 132 = .97 is the best,
    # s = 8 gives .48: 16
    assert splits.num_splits_heuristic(8, 132, 16, 128) == 16


def test_heuristic_skips_ineligible_split_counts():
    assert splits.is_split_eligible(11, 64) and not splits.is_split_eligible(12, 64)   # ceil(64/11) = ceil(64/12)
    assert not splits.is_split_eligible(3, 4)                                          # ceil(4/3) = ceil(4/2) = 2
    # 44 programs, 4 KV tiles: s = 3 would be one full wave (132/132 = 1.0) but gives 2 tiles per split like s = 2,
    # so it is skipped; the best eligible is .667 (s = 2 and s = 4), and s = 2 is the first >= .85 x .667
    assert splits.num_splits_heuristic(44, 132, 4, 128) == 2
    # bounded by the KV tiles: 12 programs, 4 tiles: eligible 1, 2, 4 -> 4
    assert splits.num_splits_heuristic(12, 132, 4, 128) == 4


def test_nsplits_cap_off_auto_and_integer():
    # 50 programs, 128 tiles: off -> 5 (250/132 = 1.89 waves, eff .947); auto caps at one wave, 132 // 50 = 2
    # (eff .758, the best within 2); a cap of 3 also picks 2 (3 gives 1.14 waves, eff .568); a cap of 8 keeps 5
    assert splits.decode_num_splits(50, 128, "off", num_sms=132) == 5
    assert splits.wave_cap(50, 132) == 2
    assert splits.decode_num_splits(50, 128, "auto", num_sms=132) == 2
    assert splits.decode_num_splits(50, 128, 3, num_sms=132) == 2
    assert splits.decode_num_splits(50, 128, 8, num_sms=132) == 5
    assert splits.decode_num_splits(50, 128, 1, num_sms=132) == 1
    # 32 programs: auto = 132 // 32 = 4, which is also what off picks
    assert splits.decode_num_splits(32, 128, "auto", num_sms=132) == splits.decode_num_splits(32, 128, "off", 132) == 4
    assert splits.wave_cap(400, 132) == 1


def test_nsplits_cap_values_and_errors():
    from vtengine.levers import get
    lever = get("nsplits_cap")
    for raw in ("off", "auto", "8", 0, "false"):
        splits.parse_cap(lever.parse(raw))            # every lever value is accepted by the kernel side
    assert splits.parse_cap(False) == "off" and splits.parse_cap("0") == "off" and splits.parse_cap(16) == 16
    for bad in ("sometimes", -1, True, 2.5):
        with pytest.raises(ValueError, match="nsplits_cap"):
            splits.parse_cap(bad)


def test_sm_count_without_gpu_is_h200():
    if CUDA:
        assert splits.sm_count() == torch.cuda.get_device_properties(0).multi_processor_count
    else:
        assert splits.sm_count() == 132


# -- store_kv ----------------------------------------------------------------------------------------------------
def test_store_kv_matches_reference_bitwise():
    gen, seed = fresh_generator()
    t, hkv, d, page, nb = 7, 2, 16, 8, 5
    fused = torch.randn(t, 3 * hkv * d, generator=gen).to(DEV)
    k = fused[:, hkv * d:2 * hkv * d].view(t, hkv, d)          # strided views, as the model hands them over
    v = fused[:, 2 * hkv * d:].view(t, hkv, d)
    slots = torch.randperm(nb * page, generator=gen)[:t].to(DEV)
    slots[3] = -1                                               # a padded row: must write nothing
    kc = torch.randn(nb, page, hkv, d, generator=gen).to(DEV)
    vc = torch.randn(nb, page, hkv, d, generator=gen).to(DEV)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    REF.store_kv(k, v, kc_ref, vc_ref, slots)
    counters.reset()
    attn.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), f"seed {seed}"
    assert counters.snapshot()["store_kv"]["paged"]["grids"] == {f"{t}x{hkv}": 1}


# -- prefill -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fast_math", [False, True])
def test_prefill_ragged_with_cached_prefix(fast_math):
    gen, seed = fresh_generator()
    hq, hkv, d, page = 4, 2, 16, 8
    # (new tokens, context): a 1-token prompt, a fresh 13-token prompt, 5 new tokens after a 24-token cached
    # prefix, and a 1-token step after 16 cached tokens; none but the first is a multiple of the block size
    q_lens, ctx_lens = [1, 13, 5, 1], [1, 13, 29, 17]
    kc, vc, bt, ctx = make_paged(ctx_lens, hkv, d, page, torch.float32, gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    q = make_q(sum(q_lens), hq, d, torch.float32, gen)
    scale = d ** -0.5
    ref = ref_prefill(q, kc, vc, cu, ctx, bt, scale)
    counters.reset()
    out = attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, fast_math=fast_math, out=poisoned(q))
    err = rel_l2(out, ref)
    assert err < BOUND[torch.float32], f"rel L2 {err:.3e}, seed {seed}"
    st = counters.snapshot()["prefill_attention"]["paged_causal"]
    blk_m = attn.PREFILL_TILES.block_m
    assert st["grids"] == {f"{-(-sum(q_lens) // blk_m) + len(q_lens)}x{hq}": 1}
    assert st["variants"] == {"fast_math" if fast_math else "precise": 1}


# -- decode: every lever arm ---------------------------------------------------------------------------------------
DECODE_SHAPE = dict(hq=4, hkv=2, d=16, page=8, ctx=[1, 21, 38])    # context 1, and lengths off the block size
TINY_TILES = attn.Tiles(block_n=16, num_warps=1, num_stages=1)


@pytest.mark.parametrize("gqa_swap", [False, True], ids=["per_q_head", "gqa_swap"])
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast_math"])
def test_decode_arm_matches_reference(gqa_swap, fast_math):
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged(s["ctx"], s["hkv"], s["d"], s["page"], torch.float32, gen, strided=gqa_swap)
    bsz = len(s["ctx"])
    q = make_q(bsz, s["hq"], s["d"], torch.float32, gen)
    scale = s["d"] ** -0.5
    ref = ref_decode(q, kc, vc, bt, ctx, scale)
    route = "gqa_swap" if gqa_swap else "per_q_head"
    if splits.sm_count() != 132:
        pytest.skip("the hand-worked split counts below assume 132 SMs (an H200, or no GPU)")
    # max_context_len 64 -> 4 KV tiles of 16; programs = 3 x 4 (per q head) or 3 x 2 (gqa_swap): eligible
    # splits 1, 2, 4 with efficiencies <= .36, so "off" and "auto" (wave cap 11 or 22) pick 4 and a cap of 2 picks 2
    cases = [dict(num_splits=1, want=1), dict(num_splits=3, want=3),
             dict(nsplits_cap="off", want=4), dict(nsplits_cap="auto", want=4), dict(nsplits_cap=2, want=2)]
    for case in cases:
        want = case.pop("want")
        counters.reset()
        out = attn.decode_attention(q, kc, vc, bt, ctx, scale, gqa_swap=gqa_swap, fast_math=fast_math,
                                    max_context_len=64, tiles=TINY_TILES, out=poisoned(q), **case)
        err = rel_l2(out, ref)
        assert err < BOUND[torch.float32], f"{route} fast_math={fast_math} {case}: rel L2 {err:.3e}, seed {seed}"
        snap = counters.snapshot()
        st = snap["decode_attention"][route]
        assert st["grids"] == {"x".join(map(str, decode_grid(route, bsz, s["hq"], s["hkv"], want))): 1}, case
        assert st["splits"] == {str(want): 1}
        assert st["variants"] == {"fast_math" if fast_math else "precise": 1}
        other = "per_q_head" if gqa_swap else "gqa_swap"
        assert other not in snap["decode_attention"]
        merges = snap.get("decode_attention_merge", {}).get(route, {}).get("launches", 0)
        assert merges == (1 if want > 1 else 0)


def test_decode_bf16_inputs_under_either_backend():
    # under the interpreter this is the tl.dot bf16 trap (triton #11584): the launcher must hand fp32 operands
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged(s["ctx"], s["hkv"], s["d"], s["page"], torch.bfloat16, gen)
    q = make_q(len(s["ctx"]), s["hq"], s["d"], torch.bfloat16, gen)
    ref = ref_decode(q, kc, vc, bt, ctx, 0.25)
    for gqa_swap in (False, True):
        out = attn.decode_attention(q, kc, vc, bt, ctx, 0.25, gqa_swap=gqa_swap, num_splits=2, out=poisoned(q))
        err = rel_l2(out, ref)
        assert err < BOUND[torch.bfloat16], f"gqa_swap={gqa_swap}: rel L2 {err:.3e}, seed {seed}"


def test_decode_on_vs_off_bitwise_is_measured():
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged(s["ctx"], s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(len(s["ctx"]), s["hq"], s["d"], torch.float32, gen)

    def run(**kw):
        return attn.decode_attention(q, kc, vc, bt, ctx, 0.25, tiles=TINY_TILES, out=poisoned(q), **kw)

    base = run(num_splits=3)
    # a run repeated must reproduce itself bitwise (no atomics, fixed reduction order): this one must hold
    assert torch.equal(base, run(num_splits=3)), f"decode is not deterministic, seed {seed}"
    bitwise_report("gqa_swap ON vs OFF (3 splits, precise)", run(num_splits=3, gqa_swap=True), base)
    bitwise_report("fast_math ON vs OFF (per_q_head, 3 splits)", run(num_splits=3, fast_math=True), base)
    bitwise_report("nsplits 2 vs 3 (per_q_head, precise)", run(num_splits=2), base)
    bitwise_report("nsplits 1 vs 3 (per_q_head, precise)", run(num_splits=1), base)


# -- the comparison must be able to fail ----------------------------------------------------------------------
@pytest.mark.parametrize("gqa_swap", [False, True], ids=["per_q_head", "gqa_swap"])
def test_deliberate_faults_fail_the_comparison(gqa_swap):
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    ctx_lens = [9, 21, 38]                      # each long enough that a fault changes its output
    kc, vc, bt, ctx = make_paged(ctx_lens, s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(len(ctx_lens), s["hq"], s["d"], torch.float32, gen)
    ref = ref_decode(q, kc, vc, bt, ctx, 0.25)
    nb, page, hkv, d = kc.shape
    wrong_stride = kc.as_strided(kc.shape, (page * hkv * d, d, page * d, 1))   # token and head strides swapped
    wrong_table = torch.where(bt >= 0, (bt + 1) % nb, bt)                     # every block id off by one (in bounds)
    faults = {
        "wrong block table (ids off by one)": dict(block_tables=wrong_table),
        "wrong stride (token/head swapped)": dict(k_cache=wrong_stride),
        "K and V swapped": dict(k_cache=vc, v_cache=kc),
        "context lengths one short": dict(context_lens=ctx - 1),
    }
    for name, fault in faults.items():
        args = dict(q=q, k_cache=kc, v_cache=vc, block_tables=bt, context_lens=ctx) | fault
        out = attn.decode_attention(scale=0.25, gqa_swap=gqa_swap, num_splits=2, out=poisoned(q), **args)
        err = rel_l2(out, ref)
        assert err > 100 * BOUND[torch.float32], f"fault '{name}' went unnoticed: rel L2 {err:.3e}, seed {seed}"


def test_launcher_errors_name_the_bad_value():
    q = torch.zeros(2, 6, 16, device=DEV)
    kc = torch.zeros(4, 8, 4, 16, device=DEV)
    bt = torch.zeros(2, 2, dtype=torch.int32, device=DEV)
    ctx = torch.ones(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="q heads 6 must be a multiple of kv heads 4"):
        attn.decode_attention(q, kc, kc, bt, ctx, 1.0)
    q = torch.zeros(2, 8, 16, device=DEV)
    with pytest.raises(ValueError, match="num_splits 0"):
        attn.decode_attention(q, kc, kc, bt, ctx, 1.0, num_splits=0)
    with pytest.raises(ValueError, match="nsplits_cap 'many'"):
        attn.decode_attention(q, kc, kc, bt, ctx, 1.0, nsplits_cap="many")
    with pytest.raises(ValueError, match="block_tables must be"):
        attn.decode_attention(q, kc, kc, bt[:1], ctx, 1.0)


# -- GPU: real shapes ----------------------------------------------------------------------------------------------
REAL = dict(hq=32, hkv=8, d=128, page=16)


@gpu
@needs_cuda
def test_gpu_decode_real_shapes_all_arms():
    gen, seed = fresh_generator()
    ctx_lens = [1, 1000, 4097, 8191]
    kc, vc, bt, ctx = make_paged(ctx_lens, REAL["hkv"], REAL["d"], REAL["page"], torch.bfloat16, gen)
    q = make_q(len(ctx_lens), REAL["hq"], REAL["d"], torch.bfloat16, gen)
    scale = REAL["d"] ** -0.5
    ref = ref_decode(q, kc, vc, bt, ctx, scale)
    outs = {}
    for gqa_swap in (False, True):
        for fast_math in (False, True):
            for case in (dict(nsplits_cap="off"), dict(nsplits_cap="auto"), dict(nsplits_cap=8),
                         dict(num_splits=1), dict(num_splits=16)):
                out = attn.decode_attention(q, kc, vc, bt, ctx, scale, gqa_swap=gqa_swap, fast_math=fast_math,
                                            max_context_len=8192, out=poisoned(q), **case)
                torch.cuda.synchronize()
                err = rel_l2(out, ref)
                assert err < BOUND[torch.bfloat16], \
                    f"gqa_swap={gqa_swap} fast_math={fast_math} {case}: rel L2 {err:.3e}, seed {seed}"
                outs[(gqa_swap, fast_math, str(case))] = out
    off = str(dict(nsplits_cap="off"))
    bitwise_report("real: gqa_swap ON vs OFF", outs[(True, False, off)], outs[(False, False, off)])
    bitwise_report("real: fast_math ON vs OFF", outs[(False, True, off)], outs[(False, False, off)])
    bitwise_report("real: nsplits auto vs off", outs[(False, False, str(dict(nsplits_cap="auto")))],
                   outs[(False, False, off)])


@gpu
@needs_cuda
def test_gpu_decode_cuda_graph_replay_matches_eager():
    gen, _ = fresh_generator()
    ctx_lens = [7, 300, 2049]
    kc, vc, bt, ctx = make_paged(ctx_lens, REAL["hkv"], REAL["d"], REAL["page"], torch.bfloat16, gen)
    q = make_q(len(ctx_lens), REAL["hq"], REAL["d"], torch.bfloat16, gen)
    for gqa_swap in (False, True):
        eager = attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=gqa_swap, max_context_len=4096)
        out = poisoned(q)
        attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=gqa_swap, max_context_len=4096, out=out)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=gqa_swap, max_context_len=4096, out=out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager), f"gqa_swap={gqa_swap}: graph replay differs from eager"


@gpu
@needs_cuda
def test_gpu_prefill_real_shapes():
    gen, seed = fresh_generator()
    q_lens, ctx_lens = [1000, 300, 1], [1000, 2100, 513]
    kc, vc, bt, ctx = make_paged(ctx_lens, REAL["hkv"], REAL["d"], REAL["page"], torch.bfloat16, gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    q = make_q(sum(q_lens), REAL["hq"], REAL["d"], torch.bfloat16, gen)
    scale = REAL["d"] ** -0.5
    ref = ref_prefill(q, kc, vc, cu, ctx, bt, scale)
    for fast_math in (False, True):
        out = attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, fast_math=fast_math, out=poisoned(q))
        torch.cuda.synchronize()
        err = rel_l2(out, ref)
        assert err < BOUND[torch.bfloat16], f"fast_math={fast_math}: rel L2 {err:.3e}, seed {seed}"


@gpu
@needs_cuda
def test_gpu_store_kv_real_shapes_bitwise():
    gen, seed = fresh_generator()
    t, nb = 64, 256
    k = torch.randn(t, REAL["hkv"], REAL["d"], generator=gen).to(torch.bfloat16).to(DEV)
    v = torch.randn(t, REAL["hkv"], REAL["d"], generator=gen).to(torch.bfloat16).to(DEV)
    slots = torch.randperm(nb * REAL["page"], generator=gen)[:t].to(DEV)
    slots[::7] = -1
    kc = torch.randn(nb, REAL["page"], REAL["hkv"], REAL["d"], generator=gen).to(torch.bfloat16).to(DEV)
    vc = torch.randn_like(kc)
    kr, vr = kc.clone(), vc.clone()
    REF.store_kv(k, v, kr, vr, slots)
    attn.store_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr), f"seed {seed}"
