"""Async scheduling (lever async_scheduling) with the device token mirror (lever async_device_mirror), on CPU.

With both on, the engine keeps one step in flight and must produce what the synchronous engine produces, token for
token: a mixed batch (greedy and seeded sampling, different max_tokens, a stop token hit mid-batch), an abort,
preemption under a small KV pool, and served through `vtengine serve`. The overlap counter shows the loop really
launches step N+1 before reading step N. With the mirror off the next step embeds the host's stale token: the
output differs, which is what the async_device_mirror campaign's gates must catch (RED first, see
tests/test_campaign_e2e.py for the campaign)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from campaigns.gates.parity import _concurrent, first_divergences
from vtengine.engine.llm import LLM
from vtengine.engine.sampling_params import SamplingParams
from vtengine import counters
from helpers import serving

pytestmark = pytest.mark.timeout(300)
ASYNC = {"async_scheduling": True, "async_device_mirror": True}
SYNC = {"async_scheduling": False, "async_device_mirror": False}     # pinned: async is the default since its flip
HOST_COPY = {"async_scheduling": True, "async_device_mirror": False}
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [3] * 20, [4, 4], list(range(40, 71)), [200, 17, 93]]


def _params(stop: list[int] | None = None) -> list[SamplingParams]:
    """Greedy and seeded sampling, different max_tokens."""
    return [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=9, temperature=0.8, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=stop or []),
            SamplingParams(max_tokens=3, temperature=1.0, top_k=20, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)]


def _generate(levers: dict, params=None, prompts=PROMPTS, **kw) -> tuple[list[list[int]], list[str], LLM]:
    llm = LLM(model="tiny", levers=levers, **kw)
    outs = llm.generate(prompts, params or _params())
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].finish_reason for o in outs], llm


@pytest.fixture(scope="module")
def sync_run():
    return _generate(SYNC)


def test_a_mixed_batch_equals_the_synchronous_engine_token_for_token(sync_run):
    want, reasons, _ = sync_run
    assert [len(t) for t in want] == [5, 9, 12, 3, 16, 1] and set(reasons) == {"length"}
    counters.reset()
    got, got_reasons, llm = _generate(ASYNC)
    assert got == want and got_reasons == reasons
    # a sequence at its max_tokens with its last token in flight is not decoded again: no step is wasted
    assert llm.engine.stats()["steps_total"] == sync_run[2].engine.stats()["steps_total"]
    snap = counters.snapshot()
    ahead = snap["async_steps"]["launched_ahead"]["launches"]
    assert ahead >= 10, snap["async_steps"]     # step N+1 launched before step N's ids were read, most steps
    assert list(snap["async_inputs"]) == ["device_mirror"]
    # steady steps take the step in flight's ids as they are; a batch that lost a sequence gathers its rows
    forms = snap["async_inputs"]["device_mirror"]["variants"]
    assert forms.get("in_order", 0) >= 5 and forms.get("gathered", 0) >= 1, forms
    eng = llm.engine
    assert not eng.has_unfinished_requests() and eng._in_flight is None       # idle when the work is done
    assert eng.block_manager.num_used == 0   # the discarded steps freed theirs


def test_the_synchronous_engine_launches_nothing_ahead(sync_run):
    counters.reset()
    _generate({"async_scheduling": False, "async_device_mirror": True})  # the mirror alone: no step in flight
    assert "async_steps" not in counters.snapshot() and "async_inputs" not in counters.snapshot()


def test_a_stop_token_found_a_step_late_discards_the_extra_token(sync_run):
    want, _, _ = sync_run
    stop = want[2][6]                       # greedy prompt 2 stops at its 7th token, mid-batch
    first = want[2].index(stop)
    ref, ref_reasons, _ = _generate(SYNC, _params([stop]))
    got, reasons, llm = _generate(ASYNC, _params([stop]))
    assert ref[2] == want[2][:first + 1] and ref_reasons[2] == "stop"
    assert got == ref and reasons == ref_reasons
    assert llm.engine.block_manager.num_used == 0
    # the stop ends the last running request: the step launched after it is read at once, the engine is idle
    alone = llm.generate([PROMPTS[2]], _params([stop])[2])
    assert alone[0].outputs[0].token_ids == ref[2]
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used == 0


def test_a_sequence_preempted_with_its_token_in_flight_can_finish_from_the_waiting_queue():
    """Preempted while step N computed its token, a sequence waits; when step N's read finishes it (a stop, its
    max_tokens), it must leave the waiting queue too, or it would be prefilled again."""
    from vtengine.engine.block_manager import BlockManager
    from vtengine.engine.scheduler import Scheduler
    from vtengine.engine.sequence import Sequence
    sched = Scheduler(BlockManager(8, 16), max_num_seqs=4, max_num_batched_tokens=256)
    seq = Sequence("r0", PROMPTS[4], SamplingParams(max_tokens=2), block_size=16)
    sched.add(seq)
    assert sched.schedule() == ([seq], True)
    seq.add_pending()
    sched.running.remove(seq)
    sched.preempt(seq)
    assert list(sched.waiting) == [seq] and not seq.block_table
    seq.resolve_pending(42)
    sched.finish(seq, "length")
    assert not sched.has_unfinished() and sched.block_manager.num_used == 0


def test_an_abort_mid_batch_leaves_the_others_equal():
    """Request r2 is aborted once 4 of its tokens are known on the host; the others go on to their ends."""
    def run(levers):
        llm = LLM(model="tiny", levers=levers)
        eng, done, aborted = llm.engine, {}, None
        for i, (p, sp) in enumerate(zip(PROMPTS, _params())):
            eng.add_request(f"r{i}", p, sp)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
                elif out.request_id == "r2" and len(out.outputs[0].token_ids) == 4:
                    aborted = list(out.outputs[0].token_ids)
                    eng.abort_request("r2")
        assert eng.block_manager.num_used == 0
        return done, aborted
    want, want_aborted = run(SYNC)
    got, got_aborted = run(ASYNC)
    assert "r2" not in want and len(want) == 5
    assert got == want and got_aborted == want_aborted


def test_preemption_under_a_small_kv_pool_keeps_the_tokens():
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 3 + \
             [SamplingParams(max_tokens=20, temperature=0.9, seed=11 + i, ignore_eos=True) for i in range(3)]
    want, _, sync_llm = _generate(SYNC, params, prompts, num_kv_blocks=12, max_num_seqs=6)
    got, _, llm = _generate(ASYNC, params, prompts, num_kv_blocks=12, max_num_seqs=6)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemptions"
    assert got == want


def test_with_the_mirror_off_the_next_step_reads_a_stale_token(sync_run):
    """The plain async port (host ids) embeds each sequence's token before its newest: greedy decoding leaves the
    synchronous tokens at the second generated token (the first decode step that ran ahead)."""
    want, _, _ = sync_run
    counters.reset()
    got, _, _ = _generate(HOST_COPY)
    assert list(counters.snapshot()["async_inputs"]) == ["host_copy"]
    for i in (0, 2, 4):                     # the greedy prompts with at least 3 tokens
        assert got[i][0] == want[i][0] and got[i][1:] != want[i][1:], i


def test_served_requests_equal_the_synchronous_engine(sync_run):
    """One at a time: token for token. Together: equal, or forking only at a near-tie (a served batch follows
    arrival times, the in-process one does not)."""
    prompts, max_tokens = PROMPTS[:4], 10
    ref_llm = LLM(model="tiny", levers=SYNC)
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    together = [list(o.outputs[0].token_ids) for o in ref_llm.generate(prompts, greedy)]
    alone = [list(ref_llm.generate([p], greedy)[0].outputs[0].token_ids) for p in prompts]
    logprobs = [ref_llm.engine.score(p, t).float() for p, t in zip(prompts, together)]
    with serving(max_num_seqs=4, levers=ASYNC) as (server, url):
        counters.reset()
        one = asyncio.run(_concurrent(url, server.model_name, prompts, max_tokens, 1))
        many = asyncio.run(_concurrent(url, server.model_name, prompts, max_tokens, 4))
        snap = counters.snapshot()
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert one == alone
    forks = first_divergences(many, together, logprobs, threshold_mnats=500.0)
    assert all(f["near_tie"] for f in forks), forks
    assert snap["async_steps"]["launched_ahead"]["launches"] > 0


def test_step_times_do_not_overlap_under_async():
    """With a step in flight, a step's time runs from its launch or the previous read, whichever is later, to its
    read: the steps' intervals are disjoint, so their sum stays within the generate's wall time (launch-to-read
    would count the step before each one again)."""
    import time
    llm = LLM(model="tiny", levers=ASYNC)
    llm.generate(PROMPTS[:2], _params()[:2])                      # warm-up
    before = dict(llm.engine.stats())
    t0 = time.perf_counter()
    llm.generate(PROMPTS, _params())
    wall = time.perf_counter() - t0
    st = llm.engine.stats()
    assert st["steps_total"] - before["steps_total"] >= 10
    assert 0 < st["step_time_s_sum"] - before["step_time_s_sum"] <= wall
