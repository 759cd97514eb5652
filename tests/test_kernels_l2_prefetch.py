"""The L2 prefetch launch (vtengine/kernels/l2_prefetch.py, lever o_prefetch): which lines it covers, its L2 budget,
its place in the decode step, and that it changes no token.

The PTX prefetch has no result to compare, and the CPU interpreter cannot run it, so the kernel's TOUCH form (each
program sums the first byte of each of its lines) carries the address arithmetic: every test compares it with the
torch reference on random bytes, with the sums poisoned first. The ``gpu`` test runs the real prefetch in the engine.
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


def _decode_counts(o_prefetch: str) -> tuple[list[list[int]], dict]:
    from vtengine.engine.llm import LLM
    from vtengine.engine.sampling_params import SamplingParams
    llm = LLM(model="tiny", backend="triton", levers={"o_prefetch": o_prefetch}, cuda_graphs=False,
              device=DEV)
    counters.reset()
    outs = llm.generate([[5, 6, 7, 8] * 3, [9, 10, 11]], SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], counters.snapshot()


def test_the_engine_prefetches_o_once_a_layer_per_decode_step_and_changes_no_token():
    on_tokens, on = _decode_counts("line")
    off_tokens, off = _decode_counts("off")
    assert on_tokens == off_tokens
    assert "l2_prefetch" not in off
    launches = sum(st["launches"] for st in on["l2_prefetch"].values())
    from vtengine.models.presets import load_preset
    layers = int(load_preset("tiny")["hf_config"]["num_hidden_layers"])
    assert launches == 3 * layers               # 4 new tokens: the first from the prefill, 3 decode steps


@pytest.mark.gpu
def test_the_real_prefetch_runs_under_graphs_and_changes_no_token():
    from vtengine.engine.llm import LLM
    from vtengine.engine.sampling_params import SamplingParams
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 9, [9] * 3]
    got = {}
    for mode in ("off",) + lp.MODES:
        llm = LLM(model="tiny", backend="triton", levers={"o_prefetch": mode, "pdl": True}, device="cuda",
                  gpu_memory_utilization=0.1)
        got[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        del llm
        torch.cuda.empty_cache()
    assert all(tokens == got["off"] for tokens in got.values()), got
    w = torch.randn(4096, 4096 + 8, device="cuda", dtype=torch.bfloat16)
    counters.reset()
    for mode in lp.MODES:
        assert lp.prefetch(w, pdl=True, mode=mode) is None
    torch.cuda.synchronize()
    assert counters.snapshot()["l2_prefetch"]["prefetch"]["launches"] == len(lp.MODES)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode 'sideways' is not known; accepted: line, bulk, load"):
        lp.prefetch(torch.zeros(256, dtype=torch.uint8), mode="sideways")
