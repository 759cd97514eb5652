"""Programmatic dependent launch (the ``pdl`` lever): on sm_90+, a kernel launched with ``launch_pdl`` starts while
the one before it on the stream drains, and waits in-kernel (griddepcontrol.wait) before reading its inputs. The
host side says whether a launch really uses it (and counts it); the device side is the wait and the early release
every PDL kernel calls. One place for both, imported by every kernel module.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from vtengine import counters
from vtengine.kernels import INTERPRET


def pdl_supported(device=None) -> bool:
    """Programmatic dependent launch (the ``pdl`` lever) needs a compiled launch on sm_90 or newer; the interpreter
    and older GPUs launch plainly."""
    if INTERPRET or not torch.cuda.is_available():
        return False
    index = None if device is None else torch.device(device).index
    return _sm90_or_newer(torch.cuda.current_device() if index is None else index)


@lru_cache(maxsize=None)
def _sm90_or_newer(index: int) -> bool:
    """Asked at every launch (use_pdl): the device's capability, looked up once."""
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """Extra keyword arguments of a Triton launch: ``launch_pdl`` asks the driver to start the kernel while the one
    before it on the stream drains (it then waits in-kernel, griddepcontrol.wait, before reading its inputs)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Under programmatic dependent launch: block until the previous kernel on the stream has finished and its
    writes are visible. Every PDL kernel calls it before its first read of an activation and before any store, so
    ordering stays transitive along the stream (a kernel cannot finish before the one it follows)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next PDL kernel on the stream start launching (its programs then wait in pdl_wait). Called once a
    program's main work is issued, so waiting dependents do not take SM slots from this kernel's later waves."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at ``ptrs`` (no register result, no wait): what a PDL kernel does with its
    weights before pdl_wait, since weights never depend on the kernel before it (lever ``pdl_prefetch``)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                              dtype=tl.int32, is_pure=False, pack=1)


def use_pdl(pdl: bool, kernel: str, device) -> bool:
    """Whether this launch really uses PDL (the lever asked and the device can), recorded as the ``launch``
    counter so the mechanism gate sees an inert lever as inert."""
    on = bool(pdl) and pdl_supported(device)
    counters.record("launch", "pdl" if on else "plain", variant=kernel)
    return on


PREFETCH_BYTES = 16 * 1024     # W a program asks of L2 before its PDL wait (the lever pdl_prefetch): one K step
                               # of the bf16 GEMV, four of the W4A16 GEMM's decode tiles


def prefetch_steps(block_n: int, block_k: int, w_bytes: float, size: int = PREFETCH_BYTES) -> int:
    """K steps of W a program prefetches under pdl_prefetch: about ``size`` bytes, at least one step. On the H200
    (2026-12-02) 64 KB (4 steps; 132 SMs x 2 programs x 64 KB = 17 MB, a third of the L2) took all of PDL's gain on
    the bf16 decode step back (c1 4.687 -> 4.865 ms); the GEMV bench (2026-12-03) timed o_proj at M = 1 in 12.8 µs
    plain, 12.1 with PDL, 11.8 with 8 or 16 KB prefetched and 13.7 with 64 KB, so the lever asks for one step."""
    return max(1, int(size // (block_n * block_k * w_bytes)))


def prefetch_bytes(prefetch: bool | int) -> int:
    """``prefetch`` as bytes per program: True means PREFETCH_BYTES (the lever), False 0, an int that many."""
    if isinstance(prefetch, bool):
        return PREFETCH_BYTES if prefetch else 0
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a bool or a byte count >= 0, got {prefetch!r}")
    return prefetch
