"""The L2 prefetch launch (vtengine/kernels/l2_prefetch.py, an experiment not wired into the engine): which lines it
covers and its L2 budget.

The PTX prefetch has no result to compare, and the CPU interpreter cannot run it, so the kernel's TOUCH form (each
program sums the first byte of each of its lines) carries the address arithmetic: every test compares it with the
torch reference on random bytes (the launcher poisons the sums with -1 first). The ``gpu`` test runs the real
prefetch, eagerly and in a graph.
"""
from __future__ import annotations

import pytest
import torch

from vtengine import counters
from vtengine.kernels import l2_prefetch as lp
from vtengine.testing import fresh_generator

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def random_bytes(n: int, gen) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen).to(DEV)


@pytest.mark.parametrize("nbytes", [1, 127, 128, 129, 4096, 70_001])
@pytest.mark.parametrize("lines_per_program", [4, 8])
def test_touch_covers_every_line_once(nbytes, lines_per_program):
    gen, seed = fresh_generator()
    t = random_bytes(nbytes, gen)
    got = lp.prefetch(t, touch=True, lines_per_program=lines_per_program)
    ref = lp.touch_reference(t, lines_per_program=lines_per_program)
    assert got.shape == ref.shape == (-(-(-(-nbytes // 128)) // lines_per_program),)
    assert torch.equal(got, ref), (got, ref)
    # the lines' first bytes, counted once each: the sums add up to them
    assert int(got.sum()) == int(t[::128].to(torch.int64).sum())


def test_touch_sees_a_changed_line():
    """A byte at a line's start moves its program's sum; one inside a line (no line starts there) does not."""
    gen, seed = fresh_generator()
    t = random_bytes(64 * 128, gen)
    before = lp.prefetch(t, touch=True, lines_per_program=8).clone()
    t[5 * 128] ^= 0x55
    after = lp.prefetch(t, touch=True, lines_per_program=8)
    assert (after != before).nonzero().flatten().tolist() == [0]
    t[5 * 128 + 1] ^= 0x55
    assert torch.equal(lp.prefetch(t, touch=True, lines_per_program=8), after)


def test_a_dense_weight_is_read_as_its_bytes():
    gen, seed = fresh_generator()
    w = torch.randn(48, 96, generator=gen).to(torch.bfloat16).to(DEV)
    assert torch.equal(lp.prefetch(w, touch=True, lines_per_program=4), lp.touch_reference(w, lines_per_program=4))


def test_the_budget_caps_the_lines_from_the_start():
    p = lp.plan(10_000 * 128, l2=4_000 * 128, share=0.5)
    assert (p.lines, p.budget_lines, p.programs) == (2_000, 2_000, -(-2_000 // lp.LINES_PER_PROGRAM))
    whole = lp.plan(33_554_432, l2=50 * 2**20)          # bf16 Qwen3-8B o_proj against an H200's L2
    assert whole.lines == 33_554_432 // 128 and whole.nbytes == 33_554_432
    gen, seed = fresh_generator()
    t = random_bytes(40 * 128, gen)
    got = lp.touch_reference(t, share=0.5, lines_per_program=4, l2=16 * 128)
    assert int(got.sum()) == int(t[:8 * 128:128].to(torch.int64).sum())


@pytest.mark.parametrize("bad", [dict(nbytes=0, l2=1024), dict(nbytes=10, l2=1024, share=0.0),
                                 dict(nbytes=10, l2=1024, share=1.5)])
def test_bad_plans_are_refused(bad):
    with pytest.raises(ValueError, match="l2 prefetch"):
        lp.plan(**bad)


def test_a_strided_tensor_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        lp.prefetch(torch.zeros(8, 8).t(), touch=True)


def test_the_interpreter_skips_the_ptx_and_counts_it():
    if CUDA:
        pytest.skip("the skip is the CPU interpreter's")
    counters.reset()
    assert lp.prefetch(torch.zeros(4096, dtype=torch.uint8)) is None
    assert counters.snapshot()["l2_prefetch"]["skipped_interpreter"]["launches"] == 1


@pytest.mark.gpu
def test_the_real_prefetch_runs_in_every_mode_eagerly_and_in_a_graph():
    w = torch.randn(4096, 4096 + 8, device="cuda", dtype=torch.bfloat16)
    counters.reset()
    for mode in lp.MODES:
        for pdl in (False, True):
            assert lp.prefetch(w, pdl=pdl, mode=mode) is None
    torch.cuda.synchronize()
    assert counters.snapshot()["l2_prefetch"]["prefetch"]["launches"] == 2 * len(lp.MODES)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for mode in lp.MODES:
            lp.prefetch(w, pdl=True, mode=mode)
    g.replay()
    torch.cuda.synchronize()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode 'sideways' is not known; accepted: line, bulk, load"):
        lp.prefetch(torch.zeros(256, dtype=torch.uint8), mode="sideways")
