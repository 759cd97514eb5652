"""Prefill attention benchmark: both routes of vtengine/kernels/attention.py's prefill (per q head; ``gqa_pack``,
with a tile sweep) against ``F.scaled_dot_product_attention`` on contiguous K/V, as TFLOP/s and as a fraction of a
bf16 matmul's rate measured in the same run.

Question it answers: a prefill chunk over a long cached prefix is bound by attention FLOPs (a 2,048-token chunk at a
30k context holds ~1 TFLOP of attention per layer of Qwen3-8B); how close to the GPU's matmul rate does each route
run, and which tiles does the packed route want?

Shapes: 32 q / 8 kv heads, head_dim 128, bf16, block_size 16, one sequence of ``q_len`` new tokens after a cached
prefix of ``prefix`` tokens (block table shuffled, pages scattered as in a running engine).

Definitions:
- FLOPs = 4 x head_dim x q_heads x (keys each query row sees, summed over rows): the two matmuls of every visible
  (query, key) pair, causal masking counted as skipped work (FlashAttention's convention).
- matmul rate = a bf16 8192 x 8192 x 8192 ``torch.mm`` (cuBLAS), do_bench median, measured in the same run: the
  ceiling the tensor cores reach on this device and these clocks (the physical limit's measured stand-in).
- time (``ms``) = ``triton.testing.do_bench`` median of a CUDA graph replaying the call (bench.common.captured):
  GPU time, what a graphed chunk step pays and what an eager step pays while its launches run ahead of the GPU.
  ``eager_ms`` = the same median of the call itself, host launch included: at small steps the GPU waits for
  the Python launcher and the two differ (2026-12-07, H100: every split arm of the split-floor sweep read
  ~0.13 ms eager whatever its prefix, 1k-6k, or split count; the same shapes read 0.05-0.09 ms that morning).
  Speed-ups and ``merge_ms`` compare ``ms``. SDPA runs on the same K/V laid out contiguously ([1, Hkv, ctx, D],
  ``enable_gqa``), with a lower-right causal mask when a prefix is cached (torch's CausalBias); if a backend
  refuses the call the error is recorded instead of a time, and a call that cannot be captured keeps its
  ``eager_ms`` with the capture's error (``graph_error``).
- rel_l2 = vtengine.testing.rel_l2 of each route against SDPA's output (both bf16 out, fp32 accumulation).

``python -m vtengine.bench.prefill_attention [OUT_DIR]`` or ``vtengine bench prefill-attention``.
``python -m vtengine.bench.prefill_attention OUT_DIR splits``: the split sweep instead (the lever ``prefill_splits``):
chunks of 128-640 new tokens in steps of 64 after a 32k prefix (a mixed step's prefill late in a long prompt, and a
prompt's last partial chunk) and two short-prefix controls, the packed route's tiles at the engine's fast math (on,
its default) at forced split counts and "auto", against splits "off" in the same run; beside each arm the speed-up
the wave model predicts (``wave_model_speedup``), so one run says whether "auto" picks the counts the model would.
``python -m vtengine.bench.prefill_attention OUT_DIR split-prefixes``: the split sweep's arms at 128, 256 and 384 new
tokens after prefixes of 1,000 to 32,000 tokens: where splitting starts to pay (the prefix per slice it needs).
``python -m vtengine.bench.prefill_attention OUT_DIR split-floor``: the same arms (2, 4, 8 and auto) at 128 and 256 new
tokens after prefixes of 1,000 to 6,000 tokens in steps of 500 to 1,000, where the sweep above turns from loss to
gain; each split arm also reports ``merge_ms``, its time less the same launch with the merge left out (the split
kernel alone), so a loss reads as the partials' merge or as the split walk itself.
``python -m vtengine.bench.prefill_attention OUT_DIR stages``: the packed route's candidate tiles at both fast-math
settings (the lever ``fast_math``; the tile table above was swept with it off, the engine runs it on), short and long
steps with and without a long prefix; each arm's output is also compared bitwise with the default tiles' at the same
fast-math setting (a change of stages alone must not change a bit).
"""
from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from vtengine import counters
from vtengine.bench import common
from vtengine.kernels import attention as attn  # noqa: F401  (sets the interpreter switch before triton)
from vtengine.kernels.splits import sm_count
from vtengine.testing import rel_l2

import triton  # noqa: E402
import triton.testing  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
DEVICE = "cuda"
SHAPES = [(512, 0), (2048, 0), (8192, 0), (512, 30000), (2048, 30000), (8192, 24000)]    # (q_len, prefix)
SPLIT_SHAPES = [(q, 32000) for q in range(128, 641, 64)] + [(128, 2000), (512, 0)]
# the split rule's prefix threshold (2026-12-07, H100: every split won after 32k, every split lost after 2k, x0.54-
# 0.69 at 128 new tokens): chunks whose grid is under one round, at prefixes between
SPLIT_PREFIX_SHAPES = [(q, p) for p in (1000, 2000, 4000, 8000, 16000, 32000) for q in (128, 256, 384)]
# where the split turns from loss to gain (2026-12-07, H100, split-prefixes: every count lost after 2,000 tokens,
# x0.60-0.86 under auto; after 4,000 auto won x2.18 at 128 new tokens and broke even at 256-384)
SPLIT_FLOOR_SHAPES = [(q, p) for p in (1000, 1500, 2000, 2500, 3000, 3500, 4000, 6000) for q in (128, 256)]
SPLIT_ARMS = ["off", 2, 3, 4, 6, 8, 16, "auto"]
SPLIT_FLOOR_ARMS = ["off", 2, 4, 8, "auto"]
SPLIT_FAST_MATH = True          # the engine's default (the lever fast_math): the tiles "auto" sizes its wave by
PACKED_SWEEP = [attn.Tiles(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in (
    (128, 64, 8, 3), (128, 64, 4, 2), (128, 64, 4, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 2),
    (64, 64, 4, 3), (256, 64, 8, 2),
    # deeper pipelines for the long steps (2026-12-05): the default 128 x 128 / 8 warps at 3 stages (K and V tiles
    # of 32 KB each per stage: 192 KB, inside Hopper's 227 KB), 64 x 128 at 3, 128 x 64 at 4
    (128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 4))]
STAGE_SHAPES = [(64, 0), (128, 0), (512, 0), (1024, 0), (2048, 0), (8192, 0), (128, 32000), (512, 32000),
                (1024, 16000), (2048, 30000), (8192, 24000)]
STAGE_SWEEP = [attn.Tiles(block_m=m, block_n=n, num_warps=w, num_stages=s) for m, n, w, s in (
    (64, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3))]


def wave_model_speedup(q_len: int, splits: int, sms: int, fast_math: bool = SPLIT_FAST_MATH,
                       tiles: attn.Tiles | None = None) -> float:
    """The speed-up over splits "off" that ``splits`` slices of the prefix buy one sequence of ``q_len`` new tokens
    over a long prefix, if the step is its slowest SM's work: the packed grid has P = cdiv(q_len, tokens a tile) x kv
    heads programs of equal length (the launch's bound adds one empty tile a sequence), an SM runs one at a time at
    full speed however many it holds (the 2026-12-05 H100 sweep: at 128 new tokens 2, 4, 8 and 16 slices all took
    0.27-0.30 ms), so S slices take ceil(P x S / SMs) rounds of 1/S of the walk: off / split = ceil(P / SMs) /
    (ceil(P x S / SMs) / S). It leaves out the merge and the partials' bytes (the 12-05 sweep: ~0.1 of the off time)
    and any speed an SM gains from a second program; the sweep measures both beside it. ``tiles``: the packed
    route's (``packed_tiles`` of the step) unless given."""
    tiles = tiles or attn.packed_tiles(q_len, fast_math)
    programs = triton.cdiv(q_len, attn.packed_tokens_per_tile(tiles, HQ // HKV)) * HKV
    return attn.wave_speedup(programs, splits, sms)


def causal_flops(q_len: int, prefix: int) -> float:
    keys = q_len * prefix + q_len * (q_len + 1) / 2          # row i sees prefix + i + 1 keys
    return 4.0 * D * HQ * keys


def make_case(q_len: int, prefix: int, gen: torch.Generator):
    ctx = prefix + q_len
    nbps = triton.cdiv(ctx, PAGE)
    k = torch.randn(1, HKV, nbps * PAGE, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, HKV, nbps * PAGE, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    bt = torch.randperm(nbps, device=DEVICE, generator=gen).to(torch.int32).view(1, nbps)
    k_cache = torch.empty(nbps, PAGE, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    k_cache[bt[0].long()] = k[0].view(HKV, nbps, PAGE, D).permute(1, 2, 0, 3)
    v_cache[bt[0].long()] = v[0].view(HKV, nbps, PAGE, D).permute(1, 2, 0, 3)
    q = torch.randn(q_len, HQ, D, device=DEVICE, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE)
    cl = torch.tensor([ctx], dtype=torch.int32, device=DEVICE)
    return q, k[:, :, :ctx].contiguous(), v[:, :, :ctx].contiguous(), k_cache, v_cache, bt, cu, cl


def sdpa_call(q, k, v, prefix: int):
    """SDPA over contiguous K/V: q [T, Hq, D] -> [T, Hq, D]."""
    qb = q.transpose(0, 1).unsqueeze(0)
    if prefix == 0:
        def run():
            return F.scaled_dot_product_attention(qb, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    else:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(q.shape[0], k.shape[2])

        def run():
            return F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, enable_gqa=True)[0].transpose(0, 1)
    return run


def time_ms(fn, graphed: bool = True) -> float:
    """do_bench median in ms of a CUDA graph replaying ``fn`` (GPU time), or of ``fn`` itself (``graphed=False``:
    host launch included)."""
    if graphed:
        fn = common.captured(fn)
    else:
        fn()
        torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def timed(fn, flops: float) -> dict:
    """An arm's ``eager_ms`` and graphed ``ms`` (with its TFLOP/s); a capture that fails keeps the eager time
    and says why (``graph_error``), so the arm drops out of the comparisons instead of mixing definitions."""
    entry = {"eager_ms": round(time_ms(fn, graphed=False), 3)}
    try:
        ms = time_ms(fn)
    except Exception as e:
        entry["graph_error"] = common.error_text(e)
        return entry
    return {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1), **entry}


def without_merge(fn):
    """``fn`` with the split route's merge launch left out (its output then is wrong: timing only)."""
    class Skipped:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    def run():
        merge, attn._prefill_merge_kernel = attn._prefill_merge_kernel, Skipped()
        try:
            return fn()
        finally:
            attn._prefill_merge_kernel = merge
    return run


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    ms = time_ms(lambda: torch.mm(a, b))
    return 2 * 8192 ** 3 / ms / 1e9


def main(out_dir: str = "bench/results", what: str = "tiles") -> dict:
    if what not in ("tiles", "splits", "split-prefixes", "split-floor", "stages"):
        raise SystemExit(f"prefill attention bench: {what!r} is not a sweep; accepted: tiles, splits, split-prefixes, "
                         "split-floor, stages")
    shapes = {"splits": SPLIT_SHAPES, "split-prefixes": SPLIT_PREFIX_SHAPES, "split-floor": SPLIT_FLOOR_SHAPES,
              "stages": STAGE_SHAPES}.get(what, SHAPES)
    sweep = what
    split_arms = SPLIT_FLOOR_ARMS if sweep == "split-floor" else SPLIT_ARMS
    what = "splits" if sweep.startswith("split") else what        # the same arms and columns
    if not torch.cuda.is_available():
        print("prefill attention bench: needs a CUDA GPU; nothing measured")
        return {"skipped": "needs a CUDA GPU"}
    props = torch.cuda.get_device_properties(0)
    peak = matmul_tflops()
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "bench": "prefill_attention", "device": props.name, "sm_count": sm_count(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "matmul_tflops": round(peak, 1),
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": PAGE, "dtype": "bfloat16"},
        "definitions": __doc__.split("Definitions:")[1].split("``python -m")[0].strip(),
        "rows": [],
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kind = {"splits": "prefill-attention-splits", "stages": "prefill-attention-stages"}.get(what, "prefill-attention")
    kind += {"split-prefixes": "-prefixes", "split-floor": "-floor"}.get(sweep, "")
    stem = out / common.unique_stem(out, f"{kind}-{now.strftime('%Y-%m-%d')}-{props.name.split()[-1].lower()}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    scale = D ** -0.5
    for q_len, prefix in shapes:
        q, k, v, kc, vc, bt, cu, cl = make_case(q_len, prefix, gen)
        flops = causal_flops(q_len, prefix)
        row = {"q_len": q_len, "prefix": prefix, "gflop": round(flops / 1e9, 1), "arms": {}}
        try:
            sd = sdpa_call(q, k, v, prefix)
            ref = sd()
            row["arms"]["sdpa"] = timed(sd, flops)
        except Exception as e:                       # a backend refusing the mask/shape: say so, keep going
            ref = None
            row["arms"]["sdpa"] = {"error": common.error_text(e)}
        arms = [("per_q_head", False, attn.PREFILL_TILES, "off")] + [
            (f"gqa_pack/m{t.block_m}n{t.block_n}w{t.num_warps}s{t.num_stages}", True, t, "off") for t in PACKED_SWEEP]
        fast = {}
        if what == "splits":
            arms = [(f"gqa_pack/splits={sp}", True, None, sp) for sp in split_arms]
            fast = {name: SPLIT_FAST_MATH for name, *_ in arms}
        if what == "stages":        # name/fast: at fast math; the default tiles' output per setting, for bitwise
            arms = [(f"m{t.block_m}n{t.block_n}w{t.num_warps}s{t.num_stages}{'/fast' if fm else ''}", True, t, "off")
                    for fm in (False, True) for t in STAGE_SWEEP]
            fast = {n: n.endswith("/fast") for n, *_ in arms}
            default = {fm: attn.prefill_attention(q, kc, vc, cu, cl, bt, scale, fast_math=fm, gqa_pack=True)
                       for fm in (False, True)}
        for name, pack, tiles, sp in arms:
            try:
                buf = torch.full_like(q, float("nan"))

                def fn(pack=pack, tiles=tiles, buf=buf, sp=sp, fm=fast.get(name, False)):
                    return attn.prefill_attention(q, kc, vc, cu, cl, bt, scale, fast_math=fm, tiles=tiles, out=buf,
                                                  gqa_pack=pack, splits=sp)
                entry = timed(fn, flops)
                if "ms" in entry:
                    entry["fraction_of_matmul"] = round(flops / entry["ms"] / 1e9 / peak, 3)
                if what == "splits":        # the count the launch used ("auto" picks it from the grid)
                    counters.reset()
                    fn()
                    entry["splits"] = list(counters.snapshot()["prefill_attention"]["gqa_pack"]["splits"])
                    if prefix:              # the model is about a long prefix's walk
                        entry["wave_model_speedup"] = round(wave_model_speedup(q_len, int(entry["splits"][0]),
                                                                               result["sm_count"]), 3)
                    if sweep == "split-floor" and int(entry["splits"][0]) > 1 and "ms" in entry:
                        try:        # two medians apart: a merge near 0 can read a little negative
                            entry["merge_ms"] = round(entry["ms"] - time_ms(without_merge(fn)), 4)
                        except Exception as e:      # the arm's own time stands
                            entry["merge_ms_error"] = common.error_text(e)
                if ref is not None:
                    entry["rel_l2_vs_sdpa"] = float(f"{rel_l2(fn(), ref):.3e}")
                if what == "stages":
                    entry["bitwise_vs_default"] = bool(torch.equal(fn(), default[fast[name]]))
                row["arms"][name] = entry
            except Exception as e:
                row["arms"][name] = {"error": common.error_text(e)}
        packed = {n: a for n, a in row["arms"].items() if n.startswith("gqa_pack") and "ms" in a}
        if what == "splits" and "ms" in row["arms"].get("gqa_pack/splits=off", {}):
            off = row["arms"]["gqa_pack/splits=off"]["ms"]
            row["speedup_vs_off"] = {n: round(off / a["ms"], 3) for n, a in packed.items()}
        elif what == "stages":
            for fm in (False, True):
                times = {n: a["ms"] for n, a in row["arms"].items() if "ms" in a and fast.get(n) == fm}
                if times:
                    row[f"best{'_fast' if fm else ''}"] = min(times, key=times.get)
        elif packed and "ms" in row["arms"]["per_q_head"]:
            best = min(packed, key=lambda n: packed[n]["ms"])
            row["best_packed"] = best
            row["best_packed_speedup_vs_per_q_head"] = round(row["arms"]["per_q_head"]["ms"] / packed[best]["ms"], 3)
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")     # a cut-short run keeps rows
        del q, k, v, kc, vc
        common.free_memory()
    stem.with_suffix(".md").write_text(markdown(result))
    return result


def markdown(result: dict) -> str:
    names = list(result["rows"][0]["arms"]) if result["rows"] else []
    lines = [f"# Prefill attention, {result['device']}, {result['date_utc']}",
             f"torch {result['torch']}, triton {result['triton']}; bf16 matmul rate {result['matmul_tflops']} TFLOP/s "
             "(measured in this run). Cells: ms / TFLOP/s of a CUDA graph's replay (GPU time) [the eager call's ms, "
             "host launch included].", "",
             "| q_len | prefix | GFLOP | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]
    if any("speedup_vs_off" in r for r in result["rows"]):
        lines[1] += (" Split arms: (measured speed-up over off; the wave model's, `wave_model_speedup`), at the "
                     "split count the launch used.")
    for r in result["rows"]:
        cells = [_cell(r, name, a) for name, a in r["arms"].items()]
        lines.append(f"| {r['q_len']} | {r['prefix']} | {r['gflop']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _cell(row: dict, name: str, arm: dict) -> str:
    eager = f" [eager {arm['eager_ms']}]" if "eager_ms" in arm else ""
    if "ms" in arm:
        return f"{arm['ms']} / {arm['tflops']}{eager}" + _split_note(row, name, arm)
    return f"no graph{eager}" if "graph_error" in arm else "error"


def _split_note(row: dict, name: str, arm: dict) -> str:
    """' (x1.18; model x1.33, S=4)' for a split sweep's arm: measured and modelled speed-up over off."""
    measured = row.get("speedup_vs_off", {}).get(name)
    if measured is None or name.endswith("=off"):
        return ""
    model = f"; model x{arm['wave_model_speedup']:.2f}" if "wave_model_speedup" in arm else ""
    used = f", S={','.join(map(str, arm['splits']))}" if arm.get("splits") else ""
    merge = f", merge {arm['merge_ms']} ms" if "merge_ms" in arm else ""
    return f" (x{measured:.2f}{model}{used}{merge})"


if __name__ == "__main__":
    main(*sys.argv[1:3])
