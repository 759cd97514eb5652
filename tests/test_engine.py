"""The engine on CPU (torch backend, tiny preset): batch invariance, preemption, quantize-on-load, clear errors."""
import pytest
import torch

from vtengine.config import ConfigError, EngineConfig
from vtengine.engine.block_manager import BlockManager
from vtengine.engine.llm import LLM
from vtengine.engine.llm_engine import LLMEngine
from vtengine.engine.sampling_params import RequestError, SamplingParams
from vtengine.engine.sequence import Sequence
from vtengine.levers import LeverError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def mixed_prompts(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 17, 16, 33, 5, 64, 9][:n]
    return [torch.randint(3, 500, (L,), generator=g).tolist() for L in lengths]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", backend="torch")


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batch_invariance_8_mixed_lengths(llm):
    prompts = mixed_prompts()
    batched = tokens(llm.generate(prompts, GREEDY))
    alone = [tokens(llm.generate([p], GREEDY))[0] for p in prompts]
    assert batched == alone
    assert all(len(t) == 12 for t in batched)
    # the outputs depend on the prompt (a constant model would pass invariance trivially)
    assert len({tuple(t) for t in batched}) == len(prompts)


def test_preemption_by_recompute_keeps_tokens(llm):
    prompts = mixed_prompts()
    expected = [tokens(llm.generate([p], GREEDY))[0] for p in prompts]
    # 8 blocks of 16 cannot hold 8 sequences of up to 76 tokens at once: the scheduler must preempt
    small = LLM(model="tiny", backend="torch", num_kv_blocks=8, max_num_seqs=8)
    got = tokens(small.generate(prompts, GREEDY))
    assert small.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert small.engine.block_manager.num_free == 8          # every block came back


def test_seeded_sampling_is_batch_invariant_and_seed_dependent(llm):
    prompts = mixed_prompts(4)
    p = SamplingParams(max_tokens=10, temperature=1.0, top_k=40, top_p=0.9, seed=123, ignore_eos=True)
    batched = tokens(llm.generate(prompts, p))
    alone = tokens(llm.generate([prompts[2]], p))[0]
    assert batched[2] == alone
    other = tokens(llm.generate([prompts[2]], SamplingParams(max_tokens=10, temperature=1.0, seed=124,
                                                             ignore_eos=True)))[0]
    assert other != alone


def test_a_vanishing_temperature_samples_greedily(llm):
    """A temperature under 1e-5 is greedy (as vLLM's): dividing the logits by 1e-300 gave inf, a NaN softmax and
    token 0 at every step, served as a 200."""
    prompt = mixed_prompts(1)[0]
    greedy = tokens(llm.generate([prompt], GREEDY))[0]
    for t in (1e-300, 1e-40, 1e-6):
        p = SamplingParams(max_tokens=12, temperature=t, seed=1, ignore_eos=True)
        assert p.greedy and tokens(llm.generate([prompt], p))[0] == greedy, t
    assert not SamplingParams(temperature=1e-4).greedy


def test_stop_token_and_eos(llm):
    prompt = mixed_prompts(1)[0]
    free = tokens(llm.generate([prompt], GREEDY))[0]
    stop = free[3]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                stop_token_ids=[stop]))[0]
    first = free.index(stop)
    assert out.outputs[0].token_ids == free[:first + 1] and out.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("quant", ["mxfp4", "nvfp4"])
def test_quantize_on_load_matches_dequantized_dense(quant):
    """W4A16 engine == dense engine whose projection weights were replaced by the dequantized ones."""
    from vtengine.quant import dequantize
    q = LLM(model="tiny", backend="torch", quant=quant)
    d = LLM(model="tiny", backend="torch")
    for lq, ld in zip(q.engine.model.layers, d.engine.model.layers):
        for name in ("qkv", "o", "gate_up", "down"):
            wq = getattr(lq, name)
            assert wq.fmt == quant
            setattr(ld, name, dequantize(wq, torch.float32))
    prompts = mixed_prompts(4)
    assert tokens(q.generate(prompts, GREEDY)) == tokens(d.generate(prompts, GREEDY))


def test_block_manager_ref_counts():
    bm = BlockManager(4, 16)
    a = Sequence("a", list(range(20)), GREEDY, 16)
    bm.allocate(a)
    assert len(a.block_table) == 2 and bm.num_free == 2
    b = Sequence("b", list(range(20)), GREEDY, 16)
    bm.fork(a, b)
    bm.free(a)
    assert bm.num_free == 2                      # b still holds the shared blocks
    bm.free(b)
    assert bm.num_free == 4
    with pytest.raises(AssertionError):
        bm._release(0)                           # a double free is caught


def test_errors_are_clear(llm):
    with pytest.raises(ConfigError, match="unknown model preset|neither a known preset"):
        LLM(model="no-such-model")
    with pytest.raises(ConfigError, match="quant 'int3'.*accepted"):
        LLM(model="tiny", quant="int3")
    with pytest.raises(LeverError, match="nsplits_cap.*'banana'.*accepted"):
        LLM(model="tiny", levers={"nsplits_cap": "banana"})
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(RequestError, match="exceeds the model's maximum length"):
        llm.generate([[5] * 2040], SamplingParams(max_tokens=20))
    with pytest.raises(RequestError, match="token ids must be integers"):
        llm.generate([[5, 100000]], GREEDY)
    with pytest.raises(RequestError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    # the engine still serves after refusing requests
    assert len(tokens(llm.generate([[5, 6, 7]], GREEDY))[0]) == 12


def test_engine_stats_count_tokens():
    eng = LLMEngine(EngineConfig(model="tiny", backend="torch"))
    eng.add_request("r1", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    st = eng.stats()
    assert st["tokens_generated_total"] == 4 and st["prompt_tokens_total"] == 3
    assert st["requests_finished_total"] == 1 and st["kv_blocks_free"] == st["kv_blocks_total"]


def test_triton_backend_matches_the_torch_backend_on_tiny():
    """Every kernel through Triton (the interpreter on CPU, fp32) against the torch oracle: the same greedy tokens
    for ragged prompts, and the decoder's qkv epilogue ran fused (no separate rope or KV-store launch)."""
    from vtengine import counters
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = mixed_prompts(3, seed=3)
    want = tokens(LLM(model="tiny", backend="torch").generate(prompts, params))
    counters.reset()
    got = tokens(LLM(model="tiny", backend="triton").generate(prompts, params))
    snap = counters.snapshot()
    assert got == want
    assert counters.launches("qkv_epilogue") > 0               # under either math variant (fast_math's default)
    assert "rope" not in snap and "store_kv" not in snap


def test_fuse_norm_keeps_the_tokens_and_launches_no_add_rms_norm_at_decode():
    """The lever fuse_norm on tiny (fp32 under the interpreter): the same greedy tokens as the torch oracle and as
    the lever off, the residual add and RMSNorm inside the GEMVs (counted), add_rms_norm gone from the decoder, and
    a prompt longer than the GEMV's 16 rows taking the separate kernels for its prefill."""
    from vtengine import counters
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = mixed_prompts(3, seed=5) + [list(range(3, 23))]
    want = tokens(LLM(model="tiny", backend="torch").generate(prompts, params))
    counters.reset()
    got = tokens(LLM(model="tiny", backend="triton", levers={"fuse_norm": True}).generate(prompts, params))
    snap = counters.snapshot()
    assert got == want
    variants = [v for st in snap["dense_linear"].values() for v in st["variants"]]
    assert any("'add_residual'" in v for v in variants) and any("'norm'" in v for v in variants)
    # the adds hand the norm GEMVs x * g (the down GEMV of the last layer feeds the separate final norm: no gain)
    assert any("'gain_out'" in v for v in variants) and any("'gained'" in v for v in variants), variants
    assert any("'add_residual'" in v and "'gain_out'" not in v for v in variants), variants
    norms = {v: n for st in snap["rms_norm"].values() for v, n in st["variants"].items()}
    adds = sum(n for v, n in norms.items() if "add_rms_norm" in v)
    # only the 20-token prompt's prefill step (M > 16) ran add_rms_norm: one per layer boundary and the final norm
    layers = LLM(model="tiny", backend="torch").engine.model.cfg.num_hidden_layers
    assert adds == 2 * layers, norms
    # prompts of 16 tokens in all prefill through the fused GEMVs too (their last tokens picked after the norm), in
    # bf16 and through the W4A16 GEMM's dense route
    short = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    for quant, kernel in (("bf16", "dense_linear"), ("mxfp4", "w4a16_gemm")):
        counters.reset()
        fused = tokens(LLM(model="tiny", quant=quant, backend="triton", levers={"fuse_norm": True}).generate(
            short, params))
        assert fused == tokens(LLM(model="tiny", quant=quant, backend="torch").generate(short, params)), quant
        snap = counters.snapshot()
        assert not any("add_rms_norm" in v for st in snap["rms_norm"].values() for v in st["variants"]), quant
        assert any("'norm'" in v for st in snap[kernel].values() for v in st["variants"]), quant


@pytest.mark.parametrize("quant,kernel", [("bf16", "dense_linear"), ("mxfp4", "w4a16_gemm")])
def test_fuse_rope_keeps_the_tokens_and_runs_each_decode_qkv_epilogue_in_the_projection(quant, kernel):
    """The lever fuse_rope on tiny (fp32 under the interpreter; bf16 weights through the Triton GEMV, MXFP4 through
    the W4A16 GEMM's dense route), with fuse_norm on and off: the torch oracle's greedy tokens, and every qkv
    epilogue run once, either in the qkv projection (decode steps) or as its kernel (the 20-token prompt's prefill,
    M > 16): the fused launches plus the kernel's equal the kernel's launches with the lever off."""
    from vtengine import counters
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = mixed_prompts(2, seed=7) + [list(range(3, 23))]
    want = tokens(LLM(model="tiny", quant=quant, backend="torch").generate(prompts, params))

    def run(**levers):
        counters.reset()
        got = tokens(LLM(model="tiny", quant=quant, backend="triton", levers=levers).generate(prompts, params))
        snap = counters.snapshot()
        fused = sum(n for st in snap[kernel].values() for v, n in st["variants"].items() if "'rope'" in v)
        return got, fused, sum(st["launches"] for st in snap.get("qkv_epilogue", {}).values())
    got, none, kernels_off = run(fuse_rope=False)
    assert got == want and none == 0 and kernels_off > 0
    for fuse_norm in (True, False):
        got, fused, kernels = run(fuse_rope=True, fuse_norm=fuse_norm)
        assert got == want, fuse_norm
        assert fused > 0 and kernels > 0 and fused + kernels == kernels_off, (fuse_norm, fused, kernels, kernels_off)


def test_cuda_graph_capture_is_refused_for_host_synchronising_backends():
    # the torch references read context lengths on the host and mask slots by value: a CUDA graph captured over
    # them is invalid, so the runner must decode eagerly on a GPU with them (tests/test_engine_gpu.py runs it)
    from vtengine.backends.torch_backend import TorchBackend
    from vtengine.backends.triton_backend import TritonBackend
    assert not TorchBackend().capturable
    assert TorchBackend().host_sync_ops() == ["decode_attention", "store_kv"]
    assert TritonBackend().capturable and TritonBackend().host_sync_ops() == []
    assert TritonBackend(kernels=["decode_attention", "store_kv"]).capturable
    part = TritonBackend(kernels=["rms_norm", "store_kv"])
    assert not part.capturable and part.host_sync_ops() == ["decode_attention"]


def test_max_num_seqs_is_sized_from_the_kv_pool_and_an_explicit_value_is_honoured():
    from vtengine.engine import llm_engine as le
    # the rule: pool blocks over one typical sequence's blocks (2048 tokens, or max_model_len when shorter), 1..256
    assert le.auto_max_num_seqs(43305, 16, 4096) == 256            # an H200's pool: ~690k tokens, capped at 256
    assert le.auto_max_num_seqs(43305, 16, 40960) == 256
    assert le.auto_max_num_seqs(1280, 16, 4096) == 10              # 1280 blocks / 128 per 2048-token sequence
    assert le.auto_max_num_seqs(64, 16, 256) == 4                  # a short bound: 16 blocks per sequence
    assert le.auto_max_num_seqs(3, 16, 4096) == 1                  # never below one
    # the engine applies it: 64 blocks of 16 at max_model_len 256 -> 4 running sequences, and no more run at once
    eng = LLMEngine(EngineConfig(model="tiny", backend="torch", num_kv_blocks=64, max_model_len=256))
    assert eng.max_num_seqs == 4 and eng.scheduler.max_num_seqs == 4 and eng.stats()["max_num_seqs"] == 4
    for i in range(6):
        eng.add_request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    assert len(eng.scheduler.running) == 4 and len(eng.scheduler.waiting) == 2
    explicit = LLMEngine(EngineConfig(model="tiny", backend="torch", num_kv_blocks=64, max_model_len=256,
                                      max_num_seqs=6))
    assert explicit.max_num_seqs == 6
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match=f"max_num_seqs must be a positive integer .*got {bad!r}"):
            EngineConfig(model="tiny", max_num_seqs=bad)


def test_block_tables_are_as_wide_as_the_longest_table_rounded():
    from vtengine.engine import model_runner as mr
    runner = LLM(model="tiny", backend="torch", max_model_len=2048).engine.runner     # 128 columns at full width
    seqs = [Sequence(str(i), [5] * 3, SamplingParams(max_tokens=1), 16) for i in range(3)]
    for s, n in zip(seqs, (1, 70, 5)):
        s.block_table = list(range(100, 100 + n))
    bt = runner._block_tables(seqs)
    assert bt.dtype == torch.int32 and tuple(bt.shape) == (3, mr.BLOCK_TABLE_ALIGN * 2)    # 70 -> 128 columns
    for row, s in zip(bt.tolist(), seqs):
        n = len(s.block_table)
        assert row[:n] == s.block_table and set(row[n:]) == {-1}
    seqs[1].block_table = seqs[1].block_table[:10]
    assert runner._block_tables(seqs).shape[1] == mr.BLOCK_TABLE_ALIGN                    # narrower when it can be
    seqs[0].block_table = list(range(120))                          # rounded up, but never past the full width
    assert runner._block_tables(seqs).shape[1] == runner.max_blocks_per_seq == 128
