"""The prefill-attention loop-body variants (vtengine/bench/prefill_attention_variants.py, an experiment the GPU
bench times) compute the engine's packed prefill attention: under the Triton interpreter each variant's output
equals the engine kernel's on a ragged two-sequence case with a cached prefix and scattered pages."""
from __future__ import annotations

import pytest

from vtengine.bench import prefill_attention_variants as variants


def test_every_variant_matches_the_engine_kernel():
    diffs = variants.check()
    assert set(diffs) == {n for n, f in variants.VARIANTS.items() if f is not None}
    for name, diff in diffs.items():
        assert diff < 1e-5, f"{name}: max |variant - engine| = {diff}"


def test_the_check_sees_a_wrong_variant(monkeypatch):
    """A variant that drops the softmax scale differs from the engine: the check above can fail."""
    real = variants.variant_attention

    def unscaled(q, k_cache, v_cache, cu, cl, bt, scale, tiles, flags, out=None):
        return real(q, k_cache, v_cache, cu, cl, bt, 1.0, tiles, flags, out)
    monkeypatch.setattr(variants, "variant_attention", unscaled)
    assert min(variants.check().values()) > 1e-3


def test_the_split_sweeps_wave_model_counts_rounds_of_whole_programs():
    """The model the split sweep prints beside each arm: P = cdiv(q_len, 32 tokens a 128-row tile of 4 q heads) x 8
    kv heads programs, S slices each, ceil(P x S / SMs) rounds of 1/S of the walk against ceil(P / SMs) rounds of
    it. On 132 SMs: 128 new tokens (32 programs) gain x2 at S=2 and x4 at S=4 or 8 (one round either way); 384 (96)
    gain nothing at S=2 (two rounds of halves) and x4/3 at S=4 (three rounds of quarters); 512 (128) gain nothing at
    2 or 4; 640 (160, two rounds unsplit) gains x4/3 at 2 and x1.6 at 4."""
    from vtengine.bench.prefill_attention import wave_model_speedup
    from vtengine.kernels import attention as attn
    fast = attn.Tiles(block_m=128, block_n=128, num_warps=8, num_stages=3)      # the GPU's fast-math tiles
    model = {(q, s): wave_model_speedup(q, s, 132, tiles=fast) for q in (128, 384, 512, 640) for s in (1, 2, 4, 8)}
    assert {k: v for k, v in model.items() if k[1] == 1} == {(q, 1): 1.0 for q in (128, 384, 512, 640)}
    assert (model[128, 2], model[128, 4], model[128, 8]) == (2.0, 4.0, 4.0)
    assert model[384, 2] == 1.0 and model[384, 4] == pytest.approx(4 / 3)
    assert model[512, 2] == 1.0 and model[512, 4] == 1.0 and model[512, 8] == 1.0
    assert model[640, 2] == pytest.approx(4 / 3) and model[640, 4] == pytest.approx(1.6)


def test_auto_picks_the_split_count_the_h100_sweep_measured_fastest():
    """prefill_splits "auto" against the split sweep it was fitted to (H100 80GB HBM3, 2026-12-06, fast-math tiles,
    one sequence: 128-640 new tokens after a 32k prefix, 128 after 2k, 512 fresh): at every shape whose grid fits one
    132-SM wave the count auto picks measured within 3% of the fastest of off and S = 2, 3, 4, 6, 8, 16. Past one
    wave (576 and 640 tokens: 144 and 160 programs) auto does not split, by design, though S = 6 and 4 gained x1.46
    and x1.35 there: the launch cannot tell such a chunk from a fresh prompt with nothing to split. The rule before
    it picked 3 at 384 and 448 new tokens (x0.91 and x0.90 of off)."""
    import json
    from pathlib import Path
    from vtengine.kernels import attention as attn
    sweep = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" /
                        "prefill-attention-splits-2026-12-06-hbm3.json").read_text())
    fast = attn.Tiles(block_m=128, block_n=128, num_warps=8, num_stages=3)      # the GPU's fast-math tiles, 1 a SM
    tokens = attn.packed_tokens_per_tile(fast, 4)
    assert tokens == 32 and sweep["sm_count"] == 132
    picks = {}
    for row in sweep["rows"]:
        arms = row["arms"]
        off = arms["gqa_pack/splits=off"]["ms"]
        speedup = {1: 1.0} | {int(name.rsplit("=", 1)[1]): off / arm["ms"] for name, arm in arms.items()
                              if name.startswith("gqa_pack/splits=") and name.rsplit("=", 1)[1].isdigit()}
        programs = -(-row["q_len"] // tokens) * 8
        pick = attn.prefill_split_count("auto", programs, sweep["sm_count"])
        picks[row["q_len"], row["prefix"]] = pick
        if programs <= sweep["sm_count"]:
            assert speedup[pick] >= 0.97 * max(speedup.values()), (row["q_len"], row["prefix"], pick, speedup)
    assert picks == {(128, 32000): 4, (192, 32000): 8, (256, 32000): 2, (320, 32000): 8, (384, 32000): 4,
                     (448, 32000): 1, (512, 32000): 1, (576, 32000): 1, (640, 32000): 1, (128, 2000): 4, (512, 0): 1}
