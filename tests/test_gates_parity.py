"""The async_parity gate: a batch-1 leg that must be token-for-token equal, and a concurrent leg whose requests
must equal the in-process batch or leave it at a near-tie (campaigns/gates/parity.py says why). Against a real
server on loopback over the `tiny` engine, with the arm's lever routed through the Triton interpreter as a CPU
campaign does.
"""
from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from campaigns.evidence import Arm
from campaigns.gates import GateContext
from campaigns.gates.parity import first_divergences, run_async_parity
from vtengine import levers
from vtengine.config import EngineConfig
from vtengine.engine.llm_engine import LLMEngine
from vtengine.server import Server, start_in_thread, stop_thread

pytestmark = pytest.mark.timeout(300)


def logprobs_with(best: int, other: int, gap_nats: float, positions: int = 3, vocab: int = 8) -> torch.Tensor:
    lp = torch.full((positions, vocab), -20.0)
    lp[:, best] = -0.1
    lp[:, other] = -0.1 - gap_nats
    return lp


def test_first_divergences_scores_the_first_fork_only():
    ref = [[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]]
    lps = [logprobs_with(1, 2, 0.3), logprobs_with(1, 2, 0.3), logprobs_with(1, 2, 0.9), logprobs_with(1, 2, 0.3)]
    served = [[1, 1, 1],            # equal: not listed
              [1, 2, 7],            # forks at 1 by 300 mnats: a near-tie (what follows is another context)
              [2, 1, 1],            # forks at 0 by 900 mnats: divergent
              [1, 1]]               # a token lost: no near-tie whatever the scores
    rows = first_divergences(served, ref, lps, threshold_mnats=500)
    assert [(r["request"], r["position"], r["near_tie"]) for r in rows] == [(1, 1, True), (2, 0, False), (3, 2, False)]
    assert rows[0]["gap_mnats"] == pytest.approx(300.0) and rows[1]["gap_mnats"] == pytest.approx(900.0)
    # the threshold is the policy's: at 200 mnats the first fork is no longer a near-tie
    assert not first_divergences(served, ref, lps, threshold_mnats=200)[0]["near_tie"]
    # a token id outside the vocabulary is no near-tie (and no crash)
    odd = first_divergences([[1, 99, 1]], [ref[0]], [lps[0]], threshold_mnats=500)
    assert [(r["position"], r["gap_mnats"], r["near_tie"]) for r in odd] == [(1, None, False)]


@pytest.fixture(scope="module")
def gate_setup():
    lever = "gqa_swap"
    arm = Arm(name="on", value=True, role="candidate")
    ctx = GateContext(lever=lever, arms=[Arm(name="off", value=False, role="baseline"), arm], model="tiny",
                      quant="bf16", device="cpu", near_tie_max_mnats=500.0,
                      gate_cfg=OmegaConf.create({"async_parity": {"prompts": 4, "max_tokens": 8, "concurrency": 4}}))
    kernels = list(levers.get(lever).affects)
    engine = LLMEngine(EngineConfig(model="tiny", backend="triton", levers={lever: True}, triton_kernels=kernels,
                                    max_model_len=ctx.cpu_max_model_len, max_num_seqs=8))
    server = Server.from_engine(engine, fault_injection=True)
    uv = start_in_thread(server)
    ctx.server_urls, ctx.server_model = {"on": uv.url}, server.model_name
    yield ctx, arm
    stop_thread(uv)
    server.engine.shutdown()


def test_async_parity_passes_and_its_fault_fails(gate_setup):
    ctx, arm = gate_setup
    ok = run_async_parity(ctx, arm)
    assert ok.passed, ok.details
    assert ok.counts["batch1_equal"] == 4 and ok.counts["batch1_mismatched"] == 0
    assert ok.counts["divergent"] == 0 and ok.counts["equal"] + ok.counts["near_tie"] == 4
    # the self-check breaks the server itself (a token lost in transit, a stale decode input): every fault fails the
    # gate, and each leg is caught on its own by at least one of them
    bad = run_async_parity(ctx, arm, fault=True)
    runs = {r["fault"]: r for r in bad.details["faults"]}
    assert not bad.passed and set(runs) == {"drop_token", "stale_input"}
    assert all(r["caught"] for r in runs.values())
    assert runs["drop_token"]["batch1_leg_caught"] and runs["drop_token"]["concurrent_leg_caught"]
    assert runs["drop_token"]["counts"]["batch1_mismatched"] == 4        # every request lost its second token
    assert runs["stale_input"]["batch1_leg_caught"]
    # mended afterwards: the same gate passes again on the same server
    assert run_async_parity(ctx, arm).passed


def test_async_parity_self_check_fails_on_a_server_without_fault_injection():
    lever = "gqa_swap"
    arm = Arm(name="on", value=True, role="candidate")
    ctx = GateContext(lever=lever, arms=[Arm(name="off", value=False, role="baseline"), arm], model="tiny",
                      quant="bf16", device="cpu", near_tie_max_mnats=500.0,
                      gate_cfg=OmegaConf.create({"async_parity": {"prompts": 2, "max_tokens": 4, "concurrency": 2}}))
    engine = LLMEngine(EngineConfig(model="tiny", backend="torch", max_model_len=ctx.cpu_max_model_len, max_num_seqs=4))
    server = Server.from_engine(engine)                  # a plain server: POST /debug/fault does not exist
    uv = start_in_thread(server)
    try:
        ctx.server_urls, ctx.server_model = {"on": uv.url}, server.model_name
        with pytest.raises(RuntimeError, match="refused a deliberate fault.*--fault-injection"):
            run_async_parity(ctx, arm, fault=True)
    finally:
        stop_thread(uv)
        server.engine.shutdown()


def test_async_parity_batch1_leg_is_exact(gate_setup):
    ctx, arm = gate_setup
    run_async_parity(ctx, arm)
    one, many = ctx.cache[f"async:{arm.name}"]
    anchor = ctx.cache[f"sync:{arm.name}"]
    # a served batch-1 request that lost its last token is caught by the exact leg, whatever the near-tie leg says
    ctx.cache[f"async:{arm.name}"] = ([t[:-1] if i == 0 else t for i, t in enumerate(one)], many)
    try:
        res = run_async_parity(ctx, arm)
    finally:
        ctx.cache[f"async:{arm.name}"] = (one, many)
    assert not res.passed and res.counts["batch1_mismatched"] == 1 and res.details["batch1_mismatched"] == [0]
    assert len(anchor["logprobs"]) == 4 and anchor["logprobs"][0].shape[0] == 8
