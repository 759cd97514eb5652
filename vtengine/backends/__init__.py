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
# the backend methods that take a projection weight, with the weight's position among their arguments: each runs
# the W4A16 GEMM or the dense linear, by that weight's type. linear_add and norm_linear (the lever fuse_norm) exist
# on the Triton backend only, so they are not in KERNEL_OPS' routing lists, but they run those kernels.
WEIGHT_OPS = {"linear": 1, "gate_up_silu": 1, "linear_add": 1, "norm_linear": 4}


def kernel_ops(kernel: str) -> tuple[str, ...]:
    """Every backend method that runs ``kernel`` (faults break and profiles name all of them): KERNEL_OPS' own, and
    for the two projection kernels every method in WEIGHT_OPS."""
    if kernel in ("w4a16_gemm", "dense_linear"):
        return tuple(WEIGHT_OPS)
    return KERNEL_OPS[kernel]


def weight_kernel(op: str, args: tuple, kwargs: dict) -> str:
    """The projection kernel a WEIGHT_OPS method runs in this call: w4a16_gemm for a quantized weight, else
    dense_linear."""
    from vtengine.quant import QuantizedWeight
    i = WEIGHT_OPS[op]
    weight = args[i] if len(args) > i else kwargs.get("weight")
    return "w4a16_gemm" if isinstance(weight, QuantizedWeight) else "dense_linear"


def make_backend(name: str, levers: ResolvedLevers, kernels: list[str] | None = None):
    if name == "torch":
        from vtengine.backends.torch_backend import TorchBackend
        return TorchBackend(levers)
    if name == "triton":
        from vtengine.backends.triton_backend import TritonBackend
        return TritonBackend(levers, kernels)
    raise ValueError(f"backend {name!r} is not known; accepted: {list(BACKENDS)}")
