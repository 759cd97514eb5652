"""The closed-loop step replay (vtengine/bench/closed_loop.py) against the H200's own counts: the binding
mixed_prefill campaign 2026-12-04-mixed_prefill-97ad59f (1,024 in / 128 out, c = 2, 6 prompts) counted 385 steps,
381 decoding, in every prefill-first leg and 387 / 381 in every mixed_prefill leg (its evidence.json)."""
from __future__ import annotations

import json

import pytest

from vtengine.bench import closed_loop

ASYNC = {"async_scheduling": True, "async_device_mirror": True}
H200_LEG = dict(concurrency=2, num_prompts=6, input_len=1024, output_len=128)


@pytest.mark.parametrize("levers,steps,prefill_steps,apart", [
    ({}, 385, 4, False),                                                    # prefill first: pairs prefill together
    ({"mixed_prefill": True, "whole_first": False}, 387, 6, True),         # decode rides: pairs a step apart
    ({"mixed_prefill": True}, 385, 4, False),                               # the preset with whole_first
], ids=["prefill-first", "mixed-ride", "mixed-whole-first"])
def test_the_replay_gives_the_h200_legs_step_counts(levers, steps, prefill_steps, apart):
    r = closed_loop.replay({**ASYNC, **levers}, **H200_LEG)
    assert (r.steps, r.decode_steps, r.prefill_steps) == (steps, 381, prefill_steps)
    pairs = list(zip(r.finished_at[::2], r.finished_at[1::2]))
    assert all((b - a == 1) if apart else (a == b) for a, b in pairs[1:]), r.finished_at


def test_the_replay_refuses_a_shape_it_cannot_run_and_prints_json(capsys):
    with pytest.raises(ValueError, match=r"concurrency \(3\) <= num_prompts \(2\)"):
        closed_loop.replay(ASYNC, concurrency=3, num_prompts=2, input_len=8, output_len=4)
    assert closed_loop.main(["--num-prompts", "2", "--input-len", "8", "--output-len", "3",
                             "--lever", "mixed_prefill=true"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decode_steps"] == 2 and len(out["finished_at"]) == 2
