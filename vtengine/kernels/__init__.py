"""Triton kernels. Each module holds the @triton.jit kernels, their launchers (grid and meta-parameter choice)
and records counters; the torch references live in vtengine/backends/torch_backend.py.

On a host without CUDA the kernels run in Triton's CPU interpreter (tiny shapes only). The switch must be set
before triton is first imported, so it lives here, where every kernel module is imported from.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_dtype(x: torch.Tensor):
    """The tl.dot operand dtype for tensor x: fp32 under the interpreter (it multiplies raw bf16 bit patterns in
    tl.dot, triton issue #11584), x's own dtype on the GPU. Pass it to kernels as a constexpr."""
    import triton.language as tl
    if INTERPRET:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]


def pdl_supported(device=None) -> bool:
    """Programmatic dependent launch (the ``pdl`` lever) needs a compiled launch on sm_90 or newer; the interpreter
    and older GPUs launch plainly."""
    if INTERPRET or not torch.cuda.is_available():
        return False
    index = None if device is None else torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(pdl: bool) -> dict:
    """Extra keyword arguments of a Triton launch: ``launch_pdl`` asks the driver to start the kernel while the one
    before it on the stream drains (it then waits in-kernel, griddepcontrol.wait, before reading its inputs)."""
    return {"launch_pdl": True} if pdl else {}
