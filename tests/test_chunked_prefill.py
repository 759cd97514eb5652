"""Long prompts on CPU (tiny model): a prompt longer than the step budget is prefilled in chunks and samples what the
unchunked engine samples; with the lever chunked_prefill the chunks alternate with decode steps, so a sequence that
is decoding keeps getting tokens (the same ones it gets alone) while a long prompt prefills; max_model_len defaults
to the model's maximum, or to what the KV pool holds when that is less."""
from __future__ import annotations

import pytest
import torch

from vtengine import counters
from vtengine.engine.llm import LLM
from vtengine.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(300)
# each step-shape lever alone: the preset that sets them all (mixed_prefill, on since 2026-12-06) stays off here
SYNC = {"async_scheduling": False, "mixed_prefill": False}
ASYNC = {"async_scheduling": True, "async_device_mirror": True, "mixed_prefill": False}


def long_prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True),
            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("levers", [SYNC, ASYNC], ids=["sync", "async"])
def test_a_prompt_past_the_budget_is_prefilled_in_chunks_and_samples_the_same(levers):
    prompts = [long_prompt(300), long_prompt(290, seed=1), [7, 8, 9]]
    whole = LLM(model="tiny", backend="torch", levers=levers, max_num_batched_tokens=2048)
    want = tokens(whole.generate(prompts, params()))
    chunked = LLM(model="tiny", backend="torch", levers=levers, max_num_batched_tokens=64)
    got = tokens(chunked.generate(prompts, params()))
    assert got == want
    st, st_whole = chunked.engine.stats(), whole.engine.stats()
    prefill_steps = st["steps_total"] - st["decode_steps_total"]
    # 593 prompt tokens in 64-token steps: at least ceil(593 / 64) = 10 prefill steps, where one step held them all
    assert prefill_steps >= 10 and st_whole["steps_total"] - st_whole["decode_steps_total"] == 1
    assert st["kv_blocks_free"] == st["kv_blocks_total"]


def _timeline(llm: LLM, long: list[int], warm_steps: int = 3,
              a_tokens: int = 40) -> tuple[list[str], dict[str, list[int]]]:
    """Request "a" (short, ``a_tokens`` new tokens) decodes; after ``warm_steps`` steps the long request "b" arrives.
    Returns, per step from b's arrival until b's first token, which requests got a token, and every request's
    tokens."""
    eng = llm.engine
    eng.add_request("a", [11, 12, 13], SamplingParams(max_tokens=a_tokens, temperature=0.0, ignore_eos=True))
    done: dict[str, list[int]] = {}
    for _ in range(warm_steps):
        eng.step()
    eng.add_request("b", long, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    steps: list[str] = []
    while eng.has_unfinished_requests():
        outs = eng.step()
        got = "".join(sorted(o.request_id for o in outs))
        if "b" not in done and not any(o.request_id == "b" for o in outs):
            steps.append(got or "-")
        elif "b" not in done:
            steps.append(got)
        for o in outs:
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
            if o.request_id == "b":
                done.setdefault("b_first_at", [len(steps)])
    return steps[:done["b_first_at"][0]], done


@pytest.mark.parametrize("levers", [SYNC, ASYNC], ids=["sync", "async"])
def test_with_the_lever_a_decoding_sequence_keeps_its_tokens_coming_while_a_long_prompt_prefills(levers):
    long = long_prompt(1200, seed=2)
    alone_a = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
        [[11, 12, 13]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))[0]
    alone_b = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
        [long], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))[0]
    # the lever at 256 tokens: b's 1200 tokens take 5 prefill steps, and "a" decodes between every two of them
    on = LLM(model="tiny", backend="torch", levers={**levers, "chunked_prefill": 256})
    steps_on, done_on = _timeline(on, long)
    assert steps_on.count("a") >= 4, steps_on
    assert done_on["a"] == alone_a and done_on["b"] == alone_b
    # without it, the same 256-token budget: b's chunks run back to back (prefill first) and "a" waits them out
    off = LLM(model="tiny", backend="torch", levers=levers, max_num_batched_tokens=256)
    steps_off, done_off = _timeline(off, long)
    assert steps_off.count("a") <= 1, steps_off
    assert done_off["a"] == alone_a and done_off["b"] == alone_b


@pytest.mark.parametrize("levers,budget", [({**SYNC, "chunked_prefill": 256}, 8192),
                                           ({**ASYNC, "chunked_prefill": 256}, 8192),
                                           ({**SYNC, "chunked_prefill": 384}, 8192),
                                           (SYNC, 257)], ids=["sync-chunk256", "async-chunk256", "sync-chunk384",
                                                              "sync-budget257"])
def test_mixed_steps_carry_the_decode_token_in_every_prefill_step(levers, budget):
    """mixed_steps: while b's 1200 tokens prefill in 256- or 384-token chunks (the chunk lever, or a 257-token
    budget less a's one decode token), every step also carries a's decode token: no step without a token for "a", no
    decode step of its own between chunks (b's first token comes in the step after its last full chunk), and both
    requests get the tokens they get alone."""
    long = long_prompt(1200, seed=2)
    alone_a = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
        [[11, 12, 13]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))[0]
    alone_b = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
        [long], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))[0]
    llm = LLM(model="tiny", backend="torch", levers={**levers, "mixed_steps": True}, max_num_batched_tokens=budget)
    counters.reset()
    steps, done = _timeline(llm, long)
    # a's token and a full chunk of b in each step but the last, which brings b's first (async: one step later)
    lag = 1 if levers.get("async_scheduling") else 0
    chunk = levers.get("chunked_prefill") or budget - 1
    full, rest = divmod(len(long), chunk)                   # 1200 = 4 x 256 + 176 = 3 x 384 + 48
    assert steps == ["a"] * (full + lag) + ["ab"], steps
    assert done["a"] == alone_a and done["b"] == alone_b
    mixed = counters.snapshot()["mixed_step"]
    assert mixed["decode_rows"]["grids"] == {f"1x{chunk}": full, f"1x{rest}": 1}     # a's row in each


@pytest.mark.parametrize("levers", [SYNC, ASYNC], ids=["sync", "async"])
def test_chunk_above_prefills_a_short_prompt_whole_and_still_chunks_a_long_one(levers):
    """chunk_above 512 with 256-token mixed chunks: a 400-token prompt arriving while "a" decodes is prefilled whole
    in one step (its first token with a's next), where without the lever it takes two chunks; a 1200-token prompt is
    still chunked (four steps of a's token and a chunk, then b's first). Every request gets its tokens alone."""
    mixed = {**levers, "mixed_steps": True, "chunked_prefill": 256}
    lag = 1 if levers.get("async_scheduling") else 0
    alone_a = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
        [[11, 12, 13]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))[0]
    for n, want_on, want_off in ((400, ["a"] * lag + ["ab"], ["a"] * (1 + lag) + ["ab"]),
                                 (1200, ["a"] * (4 + lag) + ["ab"], ["a"] * (4 + lag) + ["ab"])):
        long = long_prompt(n, seed=2)
        alone_b = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
            [long], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))[0]
        for value, want in ((512, want_on), ("off", want_off)):
            counters.reset()
            steps, done = _timeline(LLM(model="tiny", backend="torch", levers={**mixed, "chunk_above": value}), long)
            assert steps == want, (n, value, steps)
            assert done["a"] == alone_a and done["b"] == alone_b
            routes = {r: st["launches"] for r, st in counters.snapshot().get("chunk_above", {}).items()}
            assert routes == ({} if value == "off" else {"whole" if n <= 512 else "chunked": 1}), (n, value, routes)


@pytest.mark.parametrize("levers", [SYNC, {**SYNC, "mixed_steps": True}, {**ASYNC, "mixed_steps": True}],
                         ids=["sync", "sync-mixed", "async-mixed"])
def test_chunk_above_keeps_short_prompts_that_arrive_together_in_one_step(levers):
    """Four 400-token prompts arriving together: with chunk_above they prefill whole, as many per step as
    max_num_batched_tokens holds (1000: two, then two), first come first served, where 256-token chunks alone take
    seven steps; the tokens are the unchunked engine's."""
    prompts = [long_prompt(400, seed=i) for i in range(4)]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(prompts, params))
    for value, grids in ((512, {(800,): 2}), ("off", {(256,): 6, (64,): 1})):
        llm = LLM(model="tiny", backend="torch", max_num_batched_tokens=1000,
                  levers={**levers, "chunked_prefill": 256, "chunk_above": value})
        counters.reset()
        assert tokens(llm.generate(prompts, params)) == want
        snap = counters.snapshot()
        assert dict(snap["prefill_step"]["chunk=256"]["grids"]) == {f"{g[0]}": n for g, n in grids.items()}, value


def test_chunk_above_chunks_a_short_prompt_the_step_budget_cannot_hold():
    """chunk_above 512 under a 300-token max_num_batched_tokens: a 400-token prompt is at most T but past any
    step's room, so it is chunked (256 + 144) instead of waiting for ever; its tokens are the unchunked engine's."""
    prompt = long_prompt(400, seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate([prompt], params))
    llm = LLM(model="tiny", backend="torch", max_num_batched_tokens=300,
              levers={**SYNC, "mixed_steps": True, "chunked_prefill": 256, "chunk_above": 512})
    counters.reset()
    assert tokens(llm.generate([prompt], params)) == want
    snap = counters.snapshot()
    assert dict(snap["prefill_step"]["chunk=256"]["grids"]) == {"256": 1, "144": 1}
    assert {r: st["launches"] for r, st in snap["chunk_above"].items()} == {"chunked": 1}


def _pair_a_step_apart(levers: dict) -> tuple[dict[str, int], dict[str, list[int]], dict]:
    """Two equal-length requests, b arriving one step after a (closed-loop clients once one is a step ahead): the
    step() call at which each finished, their tokens, and the counters."""
    eng = LLM(model="tiny", backend="torch", levers=levers).engine
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    counters.reset()
    eng.add_request("a", long_prompt(300, seed=4), params)
    eng.step()
    eng.add_request("b", long_prompt(300, seed=5), params)
    finished: dict[str, int] = {}
    done: dict[str, list[int]] = {}
    call = 1
    while eng.has_unfinished_requests():
        call += 1
        for o in eng.step():
            if o.finished:
                finished[o.request_id], done[o.request_id] = call, list(o.outputs[0].token_ids)
    return finished, done, counters.snapshot()


@pytest.mark.parametrize("levers", [SYNC, ASYNC], ids=["sync", "async"])
def test_whole_first_keeps_equal_requests_a_step_apart_in_step(levers):
    """Mixed steps (256-token chunks, whole prompts up to 512): when b's whole prompt prefills, a's decode token
    rides in that step, so a finishes a step before b and their successors would arrive a step apart for good (the
    binding mixed_prefill REJECT at c2). With whole_first a waits that one step, as prefill first makes it wait:
    both finish at the same step, and each gets the tokens it gets alone."""
    mixed = {**levers, "mixed_steps": True, "chunked_prefill": 256, "chunk_above": 512}
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = {name: tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
        [long_prompt(300, seed=seed)], params))[0] for name, seed in (("a", 4), ("b", 5))}
    first, done, snap = _pair_a_step_apart({**mixed, "whole_first": True})
    assert first["a"] == first["b"] and done == alone, first
    assert snap["whole_first"]["waited"]["grids"] == {"1": 1}     # one step, one decoding sequence held back
    ride, done, snap = _pair_a_step_apart({**mixed, "whole_first": False})
    assert ride["a"] == ride["b"] - 1 and done == alone, ride
    assert "whole_first" not in snap
    prefill_first, _, _ = _pair_a_step_apart(levers)
    assert first == prefill_first


@pytest.mark.parametrize("levers", [SYNC, ASYNC], ids=["sync", "async"])
def test_whole_first_holds_decode_back_for_whole_prompts_only(levers):
    """whole_first with 256-token mixed chunks and chunk_above 512: a 400-token prompt arriving while "a" decodes
    prefills whole in a step without a's token (b's first token comes alone, where without the lever it comes with
    a's); a 1200-token prompt is chunked, and every chunk still carries a's token, as without the lever."""
    mixed = {**levers, "mixed_steps": True, "chunked_prefill": 256, "chunk_above": 512, "whole_first": True}
    lag = 1 if levers.get("async_scheduling") else 0
    alone_a = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
        [[11, 12, 13]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)))[0]
    for n, want in ((400, ["a"] * lag + ["b"]), (1200, ["a"] * (4 + lag) + ["ab"])):
        long = long_prompt(n, seed=2)
        alone_b = tokens(LLM(model="tiny", backend="torch", levers=SYNC).generate(
            [long], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))[0]
        counters.reset()
        steps, done = _timeline(LLM(model="tiny", backend="torch", levers=mixed), long)
        assert steps == want, (n, steps)
        assert done["a"] == alone_a and done["b"] == alone_b
        waited = counters.snapshot().get("whole_first", {})
        assert (waited["waited"]["launches"] if waited else 0) == (1 if n == 400 else 0), (n, waited)


def test_max_model_len_defaults_to_the_model_and_then_to_the_pool():
    assert LLM(model="tiny", backend="torch").engine.max_model_len == 2048     # tiny's max_position_embeddings
    small = LLM(model="tiny", backend="torch", num_kv_blocks=40).engine           # 40 blocks of 16: 640 tokens
    assert small.max_model_len == 640 and small.max_seq_tokens == 640
    assert LLM(model="tiny", backend="torch", max_model_len=512).engine.max_model_len == 512
    assert LLM(model="tiny", backend="torch", max_model_len=9999).engine.max_model_len == 2048
    # the step budget no longer grows with the bound: a 2048-token bound keeps the 8192 default, a 64 budget stays
    eng = LLM(model="tiny", backend="torch", max_num_batched_tokens=64).engine
    assert eng.max_num_batched_tokens == 64 and eng.scheduler.max_num_batched_tokens == 64


@pytest.mark.parametrize("levers", [SYNC, ASYNC, {**SYNC, "chunked_prefill": 256}, {**ASYNC, "chunked_prefill": 256},
                                    {**SYNC, "mixed_steps": True}, {**ASYNC, "mixed_steps": True}],
                         ids=["sync", "async", "sync-lever", "async-lever", "sync-mixed", "async-mixed"])
def test_chunks_preemption_and_recompute_keep_every_token(levers):
    """A 30-block pool (480 tokens) for six sequences that grow to 160-300 tokens: sequences are preempted and
    re-prefilled (prompt and generated tokens, past the 64-token budget: in chunks), a 200-token prompt is chunked,
    and every token equals the unconstrained synchronous engine's; the pool is empty at the end."""
    prompts = [long_prompt(n, seed=i) for i, n in enumerate([60, 60, 200, 60, 60, 60])]
    params = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=90, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
    want = tokens(LLM(model="tiny", backend="torch", levers=SYNC, max_num_batched_tokens=4096).generate(prompts,
                                                                                                        params))
    llm = LLM(model="tiny", backend="torch", levers=levers, max_num_batched_tokens=64, num_kv_blocks=30,
              max_num_seqs=6)
    assert tokens(llm.generate(prompts, params)) == want
    st = llm.engine.stats()
    assert st["num_preemptions"] >= 3 and st["kv_blocks_free"] == st["kv_blocks_total"]


def test_mixed_steps_through_the_triton_kernels():
    """The mixed step's two attention launches on sliced rows (the packed prefill route and split-KV decode) under
    the interpreter: the decoding request and the chunked prompt get the tokens they get alone. With prefill_splits
    "auto" each chunk's prefix keys are split (the interpreter keeps the H200's SM count) and merged; with "off"
    none is. The attention kernels run under the interpreter, the GEMMs and norms on the torch references. (Both
    values in one test, so that they share the runs alone: under the interpreter each engine run costs ~35 s.)"""
    long = long_prompt(300, seed=2)
    attention = ["prefill_attention", "decode_attention"]     # the GEMMs and norms on the torch references
    one = LLM(model="tiny", backend="triton", triton_kernels=attention, levers=SYNC)
    alone_a = tokens(one.generate([[11, 12, 13]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))[0]
    alone_b = tokens(one.generate([long], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)))[0]
    for splits in ("off", "auto"):
        llm = LLM(model="tiny", backend="triton", triton_kernels=attention, max_num_batched_tokens=100,
                  levers={**SYNC, "chunked_prefill": 256, "mixed_steps": True, "prefill_gqa_pack": True,
                          "prefill_splits": splits})
        counters.reset()
        steps, done = _timeline(llm, long, a_tokens=12)    # a decodes past b's first token
        assert steps == ["a", "ab"], (splits, steps)
        assert done["a"] == alone_a and done["b"] == alone_b, splits
        snap = counters.snapshot()
        assert snap["prefill_attention"]["gqa_pack"]["launches"] > 0, splits
        split = sum(n for s, n in snap["prefill_attention"]["gqa_pack"]["splits"].items() if int(s) > 1)
        assert (split > 0) == (splits == "auto"), (splits, snap["prefill_attention"])
        assert snap.get("prefill_attention_merge", {}).get("gqa_pack", {}).get("launches", 0) == split, splits


def _staggered(eng, n: int, longest: int, max_tokens: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` requests (5 to ``longest`` prompt tokens, greedy and seeded sampling, 5 to ``max_tokens`` new tokens)
    arriving two every three steps into ``eng`` (counters reset first): (its tokens per request, the unconstrained
    synchronous engine's)."""
    import random
    rng = random.Random(seed)
    prompts = [long_prompt(rng.randint(5, longest), seed=i) for i in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(5, max_tokens), temperature=0.0 if i % 3 else 0.8, seed=i,
                             ignore_eos=True) for i in range(n)]
    want = tokens(LLM(model="tiny", backend="torch", levers=SYNC, max_num_batched_tokens=4096).generate(prompts,
                                                                                                        params))
    counters.reset()
    got, pending, steps = {}, list(range(n)), 0
    while pending or eng.has_unfinished_requests():
        if pending and steps % 3 == 0:
            for i in pending[:2]:
                eng.add_request(f"r{i}", prompts[i], params[i])
            pending = pending[2:]
        for o in eng.step():
            if o.finished:
                got[int(o.request_id[1:])] = list(o.outputs[0].token_ids)
        steps += 1
    return [got[i] for i in range(n)], want


@pytest.mark.parametrize("levers", [{**ASYNC, "mixed_steps": True, "chunked_prefill": 256},
                                    {**SYNC, "mixed_steps": True}, {**ASYNC, "mixed_steps": True}],
                         ids=["async-mixed-chunk256", "sync-mixed-budget", "async-mixed-budget"])
def test_mixed_steps_under_staggered_arrivals_and_preemption_keep_every_token(levers):
    """24 requests (5 to 400 prompt tokens, greedy and seeded sampling, 5 to 60 new tokens) arriving two every three
    steps into a 60-block pool with a 128-token budget and 8 sequence slots: mixed steps, chunks, preemption and
    recompute all happen, and every request gets the tokens the unconstrained synchronous engine gives it."""
    eng = LLM(model="tiny", backend="torch", levers=levers, max_num_batched_tokens=128, num_kv_blocks=60,
              max_num_seqs=8).engine
    got, want = _staggered(eng, n=24, longest=400, max_tokens=60, seed=0)
    assert got == want
    st = eng.stats()
    assert st["num_preemptions"] >= 1 and st["kv_blocks_free"] == st["kv_blocks_total"]
    assert counters.snapshot()["mixed_step"]["decode_rows"]["launches"] > 10


@pytest.mark.parametrize("levers", [{**SYNC, "mixed_steps": True}, {**ASYNC, "mixed_steps": True}, SYNC],
                         ids=["sync-mixed", "async-mixed", "sync-alternating"])
def test_chunk_graphs_run_full_chunks_from_static_buffers_and_keep_every_token(levers):
    """chunk_graphs (on the CPU: the captured steps' static buffers, run eagerly): requests arriving two every three
    steps, prompts of 5 to 700 tokens in 256-token chunks, a 50-block pool (preemption) and 8 slots: every full chunk,
    with 0 to 7 decode rows padded to a captured batch, goes through the buffers, the partial chunks and multi-prompt
    steps do not, and every request gets the tokens the unconstrained synchronous engine gives it."""
    levers = {**levers, "chunked_prefill": 256, "chunk_graphs": True}
    eng = LLM(model="tiny", backend="torch", levers=levers, num_kv_blocks=50, max_num_seqs=8).engine
    cg = eng.runner.chunk_graphs
    assert cg.chunk == 256 and sorted(cg.steps) == [0, 1, 2, 4, 7]       # 0, the sizes up to 7, and 7 itself
    got, want = _staggered(eng, n=18, longest=700, max_tokens=40, seed=1)
    assert got == want
    snap = counters.snapshot()
    grids = snap["chunk_step"]["static_eager"]["grids"]
    assert sum(grids.values()) >= 10, grids
    if levers.get("mixed_steps"):
        assert any(g != "256x0" for g in grids), grids          # chunks with decode rows beside them
    assert eng.stats()["num_preemptions"] >= 1
    # every captured step wrote its logits into rows of the runner's one shared buffer (not an output of its own)
    buf = eng.runner.logits_buf
    assert buf.shape[0] == 1 + 7 and cg.out
    assert all(out.data_ptr() == buf.data_ptr() and out.shape[0] == 1 + bs for bs, out in cg.out.items())


def test_chunk_graphs_follow_the_levers_of_a_built_engine():
    """Built with the lever on, the engine re-resolved to chunk_graphs off (a gate's inert-lever fault) runs every
    step eagerly; re-resolved to another chunk size, it captures that size's graphs and runs its full chunks there;
    built with the lever off and re-resolved on (a stuck lever), it captures them too."""
    from vtengine import levers as lever_registry
    long = long_prompt(700, seed=3)
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(model="tiny", backend="torch", levers={**SYNC, "chunked_prefill": 256, "chunk_graphs": True})
    counters.reset()
    want = tokens(llm.generate([long], p))
    assert counters.snapshot()["chunk_step"]["static_eager"]["grids"] == {"256x0": 2}   # 700 = 2 x 256 + 188
    off = LLM(model="tiny", backend="torch", levers={**SYNC, "chunked_prefill": 256})
    assert off.engine.runner.chunk_graphs is None
    for eng, values, grids in ((llm.engine, {"chunked_prefill": 256, "chunk_graphs": False}, None),
                               (llm.engine, {"chunked_prefill": 512, "chunk_graphs": True}, {"512x0": 1}),
                               (off.engine, {"chunked_prefill": 256, "chunk_graphs": True}, {"256x0": 2})):
        resolved = lever_registry.resolve({**SYNC, **values})
        eng.backend.levers = resolved
        eng.set_step_levers(resolved)
        counters.reset()
        assert tokens((llm if eng is llm.engine else off).generate([long], p)) == want
        got = counters.snapshot().get("chunk_step", {}).get("static_eager", {}).get("grids")
        assert got == grids, (values, got)
