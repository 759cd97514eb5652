"""Compile the engine's Triton kernels for the GPU on a host without one.

The CPU interpreter runs a kernel's Python, never Triton's compiler: a kernel that does not lower for sm_90 (a
layout the backend rejects, inline PTX that ptxas refuses, shared memory past what one block may have) passes every
CPU test and fails on its first GPU call, in a device session that costs minutes of a 30-minute budget. This
module runs the op gate's cases (campaigns/gates/op.py) for every kernel lever at each of its values, at the GPU's
shapes, on the CPU, with a stand-in driver: Triton specializes each launch as it would on an sm_90 device (dtypes,
16-byte alignment, constexprs, launch options such as ``launch_pdl``), and a cache hook records the specialization
instead of compiling and launching it. Each distinct specialization is then compiled through Triton's own pipeline
to cubin (ptxas included) for the target, and its static shared memory checked against the target's per-block
limit.

    python -m vtengine.kernels.aot [--arch 90] [--jobs 2] [--levers gqa_swap,fuse_rope] [--quant bf16]
                                   [--cases-from MODULE] [--out report.json]

What it cannot see: register spills (ptxas reports them, Triton's compile keeps them), launch failures that depend
on the grid, and wrong results: those need the GPU tests (``pytest -m gpu``). The compiler is the host's Triton,
which may be newer than the GPU host's (the report says which). TRITON_INTERPRET must be 0 before triton is first
imported: run as a module, it re-executes itself so.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import itertools
import json
import os
import re
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

# per-block shared memory a kernel may take (cudaDevAttrMaxSharedMemoryPerBlockOptin): sm_80 163 KB, sm_90 227 KB
SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448}
OPTIONS = ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion", "launch_pdl", "maxnreg",
           "launch_cooperative_grid")


@dataclass
class Spec:
    """One specialization of a kernel as the engine launches it on the target."""
    module: str
    kernel: str
    key: str                               # Triton's specialization key (types, alignment, constexprs, options)
    signature: dict[str, str]
    constants: dict[tuple, Any]
    attrs: dict[tuple, Any]
    options: dict[str, Any]
    cases: list[str] = field(default_factory=list)     # "lever=value: case" that launched it

    def label(self) -> str:
        consts = ", ".join(f"{self._arg(path)}={_short(v)}" for path, v in sorted(self.constants.items()))
        return f"{self.kernel}[{consts}; num_warps={self.options.get('num_warps')}]"

    def _arg(self, path: tuple) -> str:
        names = list(self.signature)
        return names[path[0]] if path and path[0] < len(names) else str(path)


@dataclass
class Result:
    kernel: str
    label: str
    ok: bool
    seconds: float
    shared: int | None = None
    error: str = ""
    cases: list[str] = field(default_factory=list)
    registers: int | None = None           # per thread, from ptxas -v (None where the log did not say)
    spill_bytes: int = 0                   # spill stores + loads, from ptxas -v: local memory traffic per thread


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_stats(log: str) -> tuple[int | None, int]:
    regs = [int(m) for m in _PTXAS_REGS.findall(log)]
    spills = sum(int(a) + int(b) for a, b in _PTXAS_SPILLS.findall(log))
    return (max(regs) if regs else None), spills


def _short(v: Any) -> str:
    text = str(v)
    return text.removeprefix("triton.language.") if len(text) < 40 else text[:37] + "..."


class StandInDriver:
    """What Triton's launch path asks of the active driver, answered for a GPU that is not there."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def is_active(self) -> bool:
        return True


class Recording:
    """The specializations recorded so far (Triton key -> Spec), and ``during(label)`` to name a case's launches."""

    def __init__(self):
        self.by_key: dict[str, Spec] = {}
        self._current: list[str] = []

    @contextmanager
    def during(self, label: str):
        self._current.append(label)
        try:
            yield
        finally:
            self._current.pop()

    def specs(self) -> list[Spec]:
        return list(self.by_key.values())

    def hook(self, *args, **kw) -> bool:
        """Triton's jit_cache_hook: record the launch's specialization; True tells Triton it is handled (nothing is
        compiled or launched)."""
        fn, c = kw["fn"], kw["compile"]
        key = f"{fn.module}.{fn.name}:{c['key']}"
        spec = self.by_key.get(key)
        if spec is None:
            options = json.loads(c["specialization_data"])["options"]
            spec = self.by_key[key] = Spec(module=fn.module, kernel=fn.name, key=key, signature=dict(c["signature"]),
                                           constants=dict(c["constants"]), attrs=dict(c["configs"][0]),
                                           options={k: options[k] for k in OPTIONS if k in options})
        if self._current and self._current[-1] not in spec.cases:
            spec.cases.append(self._current[-1])
        return True


@contextmanager
def recording(arch: int = 90) -> Iterator[Recording]:
    """Within: every Triton launch is specialized for ``arch`` and recorded, not compiled or run (its outputs keep
    whatever they held); PDL counts as supported, as on sm_90."""
    from triton import knobs
    from triton.runtime import driver

    from vtengine.kernels import INTERPRET, pdl
    if INTERPRET:
        raise RuntimeError("vtengine.kernels.aot needs TRITON_INTERPRET=0 before triton is imported; run it as "
                           "`python -m vtengine.kernels.aot`")
    rec = Recording()
    saved_hook, saved_pdl = knobs.runtime.jit_cache_hook, pdl.pdl_supported
    saved_driver = driver._active      # None on a host without a GPU (reset_active would look for one and raise)
    driver.set_active(StandInDriver(arch))
    knobs.runtime.jit_cache_hook = rec.hook
    pdl.pdl_supported = lambda device=None: True
    try:
        yield rec
    finally:
        knobs.runtime.jit_cache_hook = saved_hook
        pdl.pdl_supported = saved_pdl
        driver._active = saved_driver


def op_cases(levers_wanted: list[str] | None, quant: str) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(label, call) for the op gate's cases of every kernel lever (or those named) at each of its values, at the
    GPU's shapes, in the lever context the registry resolves for ``quant``. W4A16 weights are quantized once per
    shape (their values do not matter to a compile)."""
    import torch

    from campaigns.gates import op
    from vtengine import levers
    registry = levers.registry()
    unknown = sorted(set(levers_wanted or []) - set(registry))
    if unknown:
        raise SystemExit(f"unknown lever(s) {unknown}; accepted: {', '.join(sorted(registry))}")
    quantized: dict[tuple, Any] = {}
    real_quantize = op.quantize

    def quantize_once(w, fmt):
        key = (tuple(w.shape), w.dtype, fmt)
        if key not in quantized:
            quantized[key] = real_quantize(w, fmt)
        return quantized[key]

    op.quantize = quantize_once
    try:
        for name, lever in sorted(registry.items()):
            if not lever.affects or lever.sets or (levers_wanted and name not in levers_wanted):
                continue
            cases = op.cases_for(name, "cpu", op._shapes("cuda"), torch.Generator().manual_seed(0))
            for value in lever.values:
                values = dict(levers.resolve({name: value}, environ={}, quant=quant).values)
                for kernel, case, run, _ in cases:
                    setting = op.setting_for(kernel, name, values)
                    yield f"{name}={value}: {case}", lambda run=run, setting=setting: run(setting, False)
    finally:
        op.quantize = real_quantize


def engine_cases() -> Iterator[tuple[str, Callable[[], Any]]]:
    """The kernels no lever's op cases launch, at Qwen3-8B's decode shapes: the KV store, RoPE, decode attention's
    separate merge (fused_merge off), and the L2 prefetch kernels of the benches (all three modes, with PDL)."""
    import torch

    from vtengine.kernels import attention, fused, l2_prefetch
    bf16, t, hq, hkv, d, page = torch.bfloat16, 8, 32, 8, 128, 16
    k_cache = torch.zeros(64, page, hkv, d, dtype=bf16)
    v_cache = torch.zeros_like(k_cache)
    k, v = torch.zeros(t, hkv, d, dtype=bf16), torch.zeros(t, hkv, d, dtype=bf16)
    q = torch.zeros(t, hq, d, dtype=bf16)
    slots = torch.arange(t, dtype=torch.int64)
    yield "store_kv", lambda: attention.store_kv(k, v, k_cache, v_cache, slots)
    cos_sin = torch.zeros(4096, d, dtype=torch.float32)
    yield "rope", lambda: fused.rope(q, k, torch.arange(t, dtype=torch.int64), cos_sin)
    tables = torch.arange(64, dtype=torch.int32).reshape(8, 8)
    lens = torch.full((8,), 100, dtype=torch.int32)
    for swap in (False, True):
        yield (f"decode_attention fused_merge=False gqa_swap={swap}",
               lambda swap=swap: attention.decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5,
                                                            gqa_swap=swap, fused_merge=False, max_context_len=1024))
    weights = torch.zeros(1 << 20, dtype=torch.uint8)
    for mode in l2_prefetch.MODES:
        for pdl in (False, True):
            yield (f"l2_prefetch mode={mode} pdl={pdl}",
                   lambda mode=mode, pdl=pdl: l2_prefetch.prefetch(weights, pdl=pdl, mode=mode))
    yield "l2_prefetch touch", lambda: l2_prefetch.prefetch(weights, touch=True)


def collect(cases: Iterator[tuple[str, Callable[[], Any]]], arch: int = 90) -> tuple[list[Spec], dict[str, str]]:
    """Run the cases under ``recording``: the specializations they launch, and the cases whose host code raised
    (after its launches were recorded, a case may read outputs that were never written: noted, not a failure)."""
    notes = {}
    with recording(arch) as rec:
        for label, call in cases:
            with rec.during(label):
                try:
                    call()
                except Exception as e:          # noqa: BLE001  (reported with the case's name)
                    notes[label] = f"{type(e).__name__}: {str(e)[:200]}"
        return rec.specs(), notes


def compile_spec(spec: Spec, arch: int = 90) -> Result:
    """Compile one specialization to cubin for ``arch`` and check its shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton import knobs
    t0 = time.perf_counter()
    log = io.StringIO()
    saved = getattr(knobs.nvidia, "dump_ptxas_log", False)
    try:
        fn = getattr(importlib.import_module(spec.module), spec.kernel)
        src = ASTSource(fn, spec.signature, spec.constants, spec.attrs)
        knobs.nvidia.dump_ptxas_log = True      # ptxas -v's report (registers, spills) is printed, not kept
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(spec.options))
    except Exception as e:                      # noqa: BLE001  (a compile error is the finding)
        return Result(spec.kernel, spec.label(), False, time.perf_counter() - t0, error=_first_lines(e),
                      cases=spec.cases)
    finally:
        knobs.nvidia.dump_ptxas_log = saved
    regs, spills = _ptxas_stats(log.getvalue())
    shared = int(compiled.metadata.shared)
    limit = SMEM_LIMIT.get(arch)
    result = Result(spec.kernel, spec.label(), True, time.perf_counter() - t0, shared, cases=spec.cases,
                    registers=regs, spill_bytes=spills)
    if limit is not None and shared > limit:
        result.ok = False
        result.error = (f"shared memory {shared} bytes per block exceeds sm_{arch}'s {limit}: the launch would "
                        "fail with OutOfResources")
    return result


def _first_lines(e: Exception, n: int = 12) -> str:
    text = f"{type(e).__name__}: {e}"
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return "\n".join(lines[:n])


_SPECS: list[Spec] = []


def _compile_nth(args: tuple[int, int]) -> Result:
    i, arch = args
    return compile_spec(_SPECS[i], arch)


def compile_all(specs: list[Spec], arch: int = 90, jobs: int = 1) -> list[Result]:
    """Compile every spec, ``jobs`` processes at a time (forked: the specs are not pickled)."""
    global _SPECS
    _SPECS = specs
    if jobs <= 1 or len(specs) <= 1:
        return [compile_spec(s, arch) for s in specs]
    import multiprocessing
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_compile_nth, [(i, arch) for i in range(len(specs))], chunksize=1)


def report(results: list[Result], notes: dict[str, str], arch: int, seconds: float) -> dict:
    import triton
    by_kernel: dict[str, dict] = {}
    for r in results:
        k = by_kernel.setdefault(r.kernel, {"specs": 0, "failed": 0, "max_shared": 0, "max_registers": 0,
                                            "spilling": 0})
        k["specs"] += 1
        k["failed"] += not r.ok
        k["max_shared"] = max(k["max_shared"], r.shared or 0)
        k["max_registers"] = max(k["max_registers"], r.registers or 0)
        k["spilling"] += r.spill_bytes > 0
    return {"arch": f"sm_{arch}", "triton": triton.__version__, "specs": len(results),
            "failed": sum(not r.ok for r in results), "seconds": round(seconds, 1), "kernels": by_kernel,
            "failures": [asdict(r) for r in results if not r.ok],
            "spills": [asdict(r) for r in results if r.ok and r.spill_bytes], "notes": notes,
            "results": [asdict(r) for r in results]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability to compile for (default 90: H100/H200)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    ap.add_argument("--levers", default="", help="comma-separated levers whose op cases run (default: all)")
    ap.add_argument("--quant", default="bf16", help="the lever defaults' quantization (default bf16)")
    ap.add_argument("--cases-from", default="", help="a module whose cases() yields (label, call): instead of the "
                                                       "op gate's cases")
    ap.add_argument("--out", default="", help="write the report as JSON here")
    ap.add_argument("--cached", action="store_true", help="use Triton's kernel cache (faster; a cached kernel's "
                                                          "registers and spills are not reported)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    scratch = None if args.cached else tempfile.TemporaryDirectory(prefix="vt-aot-")
    if scratch is not None:         # every kernel through ptxas, whose log gives its registers and spills
        os.environ["TRITON_CACHE_DIR"] = scratch.name
    if args.cases_from:
        cases = importlib.import_module(args.cases_from).cases()
    else:
        wanted = [x for x in args.levers.split(",") if x] or None
        cases = op_cases(wanted, args.quant)
        if wanted is None:
            cases = itertools.chain(cases, engine_cases())
    specs, notes = collect(cases, args.arch)
    results = compile_all(specs, args.arch, args.jobs)
    rep = report(results, notes, args.arch, time.perf_counter() - t0)
    print(f"{rep['specs']} kernel specializations compiled for {rep['arch']} (triton {rep['triton']}) in "
          f"{rep['seconds']} s: {rep['failed']} failed")
    for name, k in sorted(rep["kernels"].items()):
        print(f"  {name:28s} {k['specs']:3d} specs  {k['failed']} failed  shared <= {k['max_shared']:6d} B  "
              f"registers <= {k['max_registers']:3d}  {k['spilling']} spilling")
    for r in rep["spills"]:
        print(f"spills {r['spill_bytes']} B/thread: {r['label']} (launched by {', '.join(r['cases'][:2])})")
    for f in rep["failures"]:
        print(f"FAIL {f['label']}\n  launched by {', '.join(f['cases'][:3])}\n  " + f["error"].replace("\n", "\n  "))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rep, fh, indent=1, default=str)
    if scratch is not None:
        scratch.cleanup()
    return 1 if rep["failed"] or not rep["specs"] else 0


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "0":        # before triton's first import: start again without it
        os.execve(sys.executable, [sys.executable, "-m", "vtengine.kernels.aot", *sys.argv[1:]],
                  {**os.environ, "TRITON_INTERPRET": "0"})
    sys.exit(main())
