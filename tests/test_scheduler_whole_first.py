"""whole_first at the scheduler alone (no model): the KV blocks the held sequences' next tokens need stay free, and
decode tokens are never held back two steps in a row. The runner's effect of a step is played by hand: a prefill
puts the prompt in the cache, a decode appends one token."""
from __future__ import annotations

from vtengine.engine.block_manager import BlockManager
from vtengine.engine.sampling_params import SamplingParams
from vtengine.engine.scheduler import Scheduler
from vtengine.engine.sequence import Sequence

BLOCK = 4


def _scheduler(num_blocks: int, whole_first: bool = True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK), max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk=8,
                     mixed_steps=True, chunk_above=16, whole_first=whole_first)


def _seq(name: str, n: int) -> Sequence:
    return Sequence(name, list(range(3, 3 + n)), SamplingParams(max_tokens=20, ignore_eos=True), BLOCK)


def _run(seqs: list[Sequence]) -> None:
    """What the runner does to a step's sequences: prompts cached whole, decoding ones one token longer."""
    for s in seqs:
        if s.in_prefill:
            s.num_cached_tokens += s.num_new_tokens
            s.in_prefill = s.num_cached_tokens < len(s)
        else:
            s.num_cached_tokens = len(s)
        if not s.in_prefill:
            s.append_token(7)


def _step(sched: Scheduler) -> list[str]:
    seqs, _ = sched.schedule()
    _run(seqs)
    return sorted(s.request_id for s in seqs)


def test_a_whole_prompt_is_not_admitted_into_the_block_a_held_sequence_needs_next():
    """a: 8 prompt tokens in two full blocks, + its first token = 9, so its next decode needs a third block. b needs
    two blocks and the pool has two left: prefilled now it would take a's next block, and the next step would
    preempt b. So the step decodes a, and b waits for room, with no preemption; without the reservation (the
    admission checked against the whole free pool) it went the other way."""
    for reserve in (True, False):
        sched = _scheduler(num_blocks=4)
        sched.add(_seq("a", 8))
        assert _step(sched) == ["a"]                                 # a's prefill, its first token
        sched.add(_seq("b", 8))
        if not reserve:
            real = sched._schedule_prefill
            sched._schedule_prefill = lambda *a, **k: real(*a, **{**k, "reserve": 0})
        steps = [_step(sched) for _ in range(2)]
        if reserve:
            assert steps[0] == ["a"] and sched.num_preemptions == 0, steps
        else:
            assert steps[0] == ["b"] and sched.num_preemptions == 1, steps


def test_decode_tokens_are_never_held_back_two_steps_in_a_row():
    """Short prompts arriving one a step while a decodes: the first is prefilled first (a waits), the second rides
    beside a's token, the third is prefilled first again."""
    sched = _scheduler(num_blocks=64)
    sched.add(_seq("a", 5))
    assert _step(sched) == ["a"]
    got = []
    for name in "bcd":
        sched.add(_seq(name, 6))
        got.append(_step(sched))
    assert got == [["b"], ["a", "b", "c"], ["d"]], got
    off = _scheduler(num_blocks=64, whole_first=False)
    off.add(_seq("a", 5))
    _step(off)
    off.add(_seq("b", 6))
    assert _step(off) == ["a", "b"]                                  # without the lever a's token rides
