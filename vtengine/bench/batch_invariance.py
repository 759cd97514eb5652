"""Does a request's greedy output depend on which requests share its batches?

``python -m vtengine.bench.batch_invariance MODEL QUANT [LEVER=VALUE ...] [--prompts N] [--max-tokens T]``

Runs the same token-id prompts three ways through one engine and compares each request's tokens:

- together:  all prompts added at once (one prefill batch, then one decode batch): what ``LLM.generate`` does;
- alone:     each prompt by itself (prefill of its own tokens, decode at batch 1);
- staggered: prompt i added after i engine steps, as requests reaching a server one by one join a running batch
             (prefills of one request, decodes at batch 1, 2, ...).

A request whose tokens differ between the three schedules saw its numerics change with the batch around it: a GEMM
that picks another kernel (another reduction order) for another number of rows, or a split count that follows the
batch. The first differing position is reported with the teacher-forced gap there (the engine's own log-prob of
its best token minus that of the other schedule's token, in nats, under the `together` prefix): a near-tie is a
numerics difference, a large gap a bug. Prints one JSON object; ``--out DIR`` also writes it there.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from vtengine.bench import common
from vtengine.engine.llm import LLM
from vtengine.engine.sampling_params import SamplingParams


def parity_prompts(n: int, seed: int = 1234) -> list[list[int]]:
    """The async_parity gate's prompts (campaigns/gates/parity.py): mixed lengths of 1 to 3 KV blocks."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 7, 16, 17, 40, 5, 33, 12][:n] + [9] * max(0, n - 8)
    return [torch.randint(3, 250, (L,), generator=g).tolist() for L in lengths]


def run_schedule(llm: LLM, prompts: list[list[int]], params: SamplingParams, stagger: int | None) -> list[list[int]]:
    """Greedy tokens per prompt; stagger=None adds all at once, stagger=k adds prompt i after i*k engine steps."""
    eng, done, ids = llm.engine, {}, [f"bi-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    pending = list(range(len(prompts)))
    steps = 0
    while len(done) < len(prompts):
        while pending and (stagger is None or steps >= pending[0] * stagger):
            i = pending.pop(0)
            eng.add_request(ids[i], prompts[i], params)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
    return [done[r] for r in ids]


def first_gap(llm: LLM, prompt: list[int], ref: list[int], other: list[int]) -> dict | None:
    """Where ``other`` first leaves ``ref``, and the teacher-forced gap (nats) of its token there."""
    pos = next((i for i, (a, b) in enumerate(zip(ref, other)) if a != b), None)
    if pos is None:
        return None
    lp = llm.engine.score(prompt, ref[:pos + 1])[pos]
    return {"position": pos, "ref_token": ref[pos], "other_token": other[pos],
            "gap_nats": round(float(lp.max() - lp[other[pos]]), 4)}


def measure(model: str, quant: str, levers: dict, n: int, max_tokens: int, stagger: int, **engine_kw) -> dict:
    llm = LLM(model=model, quant=quant, levers=levers, **engine_kw)
    prompts = parity_prompts(n)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    together = run_schedule(llm, prompts, params, None)
    again = run_schedule(llm, prompts, params, None)
    alone = [run_schedule(llm, [p], params, None)[0] for p in prompts]
    staggered = run_schedule(llm, prompts, params, stagger)
    rows = []
    for i, p in enumerate(prompts):
        rows.append({"prompt_len": len(p), "repeat_equal": again[i] == together[i],
                     "alone_equal": alone[i] == together[i], "staggered_equal": staggered[i] == together[i],
                     "alone_divergence": first_gap(llm, p, together[i], alone[i]),
                     "staggered_divergence": first_gap(llm, p, together[i], staggered[i])})
    return {"model": model, "quant": quant, "levers": levers, "prompts": n, "max_tokens": max_tokens,
            "stagger_steps": stagger, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "deterministic": all(r["repeat_equal"] for r in rows),
            "batch_invariant": all(r["alone_equal"] and r["staggered_equal"] for r in rows), "requests": rows}


def _lever(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not LEVER=VALUE")
    k, v = text.split("=", 1)
    return k, v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vtengine.bench.batch_invariance", description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("quant")
    ap.add_argument("levers", nargs="*", type=_lever, help="LEVER=VALUE settings (repeatable)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--stagger", type=int, default=1, help="engine steps between staggered arrivals")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    kw = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    res = measure(args.model, args.quant, dict(args.levers), args.prompts, args.max_tokens, args.stagger,
                  num_kv_blocks=512, max_num_seqs=32, **kw)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = "-".join(f"{k}_{v}" for k, v in sorted(res["levers"].items())) or "defaults"
        stem = common.unique_stem(args.out, f"batch-invariance-{args.model}-{args.quant}-{tag}")
        (args.out / f"{stem}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
