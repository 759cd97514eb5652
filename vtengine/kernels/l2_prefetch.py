"""Ask L2 for a weight ahead of the GEMV that reads it: the o projection's, while decode attention leaves DRAM idle.

An experiment, measured and not wired into the engine (bench/results/l2-prefetch-notes-2026-12-04.md). The idea:
decode attention at one sequence reads ~4 MB of KV cache in ~9 us, so the DRAM bandwidth of those microseconds goes
unused, while the o projection after it (bf16 Qwen3-8B: 4096 x 4096, 33.5 MB) ran at 62-68% of copy bandwidth on the
H200 (bench/results/gemv-bf16-*-2026-12-03). A launch right after the qkv projection asks L2 for every line of the o
weight, so it streams in during the qkv epilogue and the attention. It writes nothing and changes no result.

Measured on the H200 (2026-12-04) as the lever ``o_prefetch``, in all three modes below: the decode step got slower
(bf16 c1 +2.4% to +8.2%, MXFP4 +3.4% to +6.0%), although the micro-bench (vtengine/bench/l2_prefetch.py) shows the
lines do reach L2 (o GEMV 13.8 -> 8.6 us after a ``load`` prefetch). The lever was taken back out of the decode
path (commits 15bab23..8a2d06b hold the wiring: backend method, decoder call, op cases, mechanism probe); this
module and the bench stay for a later attempt.

The L2 budget: at most ``L2_SHARE`` of the device's L2 is asked for (a weight beyond it is prefetched from its start
up to the budget), so the prefetch does not evict the lines it just brought in.

Programmatic dependent launch: the kernel may start while the kernel before it drains. It issues its prefetches,
then waits for that kernel like every PDL kernel (griddepcontrol.wait before it ends, so the kernels after it still
see that kernel's output: ordering stays transitive along the stream).

TOUCH (tests and the CPU interpreter, which cannot run inline PTX): instead of prefetching, each program loads the
first byte of each of its lines and stores their sum, so a test can check which lines a launch covers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vtengine import counters
from vtengine.kernels import INTERPRET
from vtengine.kernels.pdl import launch_options, pdl_launch_dependents, pdl_wait, prefetch_l2, use_pdl

LINE = 128                  # bytes per L2 line: one prefetch each
LINES_PER_PROGRAM = 512     # 64 KB a program: 4 prefetches a thread at 4 warps
L2_SHARE = 0.75             # of the L2 a launch may fill
CPU_L2_BYTES = 50 * 2**20   # the L2 assumed without CUDA (the interpreter): one H200's 50 MB


MODES = ("line", "bulk", "load")     # "bulk" asks 4 KB per cp.async.bulk.prefetch


@triton.jit
def _bulk_prefetch_l2(ptrs, sizes):
    """Hopper's bulk prefetch (the TMA unit): ``sizes`` bytes from each of ``ptrs`` into L2, 16-byte aligned."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;", "=r,l,r",
                              [ptrs.to(tl.int64), sizes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_kernel(base_ptr, n_lines, nbytes, sums_ptr, LINES: tl.constexpr, TOUCH: tl.constexpr,
                        MODE: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    line = pid * LINES + tl.arange(0, LINES)
    if TOUCH:
        v = tl.load(base_ptr + line.to(tl.int64) * 128, mask=line < n_lines, other=0)
        tl.store(sums_ptr + pid, tl.sum(v.to(tl.int32), axis=0))
    elif MODE == "bulk":
        CHUNKS: tl.constexpr = LINES * 128 // 4096
        start = pid.to(tl.int64) * (LINES * 128) + tl.arange(0, CHUNKS).to(tl.int64) * 4096
        size = tl.minimum(tl.maximum(tl.minimum(nbytes, n_lines.to(tl.int64) * 128) - start, 0), 4096)
        size = (size // 16) * 16
        # an empty chunk asks again for the tensor's first 16 bytes rather than for nothing
        _bulk_prefetch_l2(base_ptr + tl.where(size > 0, start, 0), tl.where(size > 0, size, 16).to(tl.int32))
    elif MODE == "load":
        # every 32-byte sector of the program's lines loaded (L2 keeps them, evict_last), summed into a dead store
        sector = pid.to(tl.int64) * (LINES * 4) + tl.arange(0, LINES * 4).to(tl.int64)
        v = tl.load(base_ptr + sector * 32, mask=sector < nbytes // 32, other=0, eviction_policy="evict_last")
        tl.store(sums_ptr + pid, tl.sum(v.to(tl.int32), axis=0), mask=nbytes < 0)
    else:
        # a last, partial program asks again for the last line rather than past the end
        prefetch_l2(base_ptr + tl.minimum(line, n_lines - 1).to(tl.int64) * 128)
    pdl_launch_dependents(USE_PDL)
    pdl_wait(USE_PDL)


@dataclass(frozen=True)
class PrefetchPlan:
    """One launch: ``lines`` 128-byte lines from the tensor's start (the whole tensor or the L2 budget), in
    ``programs`` programs of ``LINES_PER_PROGRAM``."""
    lines: int
    programs: int
    budget_lines: int

    @property
    def nbytes(self) -> int:
        return self.lines * LINE


def l2_bytes(device) -> int:
    """The device's L2 in bytes (CPU_L2_BYTES without CUDA)."""
    if INTERPRET or not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return CPU_L2_BYTES
    return int(torch.cuda.get_device_properties(torch.device(device)).L2_cache_size)


def plan(nbytes: int, l2: int, share: float = L2_SHARE, lines_per_program: int = LINES_PER_PROGRAM) -> PrefetchPlan:
    """The lines a launch asks for: the tensor's ``nbytes`` in whole lines, at most ``share`` of an ``l2``-byte L2."""
    if nbytes <= 0:
        raise ValueError(f"l2 prefetch: nothing to prefetch ({nbytes} bytes)")
    if not 0 < share <= 1:
        raise ValueError(f"l2 prefetch: share {share!r} must be in (0, 1]")
    budget = max(1, int(l2 * share) // LINE)
    lines = min(triton.cdiv(nbytes, LINE), budget)
    return PrefetchPlan(lines, triton.cdiv(lines, lines_per_program), budget)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"l2 prefetch: the tensor must be contiguous (strides {tuple(t.stride())})")
    return t.reshape(-1).view(torch.uint8)


def prefetch(t: torch.Tensor, pdl: bool = False, touch: bool = False, share: float = L2_SHARE,
             lines_per_program: int = LINES_PER_PROGRAM, mode: str = "line") -> torch.Tensor | None:
    """Ask L2 for ``t``'s bytes (up to the budget). ``touch``: load instead and return each program's sum of the
    first byte of its lines (int32 [programs]); else None. On the interpreter only ``touch`` runs (the PTX cannot).
    ``mode``: "line" (one prefetch.global.L2 per 128-byte line), "bulk" (cp.async.bulk.prefetch.L2, 4 KB each) or
    "load" (every 32-byte sector loaded with evict_last, the sums discarded)."""
    if mode not in MODES:
        raise ValueError(f"l2 prefetch: mode {mode!r} is not known; accepted: {', '.join(MODES)}")
    data = _as_bytes(t)
    p = plan(data.numel(), l2_bytes(data.device), share, lines_per_program)
    if INTERPRET and not touch:
        counters.record("l2_prefetch", "skipped_interpreter", variant="prefetch")
        return None
    if touch:           # poisoned: a program that stores nothing leaves -1, which no sum of bytes is
        sums = torch.full((p.programs,), -1, dtype=torch.int32, device=data.device)
    elif mode == "load":    # a buffer for its dead store
        sums = torch.empty(p.programs, dtype=torch.int32, device=data.device)
    else:                   # never touched: any valid pointer
        sums = data
    on = use_pdl(pdl, "l2_prefetch", data.device)
    _l2_prefetch_kernel[(p.programs,)](data, p.lines, data.numel(), sums, LINES=lines_per_program,
                                       TOUCH=bool(touch), MODE=mode, USE_PDL=on, num_warps=4, **launch_options(on))
    counters.record("l2_prefetch", "touch" if touch else "prefetch", grid=(p.programs,),
                    variant=("whole" if p.lines * LINE >= data.numel() else "budget", mode))
    return sums if touch else None


def touch_reference(t: torch.Tensor, share: float = L2_SHARE, lines_per_program: int = LINES_PER_PROGRAM,
                    l2: int | None = None) -> torch.Tensor:
    """What ``prefetch(touch=True)`` returns, in torch: per program, the sum of the first byte of its lines."""
    data = _as_bytes(t)
    p = plan(data.numel(), l2_bytes(data.device) if l2 is None else l2, share, lines_per_program)
    firsts = data[: p.lines * LINE: LINE].to(torch.int32)
    padded = torch.zeros(p.programs * lines_per_program, dtype=torch.int32, device=data.device)
    padded[: firsts.numel()] = firsts
    return padded.view(p.programs, lines_per_program).sum(dim=1, dtype=torch.int32)
