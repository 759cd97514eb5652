"""memcheck: compute-sanitizer's memcheck over a short engine run in this arm's setting must report 0 errors.

CUDA only (skipped elsewhere, with the reason). The run happens in a child process (``python -m
campaigns.gates.memcheck_target``) with the PyTorch caching allocator off, so every tensor is its own allocation and
an out-of-bounds access lands outside one. Fault: the same engine run with decode attention reading through block
table entries far past the end of the KV cache (vtengine/faults.py ``oob``); memcheck must report it. A campaign's
runs (each arm, clean and faulted) start side by side when the first is asked for (campaign_runs).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from campaigns.gates import GateContext, result, skipped
from campaigns.evidence import Arm, GateResult

SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")


def sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/compute-sanitizer", "/opt/nvidia/compute-sanitizer/compute-sanitizer"):
        if os.path.exists(cand):
            return cand
    return None


def run(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    if ctx.device != "cuda":
        return skipped("memcheck", arm, "compute-sanitizer needs a CUDA device; this host has none")
    tool = sanitizer()
    if tool is None:
        return skipped("memcheck", arm, "compute-sanitizer is not installed on this host")
    t0 = time.perf_counter()
    model = ctx.gate_cfg.memcheck.get("model") or ctx.model
    out = campaign_runs(ctx, tool).get((arm.name, bool(fault))) or _sanitize_arm(ctx, tool, arm, bool(fault))
    fault_name = "engine run with decode attention reading past the KV cache (oob)" if fault else ""
    if "error" in out:
        # a clean run that did not finish fails; a faulted one that did not finish caught nothing (passed=True: not
        # caught), since only memcheck's own report of the access shows the gate can fail
        return result("memcheck", arm, bool(fault), t0, details={"error": out["error"], "fault": fault_name})
    # the faulted run counts as caught only when memcheck itself reports the access, not when the run merely crashed
    passed = out["errors"] <= 0 if fault else out["passed"]
    return result("memcheck", arm, passed, t0,
                  counts={"errors": out["errors"], "returncode": out["returncode"]},
                  details={"model": model, "tail": out["tail"], "fault": fault_name,
                           "sanitized_run_s": out.get("seconds")})


def _sanitize_arm(ctx: GateContext, tool: str, arm: Arm, fault: bool) -> dict:
    cfg = ctx.gate_cfg.memcheck
    t0 = time.perf_counter()
    out = sanitize(tool, {"model": cfg.get("model") or ctx.model, "quant": ctx.quant,
                          "levers": ctx.lever_values(arm), "max_tokens": int(cfg.max_tokens), "fault": fault},
                   int(cfg.timeout_s))
    return {**out, "seconds": round(time.perf_counter() - t0, 1)}


def campaign_runs(ctx: GateContext, tool: str) -> dict[tuple[str, bool], dict]:
    """Every sanitized run the campaign's memcheck gates need (each arm clean, and faulted when self-checks are on),
    started side by side the first time one is asked for: each is its own process on a small model, and run one
    after another they took 75-98 s apiece on MXFP4 (H200, 2026-12-02), most of an MXFP4 campaign's gate time.
    Keyed by (arm name, fault); each result holds its own wall time."""
    from concurrent.futures import ThreadPoolExecutor
    key = "memcheck:runs"
    if key not in ctx.cache:
        faults = (False, True) if ctx.gate_cfg.get("self_check", True) else (False,)
        wanted = [(arm, fault) for arm in ctx.arms for fault in faults]
        # side by side only on the small model the gate config names; the campaign's own (8B) would hold its
        # weights four times over beside the engines the campaign keeps
        workers = len(wanted) if ctx.gate_cfg.memcheck.get("model") else 1
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {(arm.name, fault): pool.submit(_sanitize_arm, ctx, tool, arm, fault) for arm, fault in wanted}
        ctx.cache[key] = {k: f.result() for k, f in futures.items()}
    return ctx.cache[key]


def sanitize(tool: str, spec: dict, timeout_s: int) -> dict:
    """Run memcheck_target under compute-sanitizer: {passed, errors, returncode, tail} or {error}."""
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [tool, "--tool", "memcheck", "--print-limit", "20", sys.executable, "-m",
           "campaigns.gates.memcheck_target", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    text = proc.stdout + proc.stderr
    m = SUMMARY.search(text)
    errors = int(m.group(1)) if m else -1
    ran = "MEMCHECK_TARGET_DONE" in text
    return {"passed": errors == 0 and proc.returncode == 0 and ran, "errors": errors, "completed": ran,
            "returncode": proc.returncode, "tail": text[-1500:]}


def main(argv: list[str] | None = None) -> int:
    """``python -m campaigns.gates.memcheck MODEL QUANT [LEVER=VALUE ...]``: the gate outside a campaign (the
    engine run, then the planted fault, which must be caught); prints one JSON line per run, exit 0 when the run is
    clean and the fault was caught."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m campaigns.gates.memcheck")
    ap.add_argument("model")
    ap.add_argument("quant")
    ap.add_argument("levers", nargs="*", metavar="LEVER=VALUE")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout-s", type=int, default=900)
    args = ap.parse_args(argv)
    tool = sanitizer()
    if tool is None:
        print("compute-sanitizer is not installed on this host")
        return 2
    levers = dict(kv.split("=", 1) for kv in args.levers)
    ok = True
    for fault in (False, True):
        t0 = time.perf_counter()
        out = sanitize(tool, {"model": args.model, "quant": args.quant, "levers": levers,
                              "max_tokens": args.max_tokens, "fault": fault}, args.timeout_s)
        # the clean run must pass; the faulted one must have memcheck report errors
        ok &= "error" not in out and (out.get("errors", 0) > 0 if fault else out.get("passed", False))
        print(json.dumps({"model": args.model, "quant": args.quant, "levers": levers, "fault": fault,
                          "seconds": round(time.perf_counter() - t0, 1), **out}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
