"""The greedy argmax over Qwen3's vocabulary: split rows against one program a row and torch, and the byte floor

    python -m vtengine.bench.argmax OUT_DIR

Per batch size B (fp32 logits [B, 151936], as the engine's LM head leaves them): the engine's argmax at its split
(``fused.argmax_splits`` at this device's SMs), the same kernel with one program a row (the kernel until 2026-12-06:
``num_sms=1`` gives S = 1 at every B), and ``torch.argmax``. Each is first checked against torch on logits with a
tie planted across a slice boundary, then timed: one CUDA graph of ``CALLS`` launches over the same logits (L2-warm,
as the LM head has just written them), median of ``REPS`` replays, us per launch. The floor is the logits' bytes
over the copy bandwidth measured in the run (an L2-warm read can beat it at small B).

A second table sweeps the split rule's target: the same kernel at the split ``argmax_splits`` picks for K programs per
SM (``num_sms`` = K x SMs) for K in ``PER_SM``; K = 1 is the engine's rule. One program per SM keeps only its own
loads in flight (the H200 run of 2026-12-06: S = 2 at B = 64 no faster than S = 1, and slower than torch), so the
table says which K the rule should aim for.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from vtengine.bench import common

VOCAB = 151936
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CALLS = 20
REPS = 30
FORMS = ("split", "one program a row", "torch.argmax")
PER_SM = (1, 2, 4, 8)


def _forms(out: torch.Tensor):
    from vtengine.kernels import fused
    return {"split": lambda lg: fused.argmax(lg, out=out),
            "one program a row": lambda lg: fused.argmax(lg, out=out, num_sms=1),
            "torch.argmax": lambda lg: torch.argmax(lg, dim=-1, out=out)}


def _per_sm(out: torch.Tensor, k: int, sms: int):
    from vtengine.kernels import fused
    return lambda lg: fused.argmax(lg, out=out, num_sms=k * sms)


def _us_per_call(fn, lg: torch.Tensor) -> float:
    fn(lg)                                              # compiles, and allocates the argmax's buffers, eagerly
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS):
            fn(lg)
    return common.graph_us(g, CALLS, REPS)


def main(out_dir: str, batches=BATCHES) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("vtengine.bench.argmax needs a CUDA GPU")
    from vtengine.kernels import fused, sm_count
    env = common.cuda_env()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = common.unique_stem(out, f"argmax-{env['date']}")
    t0 = time.time()
    gbs = common.copy_bandwidth_gbs()
    result = dict(env=env, vocab=VOCAB, calls=CALLS, reps=REPS, copy_gbs=gbs, rows=[])
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = sm_count()
    for b in batches:
        lg = torch.randn(b, VOCAB, device="cuda", generator=gen) * 5
        edge = fused.ARGMAX_SPLIT_BLOCK
        lg[0, edge - 1] = lg[0, edge] = 100.0           # a tie across the first slice boundary: the lower wins
        ids = torch.empty(b, dtype=torch.int64, device="cuda")
        want = torch.argmax(lg, dim=-1)
        row = dict(batch=b, splits=fused.argmax_splits(b, VOCAB, sms), floor_us=b * VOCAB * 4 / gbs / 1e3,
                   per_sm={})
        forms = dict(_forms(ids))
        for k in PER_SM:
            forms[f"x{k}"] = _per_sm(ids, k, sms)
        for name, fn in forms.items():
            ids.fill_(-1)
            fn(lg)
            if not torch.equal(ids, want):
                row[f"{name} error"] = f"ids differ from torch.argmax in {int((ids != want).sum())} of {b} rows"
                continue
            us = _us_per_call(fn, lg)
            if name in FORMS:
                row[name] = us
            else:
                k = int(name[1:])
                row["per_sm"][str(k)] = dict(splits=fused.argmax_splits(b, VOCAB, k * sms), us=us)
        result["rows"].append(row)
        result["wall_s"] = time.time() - t0
        common.write_result(out, stem, result, markdown(result))
        print(row, file=sys.stderr, flush=True)
    return result


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# Greedy argmax over {result['vocab']:,} logits — {env['device']} ({env['date']})", "",
             f"torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}; {env['sms']} SMs; copy bandwidth "
             f"{result['copy_gbs']:,.0f} GB/s (measured in the run). fp32 logits, L2-warm; median of "
             f"{result['reps']} replays of a CUDA graph of {result['calls']} launches, us per launch. Split: the "
             "engine's argmax; one program a row: the same kernel at S = 1 (the kernel until 2026-12-06).", "",
             "| B | S | split us | one program a row us | torch.argmax us | split speed-up | split vs torch | "
             "floor us | split % of floor |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        cells = [str(r["batch"]), str(r["splits"])]
        cells += [f"{r[f]:.2f}" if f in r else r.get(f"{f} error", "not run") for f in FORMS]
        split, one, ref = (r.get(f) for f in FORMS)
        cells.append(f"x{one / split:.2f}" if split and one else "")
        cells.append(f"x{ref / split:.2f}" if split and ref else "")
        cells.append(f"{r['floor_us']:.2f}")
        cells.append(f"{100 * r['floor_us'] / split:.0f}%" if split else "")
        lines.append("| " + " | ".join(cells) + " |")
    swept = [r for r in result["rows"] if "per_sm" in r]
    if swept:
        erred = {int(key[1:-len(" error")]) for r in swept for key in r if key[:1] == "x" and key.endswith(" error")}
        ks = sorted({int(k) for r in swept for k in r["per_sm"]} | erred)
        lines += ["", "The split rule's target swept: S the rule picks for K programs per SM, and its time (us per "
                  "launch); K = 1 is the engine's rule. Best: the fastest K (the smallest within 2% of the fastest).",
                  "", "| B | " + " | ".join(f"K = {k}: S, us" for k in ks) + " | best K | best vs K = 1 |",
                  "|---|" + "---|" * len(ks) + "---|---|"]
        for r in swept:
            got = {int(k): v for k, v in r["per_sm"].items()}
            cells = [str(r["batch"])]
            for k in ks:
                cells.append(f"{got[k]['splits']}, {got[k]['us']:.2f}" if k in got
                             else r.get(f"x{k} error", "not run"))
            fastest = min(v["us"] for v in got.values()) if got else None
            best = min(k for k, v in got.items() if v["us"] <= 1.02 * fastest) if got else None
            cells.append(str(best) if best else "")
            cells.append(f"x{got[1]['us'] / got[best]['us']:.2f}" if best and 1 in got else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m vtengine.bench.argmax OUT_DIR")
    print(markdown(main(sys.argv[1])))
