"""Triton kernels. Each module holds the @triton.jit kernels, their launchers (grid and meta-parameter choice)
and records counters; the torch references live in vtengine/backends/torch_backend.py.

On a host without CUDA the kernels run in Triton's CPU interpreter (tiny shapes only). The switch must be set
before triton is first imported, so it lives here, where every kernel module is imported from, with the device
facts every launcher reads (the tl.dot operand dtype, the SM count). Programmatic dependent launch: pdl.py.
"""
import os
from functools import lru_cache

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


H200_SMS = 132              # the SM count assumed when there is no GPU (the interpreter, CPU CI): one H200


def sm_count(device: torch.device | str | int | None = None) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when None); H200_SMS when CUDA is unavailable or
    the device is not a CUDA device (the interpreter runs CPU tensors as if on an H200)."""
    if not torch.cuda.is_available():
        return H200_SMS
    if isinstance(device, (str, torch.device)):
        device = torch.device(device)
        if device.type != "cuda":
            return H200_SMS
        device = device.index
    return _cuda_sm_count(torch.cuda.current_device() if device is None else int(device))


@lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
