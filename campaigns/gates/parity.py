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

Faults (the engine under test broken, vtengine/faults.py): graph_parity replays decode graphs captured while the
lever's kernel was broken (the first of its kernels a decode step runs, else rms_norm) against the arm's eager
steps, and under the lever chunk_graphs, in a second run, its chunk graphs so captured; each run is caught only
where it replayed the broken graphs (counted: a "graphed" run that replayed nothing compared eager with eager) and
its tokens differ; async_parity breaks the arm's
own server (started with --fault-injection) twice, a token lost on the serving path and decode steps fed a stale
token (the async race), and each of its two legs must be caught.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import torch

from campaigns.gates import GateContext, long_prompt_len, result, skipped
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


def _graph_replays() -> tuple[int, int]:
    """Replays of captured graphs so far: (all, those of full prefill chunks under the lever chunk_graphs)."""
    from vtengine import counters
    chunk = counters.launches("chunk_step", "cuda_graph")
    return counters.launches("decode_step", "cuda_graph") + chunk, chunk


def _graphed_tokens(llm, prompts, params) -> tuple[list[list[int]], int, int]:
    """Tokens of a graphed generation, the graph replays it made and how many of them were chunk graphs (the
    counters prove replay)."""
    before = _graph_replays()
    toks = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    after = _graph_replays()
    return toks, after[0] - before[0], after[1] - before[1]


def run_graph_parity(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    """Graphed decode equals eager decode, token for token, and the graphed run really replayed graphs (counted).
    Fault: graphs captured while the lever's kernel was broken, replayed against the arm's eager run
    (_graph_parity_fault)."""
    if ctx.device != "cuda":
        return skipped("graph_parity", arm, "CUDA graphs need a CUDA device; this host has none")
    t0 = time.perf_counter()
    cfg = ctx.gate_cfg.graph_parity
    llm = ctx.engine(arm)
    runner = llm.engine.runner
    prompts = parity_prompts(ctx, int(cfg.prompts))
    chunks = runner.chunk_graphs if llm.engine.levers.on("chunk_graphs") else None
    if chunks is not None:      # the lever chunk_graphs: a prompt of two full chunks and a partial one goes through
        g = torch.Generator().manual_seed(11)       # its graphs (replayed while the others decode), and eagerly
        n = long_prompt_len(chunks.chunk, llm.engine.scheduler.chunk_above) + 37     # chunked past chunk_above
        prompts = [torch.randint(3, 250, (n,), generator=g).tolist()] + prompts
    # staggered lengths: the decode batch shrinks one sequence at a time (4, 3, 2, 1 ...), so replays also run
    # batch sizes that were not captured, i.e. padded graph rows (slot -1, context 1, block 0)
    params = [SamplingParams(max_tokens=max(2, int(cfg.max_tokens) - 3 * i), temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))]
    key = f"graphed:{arm.name}"
    if key not in ctx.cache:
        assert runner.use_graphs, "the arm's engine was built without CUDA graphs"
        ctx.cache[key] = _graphed_tokens(llm, prompts, params)
        runner.use_graphs = False
        try:
            before = _graph_replays()[0]
            eager = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            ctx.cache[f"eager:{arm.name}"] = (eager, _graph_replays()[0] - before)
        finally:
            runner.use_graphs = True
    eager, eager_replays = ctx.cache[f"eager:{arm.name}"]
    if fault:
        return _graph_parity_fault(ctx, arm, t0, prompts, params, eager, chunks is not None)
    graphed, replays, chunk_replays = ctx.cache[key]
    counts, mism = _compare(graphed, eager)
    counts.update(graph_batch_sizes=len(runner.graphs), graph_replays=replays, eager_graph_replays=eager_replays)
    if chunks is not None:
        counts["chunk_graph_replays"] = chunk_replays
    passed = not mism and replays > 0 and eager_replays == 0 and (chunks is None or chunk_replays > 0)
    why = "" if replays > 0 else "the graphed run replayed no graph (counters): graphed and eager were not compared"
    if chunks is not None and not chunk_replays:
        why = "chunk_graphs is on but no full chunk replayed its graph: the chunk graphs were not compared"
    if eager_replays:
        why = f"the eager run replayed {eager_replays} graph(s) (counters): eager was not eager"
    return result("graph_parity", arm, passed, t0, counts=counts,
                  details={"fault": "", "mismatched": mism, "why": why})


def _graph_parity_fault(ctx: GateContext, arm: Arm, t0: float, prompts, params, eager, chunked: bool) -> GateResult:
    """graph_parity's self-check: decode graphs captured over a broken kernel, replayed against the arm's eager
    tokens, must differ from them; under the lever chunk_graphs its chunk graphs so captured must too (with the
    decode graphs clean: mismatches of the decode graphs alone never showed a broken chunk graph caught). A run is
    caught only where it replayed the broken graphs (counted) and its tokens differ."""
    fault_obj = ctx.decode_fault()
    if fault_obj == ctx.standing_fault(arm):    # a product test's broken arm runs that fault throughout: its
        fault_obj = ctx.decode_fault(-3.0)      # graphs would equal its eager steps; break them another way
    runs, counts = [], {}
    for which in ("decode", "chunk") if chunked else ("decode",):
        with ctx.graphs_captured_with(arm, fault_obj, len(prompts), chunk=which == "chunk") as faulted:
            graphed, replays, chunk_replays = _graphed_tokens(faulted, prompts, params)
        _, mism = _compare(graphed, eager)
        broken = chunk_replays if which == "chunk" else replays - chunk_replays
        runs.append({"fault": f"{which} graphs", "caught": bool(mism) and broken > 0, "mismatched": mism,
                     "broken_graph_replays": broken})
        counts[f"{which}_mismatched"], counts[f"{which}_broken_replays"] = len(mism), broken
    note = (f"{' and '.join(r['fault'] for r in runs)} captured over a broken kernel ({fault_obj.describe()}), "
            "replayed against the arm's eager steps")
    return result("graph_parity", arm, not all(r["caught"] for r in runs), t0, counts=counts,
                  details={"fault": note, "faults": runs})


def sync_reference(ctx: GateContext, arm: Arm) -> dict:
    """In-process anchors for the async_parity prompts, computed before the servers start (the in-process engines
    are freed for them): ``together`` (all prompts in one generate call), ``alone`` (each prompt by itself) and
    ``logprobs``, per prompt the teacher-forced log-probabilities [max_tokens, vocab] along its ``together``
    tokens, which score a served token at the first position where it leaves them (same prefix up to there)."""
    key = f"sync:{arm.name}"
    if key not in ctx.cache:
        cfg = ctx.gate_cfg.async_parity
        prompts = parity_prompts(ctx, int(cfg.prompts))
        with ctx.synchronous(arm) as llm:       # the anchor is the synchronous engine, whatever the arm schedules
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


SERVER_FAULTS = ({"kind": "drop_token"}, {"kind": "stale_input"})


def _set_server_fault(url: str, fault: dict | None) -> None:
    r = httpx.post(f"{url}/debug/fault", json=fault, timeout=60.0)
    if r.status_code != 200:
        raise RuntimeError(f"the server at {url} refused a deliberate fault ({r.status_code}: {r.text[:200]}); "
                           "campaign servers are started with --fault-injection")


def _legs(ctx: GateContext, url: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]]]:
    cfg = ctx.gate_cfg.async_parity
    one = asyncio.run(_concurrent(url, ctx.server_model, prompts, int(cfg.max_tokens), 1))
    many = asyncio.run(_concurrent(url, ctx.server_model, prompts, int(cfg.max_tokens), int(cfg.concurrency)))
    return [list(t) for t in one], [list(t) for t in many]


def _judge(ctx: GateContext, prompts, anchor, one, many) -> tuple[dict, dict, bool, bool]:
    """(counts, details, batch-1 leg passed, concurrent leg passed)."""
    b1, b1_mism = _compare(one, anchor["alone"])
    conc, _ = _compare(many, anchor["together"])
    forks = first_divergences(many, anchor["together"], anchor["logprobs"], ctx.near_tie_max_mnats)
    divergent = [f["request"] for f in forks if not f["near_tie"]]
    counts = {"requests": len(prompts), "concurrency": int(ctx.gate_cfg.async_parity.concurrency),
              "batch1_equal": b1["equal"], "batch1_mismatched": b1["mismatched"],
              "equal": conc["equal"], "near_tie": len(forks) - len(divergent), "divergent": len(divergent)}
    details = {"batch1_mismatched": b1_mism, "concurrent_forks": forks}
    return counts, details, not b1_mism, not divergent


def run_async_parity(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    """Fault: the arm's own server broken, once per fault of SERVER_FAULTS (a token lost on the serving path; a
    decode step fed a stale token, the async race). Each must fail the gate, and each leg (batch-1 and concurrent)
    must be caught by at least one of them on its own."""
    url = ctx.server_urls.get(arm.name)
    if not url:
        return skipped("async_parity", arm, "no server is running for this arm")
    t0 = time.perf_counter()
    prompts = parity_prompts(ctx, int(ctx.gate_cfg.async_parity.prompts))
    anchor = sync_reference(ctx, arm)
    if not fault:
        key = f"async:{arm.name}"
        if key not in ctx.cache:
            ctx.cache[key] = _legs(ctx, url, prompts)
        counts, details, b1_ok, conc_ok = _judge(ctx, prompts, anchor, *ctx.cache[key])
        details.update(fault="", threshold_mnats=ctx.near_tie_max_mnats)
        return result("async_parity", arm, b1_ok and conc_ok, t0, counts=counts, details=details)
    runs = []
    try:
        for f in SERVER_FAULTS:
            _set_server_fault(url, f)
            counts, _, b1_ok, conc_ok = _judge(ctx, prompts, anchor, *_legs(ctx, url, prompts))
            runs.append({"fault": f["kind"], "caught": not (b1_ok and conc_ok), "batch1_leg_caught": not b1_ok,
                         "concurrent_leg_caught": not conc_ok, "counts": counts})
    finally:
        _set_server_fault(url, None)
    every = all(r["caught"] for r in runs)
    b1_covered = any(r["batch1_leg_caught"] for r in runs)
    conc_covered = any(r["concurrent_leg_caught"] for r in runs)
    counts = {"faults": len(runs), "caught": sum(r["caught"] for r in runs),
              "batch1_leg_caught": sum(r["batch1_leg_caught"] for r in runs),
              "concurrent_leg_caught": sum(r["concurrent_leg_caught"] for r in runs)}
    note = "the arm's server broken: " + ", ".join(f["kind"] for f in SERVER_FAULTS)
    return result("async_parity", arm, not (every and b1_covered and conc_covered), t0, counts=counts,
                  details={"fault": note, "faults": runs})
