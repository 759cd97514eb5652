"""`vtengine bench prefill` on CPU (tiny model, torch backend): one step of N new tokens over a cached prefix of P
tokens is timed and profiled for every (P, N), written as JSON and markdown; a step that does not fit is recorded as
an error and the others still run; bad flags name the flag."""
from __future__ import annotations

import json

import pytest
import torch

from vtengine import cli
from vtengine.bench import prefill


def test_steps_over_a_cached_prefix_are_timed_profiled_and_written(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    argv = ["--model", "tiny", "--device", "cpu", "--backend", "torch", "--prefixes", "0,96", "--chunks", "16,48",
            "--reps", "2", "--profile"]
    assert cli.main(["bench", "prefill", "--out", str(tmp_path)] + argv) == 0
    [path] = tmp_path.glob("prefill-*.json")
    res = json.loads(path.read_text())
    assert [(r["prefix"], r["chunk"]) for r in res["rows"]] == [(0, 16), (0, 48), (96, 16), (96, 48)]
    for r in res["rows"]:
        assert "error" not in r, r
        assert len(r["ms_all"]) == 2 and r["ms"] > 0 and r["us_per_token"] == pytest.approx(1e3 * r["ms"] / r["chunk"])
        assert r["kernels"] and all(k["us"] >= 0 for k in r["kernels"])        # CPU ops by self time
    md = path.with_suffix(".md").read_text()
    assert "| 96 | 48 |" in md and "top kernels" in md


def test_the_step_reads_the_cached_prefix(tmp_path):
    """The chunk's last logits equal those of one prefill over prefix + chunk: the step attends to the cache."""
    from vtengine.engine.llm import LLM
    from vtengine.engine.sampling_params import SamplingParams
    from vtengine.engine.sequence import Sequence
    llm = LLM(model="tiny", backend="torch", num_kv_blocks=64, max_num_seqs=1)
    eng = llm.engine
    tokens = torch.randint(3, 500, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = eng.score(tokens, [5])[0]           # one prefill of all 80 (and a token after): the next-token row
    seq = Sequence("s", tokens, SamplingParams(max_tokens=1), eng.config.block_size)
    eng.block_manager.allocate(seq)
    prefill._step(eng.runner, seq, 0, 64)
    seq.num_cached_tokens, seq.num_new_tokens, seq.in_prefill = 64, 16, True
    with torch.inference_mode():
        chunked = torch.log_softmax(eng.runner._logits([seq], True)[0].double(), -1)
    eng.block_manager.free(seq)
    assert torch.allclose(chunked, whole, atol=1e-4), (chunked - whole).abs().max()


def test_a_step_that_does_not_fit_is_an_error_row_and_bad_flags_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv("OUT", raising=False)
    with pytest.raises(ValueError, match="--chunks expects comma-separated integers >= 1, got '0'"):
        prefill.main(str(tmp_path), ["--chunks", "0"])
    with pytest.raises(ValueError, match="--prefixes expects"):
        prefill.main(str(tmp_path), ["--prefixes", "many"])
    # tiny's model maximum is 2048 tokens: 2040 + 16 does not fit, 0 + 16 does
    assert prefill.main(str(tmp_path), ["--model", "tiny", "--device", "cpu", "--backend", "torch",
                                        "--prefixes", "0,2040", "--chunks", "16", "--reps", "1"]) == 0
    [path] = tmp_path.glob("prefill-*.json")
    rows = json.loads(path.read_text())["rows"]
    assert "ms" in rows[0] and "do not fit this engine" in rows[1]["error"], rows


def test_the_prefill_attention_bench_refuses_an_unknown_sweep_naming_its_sweeps(tmp_path):
    """`python -m vtengine.bench.prefill_attention OUT_DIR <sweep>`: a misspelt sweep is refused before any GPU work,
    naming the accepted ones; split-prefixes spans the prefixes where splitting lost (2k) and won (32k)."""
    from vtengine.bench import prefill_attention as bench
    with pytest.raises(SystemExit, match=r"'prefixes' is not a sweep; accepted: tiles, splits, split-prefixes, "
                                         r"split-floor, stages"):
        bench.main(str(tmp_path), "prefixes")
    assert sorted({p for _, p in bench.SPLIT_PREFIX_SHAPES}) == [1000, 2000, 4000, 8000, 16000, 32000]
    assert not list(tmp_path.iterdir())


def test_the_split_floor_sweep_times_the_split_kernel_without_its_merge(tmp_path):
    """split-floor's merge_ms is an arm's time less the same launch without the merge: `without_merge` leaves the
    merge out of that one call (the output keeps its poison where only the merge writes) and puts it back after,
    so the next call merges again (run here under the interpreter, at a tiny split shape)."""
    from test_kernels_attention import poisoned, prefill_case

    from vtengine import counters
    from vtengine.bench import prefill_attention as bench
    from vtengine.kernels import attention as attn
    from vtengine.testing import rel_l2
    gen = torch.Generator().manual_seed(0)
    q, kc, vc, cu, ctx, bt, scale, ref = prefill_case([5], [70], 4, 2, 16, 8, gen)
    out = poisoned(q)

    def fn():
        return attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, out=out, gqa_pack=True, splits=2)
    counters.reset()
    assert torch.isnan(bench.without_merge(fn)()).all()             # split kernel only: nothing merged into out
    assert counters.snapshot()["prefill_attention"]["gqa_pack"]["splits"] == {"2": 1}
    assert rel_l2(fn(), ref) < 1e-5                                 # the merge is back
    with pytest.raises(SystemExit, match="accepted: tiles, splits, split-prefixes, split-floor, stages"):
        bench.main(str(tmp_path), "floor")
    assert sorted({p for _, p in bench.SPLIT_FLOOR_SHAPES}) == [1000, 1500, 2000, 2500, 3000, 3500, 4000, 6000]


def test_the_prefill_attention_table_shows_graph_and_eager_times_and_a_failed_capture():
    """Cells read the graphed time (GPU) with the eager call's beside it; an arm whose capture failed shows its
    eager time as "no graph", never as a graphed figure."""
    from vtengine.bench import prefill_attention as bench
    arms = {"sdpa": {"ms": 0.03, "tflops": 80.0, "eager_ms": 0.031},
            "gqa_pack/splits=off": {"ms": 0.06, "tflops": 40.0, "eager_ms": 0.07},
            "gqa_pack/splits=2": {"ms": 0.04, "tflops": 60.0, "eager_ms": 0.13, "splits": ["2"], "merge_ms": 0.004},
            "gqa_pack/splits=4": {"eager_ms": 0.12, "graph_error": "RuntimeError: capture"}}
    result = {"device": "GPU", "date_utc": "2026-12-07T00:00:00Z", "torch": "2", "triton": "3", "matmul_tflops": 1.0,
              "rows": [{"q_len": 128, "prefix": 2000, "gflop": 4.3, "arms": arms,
                        "speedup_vs_off": {"gqa_pack/splits=off": 1.0, "gqa_pack/splits=2": 1.5}}]}
    row = bench.markdown(result).splitlines()[-1].split(" | ")
    assert row[3:] == ["0.03 / 80.0 [eager 0.031]", "0.06 / 40.0 [eager 0.07]",
                       "0.04 / 60.0 [eager 0.13] (x1.50, S=2, merge 0.004 ms)", "no graph [eager 0.12] |"]
    assert "CUDA graph's replay (GPU time)" in bench.markdown(result)


@pytest.mark.gpu
def test_the_timed_graph_replays_the_whole_split_launch():
    """The bench's ``ms`` times a CUDA graph's replay, so the graph must hold the work the eager call does:
    replayed into a poisoned output it writes the eager output bitwise, and the graph captured without the merge
    leaves the poison (merge_ms subtracts the merge and nothing else)."""
    from test_kernels_attention import poisoned, prefill_case

    from vtengine.bench import common
    from vtengine.bench import prefill_attention as bench
    from vtengine.kernels import attention as attn
    from vtengine.testing import rel_l2
    q, kc, vc, cu, ctx, bt, scale, ref = prefill_case([64], [700], 4, 2, 64, 16, torch.Generator().manual_seed(0))
    out = poisoned(q)

    def fn():
        return attn.prefill_attention(q, kc, vc, cu, ctx, bt, scale, out=out, gqa_pack=True, splits=2)
    eager = fn().clone()
    assert rel_l2(eager, ref) < 1e-3
    replay, no_merge = common.captured(fn), common.captured(bench.without_merge(fn))
    for graph, merged in ((replay, True), (no_merge, False), (replay, True)):
        out.fill_(float("nan"))
        graph()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) if merged else torch.isnan(out).all()


@pytest.mark.parametrize("sweep", ["split-floor", "stages"])
def test_every_arm_of_a_prefill_attention_sweep_is_timed_and_checked(tmp_path, monkeypatch, sweep):
    """The sweep's own loop on this host: the kernels run under the interpreter at a tiny shape, only the GPU's
    timer is a stand-in (no CUDA graph here): every arm is timed both ways, its output checked against SDPA, and
    none is an error row (a name in the loop that shadowed `timed` once turned every arm into one)."""
    from types import SimpleNamespace

    from vtengine.bench import prefill_attention as bench
    for name, value in {"DEVICE": "cpu", "HQ": 4, "HKV": 2, "D": 16, "matmul_tflops": lambda: 1.0,
                        "sm_count": lambda: 4, "SPLIT_FLOOR_SHAPES": [(16, 40)], "STAGE_SHAPES": [(16, 40)],
                        "STAGE_SWEEP": bench.STAGE_SWEEP[:1]}.items():
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name="CPU stand-in"))
    timings = []

    def time_ms(fn, graphed=True):
        fn()
        timings.append(graphed)
        return 0.5 if graphed else 0.75
    monkeypatch.setattr(bench, "time_ms", time_ms)
    result = bench.main(str(tmp_path), sweep)
    arms = result["rows"][0]["arms"]
    assert len(arms) >= 3 and all("error" not in a for a in arms.values()), arms
    for name, arm in arms.items():
        assert (arm["ms"], arm["eager_ms"]) == (0.5, 0.75), (name, arm)
        assert name == "sdpa" or arm["rel_l2_vs_sdpa"] < 2e-2, (name, arm)
        assert arm.get("bitwise_vs_default", True) is True, (name, arm)     # stages: the default tiles' output
    assert timings.count(False) == len(arms) and "[eager 0.75]" in next(tmp_path.glob("*.md")).read_text()
