"""Op backends: ``torch`` (references, any device) and ``triton`` (the kernels; CUDA, or the CPU interpreter)."""
from __future__ import annotations

from vtengine.levers import ResolvedLevers

BACKENDS = ("torch", "triton")


def make_backend(name: str, levers: ResolvedLevers, kernels: list[str] | None = None):
    if name == "torch":
        from vtengine.backends.torch_backend import TorchBackend
        return TorchBackend(levers)
    if name == "triton":
        from vtengine.backends.triton_backend import TritonBackend
        return TritonBackend(levers, kernels)
    raise ValueError(f"backend {name!r} is not known; accepted: {list(BACKENDS)}")
