"""Decode attention benchmark: every lever arm of vtengine/kernels/attention.py against
``F.scaled_dot_product_attention(enable_gqa=True)`` on contiguous K/V, as a fraction of copy bandwidth.

Shapes: 32 q / 8 kv heads, head_dim 128, bf16, block_size 16, batch 1, 8, 32 x context 1024, 8192 (every sequence
at the full context; the block table is shuffled, so pages are scattered as in a running engine).

Definitions:
- bytes moved = K + V of every sequence read once + q read + out written (bf16). Split partials and the block table
  are overhead, not counted.
- copy bandwidth = vtengine/bench/common.py's ``copy_bandwidth_gbs`` (a device-to-device copy of max(1 GiB, 8 x L2),
  bytes read + written, do_bench median; the ceiling every benchmark uses), measured in the same run.
- time = ``triton.testing.do_bench`` median. do_bench writes a 256 MB buffer before every repetition, which evicts
  the 60 MB L2, so K/V come from HBM each time (no buffer rotation is needed on top). ``eager_us`` times the
  Python launch path; ``graph_us`` replays a CUDA graph of the same call (what the engine's decode does), which
  removes host launch gaps between stage 1 and the merge.
- two launches: the arms run the default fused merge (one launch). Where an arm splits, the same call with
  ``fused_merge=False`` (stage 1, then the merge as a second launch) is timed beside it (``two_launch_eager_us``,
  ``two_launch_graph_us``), and ``bitwise_vs_two_launch`` says whether the two outputs are bitwise equal (they
  must be).
- rel_l2 = vtengine.testing.rel_l2, ||out - ref|| / ||ref|| in fp64 (inf if out holds a NaN or inf), against the
  torch reference backend (fp32 math and output, same bf16 inputs).

``python -m vtengine.bench.attention OUT_DIR`` or ``vtengine bench kernels``.
"""
from __future__ import annotations

import datetime
import functools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vtengine.bench import common
from vtengine.kernels import attention as attn  # noqa: F401  (sets the interpreter switch before triton)
from vtengine.kernels.splits import sm_count
from vtengine.testing import rel_l2

import triton  # noqa: E402
import triton.testing  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
DEVICE = "cuda"
BATCHES = (1, 8, 32)
CONTEXTS = (1024, 8192)
ARMS = [  # name, kwargs
    ("per_q_head/off", dict(gqa_swap=False, nsplits_cap="off")),
    ("per_q_head/auto", dict(gqa_swap=False, nsplits_cap="auto")),
    ("gqa_swap/off", dict(gqa_swap=True, nsplits_cap="off")),
    ("gqa_swap/auto", dict(gqa_swap=True, nsplits_cap="auto")),
    ("per_q_head/off/fast_math", dict(gqa_swap=False, nsplits_cap="off", fast_math=True)),
    ("gqa_swap/off/fast_math", dict(gqa_swap=True, nsplits_cap="off", fast_math=True)),
]
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32, 64)
OLD_COPY_BW_METHOD = "1 GiB device-to-device, read + write"     # how files without copy_bw_method measured it
TILE_SWEEP = [attn.Tiles(block_n=bn, num_warps=w, num_stages=st)
              for bn, w, st in ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 2))]


def make_case(batch: int, context: int, gen: torch.Generator):
    """Paged bf16 K/V (shuffled blocks) and the same K/V contiguous [B, Hkv, ctx, D] for SDPA."""
    nbps = context // PAGE
    k = torch.randn(batch, HKV, context, D, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(batch, HKV, context, D, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    perm = torch.randperm(batch * nbps, device=DEVICE, generator=gen)
    bt = perm.view(batch, nbps).to(torch.int32)
    k_cache = torch.empty(batch * nbps, PAGE, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    # [B, Hkv, nbps, PAGE, D] -> [B, nbps, PAGE, Hkv, D], scattered to the shuffled blocks
    k_cache[bt.long()] = k.view(batch, HKV, nbps, PAGE, D).permute(0, 2, 3, 1, 4)
    v_cache[bt.long()] = v.view(batch, HKV, nbps, PAGE, D).permute(0, 2, 3, 1, 4)
    q = torch.randn(batch, HQ, D, device=DEVICE, generator=gen, dtype=torch.bfloat16)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    return q, k, v, k_cache, v_cache, bt, ctx


def time_us(fn) -> dict:
    """do_bench median of the eager call and of a CUDA graph replaying it, in microseconds."""
    fn()
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(fn, warmup=15, rep=60, return_mode="median") * 1e3
    graphed = triton.testing.do_bench(common.captured(fn), warmup=15, rep=60, return_mode="median") * 1e3
    return {"eager_us": round(eager, 2), "graph_us": round(graphed, 2)}


def main(out_dir: str = "bench/results", sweeps: bool = True, max_seconds: float | None = None) -> dict:
    """Measure, write JSON + markdown after every shape (a cut-short run keeps what it measured), return the
    figures. Sweeps are skipped once ``max_seconds`` have passed."""
    if not torch.cuda.is_available():
        print("attention bench: needs a CUDA GPU; nothing measured")
        return {"skipped": "needs a CUDA GPU"}
    from vtengine import counters
    from vtengine.backends.torch_backend import TorchBackend
    ref_backend = TorchBackend()
    props = torch.cuda.get_device_properties(0)
    copy_gbs = common.copy_bandwidth_gbs()
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {
        "bench": "decode_attention", "device": props.name, "sm_count": sm_count(),
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "copy_bw_gbs": round(copy_gbs, 1),
        "copy_bw_method": common.COPY_BANDWIDTH_DEFINITION,
        "shape": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "block_size": PAGE, "dtype": "bfloat16"},
        "timing": "triton.testing.do_bench median (L2 flushed before each rep); eager and CUDA-graph replay",
        "cases": [], "split_sweep": [], "tile_sweep": [],
    }
    stem = common.unique_stem(out_dir, f"attention-{result['date_utc'][:10]}-{_slug(props.name)}")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    scale = D ** -0.5
    t0 = time.monotonic()
    for batch in BATCHES:
        for context in CONTEXTS:
            q, k, v, k_cache, v_cache, bt, ctx = make_case(batch, context, gen)
            nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
            # fp32 inputs (exact upcasts of the bf16 ones): the reference's own output is not rounded to bf16
            ref = ref_backend.decode_attention(q.float(), k_cache.float(), v_cache.float(), bt, ctx, scale)

            def row(arm, t, err, extra=None):
                r = {"batch": batch, "context": context, "arm": arm, "bytes": nbytes, "rel_l2": err, **t}
                for key in ("eager", "graph"):
                    gbs = nbytes / (t[f"{key}_us"] * 1e-6) / 1e9
                    r[f"{key}_gbs"] = round(gbs, 1)
                    r[f"{key}_frac_copy"] = round(gbs / copy_gbs, 3)
                r.update(extra or {})
                return r

            for arm, kw in ARMS:
                out = torch.full_like(q, float("nan"))
                counters.reset()
                attn.decode_attention(q, k_cache, v_cache, bt, ctx, scale, max_context_len=context, out=out, **kw)
                torch.cuda.synchronize()
                err = rel_l2(out, ref)
                st = counters.snapshot()["decode_attention"]
                route_stats = next(iter(st.values()))
                splits = int(next(iter(route_stats["splits"])))
                grid = next(iter(route_stats["grids"]))
                t = time_us(lambda: attn.decode_attention(q, k_cache, v_cache, bt, ctx, scale,
                                                          max_context_len=context, out=out, **kw))
                extra = {"route": next(iter(st)), "num_splits": splits, "grid": grid}
                if splits > 1:      # the merge as its own launch, same call otherwise
                    out2 = torch.full_like(q, float("nan"))
                    two = functools.partial(attn.decode_attention, q, k_cache, v_cache, bt, ctx, scale,
                                            max_context_len=context, out=out2, fused_merge=False, **kw)
                    two()
                    torch.cuda.synchronize()
                    extra["bitwise_vs_two_launch"] = torch.equal(out, out2)
                    extra.update({f"two_launch_{key}": us for key, us in time_us(two).items()})
                result["cases"].append(row(arm, t, err, extra))
            q4 = q.view(batch, HQ, 1, D)
            sdpa_out = F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
            err = rel_l2(sdpa_out.view(batch, HQ, D), ref)
            t = time_us(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
            result["cases"].append(row("sdpa(enable_gqa)", t, err))

            if sweeps and (max_seconds is None or time.monotonic() - t0 < max_seconds):
                for gqa_swap in (False, True):
                    for ns in SPLIT_SWEEP:
                        out = torch.empty_like(q)
                        fn = (lambda: attn.decode_attention(q, k_cache, v_cache, bt, ctx, scale, gqa_swap=gqa_swap,
                                                            num_splits=ns, out=out))
                        fn()
                        torch.cuda.synchronize()
                        err = rel_l2(out, ref)
                        t = time_us(fn)
                        result["split_sweep"].append(row("gqa_swap" if gqa_swap else "per_q_head", t, err,
                                                         {"num_splits": ns}))
                if (batch, context) in ((8, 8192), (1, 1024)):
                    for gqa_swap in (False, True):
                        for tiles in TILE_SWEEP:
                            out = torch.empty_like(q)
                            fn = (lambda: attn.decode_attention(q, k_cache, v_cache, bt, ctx, scale,
                                                                gqa_swap=gqa_swap, max_context_len=context,
                                                                tiles=tiles, out=out))
                            fn()
                            torch.cuda.synchronize()
                            err = rel_l2(out, ref)
                            t = time_us(fn)
                            result["tile_sweep"].append(row("gqa_swap" if gqa_swap else "per_q_head", t, err, {
                                "block_n": tiles.block_n, "num_warps": tiles.num_warps,
                                "num_stages": tiles.num_stages}))
            del q, k, v, k_cache, v_cache, bt, ctx, ref
            torch.cuda.empty_cache()
            result["targets"] = evaluate_targets(result)
            paths = write(result, out_dir, stem)
            print(f"attention bench: batch {batch} context {context} done at {time.monotonic() - t0:.0f} s",
                  flush=True)

    result["files"] = paths
    print(summary_table(result))
    return result


EXPLORE_TILES = [attn.Tiles(block_n=bn, num_warps=w, num_stages=st)
                 for bn, w, st in ((64, 4, 1), (64, 4, 2), (64, 4, 3), (128, 4, 1), (128, 4, 2), (128, 8, 2))]
EXPLORE_SPLITS = (1, 2, 4, 8, 16, 32, 64)


def graph_us(fn, warmup_ms: int = 10, rep_ms: int = 30) -> float:
    return triton.testing.do_bench(common.captured(fn), warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e3


def explore(out_dir: str, max_seconds: float | None = None) -> dict:
    """Tuning data: graph-replay time of every (route, tiles, forced split count) at every bench shape, and the
    host time of one eager launcher call. Picks the tiles and programs_per_sm the launcher defaults use."""
    from vtengine.backends.torch_backend import TorchBackend
    ref_backend = TorchBackend()
    copy_gbs = common.copy_bandwidth_gbs()
    res = {"device": torch.cuda.get_device_properties(0).name, "torch": torch.__version__,
           "triton": triton.__version__, "copy_bw_gbs": round(copy_gbs, 1),
           "copy_bw_method": common.COPY_BANDWIDTH_DEFINITION,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "rows": [], "host_us": {}}
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    scale = D ** -0.5
    t0 = time.monotonic()
    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    stem = common.unique_stem(out_path, f"attention-explore-{res['date_utc'][:10]}-{_slug(res['device'])}")
    for batch in BATCHES:
        for context in CONTEXTS:
            if max_seconds is not None and time.monotonic() - t0 > max_seconds:
                break
            q, k, v, k_cache, v_cache, bt, ctx = make_case(batch, context, gen)
            nbytes = 2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size()
            ref = ref_backend.decode_attention(q.float(), k_cache.float(), v_cache.float(), bt, ctx, scale)
            out = torch.empty_like(q)
            for gqa_swap in (False, True):
                for tiles in EXPLORE_TILES:
                    for ns in EXPLORE_SPLITS:
                        def fn():
                            attn.decode_attention(q, k_cache, v_cache, bt, ctx, scale, gqa_swap=gqa_swap,
                                                  num_splits=ns, tiles=tiles, out=out)
                        out.fill_(float("nan"))
                        fn()
                        torch.cuda.synchronize()
                        err = rel_l2(out, ref)
                        us = graph_us(fn)
                        res["rows"].append({"batch": batch, "context": context, "gqa_swap": gqa_swap,
                                            "block_n": tiles.block_n, "num_warps": tiles.num_warps,
                                            "num_stages": tiles.num_stages, "num_splits": ns,
                                            "graph_us": round(us, 2), "rel_l2": err,
                                            "frac_copy": round(nbytes / (us * 1e-6) / 1e9 / copy_gbs, 3)})
            for gqa_swap in (False, True):
                def call():
                    attn.decode_attention(q, k_cache, v_cache, bt, ctx, scale, gqa_swap=gqa_swap,
                                          max_context_len=context, out=out)
                call()
                torch.cuda.synchronize()
                h0 = time.perf_counter()
                for _ in range(100):
                    call()
                host = (time.perf_counter() - h0) / 100 * 1e6
                torch.cuda.synchronize()
                res["host_us"][f"b{batch}_ctx{context}_{'gqa_swap' if gqa_swap else 'per_q_head'}"] = round(host, 1)
            del q, k, v, k_cache, v_cache, bt, ctx, ref
            torch.cuda.empty_cache()
            (out_path / f"{stem}.json").write_text(json.dumps(res, indent=0) + "\n")
            print(f"explore: batch {batch} context {context} done at {time.monotonic() - t0:.0f} s", flush=True)
    return res


def evaluate_targets(result: dict) -> dict:
    """DESIGN.md section 8: >= 80% of copy bandwidth at batch >= 8, context >= 4096 (graph timing, best of our
    lever arms and of each arm at its default); faster than SDPA at batch 1, context 1024."""
    ours = [c for c in result["cases"] if c["arm"] != "sdpa(enable_gqa)"]
    big = {}
    for c in ours:
        if c["batch"] >= 8 and c["context"] >= 4096:
            key = f"b{c['batch']}_ctx{c['context']}"
            if key not in big or c["graph_frac_copy"] > big[key]["graph_frac_copy"]:
                big[key] = {"arm": c["arm"], "graph_frac_copy": c["graph_frac_copy"]}
    small = [c for c in result["cases"] if c["batch"] == 1 and c["context"] == 1024]
    sdpa = [c for c in small if c["arm"] == "sdpa(enable_gqa)"]
    mine = [c for c in small if c["arm"] != "sdpa(enable_gqa)"]
    if sdpa and mine:
        best = min(mine, key=lambda c: c["graph_us"])
        vs_sdpa = {"met": best["graph_us"] < sdpa[0]["graph_us"], "ours_arm": best["arm"],
                   "ours_graph_us": best["graph_us"], "sdpa_graph_us": sdpa[0]["graph_us"],
                   "ours_eager_us": best["eager_us"], "sdpa_eager_us": sdpa[0]["eager_us"]}
    else:
        vs_sdpa = {"met": None, "ours_arm": "not measured", "ours_graph_us": None, "sdpa_graph_us": None,
                   "ours_eager_us": None, "sdpa_eager_us": None}
    return {
        "bw_80pct_at_b8plus_ctx4096plus": {"met": bool(big) and all(v["graph_frac_copy"] >= 0.8
                                                                    for v in big.values()),
                                           "best_per_shape": big},
        "beats_sdpa_b1_ctx1024": vs_sdpa,
    }


def summary_table(result: dict) -> str:
    lines = [f"# Decode attention, {result['device']} ({result['sm_count']} SMs), torch {result['torch']}, "
             f"triton {result['triton']}, {result['date_utc']}",
             "",
             f"Copy bandwidth ({result.get('copy_bw_method', OLD_COPY_BW_METHOD)}): {result['copy_bw_gbs']} GB/s. "
             "32 q / 8 kv heads, d=128, bf16, block_size 16. Times: do_bench median, L2 flushed per rep.",
             "",
             "Arms merge split outputs inside stage 1 (one launch); 'graph µs, 2 launches' is the same call with the "
             "merge as a second launch, and '= 2 launches' whether the two outputs are bitwise equal.",
             "",
             "| batch | context | arm | splits | grid | eager µs | graph µs | GB/s (graph) | % of copy (graph) "
             "| rel L2 | graph µs, 2 launches | = 2 launches |",
             "|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in result["cases"]:
        same = {True: "yes", False: "NO", None: ""}[c.get("bitwise_vs_two_launch")]
        lines.append(f"| {c['batch']} | {c['context']} | {c['arm']} | {c.get('num_splits', '')} | "
                     f"{c.get('grid', '')} | {c['eager_us']} | {c['graph_us']} | {c['graph_gbs']} | "
                     f"{100 * c['graph_frac_copy']:.1f} | {c['rel_l2']:.2e} | {c.get('two_launch_graph_us', '')} | "
                     f"{same} |")
    if result["split_sweep"]:
        lines += ["", "## Forced split counts (graph µs)", "",
                  "| batch | context | route | " + " | ".join(f"S={s}" for s in SPLIT_SWEEP) + " |",
                  "|---:|---:|---|" + "---:|" * len(SPLIT_SWEEP)]
        keys = sorted({(c["batch"], c["context"], c["arm"]) for c in result["split_sweep"]})
        for b, ctx, route in keys:
            cells = {c["num_splits"]: c["graph_us"] for c in result["split_sweep"]
                     if (c["batch"], c["context"], c["arm"]) == (b, ctx, route)}
            lines.append(f"| {b} | {ctx} | {route} | " + " | ".join(str(cells.get(s, "")) for s in SPLIT_SWEEP)
                         + " |")
    if result["tile_sweep"]:
        lines += ["", "## Tile sweep at the heuristic's split count (graph µs, % of copy)", "",
                  "| batch | context | route | BLOCK_N | warps | stages | graph µs | % of copy |",
                  "|---:|---:|---|---:|---:|---:|---:|---:|"]
        for c in result["tile_sweep"]:
            lines.append(f"| {c['batch']} | {c['context']} | {c['arm']} | {c['block_n']} | {c['num_warps']} | "
                         f"{c['num_stages']} | {c['graph_us']} | {100 * c['graph_frac_copy']:.1f} |")
    t = result["targets"]
    lines += ["", "## Targets (DESIGN.md section 8)", "",
              f"- >= 80% of copy bandwidth at batch >= 8, context >= 4096: "
              f"{'MET' if t['bw_80pct_at_b8plus_ctx4096plus']['met'] else 'MISSED'} "
              f"({json.dumps(t['bw_80pct_at_b8plus_ctx4096plus']['best_per_shape'])})",
              f"- faster than SDPA at batch 1, context 1024: "
              f"{ {True: 'MET', False: 'MISSED', None: 'NOT MEASURED'}[t['beats_sdpa_b1_ctx1024']['met']]} "
              f"(ours {t['beats_sdpa_b1_ctx1024']['ours_arm']} {t['beats_sdpa_b1_ctx1024']['ours_graph_us']} µs "
              f"vs SDPA {t['beats_sdpa_b1_ctx1024']['sdpa_graph_us']} µs, graph; eager "
              f"{t['beats_sdpa_b1_ctx1024']['ours_eager_us']} vs {t['beats_sdpa_b1_ctx1024']['sdpa_eager_us']} µs)"]
    return "\n".join(lines) + "\n"


def _slug(device: str) -> str:
    return "".join(ch for ch in device.lower().replace("nvidia", "") if ch.isalnum()) or "gpu"


def write(result: dict, out_dir: str, stem: str) -> list[str]:
    """The run's JSON and Markdown under ``stem`` (chosen once per run: main rewrites them after every shape)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(summary_table(result))
    return [str(out / f"{stem}.json"), str(out / f"{stem}.md")]


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out_dir = args[0] if args else "bench/results"
    budget = float(args[1]) if len(args) > 1 else None
    if "--explore" in sys.argv:
        explore(out_dir, max_seconds=budget)
    else:
        main(out_dir, max_seconds=budget)
