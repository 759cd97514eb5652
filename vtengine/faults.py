"""Deliberate faults: the engine under test broken where a real bug would be, so a campaign gate can prove it fails.

A gate that only ever passes proves nothing; each gate's self-check runs the engine with one of these faults and
must fail. The faults live in the engine (a kernel's output perturbed inside the forward, a block table pointing
past the KV cache, a decode step fed a stale token, a token lost on the serving path), never in the gate's own
bookkeeping, so a gate that stopped running the engine would miss them and the campaign would be INVALID.

Off unless set: in process with ``set_fault(engine, Fault(...))`` (the gates), and in a server only when it was
started with ``--fault-injection`` (campaign servers), through ``POST /debug/fault``. Nothing reads an environment
variable.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable

from vtengine.backends import KERNEL_OPS, WEIGHT_OPS, kernel_ops, weight_kernel

KINDS = {
    "perturb": "the kernel's output scaled by (1 + size) on every call",
    "oob": "decode attention reads through block-table entries far past the end of the KV cache",
    "stale_input": "each decode step embeds a sequence's previous token instead of its newest one (the async race)",
    "drop_token": "the serving path drops the second token of every request's stream",
    "slow": "the kernel runs twice per call, or 1 + size times (its result unchanged, its time multiplied)",
}
OOB_GAP_BYTES = 1 << 30         # an "oob" read lands this far above the highest tensor the engine holds
INT32_MAX = 2**31 - 1           # the decode kernel's block offset (block x stride) is a 32-bit product


class FaultError(ValueError):
    """A fault that does not exist or cannot be applied; the message names it and what is accepted."""


@dataclass(frozen=True)
class Fault:
    kind: str
    kernel: str | None = None       # perturb: the kernel whose output is perturbed (a name of KERNEL_OPS)
    size: float = 0.0               # perturb: relative size; -2.0 negates the output. slow: extra runs (0: one)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise FaultError(f"fault kind {self.kind!r} is not known; accepted: {', '.join(KINDS)}")
        if self.kind in ("perturb", "slow"):
            if self.kernel not in KERNEL_OPS:
                raise FaultError(f"perturb needs a kernel; {self.kernel!r} is not one of {sorted(KERNEL_OPS)}")
            if self.kernel in ("store_kv", "argmax"):
                raise FaultError(f"kernel {self.kernel!r} returns no values to perturb; choose another")

    def describe(self) -> str:
        what = KINDS[self.kind]
        if self.kind == "perturb":
            factor = 1 + self.size
            what = f"{self.kernel} output scaled by {factor:g}" + (" (negated)" if factor == -1 else "")
        elif self.kind == "slow":
            runs = self.runs
            what = f"{self.kernel} run {'twice' if runs == 2 else f'{runs} times'} per call"
        return what

    @property
    def runs(self) -> int:
        """slow: how many times the kernel runs per call (twice unless size asks for more extra runs)."""
        return 1 + max(1, int(self.size))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "Fault | None":
        if not d:
            return None
        unknown = sorted(set(d) - {"kind", "kernel", "size"})
        if unknown:
            raise FaultError(f"unknown fault key(s) {unknown}; accepted: kind, kernel, size")
        return cls(kind=str(d.get("kind")), kernel=d.get("kernel"), size=float(d.get("size", 0.0)))


def first_perturbable(kernels: list[str], quant: str | None = None) -> str:
    """The first of a lever's kernels whose output can be perturbed (the lever's own route is broken there). With
    the model's ``quant``, a kernel the model never runs is passed over: w4a16_gemm on bf16 weights; on W4A16
    weights w4a16_gemm goes before dense_linear (which then runs the LM head alone)."""
    order = list(kernels)
    if quant == "bf16":
        order = [k for k in order if k != "w4a16_gemm"]
    elif quant and "w4a16_gemm" in order and "dense_linear" in order:
        order.remove("w4a16_gemm")
        order.insert(order.index("dense_linear"), "w4a16_gemm")
    for k in order:
        if k in KERNEL_OPS and k not in ("store_kv", "argmax"):
            return k
    runs = f" runs on {quant} weights" if quant else ""
    raise FaultError(f"none of the kernels {list(kernels)}{runs} with an output to perturb")


class _Outermost(threading.local):
    """Which faulted op is running: a faulted op that calls another (gate_up_silu's unfused form calls linear)
    breaks the kernel once per call. A perturbation breaks the outer call's output; a slowdown repeats the innermost
    faulted call, the one that launches the kernel: repeating the outer call reran what it wraps beside the kernel
    (H200, 2026-12-04: slowing dense_linear doubled silu_mul too, the profile gate named silu_mul, fuse_silu's off
    arm ended INVALID)."""
    depth = 0
    inner = False       # a slowdown: a faulted call inside the outer one repeated the kernel


def _hits(name: str, fault: Fault, args: tuple, kwargs: dict) -> bool:
    """Whether this call runs the faulted kernel: a projection method serves the W4A16 GEMM or the dense linear by
    its weight; every other method its own kernel."""
    return name not in WEIGHT_OPS or weight_kernel(name, args, kwargs) == fault.kernel


def _once(name: str, op: Callable, fault: Fault, broken: Callable, state: _Outermost) -> Callable:
    slow = fault.kind == "slow"

    def wrapped(*args, **kwargs):
        if not _hits(name, fault, args, kwargs) or state.depth > 1 or (state.depth and not slow):
            return op(*args, **kwargs)
        if state.depth:                             # a slowdown's inner call: it launches the kernel, it repeats
            state.inner = True
            state.depth += 1
            try:
                return broken(*args, **kwargs)
            finally:
                state.depth -= 1
        state.depth, state.inner = 1, False
        try:
            if not slow:
                return broken(*args, **kwargs)
            out = op(*args, **kwargs)
            for _ in range(0 if state.inner else fault.runs - 1):     # no inner call did: this one launches it
                op(*args, **kwargs)
            return out
        finally:
            state.depth, state.inner = 0, False
    return wrapped


def _perturbed(name: str, op: Callable, fault: Fault) -> Callable:
    factor = 1.0 + fault.size

    def broken(*args, **kwargs):
        out = op(*args, **kwargs)
        if name == "linear_add":            # (residual, its sums of squares, residual * gain or None): the squares
            return out[0] * factor, out[1] * factor ** 2, None if out[2] is None else out[2] * factor   # follow
        if isinstance(out, tuple):          # add_rms_norm returns (normed, residual): the kernel's output is both
            return tuple(t * factor if t.is_floating_point() else t for t in out)
        return out * factor if out.is_floating_point() else out
    return broken


def _repeated(op: Callable, runs: int) -> Callable:
    def broken(*args, **kwargs):
        for _ in range(runs - 1):
            op(*args, **kwargs)
        return op(*args, **kwargs)
    return broken


def _oob(op: Callable, ceiling: int) -> Callable:
    """Decode attention through block-table entries that point OOB_GAP_BYTES above ``ceiling``, the end of the
    highest tensor the engine holds: memcheck only reports an access outside every live allocation, so a fixed
    offset past the cache can land inside another tensor (the mxfp4 layout did) and go unseen."""
    def wrapped(q, k_cache, v_cache, block_tables, *args, **kwargs):
        block_bytes = k_cache.stride(0) * k_cache.element_size()
        far = -(-(ceiling + OOB_GAP_BYTES - k_cache.data_ptr()) // block_bytes)
        far = max(k_cache.shape[0], min(far, INT32_MAX // k_cache.stride(0) - k_cache.shape[0]))
        return op(q, k_cache, v_cache, block_tables + far, *args, **kwargs)
    return wrapped


def _tensors(obj, seen: set | None = None):
    """Every torch tensor reachable from an engine's model and caches (weights, quantized parts, KV)."""
    import torch
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("vtengine"):
        for x in vars(obj).values():
            yield from _tensors(x, seen)


def _ceiling(engine) -> int:
    """The end address of the highest tensor an engine holds."""
    ends = [t.data_ptr() + t.untyped_storage().nbytes() for t in _tensors([engine.model, engine.runner.kv_caches])]
    return max(ends, default=0)


def install(backend, fault: Fault | None, ceiling: int = 0) -> None:
    """Apply ``fault`` to a backend's op methods (instance attributes shadow the class's), or mend it with None.
    The backend's own instance attributes (TritonBackend routes some ops to the references that way) come back
    as they were."""
    for op, saved in getattr(backend, "_fault_saved", {}).items():
        if saved is None:
            backend.__dict__.pop(op, None)
        else:
            setattr(backend, op, saved)
    backend._fault_saved = {}
    if fault is None or fault.kind not in ("perturb", "slow", "oob"):
        return
    if fault.kind == "oob":
        wrap = {"decode_attention": _oob(backend.decode_attention, ceiling)}
    else:
        state = _Outermost()
        ops = {name: getattr(backend, name) for name in kernel_ops(fault.kernel) if hasattr(backend, name)}
        wrap = {name: _once(name, op, fault, _perturbed(name, op, fault) if fault.kind == "perturb"
                            else _repeated(op, fault.runs), state) for name, op in ops.items()}
    for op, fn in wrap.items():
        backend._fault_saved[op] = backend.__dict__.get(op)
        setattr(backend, op, fn)


def set_fault(engine, fault: Fault | None) -> None:
    """Break (or mend, with None) an ``LLMEngine``: its backend's ops, its runner's decode inputs, its outputs."""
    install(engine.backend, fault, _ceiling(engine) if fault is not None and fault.kind == "oob" else 0)
    engine.fault = fault
    engine.runner.fault = fault
