"""The whole engine on a GPU: backend=triton against the torch backend (the oracle) on qwen3-0.6b in bf16, and
graphed decode against eager. CUDA only (the CPU suite runs the same comparison on `tiny` in the interpreter,
tests/test_engine.py).

Greedy tokens must equal the oracle's, or every divergence must be a near-tie: at each position of our sequence
the oracle's (teacher-forced) log-probability of our token is within 0.5 nats of its best token's. The counts are
printed (run with -s to see them).
"""
from __future__ import annotations

import pytest
import torch

from vtengine.engine.llm import LLM
from vtengine.engine.sampling_params import SamplingParams

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the whole engine on it)")
NEAR_TIE_NATS = 0.5
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
ENGINE = dict(model="qwen3-0.6b", quant="bf16", max_model_len=2048, num_kv_blocks=2048)


def prompts(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 64, 100, 129, 256, 5, 511, 33, 700, 1, 48][:n]
    return [torch.randint(16, 30000, (L,), generator=g).tolist() for L in lengths]


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def worst_gap_nats(oracle: LLM, prompt: list[int], ours: list[int]) -> float:
    lp = oracle.engine.score(prompt, ours)
    return float((lp.max(dim=-1).values - lp[range(len(ours)), ours]).clamp(min=0).max())


@gpu
@needs_cuda
def test_gpu_triton_engine_matches_the_torch_oracle_qwen3_0_6b():
    ps = prompts()
    oracle = LLM(backend="torch", **ENGINE)
    assert not oracle.engine.runner.use_graphs     # its references synchronise with the host: decoded eagerly
    want = tokens(oracle.generate(ps, GREEDY))
    ours = tokens(LLM(backend="triton", levers={"gqa_swap": True}, **ENGINE).generate(ps, GREEDY))
    strict = sum(a == b for a, b in zip(ours, want))
    gaps = [worst_gap_nats(oracle, p, o) for p, o, w in zip(ps, ours, want) if o != w]
    print(f"\nqwen3-0.6b bf16, triton vs torch: {strict}/{len(ps)} strict, {len(gaps)} divergent sequences, "
          f"worst gap {max(gaps, default=0.0):.3f} nats")
    assert all(len(o) == GREEDY.max_tokens for o in ours)
    assert all(g <= NEAR_TIE_NATS for g in gaps), f"a divergence beyond a near-tie: gaps {gaps}"
    # the check can fail: a sequence with one token replaced by the oracle's least likely one is no near-tie
    lp = oracle.engine.score(ps[0], want[0][:1])
    bad = [int(lp[0].argmin())] + want[0][1:]
    assert worst_gap_nats(oracle, ps[0], bad) > NEAR_TIE_NATS


@gpu
@needs_cuda
def test_gpu_graphed_decode_equals_eager_qwen3_0_6b():
    ps = prompts(8, seed=1)
    levers = {"gqa_swap": True}
    graphed = LLM(backend="triton", levers=levers, **ENGINE)
    assert graphed.engine.runner.use_graphs
    eager = LLM(backend="triton", levers=levers, cuda_graphs=False, **ENGINE)
    assert not eager.engine.runner.use_graphs
    assert tokens(graphed.generate(ps, GREEDY)) == tokens(eager.generate(ps, GREEDY))


@gpu
@needs_cuda
def test_async_scheduling_on_the_gpu_equals_sync_and_launches_without_a_host_sync():
    """Graphed decode with one step in flight equals the synchronous engine token for token, and launching a step
    (inputs, mirror gather, graph replay, sampling, the host copy) never waits for the device: under
    ``torch.cuda.set_sync_debug_mode("error")`` any synchronising call in ``launch`` raises."""
    ps = prompts(8)
    sampled = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    params = [GREEDY, sampled] * 4
    sync = LLM(**ENGINE)
    want = tokens(sync.generate(ps, params))
    llm = LLM(**ENGINE, levers={"async_scheduling": True, "async_device_mirror": True})
    runner = llm.engine.runner
    launch = runner.launch

    def strict_launch(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    runner.launch = strict_launch
    assert tokens(llm.generate(ps, params)) == want


@gpu
@needs_cuda
def test_gpu_chunk_graphs_equal_eager_chunks_without_a_host_sync():
    """chunk_graphs on qwen3-0.6b: prompts of up to 1,100 tokens in 256-token chunks beside decoding requests (mixed
    steps). Full chunks replay their graphs, and copying a step into the graph's buffers and replaying it never waits
    for the device (``set_sync_debug_mode("error")`` raises on any synchronising call); every request's tokens equal
    the eager chunks' or diverge only at a near tie (padded decode rows change the GEMMs' M)."""
    from vtengine import counters
    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(16, 30000, (n,), generator=g).tolist() for n in (700, 5, 1100, 300, 17, 513, 256, 40)]
    # chunk_above off: mixed_prefill (on by default) would otherwise prefill every prompt of at most 1,536 tokens whole
    levers = {"chunked_prefill": 256, "mixed_steps": True, "chunk_above": "off"}
    eager = LLM(levers=levers, **ENGINE)
    want = tokens(eager.generate(ps, GREEDY))
    graphed = LLM(levers={**levers, "chunk_graphs": True}, **ENGINE)
    runner = graphed.engine.runner
    assert runner.chunk_graphs is not None and runner.chunk_graphs.chunk == 256
    replay = runner._chunk_replay

    def strict_replay(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return replay(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    runner._chunk_replay = strict_replay
    counters.reset()
    got = tokens(graphed.generate(ps, GREEDY))
    assert counters.launches("chunk_step", "cuda_graph") >= 6       # 700 -> 2, 1100 -> 4, 513 -> 2, 256 -> 1 ...
    for p, ours, theirs in zip(ps, got, want):
        if ours != theirs:
            assert worst_gap_nats(eager, p, ours) <= NEAR_TIE_NATS
