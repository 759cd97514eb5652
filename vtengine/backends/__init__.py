"""Op backends: ``torch`` (references, any device) and ``triton`` (the kernels; CUDA, or the CPU interpreter)."""
from __future__ import annotations

from vtengine.levers import ResolvedLevers

BACKENDS = ("torch", "triton")
# kernel names as lever files list them in `affects`, and the backend methods each one routes
KERNEL_OPS = {
    "rms_norm": ("rms_norm", "add_rms_norm"), "silu_mul": ("silu_mul",), "rope": ("rope",),
    "store_kv": ("store_kv",), "prefill_attention": ("prefill_attention",),
    "decode_attention": ("decode_attention",), "w4a16_gemm": ("linear", "gate_up_silu"),
    "dense_linear": ("linear",),
    "argmax": ("greedy",), "qkv_epilogue": ("qkv_epilogue",),
}


def make_backend(name: str, levers: ResolvedLevers, kernels: list[str] | None = None):
    if name == "torch":
        from vtengine.backends.torch_backend import TorchBackend
        return TorchBackend(levers)
    if name == "triton":
        from vtengine.backends.triton_backend import TritonBackend
        return TritonBackend(levers, kernels)
    raise ValueError(f"backend {name!r} is not known; accepted: {list(BACKENDS)}")
