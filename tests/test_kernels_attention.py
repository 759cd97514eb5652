"""The Triton attention kernels (vtengine/kernels/attention.py) and the split heuristic (vtengine/kernels/splits.py)
against the torch reference backend.

On a CPU host the kernels run in Triton's interpreter at tiny shapes (fp32, and one bf16 case); on a CUDA host
the same tests run compiled, and the ``gpu`` tests add the real shapes (32 q / 8 kv heads, d=128, bf16).
Every check draws fresh random inputs (the seed is printed on failure), poisons the output with NaN, and compares
by relative L2 against the reference computed in fp32 from fp64-upcast inputs. Whether two lever arms agree
bitwise is measured and printed (run with -s to see it), not asserted; the fused and the two-launch merge are two
forms of one computation and must agree bitwise, which is asserted (on the GPU too: the memory-ordering stress).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from vtengine import counters
from vtengine.backends.torch_backend import TorchBackend
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


def prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen):
    """fp32 varlen prefill inputs (q_lens new tokens of contexts ctx_lens) and their fp64 reference output:
    (q, k_cache, v_cache, cu_seqlens, context_lens, block_tables, scale, ref)."""
    kc, vc, bt, ctx = make_paged(ctx_lens, hkv, d, page, torch.float32, gen)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    q = make_q(sum(q_lens), hq, d, torch.float32, gen)
    scale = d ** -0.5
    return q, kc, vc, cu, ctx, bt, scale, ref_prefill(q, kc, vc, cu, ctx, bt, scale)


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


# -- the split rule (hand-worked cases) -------------------------------------------------------------------------
def test_split_rule_values_and_errors():
    from vtengine.levers import get
    for raw in get("split_rule").values:
        splits.parse_split_rule(raw)              # every lever value is accepted by the kernel side
    assert splits.parse_split_rule("count") == splits.parse_split_rule("off") == ("count", None)
    assert splits.parse_split_rule("LEN512") == ("length", 512)
    for bad in ("len", "len0", "len-4", "length512", "fixed", 512):
        with pytest.raises(ValueError, match="split_rule .* accepted: 'off'"):
            splits.parse_split_rule(bad)


def test_split_plan_count_is_the_heuristic_over_the_bound():
    # batch-independent: 8 kv heads, bound 4096 in 128-token slices = 32, a wave of 528 -> the heuristic's 32 slots
    for batch in (1, 64):
        plan = splits.split_plan("count", "off", 8, batch, 4096, 64, 528)
        assert plan == (32, 128, 32, 32) and plan.programs == plan.slots
    # a cap bounds the slots themselves under "count": within 8, 7 x 8 / 528 = .106 is >= .85 x (8 x 8 / 528)
    assert splits.split_plan("count", 8, 8, 1, 4096, 64, 528) == (7, 128, 7, 32)


def test_split_plan_length_fixes_the_slice_and_fills_one_wave():
    # len512 over a 4096 bound: 8 slots of 512 tokens whatever the batch; the programs per (sequence, head) fill
    # about one wave of 528: batch 1 x 8 heads could use 66, capped at the 8 slots; batch 64 x 8 = 512 programs
    # need cdiv(528, 512) = 2 each; batch 128 one each
    assert splits.split_plan("len512", "off", 8, 1, 4096, 64, 528) == (8, 512, 8, 8)
    assert splits.split_plan("len512", "off", 8, 64, 4096, 64, 528) == (8, 512, 2, 2)
    assert splits.split_plan("len512", "off", 8, 128, 4096, 64, 528) == (8, 512, 1, 1)
    # the bound sizes the slots only: 40960 / 512 = 80, the programs the same
    assert splits.split_plan("len512", "off", 8, 64, 40960, 64, 528) == (80, 512, 2, 2)
    # L is rounded up to whole tiles; nsplits_cap caps the programs, "auto" to floor(wave / programs)
    assert splits.split_plan("len100", "off", 8, 1, 4096, 64, 528).min_split == 128
    assert splits.split_plan("len512", 4, 8, 1, 4096, 64, 528) == (8, 512, 4, 8)
    assert splits.split_plan("len512", "auto", 8, 64, 4096, 64, 528) == (8, 512, 1, 2)


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
@pytest.mark.parametrize("gqa_pack,hq", [(False, 4), (True, 4), (True, 6)],
                         ids=["per_q_head", "gqa_pack", "gqa_pack-group3"])
def test_prefill_ragged_with_cached_prefix(fast_math, gqa_pack, hq):
    """Both routes against the fp64 reference; gqa_pack with a group of 3 pads each group to 4 rows (masked), and
    the 24-token prefix puts whole tiles in its unmasked key loop."""
    gen, seed = fresh_generator()
    hkv, d, page = 2, 16, 8
    # (new tokens, context): a 1-token prompt, a fresh 13-token prompt, 5 new tokens after a 24-token cached
    # prefix, and a 1-token step after 16 cached tokens; none but the first is a multiple of the block size
    q_lens, ctx_lens = [1, 13, 5, 1], [1, 13, 29, 17]
    q, kc, vc, cu, ctx, bt, scale, ref = prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen)
    counters.reset()
    out = attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, fast_math=fast_math, out=poisoned(q),
                                 gqa_pack=gqa_pack)
    err = rel_l2(out, ref)
    assert err < BOUND[torch.float32], f"rel L2 {err:.3e}, seed {seed}"
    if gqa_pack:    # rows = tokens x the group padded to a power of two: 16 rows hold 8 tokens (group 2) or 4 (3)
        st = counters.snapshot()["prefill_attention"]["gqa_pack"]
        tokens_per_tile = max(attn.PREFILL_PACKED_TILES.block_m, 16) // (2 if hq // hkv == 2 else 4)
        assert st["grids"] == {f"{-(-sum(q_lens) // tokens_per_tile) + len(q_lens)}x{hkv}": 1}
    else:
        st = counters.snapshot()["prefill_attention"]["paged_causal"]
        blk_m = attn.PREFILL_TILES.block_m
        assert st["grids"] == {f"{-(-sum(q_lens) // blk_m) + len(q_lens)}x{hq}": 1}
    assert st["variants"] == {"fast_math" if fast_math else "precise": 1}


@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast_math"])
def test_prefill_splits_match_reference_and_off(fast_math):
    """prefill_splits: the gqa_pack route with the keys every row sees cut into S slices (own programs, partials
    merged by log-sum-exp) against the fp64 reference, at counts that leave slices empty (a 1-token prompt, a fresh
    prompt shorter than one key tile) and that do not divide the prefix; S = 1 is "off" bit for bit; "auto" takes the
    wave model's count for a grid of at most one wave (here 20 programs with tokens, 2 a SM: none on 1 or 8 SMs,
    past one wave; 8 on 16 SMs, 5 rounds of eighths against 1 whole; 2 on 20, where 2 to 8 slices all take half the
    time and the fewest merge least; 8 on 1,000), and the counters show the count and the merge launch."""
    gen, seed = fresh_generator()
    hq, hkv, d, page = 6, 2, 16, 8
    q_lens, ctx_lens = [1, 13, 5, 9], [1, 13, 69, 89]
    q, kc, vc, cu, ctx, bt, scale, ref = prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen)
    off = attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, fast_math=fast_math, out=poisoned(q), gqa_pack=True)
    tiles = -(-sum(q_lens) // (attn.PREFILL_PACKED_TILES.block_m // 4)) + len(q_lens)     # group 3 pads to 4
    assert (tiles - 1) * hkv == 20                          # the launch's bound has one empty tile
    for splits, sms, want in (("off", None, 1), (1, None, 1), (2, None, 2), (5, None, 5), ("auto", 1, 1),
                              ("auto", 8, 1), ("auto", 16, 8), ("auto", 20, 2),
                              ("auto", 1000, attn.PREFILL_AUTO_MAX_SPLITS)):
        counters.reset()
        out = attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, fast_math=fast_math, out=poisoned(q),
                                     gqa_pack=True, splits=splits, num_sms=sms)
        err = rel_l2(out, ref)
        assert err < BOUND[torch.float32], f"splits={splits}: rel L2 {err:.3e}, seed {seed}"
        snap = counters.snapshot()
        st = snap["prefill_attention"]["gqa_pack"]
        assert st["splits"] == {str(want): 1}, f"splits={splits} num_sms={sms}: {st['splits']}"
        if want == 1:
            assert torch.equal(out, off), f"splits={splits}: one slice must be the unsplit kernel, bit for bit"
            assert st["grids"] == {f"{tiles}x{hkv}": 1} and "prefill_attention_merge" not in snap
        else:
            assert st["grids"] == {f"{tiles}x{hkv}x{want}": 1}
            assert snap["prefill_attention_merge"]["gqa_pack"]["grids"] == {f"{sum(q_lens)}x{hkv}": 1}
            bitwise_report(f"prefill splits={want} vs off", out, off)


def test_prefill_splits_auto_sizes_its_wave_by_the_programs_a_tile_set_fits_per_sm(monkeypatch):
    """"auto" counts rounds of a wave of SMs x the programs a tile set fits per SM: the fast-math tiles (~165 KB of
    shared memory) fit one, where a fixed two per SM had 512-token chunks at a 32k prefix split four ways. Same
    launch, same SM count: tiles fitting two split (under half a wave), tiles fitting one (one full wave) not."""
    gen, _ = fresh_generator()
    hq, hkv, d, page = 4, 2, 16, 8
    q_lens, ctx_lens = [9, 5], [40, 21]
    q, kc, vc, cu, ctx, bt, scale, _ = prefill_case(q_lens, ctx_lens, hq, hkv, d, page, gen)
    two = attn.PREFILL_PACKED_TILES
    one = dataclasses.replace(two, num_stages=two.num_stages + 1)
    monkeypatch.setattr(attn, "PACKED_PROGRAMS_PER_SM", {one: 1})
    assert (attn.packed_programs_per_sm(one), attn.packed_programs_per_sm(two)) == (1, attn.PREFILL_PROGRAMS_PER_SM)
    programs = (-(-sum(q_lens) // (two.block_m // 2)) + len(q_lens) - 1) * hkv     # with tokens; group 2: 2 rows
    sms = programs + 1                      # one wave at one program per SM, under half a wave at two
    got = {}
    for tiles in (one, two):
        counters.reset()
        attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, out=poisoned(q), gqa_pack=True, splits="auto",
                               tiles=tiles, num_sms=sms)
        got[attn.packed_programs_per_sm(tiles)] = counters.snapshot()["prefill_attention"]["gqa_pack"]["splits"]
    want2 = attn.prefill_split_count("auto", programs, 2 * sms)
    assert want2 > 1 and got == {1: {"1": 1}, 2: {str(want2): 1}}, got


def test_prefill_split_count_and_bad_values():
    """"auto" is the wave model's pick for a grid of at most one wave: of S <= 8 the smallest within 5% of the best
    speed-up, if that best is x1.3 or more. In a wave of 264: 72 programs take one round at S = 1-3, two rounds of
    1/7 at S = 7 (x3.5, the best); 136 at S = 7 four rounds of 1/7 (x1.75), at S = 5 three of 1/5 (x1.67, within 5%:
    fewer partials to merge); 200 at best x1.25 (S = 5): not enough to pay for the merge; 263 and 264 fill their
    round; 265, 300 and 1,000 are past one wave: never split (the count cannot tell a chunk from a fresh prompt or
    from light programs beside it); 1 program, 8 slices in one round."""
    assert [attn.prefill_split_count("auto", p, 264) for p in (72, 136, 200, 263, 264, 265, 300, 1000)] == \
        [7, 5, 1, 1, 1, 1, 1, 1]
    assert attn.prefill_split_count("auto", 1, 264) == attn.PREFILL_AUTO_MAX_SPLITS == 8
    assert attn.wave_speedup(136, 7, 264) == 1.75 and attn.wave_speedup(200, 5, 264) == 1.25
    assert [attn.prefill_split_count(v, 72, 264) for v in ("off", "OFF", 1, "4", 32)] == [1, 1, 1, 4, 32]
    for bad in (0, -2, "two", True, 1.5, None):
        with pytest.raises(ValueError, match=r"prefill_splits .* is not accepted; accepted: 'off', 'auto' or a "):
            attn.parse_prefill_splits(bad)


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
    # max_context_len 128 -> 4 minimum slices of 2 KV tiles of 16; programs = 3 x 4 (per q head) or 3 x 2
    # (gqa_swap): eligible splits 1, 2, 4 with efficiencies <= .36, so "off" and "auto" (wave cap 11 or 22) pick 4
    # and a cap of 2 picks 2
    cases = [dict(num_splits=1, want=1), dict(num_splits=3, want=3),
             dict(nsplits_cap="off", want=4), dict(nsplits_cap="auto", want=4), dict(nsplits_cap=2, want=2)]
    for case in cases:
        want = case.pop("want")
        counters.reset()
        out = attn.decode_attention(q, kc, vc, bt, ctx, scale, gqa_swap=gqa_swap, fast_math=fast_math,
                                    max_context_len=128, tiles=TINY_TILES, out=poisoned(q), **case)
        err = rel_l2(out, ref)
        assert err < BOUND[torch.float32], f"{route} fast_math={fast_math} {case}: rel L2 {err:.3e}, seed {seed}"
        snap = counters.snapshot()
        st = snap["decode_attention"][route]
        assert st["grids"] == {"x".join(map(str, decode_grid(route, bsz, s["hq"], s["hkv"], want))): 1}, case
        assert st["splits"] == {str(want): 1}
        assert st["variants"] == {"fast_math" if fast_math else "precise": 1}
        other = "per_q_head" if gqa_swap else "gqa_swap"
        assert other not in snap["decode_attention"]
        merge = snap.get("decode_attention_merge", {}).get(route, {})
        assert merge.get("launches", 0) == (1 if want > 1 else 0)
        if want > 1:        # fused (the default): recorded with the merging programs' grid, no launch of its own
            assert merge["variants"] == {("fast_math" if fast_math else "precise") + "/fused_merge": 1}
            assert merge["grids"] == {"x".join(map(str, decode_grid(route, bsz, s["hq"], s["hkv"], want)[:2])): 1}


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


# -- decode: the fused merge against the two-launch merge ---------------------------------------------------------
FUSED_CTX = [1, 21, 38]      # 38 tokens = 3 KV tiles of 16: 5 splits leave trailing ones empty for every sequence


@pytest.fixture
def poisoned_partials(monkeypatch):
    """NaN-filled split partials: a partial read before its program wrote it shows up as NaN in the output."""
    alloc = attn._split_workspace

    def poisoned_workspace(*args):
        return tuple(t.fill_(float("nan")) for t in alloc(*args))
    monkeypatch.setattr(attn, "_split_workspace", poisoned_workspace)


def arrivals_of(device) -> torch.Tensor:
    return attn._ARRIVALS[torch.device(device)]


@pytest.mark.parametrize("gqa_swap", [False, True], ids=["per_q_head", "gqa_swap"])
@pytest.mark.parametrize("fast_math", [False, True], ids=["precise", "fast_math"])
def test_decode_fused_merge_bitwise_equals_two_launches(gqa_swap, fast_math, poisoned_partials):
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged(FUSED_CTX, s["hkv"], s["d"], s["page"], torch.float32, gen, strided=gqa_swap)
    q = make_q(len(FUSED_CTX), s["hq"], s["d"], torch.float32, gen)
    scale = s["d"] ** -0.5
    ref = ref_decode(q, kc, vc, bt, ctx, scale)
    route = "gqa_swap" if gqa_swap else "per_q_head"
    for num_splits in (1, 2, 5):
        outs = {}
        for fused_merge in (True, False):
            counters.reset()
            outs[fused_merge] = attn.decode_attention(q, kc, vc, bt, ctx, scale, gqa_swap=gqa_swap,
                                                      fast_math=fast_math, num_splits=num_splits, tiles=TINY_TILES,
                                                      out=poisoned(q), fused_merge=fused_merge)
            err = rel_l2(outs[fused_merge], ref)
            assert err < BOUND[torch.float32], \
                f"{route} S={num_splits} fused_merge={fused_merge}: rel L2 {err:.3e}, seed {seed}"
            merge = counters.snapshot().get("decode_attention_merge", {}).get(route, {"variants": {}})
            want = ("fast_math" if fast_math else "precise") + ("/fused_merge" if fused_merge else "")
            assert merge["variants"] == ({want: 1} if num_splits > 1 else {}), (num_splits, fused_merge)
        assert torch.equal(outs[True], outs[False]), \
            f"{route} fast_math={fast_math} S={num_splits}: fused merge differs from two launches, seed {seed}"
        if num_splits > 1:
            assert not arrivals_of(DEV).any(), f"S={num_splits}: arrival counters left dirty"


def test_decode_fused_merge_many_splits_in_chunks(poisoned_partials):
    # 17 splits: two chunks of the merge loop (CHUNK_S = 16), most of them empty, on the smaller gqa_swap grid
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged([70, 5], s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(2, s["hq"], s["d"], torch.float32, gen)
    outs = [attn.decode_attention(q, kc, vc, bt, ctx, 0.25, gqa_swap=True, num_splits=17, tiles=TINY_TILES,
                                  out=poisoned(q), fused_merge=fm) for fm in (True, False)]
    assert torch.equal(outs[0], outs[1]), f"seed {seed}"
    err = rel_l2(outs[0], ref_decode(q, kc, vc, bt, ctx, 0.25))
    assert err < BOUND[torch.float32], f"rel L2 {err:.3e}, seed {seed}"


@pytest.mark.parametrize("gqa_swap", [False, True], ids=["per_q_head", "gqa_swap"])
def test_decode_length_rule_independent_of_programs_bound_and_batch(gqa_swap, poisoned_partials):
    # len32 = two tiles of 16 per slice: contexts 1, 21, 38, 70 have 1, 1, 2, 3 live slices. The slots past them are
    # NaN (poisoned) and must never be read; the result must not change with the programs per head (grid_splits),
    # the bound (slots), the merge form, or the batch around a sequence; and it must match the reference.
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    lens = [1, 21, 38, 70]
    kc, vc, bt, ctx = make_paged(lens, s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(len(lens), s["hq"], s["d"], torch.float32, gen)
    ref = ref_decode(q, kc, vc, bt, ctx, 0.25)

    def run(q, bt, ctx, **kw):
        return attn.decode_attention(q, kc, vc, bt, ctx, 0.25, gqa_swap=gqa_swap, split_rule="len32",
                                     tiles=TINY_TILES, out=poisoned(q), **kw)
    first = run(q, bt, ctx, max_context_len=80)
    err = rel_l2(first, ref)
    assert err < BOUND[torch.float32], f"rel L2 {err:.3e}, seed {seed}"
    for kw in (dict(max_context_len=80, grid_splits=1), dict(max_context_len=80, grid_splits=2),
               dict(max_context_len=400), dict(max_context_len=400, grid_splits=3),
               dict(max_context_len=80, fused_merge=False), dict(max_context_len=80, nsplits_cap=1)):
        assert torch.equal(run(q, bt, ctx, **kw), first), f"{kw}: the length rule's result moved, seed {seed}"
    for b in range(len(lens)):          # each sequence alone
        alone = run(q[b:b + 1], bt[b:b + 1], ctx[b:b + 1], max_context_len=80)
        assert torch.equal(alone[0], first[b]), f"sequence {b} alone differs from it in the batch, seed {seed}"


def test_decode_count_rule_skips_empty_slices(poisoned_partials):
    # count rule with 9 slots of two tiles over 38 tokens: 2 live slices, 7 empty ones never written (NaN) and never
    # read; the result equals the two-launch merge and the reference, and every program count gives the same bits
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged([38, 3], s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(2, s["hq"], s["d"], torch.float32, gen)
    outs = [attn.decode_attention(q, kc, vc, bt, ctx, 0.25, num_splits=9, tiles=TINY_TILES, out=poisoned(q), **kw)
            for kw in (dict(), dict(fused_merge=False), dict(grid_splits=1), dict(grid_splits=4))]
    for o in outs[1:]:
        assert torch.equal(o, outs[0]), f"seed {seed}"
    err = rel_l2(outs[0], ref_decode(q, kc, vc, bt, ctx, 0.25))
    assert err < BOUND[torch.float32], f"rel L2 {err:.3e}, seed {seed}"


@pytest.mark.parametrize("gqa_swap", [False, True], ids=["per_q_head", "gqa_swap"])
def test_decode_wave_grid_launches_fewer_programs_for_the_same_bits(gqa_swap, poisoned_partials):
    """The lever decode_wave_grid: under the count rule a batch of 4 gets about one wave of programs per (sequence,
    head), fewer than the slots, each walking several slices; the output is bitwise the slot-per-program one and
    matches the reference. The counters say how many programs ran against how many slots."""
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    lens = [1, 21, 38, 70]
    kc, vc, bt, ctx = make_paged(lens, s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(len(lens), s["hq"], s["d"], torch.float32, gen)
    heads = s["hkv"] if gqa_swap else s["hq"]

    def run(wave_grid):
        counters.reset()
        out = attn.decode_attention(q, kc, vc, bt, ctx, 0.25, gqa_swap=gqa_swap, max_context_len=400, num_sms=16,
                                    tiles=TINY_TILES, out=poisoned(q), wave_grid=wave_grid)
        return out, counters.snapshot()["decode_grid"]
    slots_out, slots_grid = run(False)
    wave_out, wave_grid = run(True)
    (slots_variant,), (wave_variant,) = slots_grid["slots"]["variants"], wave_grid["wave"]["variants"]
    programs, slots = map(int, wave_variant.split("/"))
    assert slots_variant == f"{slots}/{slots}" and slots > 1, slots_grid
    assert programs == splits.wave_programs(len(lens), heads, 16 * TINY_TILES.programs_per_sm) < slots, wave_grid
    assert torch.equal(wave_out, slots_out), f"the wave grid changed bits, seed {seed}"
    err = rel_l2(wave_out, ref_decode(q, kc, vc, bt, ctx, 0.25))
    assert err < BOUND[torch.float32], f"rel L2 {err:.3e}, seed {seed}"


def test_decode_split_rule_counters_and_errors():
    gen, _ = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged([38], s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(1, s["hq"], s["d"], torch.float32, gen)
    counters.reset()
    attn.decode_attention(q, kc, vc, bt, ctx, 0.25, split_rule="len32", max_context_len=128, tiles=TINY_TILES)
    rule = counters.snapshot()["decode_split_rule"]
    assert list(rule) == ["len32"] and rule["len32"]["variants"] == {"min_split=32": 1}
    counters.reset()
    attn.decode_attention(q, kc, vc, bt, ctx, 0.25, max_context_len=128, tiles=TINY_TILES)
    assert list(counters.snapshot()["decode_split_rule"]) == ["off"]
    with pytest.raises(ValueError, match="num_splits=3 forces a slot count"):
        attn.decode_attention(q, kc, vc, bt, ctx, 0.25, split_rule="len32", num_splits=3, tiles=TINY_TILES)
    with pytest.raises(ValueError, match="grid_splits 0 must be a positive integer"):
        attn.decode_attention(q, kc, vc, bt, ctx, 0.25, grid_splits=0, tiles=TINY_TILES)
    with pytest.raises(ValueError, match="split_rule 'len' is not valid"):
        attn.decode_attention(q, kc, vc, bt, ctx, 0.25, split_rule="len", tiles=TINY_TILES)


def test_decode_fused_merge_counters_clean_themselves():
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged(FUSED_CTX, s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(len(FUSED_CTX), s["hq"], s["d"], torch.float32, gen)

    def run():
        return attn.decode_attention(q, kc, vc, bt, ctx, 0.25, num_splits=3, tiles=TINY_TILES, out=poisoned(q))

    first = run()
    buf = arrivals_of(DEV)
    assert buf.dtype == torch.int32 and buf.numel() >= len(FUSED_CTX) * s["hq"]
    assert not buf.any(), f"counters after one call: {buf[:len(FUSED_CTX) * s['hq']].tolist()}"
    second = run()
    assert arrivals_of(DEV) is buf, "a large enough buffer must be reused, not reallocated"
    assert not buf.any() and torch.equal(first, second), f"seed {seed}"


@pytest.mark.parametrize("gqa_swap", [False, True], ids=["per_q_head", "gqa_swap"])
def test_decode_fused_merge_faults_fail_the_comparison(gqa_swap, poisoned_partials):
    gen, seed = fresh_generator()
    s = DECODE_SHAPE
    kc, vc, bt, ctx = make_paged(FUSED_CTX, s["hkv"], s["d"], s["page"], torch.float32, gen)
    q = make_q(len(FUSED_CTX), s["hq"], s["d"], torch.float32, gen)
    num_splits = 3
    n = len(FUSED_CTX) * (s["hkv"] if gqa_swap else s["hq"])

    def run(**kw):
        return attn.decode_attention(q, kc, vc, bt, ctx, 0.25, gqa_swap=gqa_swap, num_splits=num_splits,
                                     tiles=TINY_TILES, out=poisoned(q), **kw)

    two_launch = run(fused_merge=False)
    assert torch.equal(run(), two_launch), f"seed {seed}"
    buf = arrivals_of(DEV)
    faults = {
        # a skipped reset leaves S per (b, g): the next call's arrivals count S .. 2S - 1, none is the last
        "reset skipped": num_splits,
        # one arrival too many (an early merge, as a missing release/acquire would allow): the merge runs before
        # the last split's partial is written and reads its NaN poison
        "counter one ahead": 1,
    }
    # the buffer is the process's: an engine test that ran first under inference_mode made it an inference tensor,
    # which only inference_mode may write in place (CI, 2026-12-04: "Inplace update to inference tensor")
    with torch.inference_mode():
        try:
            for name, dirty in faults.items():
                buf[:n] = dirty
                out = run()
                assert not torch.equal(out, two_launch), f"fault '{name}' went unnoticed, seed {seed}"
                assert rel_l2(out, two_launch) == float("inf"), f"fault '{name}': expected NaN rows, seed {seed}"
                buf.zero_()
        finally:
            buf.zero_()          # the buffer is shared by every later test on this device
    assert torch.equal(run(), two_launch), f"a clean buffer must give the right result again, seed {seed}"


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
                         dict(num_splits=1), dict(num_splits=16), dict(split_rule="len256"),
                         dict(split_rule="len512", grid_splits=1), dict(split_rule="len1024")):
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
def test_gpu_length_rule_invariant_to_batch_bound_and_graphs():
    # fixed-length slices: a sequence's output must not move with the batch around it, the context bound (8k or
    # 40k: 16 or 80 slots of 512) or CUDA-graph replay, for both routes
    gen, seed = fresh_generator()
    ctx_lens = [7, 300, 1100, 2049, 8191]
    kc, vc, bt, ctx = make_paged(ctx_lens, REAL["hkv"], REAL["d"], REAL["page"], torch.bfloat16, gen)
    q = make_q(len(ctx_lens), REAL["hq"], REAL["d"], torch.bfloat16, gen)
    ref = ref_decode(q, kc, vc, bt, ctx, 0.088)
    for gqa_swap in (False, True):
        for rule in ("len256", "len512"):
            kw = dict(gqa_swap=gqa_swap, split_rule=rule)
            first = attn.decode_attention(q, kc, vc, bt, ctx, 0.088, max_context_len=8192, out=poisoned(q), **kw)
            torch.cuda.synchronize()
            assert rel_l2(first, ref) < BOUND[torch.bfloat16], f"{kw}: seed {seed}"
            wide = attn.decode_attention(q, kc, vc, bt, ctx, 0.088, max_context_len=40960, out=poisoned(q), **kw)
            assert torch.equal(wide, first), f"{kw}: a 40k bound changed the result"
            for b in range(len(ctx_lens)):
                alone = attn.decode_attention(q[b:b + 1], kc, vc, bt[b:b + 1], ctx[b:b + 1], 0.088,
                                              max_context_len=8192, **kw)
                assert torch.equal(alone[0], first[b]), f"{kw}: sequence {b} alone differs, seed {seed}"
            out = poisoned(q)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                attn.decode_attention(q, kc, vc, bt, ctx, 0.088, max_context_len=40960, out=out, **kw)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, first), f"{kw}: graph replay differs from eager"


@gpu
@needs_cuda
def test_gpu_wave_grid_is_bitwise_the_slot_grid_at_a_large_batch():
    # decode_wave_grid at Qwen3-8B's heads, 64 sequences of ~1k tokens under the 40,960 bound (64 slots): about one
    # wave of programs instead of 64 per head, the same bits, eager and graph-replayed, for both routes
    gen, seed = fresh_generator()
    ctx_lens = torch.randint(900, 1200, (64,), generator=gen).tolist()
    kc, vc, bt, ctx = make_paged(ctx_lens, REAL["hkv"], REAL["d"], REAL["page"], torch.bfloat16, gen)
    q = make_q(len(ctx_lens), REAL["hq"], REAL["d"], torch.bfloat16, gen)
    ref = ref_decode(q, kc, vc, bt, ctx, 0.088)
    for gqa_swap in (False, True):
        slots = attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=gqa_swap, max_context_len=40960,
                                      out=poisoned(q))
        counters.reset()
        wave = attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=gqa_swap, max_context_len=40960,
                                     out=poisoned(q), wave_grid=True)
        torch.cuda.synchronize()
        (variant,) = counters.snapshot()["decode_grid"]["wave"]["variants"]
        programs, n_slots = map(int, variant.split("/"))
        assert programs < n_slots, variant
        assert torch.equal(wave, slots), f"gqa_swap={gqa_swap}: the wave grid changed bits, seed {seed}"
        assert rel_l2(wave, ref) < BOUND[torch.bfloat16], f"gqa_swap={gqa_swap}: seed {seed}"
        out = poisoned(q)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=gqa_swap, max_context_len=40960, out=out,
                                  wave_grid=True)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, slots), f"gqa_swap={gqa_swap}: graph replay differs from eager"


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
        for gqa_pack, splits in ((False, "off"), (True, "off"), (True, 4), (True, "auto")):
            out = attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, fast_math=fast_math, out=poisoned(q),
                                         gqa_pack=gqa_pack, splits=splits)
            torch.cuda.synchronize()
            err = rel_l2(out, ref)
            assert err < BOUND[torch.bfloat16], \
                f"fast_math={fast_math} gqa_pack={gqa_pack} splits={splits}: rel L2 {err:.3e}, seed {seed}"


def _compiled_kernels(fn) -> dict:
    """Every compiled binary of a @triton.jit function, by id (the first entry of each device cache is its
    kernel cache)."""
    return {id(k): k for entry in fn.device_caches.values() for k in entry[0].values()}


@gpu
@needs_cuda
def test_gpu_packed_prefill_tiles_fit_the_programs_per_sm_they_claim():
    """prefill_splits "auto" sizes its wave by the programs each packed tile set fits per SM. Each set is compiled
    here at the real shapes (the fast-math set with fast math, as the engine runs it) and its occupancy worked out
    from the binary's shared memory and registers against this GPU's per-SM limits: the claim
    (packed_programs_per_sm) must equal it."""
    gen, _ = fresh_generator()
    q_lens, ctx_lens = [300], [2100]
    kc, vc, bt, ctx = make_paged(ctx_lens, REAL["hkv"], REAL["d"], REAL["page"], torch.bfloat16, gen)
    cu = torch.tensor([0, q_lens[0]], dtype=torch.int32, device=DEV)
    q = make_q(q_lens[0], REAL["hq"], REAL["d"], torch.bfloat16, gen)
    props = torch.cuda.get_device_properties(0)
    smem_sm = getattr(props, "shared_memory_per_multiprocessor", 233472)
    regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
    threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
    report = []
    for name, fast in (("PREFILL_PACKED_TILES", False), ("PREFILL_PACKED_TILES_SHORT", False),
                       ("PREFILL_PACKED_TILES_FAST", True)):
        tiles = getattr(attn, name)
        attn._prefill_packed_kernel.device_caches.clear()          # only this launch's binary in it (disk-cached)
        attn.prefill_attention(q, kc, vc, cu, ctx, bt, REAL["d"] ** -0.5, fast_math=fast, out=poisoned(q),
                               gqa_pack=True, tiles=tiles)
        torch.cuda.synchronize()
        (kern,) = _compiled_kernels(attn._prefill_packed_kernel).values()
        assert (kern.metadata.num_warps, kern.metadata.num_stages) == (tiles.num_warps, tiles.num_stages), name
        kern.run        # loads the binary: its register count
        by_smem = smem_sm // (kern.metadata.shared + 1024)          # 1 KB a block reserved by the driver
        regs_warp = -(-kern.n_regs * 32 // 256) * 256               # registers go out 256 a warp
        by_regs = (regs_sm // regs_warp) // tiles.num_warps
        by_threads = threads_sm // (tiles.num_warps * 32)
        fits = min(by_smem, by_regs, by_threads)
        claim = attn.packed_programs_per_sm(tiles)
        report.append((fits == claim,
                       f"{name}: {kern.metadata.shared} B shared, {kern.n_regs} registers -> {fits} a SM (shared "
                       f"memory {by_smem}, registers {by_regs}, threads {by_threads}); claims {claim}"))
    assert all(ok for ok, _ in report), "\n".join(line for _, line in report)


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


STRESS_REPS = 50


def real_paged_on_device(batch, context, gen):
    """Real-shape bf16 paged K/V made on the GPU (the CPU helper is slow at 32 x 8192 tokens): shuffled blocks,
    sequence 0 at the full context and the others ragged in [1, context] (short ones leave trailing splits empty)."""
    nbps = context // REAL["page"]
    shape = (batch * nbps, REAL["page"], REAL["hkv"], REAL["d"])
    kc = torch.randn(shape, device=DEV, generator=gen, dtype=torch.bfloat16)
    vc = torch.randn(shape, device=DEV, generator=gen, dtype=torch.bfloat16)
    bt = torch.randperm(batch * nbps, device=DEV, generator=gen).view(batch, nbps).to(torch.int32)
    ctx = torch.randint(1, context + 1, (batch,), device=DEV, generator=gen, dtype=torch.int32)
    ctx[0] = context
    q = torch.randn(batch, REAL["hq"], REAL["d"], device=DEV, generator=gen, dtype=torch.bfloat16)
    return q, kc, vc, bt, ctx


def stress_fused_merge(q, kc, vc, bt, ctx, where, **kw):
    """STRESS_REPS fused launches back to back and STRESS_REPS replays of a graph of one, each against the
    two-launch result, bitwise."""
    def call(out, fused_merge=True):
        return attn.decode_attention(q, kc, vc, bt, ctx, REAL["d"] ** -0.5, out=out, fused_merge=fused_merge, **kw)

    two_launch = call(poisoned(q), fused_merge=False)
    eager = [poisoned(q) for _ in range(STRESS_REPS)]
    for out in eager:                 # no sync between launches: each one's counters must be clean for the next
        call(out)
    g_out = poisoned(q)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(g_out)
    replays = [poisoned(q) for _ in range(STRESS_REPS)]
    for out in replays:
        g_out.fill_(float("nan"))
        graph.replay()
        out.copy_(g_out)
    torch.cuda.synchronize()
    assert torch.isfinite(two_launch).all(), where
    bad = [i for i, out in enumerate(eager) if not torch.equal(out, two_launch)]
    assert not bad, f"{where}: eager launches {bad} differ from the two-launch result"
    bad = [i for i, out in enumerate(replays) if not torch.equal(out, two_launch)]
    assert not bad, f"{where}: graph replays {bad} differ from the two-launch result"
    assert not attn._ARRIVALS[q.device].any(), f"{where}: arrival counters left dirty"


@gpu
@needs_cuda
@pytest.mark.parametrize("gqa_swap", [False, True], ids=["per_q_head", "gqa_swap"])
def test_gpu_fused_merge_bitwise_stress(gqa_swap):
    """The memory-ordering stress: the fused merge reads partials that other programs wrote, ordered only by the
    arrival counter's release/acquire. A missing barrier, release, acquire or counter reset shows up as a stale
    or NaN-poisoned row in some of the launches or replays. Forced 16 and 64 splits make every shape merge (the
    heuristic gives 1 split at large batches); 64 leaves many trailing splits empty."""
    _, seed = fresh_generator()
    gen = torch.Generator(device=DEV).manual_seed(seed)
    for batch in (1, 8, 32):
        for context in (1024, 8192):
            tensors = real_paged_on_device(batch, context, gen)
            for case in (dict(max_context_len=context), dict(num_splits=16), dict(num_splits=64)):
                stress_fused_merge(*tensors, f"gqa_swap={gqa_swap} batch {batch} context {context} {case} "
                                             f"seed {seed}", gqa_swap=gqa_swap, **case)
            del tensors
            torch.cuda.empty_cache()


@gpu
@needs_cuda
def test_gpu_fused_merge_counters_allocated_during_capture():
    # no cached counter buffer when the graph is captured: the launcher allocates one inside the capture (its
    # zero fill becomes a memset node), and every replay must still start from zeros
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, kc, vc, bt, ctx = real_paged_on_device(8, 1024, gen)
    two_launch = attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=True, num_splits=16, fused_merge=False)
    out = poisoned(q)
    attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=True, num_splits=16, out=out)   # compile
    torch.cuda.synchronize()
    attn._RETIRED_ARRIVALS.append(attn._ARRIVALS.pop(q.device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.decode_attention(q, kc, vc, bt, ctx, 0.088, gqa_swap=True, num_splits=16, out=out)
    assert q.device not in attn._ARRIVALS, "a buffer allocated during capture must not be cached"
    for i in range(STRESS_REPS):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, two_launch), f"replay {i} differs from the two-launch result"


def test_packed_tiles_follow_fast_math_then_step_length(monkeypatch):
    """At fast math every packed prefill step takes the 3-stage tiles (the H100 variants run of 2026-12-06); without
    it a step of at most PACKED_SHORT_TOKENS new tokens takes the short tiles, a longer one the long tiles."""
    fast, short, long_ = (attn.Tiles(block_m=m, block_n=m, num_warps=w, num_stages=s)
                          for m, w, s in ((128, 8, 3), (64, 4, 3), (128, 8, 2)))
    monkeypatch.setattr(attn, "PREFILL_PACKED_TILES_FAST", fast)
    monkeypatch.setattr(attn, "PREFILL_PACKED_TILES_SHORT", short)
    monkeypatch.setattr(attn, "PREFILL_PACKED_TILES", long_)
    n = attn.PACKED_SHORT_TOKENS
    assert [attn.packed_tiles(t, True) for t in (1, n, n + 1)] == [fast] * 3
    assert [attn.packed_tiles(t, False) for t in (1, n, n + 1)] == [short, short, long_]
