"""graph_parity: CUDA-graphed decode and eager decode give identical tokens (same engine, replay switched off).

async_parity: the arm's server against in-process synchronous generation, in two legs (RITUAL: "batch-1 and
concurrent"):

- batch 1: the prompts sent one at a time (concurrency 1) must equal each prompt generated alone in process, token
  for token. Both sides run the same schedule (a prefill of that prompt, decode at batch 1), so any difference is
  the serving path's own (request mix-ups, stream ordering, a lost or repeated token).
- concurrent: the prompts sent N at a time against all of them generated together in process. Requests reach a
  server one by one and join its running batch at different steps, so a request's prefill and decode batches
  differ from the in-process ones; GEMMs whose kernel (and reduction order) follows the row count then round
  differently, and at an exact or near tie the argmax moves. Measured on an H200 (qwen3-8b bf16, 2026-11-30,
  python -m vtengine.bench.batch_invariance): the same four prompts together, alone or staggered differ at the
  first token (prefill) with gaps of 0.000 and 0.125 nats, on every arm, with or without the lever. Token-for-token
  equality here held or failed with the requests' arrival times. So a concurrent request must equal the in-process
  one, or leave it at a near-tie: at the first position where they differ (same prefix up to there) the served
  token's teacher-forced log-probability, under the arm's own engine, is within the policy's near-tie threshold of
  the best token's. A served token that is no near-tie there fails the gate.

Faults: graph_parity flips one graphed token; async_parity puts, at the first position of the last concurrent
request, the token the arm's engine finds least likely (a near-tie check that cannot fail lets it through).
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import torch

from campaigns.gates import GateContext, result, skipped
from campaigns.evidence import Arm, GateResult
from vtengine.engine.sampling_params import SamplingParams


def parity_prompts(ctx: GateContext, n: int) -> list[list[int]]:
    """Token-id prompts of mixed lengths (1 .. 3 blocks), seeded: the same for every arm and both sides."""
    g = torch.Generator().manual_seed(1234)
    lengths = [1, 7, 16, 17, 40, 5, 33, 12][:n] + [9] * max(0, n - 8)
    return [torch.randint(3, 250, (L,), generator=g).tolist() for L in lengths]


def _params(cfg) -> SamplingParams:
    return SamplingParams(max_tokens=int(cfg.max_tokens), temperature=0.0, ignore_eos=True)


def _compare(a: list[list[int]], b: list[list[int]]) -> dict:
    mism = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return {"requests": len(a), "equal": len(a) - len(mism), "mismatched": len(mism)}, mism


def run_graph_parity(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    if ctx.device != "cuda":
        return skipped("graph_parity", arm, "CUDA graphs need a CUDA device; this host has none")
    t0 = time.perf_counter()
    cfg = ctx.gate_cfg.graph_parity
    llm = ctx.engine(arm)
    runner = llm.engine.runner
    prompts = parity_prompts(ctx, int(cfg.prompts))
    # staggered lengths: the decode batch shrinks one sequence at a time (4, 3, 2, 1 ...), so replays also run
    # batch sizes that were not captured, i.e. padded graph rows (slot -1, context 1, block 0)
    params = [SamplingParams(max_tokens=max(2, int(cfg.max_tokens) - 3 * i), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    key = f"graphed:{arm.name}"
    if key not in ctx.cache:
        assert runner.use_graphs, "the arm's engine was built without CUDA graphs"
        ctx.cache[key] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        runner.use_graphs = False
        try:
            ctx.cache[f"eager:{arm.name}"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        finally:
            runner.use_graphs = True
    graphed = [list(t) for t in ctx.cache[key]]
    eager = ctx.cache[f"eager:{arm.name}"]
    note = ""
    if fault:
        graphed[0][-1] += 1
        note = "flipped the last token of graphed request 0"
    counts, mism = _compare(graphed, eager)
    counts["graph_batch_sizes"] = len(runner.graphs)
    return result("graph_parity", arm, not mism, t0, counts=counts, details={"fault": note, "mismatched": mism})


def sync_reference(ctx: GateContext, arm: Arm) -> dict:
    """In-process anchors for the async_parity prompts, computed before the servers start (the in-process engines
    are freed for them): ``together`` (all prompts in one generate call), ``alone`` (each prompt by itself) and
    ``logprobs``, per prompt the teacher-forced log-probabilities [max_tokens, vocab] along its ``together``
    tokens, which score a served token at the first position where it leaves them (same prefix up to there)."""
    key = f"sync:{arm.name}"
    if key not in ctx.cache:
        cfg = ctx.gate_cfg.async_parity
        prompts = parity_prompts(ctx, int(cfg.prompts))
        llm = ctx.engine(arm)
        together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _params(cfg))]
        alone = [list(llm.generate([p], _params(cfg))[0].outputs[0].token_ids) for p in prompts]
        logprobs = [llm.engine.score(p, t).float().cpu() for p, t in zip(prompts, together)]
        ctx.cache[key] = {"together": together, "alone": alone, "logprobs": logprobs}
    return ctx.cache[key]


def first_divergences(served: list[list[int]], ref: list[list[int]], logprobs: list[torch.Tensor],
                      threshold_mnats: float) -> list[dict]:
    """For each served request that differs from ``ref``: where it first leaves it, the gap there in mnats (the
    best token's log-probability minus the served token's, from ``logprobs`` along ``ref``) and whether that is
    a near-tie. A length difference with an equal common prefix is no near-tie (a token was lost or added)."""
    rows = []
    for i, (got, want) in enumerate(zip(served, ref)):
        if got == want:
            continue
        pos = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if pos is None:
            rows.append({"request": i, "position": min(len(got), len(want)), "served_len": len(got),
                         "ref_len": len(want), "gap_mnats": None, "near_tie": False})
            continue
        lp = logprobs[i][pos]
        if not 0 <= got[pos] < lp.numel():          # no token of this vocabulary: no near-tie either
            rows.append({"request": i, "position": pos, "served_token": got[pos], "ref_token": want[pos],
                         "gap_mnats": None, "near_tie": False})
            continue
        gap = round(float(lp.max() - lp[got[pos]]) * 1000.0, 1)
        rows.append({"request": i, "position": pos, "served_token": got[pos], "ref_token": want[pos],
                     "gap_mnats": gap, "near_tie": gap <= threshold_mnats})
    return rows


async def _stream_tokens(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                         sem: asyncio.Semaphore) -> list[int]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    tokens: list[int] = []
    async with sem:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"server answered {r.status_code}: {(await r.aread()).decode()[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for choice in chunk.get("choices", []):
                    tokens.extend(choice.get("token_ids") or [])
    return tokens


async def _concurrent(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        return await asyncio.gather(*(_stream_tokens(client, url, model, p, max_tokens, sem) for p in prompts))


def run_async_parity(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    url = ctx.server_urls.get(arm.name)
    if not url:
        return skipped("async_parity", arm, "no server is running for this arm")
    t0 = time.perf_counter()
    cfg = ctx.gate_cfg.async_parity
    prompts = parity_prompts(ctx, int(cfg.prompts))
    anchor = sync_reference(ctx, arm)
    key = f"async:{arm.name}"
    if key not in ctx.cache:
        one = asyncio.run(_concurrent(url, ctx.server_model, prompts, int(cfg.max_tokens), 1))
        many = asyncio.run(_concurrent(url, ctx.server_model, prompts, int(cfg.max_tokens), int(cfg.concurrency)))
        ctx.cache[key] = (one, many)
    one, many = ([list(t) for t in leg] for leg in ctx.cache[key])
    note = ""
    if fault:
        many[-1][0] = int(anchor["logprobs"][-1][0].argmin())
        note = "the least likely token at the first position of the last concurrent request"
    b1, b1_mism = _compare(one, anchor["alone"])
    conc, _ = _compare(many, anchor["together"])
    forks = first_divergences(many, anchor["together"], anchor["logprobs"], ctx.near_tie_max_mnats)
    divergent = [f["request"] for f in forks if not f["near_tie"]]
    counts = {"requests": len(prompts), "concurrency": int(cfg.concurrency),
              "batch1_equal": b1["equal"], "batch1_mismatched": b1["mismatched"],
              "equal": conc["equal"], "near_tie": len(forks) - len(divergent), "divergent": len(divergent)}
    passed = not b1_mism and not divergent
    return result("async_parity", arm, passed, t0, counts=counts,
                  details={"fault": note, "batch1_mismatched": b1_mism, "concurrent_forks": forks,
                           "threshold_mnats": ctx.near_tie_max_mnats})
