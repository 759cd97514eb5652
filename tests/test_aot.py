"""The engine's kernels compile for sm_90 on a host without a GPU (vtengine/kernels/aot.py): every kernel the
engine launches is specialized as on an H200 and compiled to cubin, and what the interpreter cannot see (PTX that
ptxas refuses, shared memory past one block's limit) fails the check."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vtengine.kernels import aot

ROOT = Path(__file__).resolve().parent.parent


def run_aot(tmp_path: Path, *args: str) -> tuple[int, dict, str]:
    out = tmp_path / "aot.json"
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "vtengine.kernels.aot", "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    report = json.loads(out.read_text()) if out.is_file() else {}
    return proc.returncode, report, proc.stdout + proc.stderr[-4000:]


def engine_kernels() -> set[str]:
    """Every @triton.jit kernel (a ``_..._kernel`` function) in vtengine/kernels/."""
    out = set()
    for path in (ROOT / "vtengine" / "kernels").glob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("_") and node.name.endswith("_kernel"):
                out.add(node.name)
    return out


def test_every_engine_kernel_compiles_for_sm90(tmp_path):
    """The op gate's cases of every lever at each value, at Qwen3-8B's shapes, and the kernels no lever touches:
    each specialization compiles to cubin for sm_90, within its shared memory; every kernel of vtengine/kernels
    is among them (a kernel nothing launches here would be compiled first on the GPU)."""
    rc, report, log = run_aot(tmp_path, "--jobs", "2")
    assert rc == 0, log
    assert report["arch"] == "sm_90" and report["failed"] == 0, log
    assert set(report["kernels"]) >= engine_kernels(), sorted(engine_kernels() - set(report["kernels"]))
    assert report["specs"] >= 90, report["kernels"]
    w4a16 = report["kernels"]["_w4a16_gemm_kernel"]
    assert w4a16["specs"] >= 30 and 0 < w4a16["max_registers"] <= 255, w4a16
    # a case whose host code reads an output no kernel wrote is a note, never a hidden launcher error
    assert all(label.startswith("pdl=") and "argmax" in label for label in report["notes"]), report["notes"]


def test_the_check_fails_what_the_interpreter_cannot(tmp_path):
    """tests/aot_faults.py: inline PTX that ptxas refuses and a 512 KB tile fail, each named with its reason; the
    plain kernel beside them compiles, with its registers from ptxas."""
    rc, report, log = run_aot(tmp_path, "--jobs", "1", "--cases-from", "aot_faults")
    assert rc == 1, log
    failures = {f["kernel"]: f for f in report["failures"]}
    assert set(failures) == {"bad_ptx_kernel", "huge_tile_kernel"}, log
    assert "ptxas" in failures["bad_ptx_kernel"]["error"] and "Unknown modifier" in failures["bad_ptx_kernel"]["error"]
    assert "exceeds sm_90's 232448" in failures["huge_tile_kernel"]["error"]
    assert failures["huge_tile_kernel"]["cases"] == ["huge tile"]
    assert report["kernels"]["copy_kernel"] == {"specs": 1, "failed": 0, "max_shared": 0,
                                                "max_registers": report["kernels"]["copy_kernel"]["max_registers"],
                                                "spilling": 0}
    assert report["kernels"]["copy_kernel"]["max_registers"] > 0


def test_ptxas_stats_read_registers_and_spills():
    log = ("ptxas info    : Used 96 registers, used 1 barriers, 64 bytes smem\n"
           "ptxas info    : 52 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads\n"
           "ptxas info    : Used 40 registers\n")
    assert aot._ptxas_stats(log) == (96, 52)
    assert aot._ptxas_stats("") == (None, 0)


def test_recording_refuses_the_interpreter():
    from vtengine.kernels import INTERPRET
    if not INTERPRET:
        pytest.skip("the interpreter is off in this process")
    with pytest.raises(RuntimeError, match="needs TRITON_INTERPRET=0"):
        with aot.recording():
            pass
