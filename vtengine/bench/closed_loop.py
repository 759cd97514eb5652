"""Which steps does a closed-loop grid leg make? The scheduler and the engine replayed at step granularity.

    python -m vtengine.bench.closed_loop --concurrency 2 --num-prompts 6 --input-len 1024 --output-len 128 \
        [--lever NAME=VALUE ...]

A binding grid's server reports how many steps a leg took and how many of them decoded (``server_steps``,
``server_decode_steps``), not what each step carried. This replays the leg's shape on the CPU engine (the ``tiny``
model, so only the schedule means anything, not the time): ``concurrency`` clients, each sending its next request
once its last one finished, and that request reaching the engine ``lag`` step() calls after the final token was
returned (a server's HTTP round trip is shorter than a decode step). Of the first wave, request 0 reaches the idle
engine first and the others one call later: the engine thread wakes on the first. Timing never enters, so a replay
is exact and repeatable.

It counts what the server counts (steps, decode steps, prefill or mixed steps) and each request's finishing call.
On the H200 (2026-12-04, `2026-12-04-mixed_prefill-97ad59f`, 1,024 in / 128 out, c = 2, 6 prompts) every leg of the
mixed_prefill arm took 387 steps with 381 decoding, and prefill first 385 with 381; the replay gives the same
counts, and shows why: with mixed steps the pairs finish a step apart (see the lever whole_first).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch

from vtengine.engine.llm import LLM
from vtengine.engine.sampling_params import SamplingParams


@dataclass
class Replay:
    steps: int
    decode_steps: int
    prefill_steps: int              # prefill or mixed steps (a mixed step counts as a prefill step, as on a server)
    finished_at: list[int]          # per request, in sending order: the step() call that returned its last token


def replay(levers: dict, concurrency: int, num_prompts: int, input_len: int, output_len: int,
           lag: int = 1) -> Replay:
    if not (1 <= concurrency <= num_prompts and input_len >= 1 and output_len >= 1 and lag >= 1):
        raise ValueError(f"need 1 <= concurrency ({concurrency}) <= num_prompts ({num_prompts}), input_len "
                         f"({input_len}) >= 1, output_len ({output_len}) >= 1 and lag ({lag}) >= 1")
    eng = LLM(model="tiny", backend="torch", levers=levers).engine
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    def prompt(i: int) -> list[int]:
        return torch.randint(3, 500, (input_len,), generator=torch.Generator().manual_seed(i)).tolist()

    arrivals = {i: min(i, 1) for i in range(concurrency)}     # request -> the call at which it reaches the engine
    sent, call = concurrency, 0
    finished: dict[int, int] = {}
    while arrivals or eng.has_unfinished_requests():
        for i in sorted(r for r, at in arrivals.items() if at <= call):
            eng.add_request(str(i), prompt(i), params)
            del arrivals[i]
        if eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    finished[int(out.request_id)] = call
                    if sent < num_prompts:
                        arrivals[sent], sent = call + lag, sent + 1
        call += 1
    st = eng.stats()
    return Replay(st["steps_total"], st["decode_steps_total"], st["steps_total"] - st["decode_steps_total"],
                  [finished[i] for i in range(num_prompts)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vtengine.bench.closed_loop", description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--lag", type=int, default=1, help="step() calls from a final token to the next request")
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE",
                    help="a lever value, parsed as the engine parses it (repeatable)")
    args = ap.parse_args(argv)
    from vtengine.cli import _lever_args
    try:
        levers = {"async_scheduling": True, "async_device_mirror": True, **_lever_args(args.lever)}
    except ValueError as e:
        ap.error(str(e))
    print(json.dumps(asdict(replay(levers, args.concurrency, args.num_prompts, args.input_len, args.output_len,
                                   args.lag))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
