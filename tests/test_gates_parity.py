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
    server = Server.from_engine(engine)
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
    bad = run_async_parity(ctx, arm, fault=True)
    assert not bad.passed and bad.counts["divergent"] == 1
    fork = [f for f in bad.details["concurrent_forks"] if not f["near_tie"]]
    assert fork[0]["request"] == 3 and fork[0]["position"] == 0 and fork[0]["gap_mnats"] > 500


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
