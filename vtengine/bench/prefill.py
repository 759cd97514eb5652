"""``vtengine bench prefill``: one prefill step of N new tokens over a cached prefix of P tokens, timed and profiled.

Question it answers: does a chunk's cost follow its own tokens (N) or the prefix it attends to (P)? On the H200
(2026-12-01, bench/results/long-context-notes-2026-12-01.md) a 2,048-token chunk at a ~30k context took ~360 ms and an
8,192-token one ~500 ms, so chunked prefill lost 3x of its throughput; this isolates one step from the serving loop.

For every prefix and chunk: a sequence of P + N random tokens is allocated in the engine's KV pool, its prefix is
prefilled once (in steps of at most ``max_num_batched_tokens``), then the step that computes tokens P .. P + N - 1
over the cached prefix is run ``reps`` times (each rewrites the same K/V slots), synchronised around each run; the
median is the figure. With ``--profile`` one more run goes under torch.profiler and its kernels are tabled
(vtengine/bench/decode/kernel_profile.py's aggregation: device kernels on a GPU, CPU ops on a CPU).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vtengine.bench.common import error_text, free_memory, quiet_profiler, synchronize
from vtengine.bench.decode.engine_timing import random_prompts
from vtengine.bench.decode.kernel_profile import kernel_table
from vtengine.bench.decode.report import unique_stem

TOP_KERNELS = 12


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vtengine bench prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--quant", default="bf16")
    ap.add_argument("--prefixes", default="0,30000", help="cached prefix lengths P, comma-separated")
    ap.add_argument("--chunks", default="512,2048,8192", help="new tokens N per step, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="one more run of each step under torch.profiler")
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--device", default=None, help="cuda (default when present) or cpu (tests)")
    ap.add_argument("--backend", default=None)
    return ap


def _ints(text: str, flag: str, minimum: int) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < minimum for v in values):
        raise ValueError(f"{flag} expects comma-separated integers >= {minimum}, got {text!r}")
    return values


def _step(runner, seq, start: int, n: int) -> None:
    """Compute tokens start .. start + n - 1 of ``seq`` over its cached tokens 0 .. start - 1."""
    seq.num_cached_tokens, seq.num_new_tokens, seq.in_prefill = start, n, True
    with torch.inference_mode():
        runner._logits([seq], True)


def measure(llm, prefix: int, chunk: int, reps: int, profile: bool) -> dict:
    """The figures of one (prefix, chunk) step on a built engine (which must be idle); frees its blocks after."""
    from vtengine.engine.sampling_params import SamplingParams
    from vtengine.engine.sequence import Sequence
    eng = llm.engine
    tokens = random_prompts(1, prefix + chunk, eng.model_config.vocab_size)[0]
    seq = Sequence(f"prefill-{prefix}-{chunk}", tokens, SamplingParams(max_tokens=1), eng.config.block_size)
    if prefix + chunk > eng.max_seq_tokens or not eng.block_manager.can_allocate(seq):
        raise ValueError(f"prefix {prefix} + chunk {chunk} tokens do not fit this engine (at most "
                         f"{eng.max_seq_tokens} tokens, {eng.block_manager.num_free} free blocks)")
    eng.block_manager.allocate(seq)
    try:
        for start in range(0, prefix, eng.max_num_batched_tokens):          # the prefix, cached once
            _step(eng.runner, seq, start, min(eng.max_num_batched_tokens, prefix - start))
        _step(eng.runner, seq, prefix, chunk)                                 # warm-up (compiles, allocations)
        times = []
        for _ in range(reps):
            synchronize(eng.device)
            t0 = time.perf_counter()
            _step(eng.runner, seq, prefix, chunk)
            synchronize(eng.device)
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        row = {"prefix": prefix, "chunk": chunk, "reps": reps, "ms": ms, "ms_all": [1e3 * t for t in times],
               "us_per_token": 1e3 * ms / chunk}
        row["phases_ms"] = _phases(eng, seq, prefix, chunk)
        if profile:
            row["kernels"], row["host_ops"], row["profiled_ms"] = _profile(eng, seq, prefix, chunk)
        return row
    finally:
        eng.block_manager.free(seq)


def _phases(eng, seq, prefix: int, chunk: int) -> dict[str, float]:
    """One step cut where the host hands over: inputs built (prepare), every kernel queued (launch: the forward
    and the logits, host time while the device runs behind), then the wait for the device (wait)."""
    runner = eng.runner
    seq.num_cached_tokens, seq.num_new_tokens, seq.in_prefill = prefix, chunk, True
    synchronize(eng.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        ids, pos, ctx = runner.prepare_prefill([seq])
        t1 = time.perf_counter()
        hidden = runner.model.forward(ids, pos, ctx, runner.kv_caches)
        if ctx.last_token_idx.numel():
            runner.model.logits(hidden)
        t2 = time.perf_counter()
        synchronize(eng.device)
        t3 = time.perf_counter()
    return {"prepare": round(1e3 * (t1 - t0), 3), "launch": round(1e3 * (t2 - t1), 3),
            "wait": round(1e3 * (t3 - t2), 3)}


def _profile(eng, seq, prefix: int, chunk: int) -> tuple[list[dict], list[dict], float]:
    """(top device kernels, top host operations by self time, the profiled step's wall ms): a step much longer than
    its kernels spends the difference on the host, and the host table says where."""
    from torch.profiler import ProfilerActivity, profile
    quiet_profiler()
    on_device = eng.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        _step(eng.runner, seq, prefix, chunk)
        synchronize(eng.device)
        wall_ms = 1e3 * (time.perf_counter() - t0)
    host = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_KERNELS]
    host_ops = [{"op": e.key, "self_us": round(e.self_cpu_time_total, 1), "calls": e.count} for e in host]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "trace.json")
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    rows = kernel_table(events, 1, on_device)
    kernels = [{"kernel": r.kernel, "us": r.us_per_step, "launches": r.launches_per_step} for r in rows[:TOP_KERNELS]]
    return kernels, host_ops, round(wall_ms, 2)


def markdown(result: dict) -> str:
    lines = [f"# prefill steps over a cached prefix — {result['device']}, torch {result['torch']}, {result['date']}",
             "", f"{result['model']} ({result['quant']}), levers {result['levers']}; one step of N new tokens over a "
             f"cached prefix of P tokens, median of {result['reps']} synchronised runs; one more run cut into "
             "host phases (prepare inputs / queue every kernel / wait for the device).", "",
             "| prefix P | chunk N | ms | µs per new token | prepare ms | launch ms | wait ms |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ph = r.get("phases_ms", {})
        lines.append(f"| {r['prefix']} | {r['chunk']} | " + (
            f"{r['ms']:.2f} | {r['us_per_token']:.1f} | {ph.get('prepare', '')} | {ph.get('launch', '')} | "
            f"{ph.get('wait', '')} |" if "ms" in r else f"error: {r['error']} | | | | |"))
    for r in result["rows"]:
        if r.get("kernels"):
            lines += ["", f"## P = {r['prefix']}, N = {r['chunk']}: top kernels (one profiled run)", "",
                      "| kernel | µs | launches |", "|---|---|---|"]
            lines += [f"| `{k['kernel']}` | {k['us']:.1f} | {k['launches']:.0f} |" for k in r["kernels"]]
            lines += ["", f"Host operations by self time (the profiled step took {r['profiled_ms']:.1f} ms):", "",
                      "| operation | self µs | calls |", "|---|---|---|"]
            lines += [f"| `{h['op']}` | {h['self_us']:.1f} | {h['calls']} |" for h in r["host_ops"]]
    return "\n".join(lines) + "\n"


def main(out_dir: str = "bench/results", argv: list[str] | None = None) -> int:
    """Run it; writes OUT_DIR/prefill-<date>.json and .md (and copies both to $OUT when set)."""
    args = build_parser().parse_args(argv or [])
    prefixes = _ints(args.prefixes, "--prefixes", 0)
    chunks = _ints(args.chunks, "--chunks", 1)
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    levers = dict(p.split("=", 1) for p in args.lever)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from vtengine.engine.llm import LLM
    kw = dict(gpu_memory_utilization=0.85) if device == "cuda" else dict(num_kv_blocks=max(64, 2 * (
        max(prefixes) + max(chunks)) // 16))
    llm = LLM(model=args.model, quant=args.quant, levers=levers, device=device, backend=args.backend,
              max_num_seqs=1, max_model_len=max(prefixes) + max(chunks), cuda_graphs=False, **kw)
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__,
              "python": platform.python_version(), "date": datetime.date.today().isoformat(), "model": args.model,
              "quant": args.quant, "levers": levers, "reps": args.reps, "argv": list(argv or []), "rows": []}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = unique_stem(out, f"prefill-{result['date']}")
    for p in prefixes:
        for n in chunks:
            try:
                row = measure(llm, p, n, args.reps, args.profile)
                print(f"prefix {p} chunk {n}: {row['ms']:.2f} ms ({row['us_per_token']:.1f} us per new token)",
                      flush=True)
            except Exception as e:                      # recorded, and the other steps still run
                row = {"prefix": p, "chunk": n, "error": error_text(e)}
                print(f"prefix {p} chunk {n}: error {row['error']}", flush=True)
            result["rows"].append(row)
            (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
            (out / f"{stem}.md").write_text(markdown(result))
    if os.environ.get("OUT"):
        for suffix in (".json", ".md"):
            Path(os.environ["OUT"], stem + suffix).write_text((out / f"{stem}{suffix}").read_text())
    llm = None
    free_memory()
    return 0
