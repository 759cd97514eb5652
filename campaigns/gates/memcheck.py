"""memcheck: compute-sanitizer's memcheck over a short engine run in this arm's setting must report 0 errors.

CUDA only (skipped elsewhere, with the reason). The run happens in a child process (``python -m
campaigns.gates.memcheck_target``) with the PyTorch caching allocator off, so every tensor is its own allocation and
an out-of-bounds access lands outside one. Fault: the same child runs a Triton kernel that writes past the end of
its output; memcheck must report it.
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
    cfg = ctx.gate_cfg.memcheck
    model = cfg.get("model") or ctx.model
    spec = {"model": model, "quant": ctx.quant, "levers": ctx.lever_values(arm),
            "max_tokens": int(cfg.max_tokens), "fault": bool(fault)}
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    cmd = [tool, "--tool", "memcheck", "--print-limit", "20", sys.executable, "-m",
           "campaigns.gates.memcheck_target", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=int(cfg.timeout_s), env=env)
    except subprocess.TimeoutExpired:
        return result("memcheck", arm, False, t0, details={"error": f"timed out after {cfg.timeout_s} s",
                                                           "fault": "planted OOB write" if fault else ""})
    text = proc.stdout + proc.stderr
    m = SUMMARY.search(text)
    errors = int(m.group(1)) if m else -1
    ran = "MEMCHECK_TARGET_DONE" in text or fault
    passed = errors == 0 and proc.returncode == 0 and ran
    return result("memcheck", arm, passed, t0, counts={"errors": errors, "returncode": proc.returncode},
                  details={"model": model, "tail": text[-1500:], "fault": "planted OOB write" if fault else ""})
