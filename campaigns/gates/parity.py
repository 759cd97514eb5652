"""graph_parity: CUDA-graphed decode and eager decode give identical tokens (same engine, replay switched off).
async_parity: N concurrent streamed requests through the arm's server equal in-process synchronous generation,
token for token. Fault for both: one flipped token on the measured side.
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


def sync_reference(ctx: GateContext, arm: Arm) -> list[list[int]]:
    """In-process synchronous generation for the async_parity prompts (computed before the servers start)."""
    key = f"sync:{arm.name}"
    if key not in ctx.cache:
        cfg = ctx.gate_cfg.async_parity
        prompts = parity_prompts(ctx, int(cfg.prompts))
        llm = ctx.engine(arm)
        ctx.cache[key] = [o.outputs[0].token_ids for o in llm.generate(prompts, _params(cfg))]
    return ctx.cache[key]


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
    key = f"async:{arm.name}"
    if key not in ctx.cache:
        ctx.cache[key] = asyncio.run(_concurrent(url, ctx.server_model, prompts, int(cfg.max_tokens),
                                                 int(cfg.concurrency)))
    served = [list(t) for t in ctx.cache[key]]
    note = ""
    if fault:
        served[-1][0] += 1
        note = "flipped the first token of the last served request"
    counts, mism = _compare(served, sync_reference(ctx, arm))
    counts["concurrency"] = int(cfg.concurrency)
    return result("async_parity", arm, not mism, t0, counts=counts, details={"fault": note, "mismatched": mism})
