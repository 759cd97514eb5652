"""Does a weight asked of L2 ahead of its GEMV make that GEMV faster? (the o_prefetch experiment)

    python -m vtengine.bench.l2_prefetch OUT_DIR

The decode step's window is imitated by a device-side spin (``torch.cuda._sleep``, ~12 us: the qkv epilogue and
the decode attention of one sequence, which leave DRAM idle), then the o projection's GEMV (bf16 4096 x 4096, the
Triton GEMV the engine runs at M = 1). One CUDA graph holds ``SETS`` such iterations over different weights (201 MB,
four times an H200's L2), so each GEMV starts with its weight out of L2 unless the prefetch put it there. Per mode:

- ``spin``: the spin alone; ``gemv``: the GEMV alone; ``none``: spin, then GEMV;
- ``<mode>``: prefetch (l2_prefetch.MODES), spin, GEMV; ``<mode> only``: prefetch and spin, no GEMV.

The GEMV's time after a prefetch = t(<mode>) - t(<mode> only); without one, t(none) - t(spin). Figures are graph
replays timed with CUDA events, median of REPS replays, per iteration.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from vtengine.bench import common

SETS = 6
REPS = 30
SPIN_US = 12.0                  # the qkv epilogue (~3.5 us) and the decode attention (~9 us) at c1
SHAPE = (4096, 4096)            # bf16 Qwen3-8B o_proj: N, K


def _graph(fn):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                    # warm-up: compiles every kernel before capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _time_us(g, iters: int) -> float:
    return common.graph_us(g, iters, REPS)


def spin_cycles_for(us: float, probe_cycles: int = 200_000) -> int:
    """Cycles of ``torch.cuda._sleep`` that spin about ``us`` microseconds, timed here: NVML's clock reading is the
    idle clock (345 MHz on the H200 of 2026-12-04, so a spin sized from it lasted 3.3 us instead of 10)."""
    g = _graph(lambda: torch.cuda._sleep(probe_cycles))
    return max(1, int(probe_cycles * us / _time_us(g, 1)))


def main(out_dir: str) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("vtengine.bench.l2_prefetch needs a CUDA GPU")
    from vtengine.kernels import gemv, l2_prefetch
    env = common.cuda_env()
    t0 = time.time()
    spin_cycles = spin_cycles_for(SPIN_US)
    n, k = SHAPE
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(1, n, device="cuda", dtype=torch.bfloat16) for _ in range(SETS)]
    rows = {}

    def run(mode: str | None, spin: bool, gemv_on: bool, pdl: bool):
        def fn():
            for w, y in zip(ws, outs):
                if mode is not None:
                    l2_prefetch.prefetch(w, pdl=pdl, mode=mode)
                if spin:
                    torch.cuda._sleep(spin_cycles)
                if gemv_on:
                    gemv.linear(x, w, triton_gemv=True, pdl=pdl, out=y)
        return _time_us(_graph(fn), SETS)

    for pdl in (False, True):
        tag = "pdl" if pdl else "plain"
        r = {"spin": run(None, True, False, pdl), "gemv": run(None, False, True, pdl),
             "none": run(None, True, True, pdl)}
        for mode in l2_prefetch.MODES:
            try:
                r[mode] = run(mode, True, True, pdl)
                r[f"{mode} only"] = run(mode, True, False, pdl)
            except Exception as e:              # a mode the device refuses is reported, not fatal
                r[f"{mode} error"] = common.error_text(e)
        rows[tag] = r
        print(json.dumps({tag: r}), file=sys.stderr, flush=True)
    result = dict(env=env, shape=SHAPE, sets=SETS, reps=REPS, spin_us=SPIN_US, spin_cycles=spin_cycles,
                  weight_mb=n * k * 2 / 1e6, rows=rows, wall_s=time.time() - t0)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    common.write_result(out, common.unique_stem(out, f"l2-prefetch-{env['date']}"), result, markdown(result))
    return result


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# L2 prefetch ahead of the o GEMV — {env['device']} ({env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; L2 {env['l2_mb']:.0f} MB. "
             f"Weight {result['weight_mb']:.1f} MB bf16 {result['shape'][0]} x {result['shape'][1]}, M = 1, "
             f"{result['sets']} weights in turn per graph, a spin of {result['spin_us']} us asked (the spin column is "
             f"what it took); median of "
             f"{result['reps']} replays, us per iteration.", "",
             "| launch | spin | gemv alone | spin + gemv | mode | prefetch + spin + gemv | prefetch + spin | "
             "gemv after prefetch | gemv without |", "|---|---|---|---|---|---|---|---|---|"]
    for tag, r in result["rows"].items():
        without = r["none"] - r["spin"]
        for mode in ("line", "bulk", "load"):
            if mode not in r:
                lines.append(f"| {tag} | | | | {mode} | {r.get(f'{mode} error', 'not run')} | | | |")
                continue
            after = r[mode] - r[f"{mode} only"]
            lines.append(f"| {tag} | {r['spin']:.2f} | {r['gemv']:.2f} | {r['none']:.2f} | {mode} | {r[mode]:.2f} | "
                         f"{r[f'{mode} only']:.2f} | {after:.2f} | {without:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m vtengine.bench.l2_prefetch OUT_DIR")
    print(markdown(main(sys.argv[1])))
