"""The decode graphs' static inputs on the CPU: capture_graphs there keeps each batch size's step as a callable over
the same static buffers a CUDA graph reads, so the replay's input handling (rows written in place, padded rows past
the batch) is tested without a GPU."""
import pytest
import torch

from vtengine import counters
from vtengine.engine.llm import LLM
from vtengine.engine.sampling_params import SamplingParams
from vtengine.engine.transfer import to_device


def staggered(n=6, seed=3):
    """n prompts (one past a 64-column block table, so a wide table precedes narrow ones) whose outputs end one
    after another: the decode batch shrinks n, n-1, ..., 1 through sizes that were not captured (padded rows)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1100, 7, 30, 3, 64, 12][:n]
    prompts = [torch.randint(3, 500, (L,), generator=g).tolist() for L in lengths]
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny", backend="torch", device="cpu", max_model_len=2048, max_num_seqs=8)


def tokens(llm, prompts, params):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


def test_static_replay_decodes_the_eager_tokens(llm):
    runner = llm.engine.runner
    prompts, params = staggered()
    assert not runner.use_graphs
    eager = tokens(llm, prompts, params)
    runner.capture_graphs(8)
    assert sorted(runner.graphs) == [1, 2, 4, 8] and not any(isinstance(g, torch.cuda.CUDAGraph)
                                                             for g in runner.graphs.values())
    runner.use_graphs = True
    counters.reset()
    try:
        graphed = tokens(llm, prompts, params)
    finally:
        runner.use_graphs = False
    snap = counters.snapshot()["decode_step"]
    assert "eager" not in snap
    grids = snap["static_eager"]["grids"]
    # batches 6 and 5 replay size 8, 3 replays 4: padded rows ran, and every step went through the static buffers
    assert grids.get("8", 0) >= 2 and grids.get("4", 0) >= 1 and grids.get("1", 0) >= 1, grids
    assert graphed == eager
    assert len({tuple(t) for t in eager}) == len(prompts)


def test_replay_pads_the_rows_past_the_batch(llm):
    """Rows past the step's batch, up to the replayed size, are padding however an earlier step left them; rows of
    the batch hold exactly this step's inputs."""
    runner = llm.engine.runner
    if not runner.graphs:
        runner.capture_graphs(8)
    eng = llm.engine
    prompts, _ = staggered(4)
    for i, p in enumerate(prompts):
        eng.add_request(f"pad{i}", p, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    try:
        _check_padding(runner, eng)
    finally:
        for i in range(len(prompts)):
            eng.abort_request(f"pad{i}")


def _check_padding(runner, eng):
    while eng.scheduler.waiting or any(not s.num_completion_tokens for s in eng.scheduler.running):
        eng.step()
    seqs = list(eng.scheduler.running)[:3]
    assert len(seqs) == 3
    g = runner.g_ctx
    with torch.inference_mode():
        # an earlier, larger step's leftovers in row 3 (a live slot, a long context, a real table) and past the graph
        g.slot_mapping[3:].fill_(runner._slot(seqs[0], len(seqs[0]) - 2))
        g.context_lens[3:].fill_(len(seqs[0]))
        g.block_tables[3:, :4].fill_(seqs[0].block_table[0])
        before = [k.clone() for k, _ in runner.kv_caches]
        runner.prepare_decode(seqs, static=True)
        out = runner._replay(3)
    assert out.shape[0] == 3
    assert g.slot_mapping[3].item() == -1 and g.context_lens[3].item() == 1
    assert not g.block_tables[3].any()
    assert g.slot_mapping[4].item() != -1        # past the replayed size (4): untouched, no graph of 4 reads it
    width = runner._block_tables(seqs).shape[1]          # the step's table width (whole 64-column groups)
    for i, s in enumerate(seqs):
        assert g.slot_mapping[i].item() == runner._slot(s, len(s) - 1)
        assert g.context_lens[i].item() == len(s)
        newest = runner.mirror.ids[runner.mirror.rows[s.seq_id]].item() if s.has_pending else s.last_token
        assert runner.g_pos[i].item() == len(s) - 1 and runner.g_ids[i].item() == newest >= 0
        n = len(s.block_table)
        assert g.block_tables[i, :n].tolist() == s.block_table
        assert set(g.block_tables[i, n:width].tolist()) <= {-1}       # -1 past the table, up to the step's width
    # only this step's three slots were written: the padded row wrote nothing into seqs[0]'s earlier slot
    written = {runner._slot(s, len(s) - 1) for s in seqs}
    for (k, _), k0 in zip(runner.kv_caches, before):
        changed = (k.flatten(0, 1) != k0.flatten(0, 1)).flatten(1).any(-1)       # per flat slot
        assert set(changed.nonzero().flatten().tolist()) <= written


def test_to_device_into_a_buffer_checks_the_shape():
    buf = torch.full((4,), -7, dtype=torch.int64)
    assert to_device([1, 2], torch.int64, "cpu", out=buf[:2]) is not None and buf.tolist() == [1, 2, -7, -7]
    with pytest.raises(ValueError, match=r"data of shape \(3,\) and dtype torch.int64 cannot fill out of shape \(2,\)"):
        to_device([1, 2, 3], torch.int64, "cpu", out=buf[:2])
    with pytest.raises(ValueError, match=r"cannot fill out of shape \(2,\) and dtype torch.int64"):
        to_device([1, 2], torch.int32, "cpu", out=buf[:2])
