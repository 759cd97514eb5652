"""The Triton backend: the torch backend's ops routed to the Triton kernels in vtengine/kernels/.

Levers are read once, at construction, and passed to the launchers as arguments (the launchers turn them into
``constexpr`` choices or grid choices); nothing in the hot path reads the environment.
"""
from __future__ import annotations

import torch

from vtengine.backends import KERNEL_OPS
from vtengine.backends.torch_backend import TorchBackend
from vtengine.kernels import INTERPRET, attention, fused, gemv, sm_count, w4a16
from vtengine.kernels.epilogue import NormIn

# Under the CPU interpreter each program runs one after another in Python: present a 2-SM machine to the split
# heuristic, so decode still splits (nsplits_cap stays live) over a handful of programs instead of hundreds.
INTERPRETER_SMS = 2
from vtengine.quant import QuantizedWeight



class TritonBackend(TorchBackend):
    """``kernels``: route only these kernels (names as in KERNEL_OPS) through Triton and the rest through the torch
    references; None routes all. Under the CPU interpreter a campaign routes just its lever's kernels, so the
    lever's own route really runs while a rehearsal stays fast enough for CI."""
    name = "triton"

    def __init__(self, levers=None, kernels=None):
        super().__init__(levers)
        if kernels is not None:
            unknown = sorted(set(kernels) - set(KERNEL_OPS))
            if unknown:
                raise ValueError(f"unknown kernel(s) {unknown}; accepted: {sorted(KERNEL_OPS)}")
            keep = {op for k in kernels for op in KERNEL_OPS[k]}
            for ops in KERNEL_OPS.values():
                for op in ops:
                    if op not in keep:
                        setattr(self, op, getattr(TorchBackend, op).__get__(self))
        self.kernels = None if kernels is None else sorted(kernels)
        # the fused qkv epilogue stands in for rms_norm (q/k norms), rope and store_kv: it runs when asked for by name
        # or when all three are routed (otherwise the torch backend's composition of the routed ops runs)
        self.fuse_qkv_epilogue = kernels is None or "qkv_epilogue" in kernels or {"rms_norm", "rope",
                                                                                    "store_kv"} <= set(kernels)

    def rms_norm(self, x, weight, eps):
        return fused.rms_norm(x, weight, eps, fast_math=self.levers.on("fast_math"), pdl=self.levers.on("pdl"))

    def add_rms_norm(self, x, residual, weight, eps):
        return fused.add_rms_norm(x, residual, weight, eps, fast_math=self.levers.on("fast_math"),
                                  pdl=self.levers.on("pdl"))

    def silu_mul(self, gate_up):
        return fused.silu_mul(gate_up, pdl=self.levers.on("pdl"))

    def rope(self, q, k, positions, cos_sin):
        return fused.rope(q, k, positions, cos_sin)

    def store_kv(self, k, v, k_cache, v_cache, slot_mapping):
        attention.store_kv(k, v, k_cache, v_cache, slot_mapping)

    def qkv_epilogue(self, qkv, num_q_heads, num_kv_heads, positions, cos_sin, k_cache, v_cache, slot_mapping,
                     q_norm=None, k_norm=None, eps=1e-6):
        if not self.fuse_qkv_epilogue:
            return super().qkv_epilogue(qkv, num_q_heads, num_kv_heads, positions, cos_sin, k_cache, v_cache,
                                        slot_mapping, q_norm, k_norm, eps)
        return fused.qkv_epilogue(qkv, num_q_heads, num_kv_heads, positions, cos_sin, k_cache, v_cache,
                                  slot_mapping, q_norm, k_norm, eps, fast_math=self.levers.on("fast_math"),
                                  pdl=self.levers.on("pdl"))

    def prefill_attention(self, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
        # no INTERPRETER_SMS here: on 2 SMs every packed grid of the tiny model fills the wave and "auto" never
        # splits, so the interpreter keeps its H200 count and prefill_splits stays live on the CPU
        return attention.prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale,
                                           fast_math=self.levers.on("fast_math"),
                                           gqa_pack=self.levers.on("prefill_gqa_pack"),
                                           splits=self.levers.prefill_splits)

    def decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale, max_context_len=None):
        return attention.decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale,
                                          max_context_len=max_context_len,
                                          num_sms=INTERPRETER_SMS if INTERPRET else None,
                                          gqa_swap=self.levers.on("gqa_swap"),
                                          nsplits_cap=self.levers.nsplits_cap,
                                          split_rule=self.levers.split_rule,
                                          wave_grid=self.levers.on("decode_wave_grid"),
                                          fast_math=self.levers.on("fast_math"), pdl=self.levers.on("pdl"))

    def _w4a16_levers(self) -> dict:
        """The W4A16 GEMM's lever arguments (route, PDL, decode layout, prefetch, decode tiles past 16 tokens)."""
        on = self.levers.on
        return dict(dense=on("marlin_dense"), pdl=on("pdl"), rot=on("w4a16_rot"), prefetch=on("pdl_prefetch"),
                    mid=on("w4a16_mid_m"))

    def _gemv_levers(self) -> dict:
        """The bf16 GEMV's lever arguments (PDL, and with it the weight prefetch before the wait)."""
        return dict(pdl=self.levers.on("pdl"), prefetch=self.levers.on("pdl_prefetch"))

    def linear(self, x, weight, rope=None):
        """x @ W^T; with ``rope`` (rope_out's, the lever fuse_rope) the qkv projection's q, its k and v in the cache."""
        if isinstance(weight, QuantizedWeight):
            return w4a16.w4a16_linear(x, weight, rope=rope, **self._w4a16_levers())
        return gemv.linear(x, weight, triton_gemv=self.levers.on("triton_gemv"), rope=rope, **self._gemv_levers())

    def gate_up_silu(self, x, weight):
        if self.levers.on("fuse_silu"):
            if isinstance(weight, QuantizedWeight):
                kw = self._w4a16_levers()
                if w4a16.fusable(x.shape[0], kw["dense"]):
                    return w4a16.w4a16_linear(x, weight, silu_mul=True, **kw)
            elif gemv.fusable(x.shape[0], self.levers.on("triton_gemv")):
                return gemv.linear(x, weight, triton_gemv=True, silu_mul=True, **self._gemv_levers())
        return super().gate_up_silu(x, weight)

    def fuses_norm(self, tokens: int, weight) -> bool:
        """The lever fuse_norm applies: GEMVs (bf16, triton_gemv on) or W4A16 GEMMs (the dense route) at M <= 16."""
        if not self.levers.on("fuse_norm"):
            return False
        if isinstance(weight, QuantizedWeight):
            return (self.kernels is None or {"w4a16_gemm", "rms_norm"} <= set(self.kernels)) and \
                w4a16.fusable(tokens, self.levers.on("marlin_dense"))
        return (self.kernels is None or {"dense_linear", "rms_norm"} <= set(self.kernels)) and \
            gemv.fusable(tokens, self.levers.on("triton_gemv"))

    def rope_out(self, tokens, weight, num_q_heads, num_kv_heads, positions, cos_sin, k_cache, v_cache, slot_mapping,
                 q_norm=None, k_norm=None, eps=1e-6):
        """The lever fuse_rope applies (at M <= 16: bf16 weights on the Triton GEMV, or W4A16 on the dense route; the
        fused qkv epilogue and the projection's kernel both routed; whole heads in the tile groups): what the qkv
        projection takes as ``rope=``; else None."""
        if not self.levers.on("fuse_rope") or not self.fuse_qkv_epilogue:
            return None
        n, k = weight.shape
        if isinstance(weight, QuantizedWeight):
            if not w4a16.fusable(tokens, self.levers.on("marlin_dense")) or \
                    (self.kernels is not None and "w4a16_gemm" not in self.kernels):
                return None
            block_n = w4a16.launch_config(tokens, weight, dense=True, mid=self.levers.on("w4a16_mid_m"))["BLOCK_N"]
        else:
            if not gemv.fusable(tokens, self.levers.on("triton_gemv")) or \
                    (self.kernels is not None and "dense_linear" not in self.kernels):
                return None
            block_n = gemv.gemv_config(n, k, sm_count(weight.device))["BLOCK_N"]
        if k_cache.shape[-1] % block_n:
            return None
        return fused.RopeOut(num_q_heads, num_kv_heads, positions, cos_sin, k_cache, v_cache, slot_mapping, q_norm,
                             k_norm, eps, self.levers.on("fast_math"))

    def linear_add(self, x, weight, residual, gain=None):
        """(round(x W^T + residual), its per-tile sums of squares, round(that residual * gain) or None): the new
        residual for norm_linear and, on the bf16 GEMV when the next norm's weight ``gain`` is given, its input with
        the gain applied (so that GEMV's K loop is the plain one); the W4A16 GEMM returns None there."""
        if isinstance(weight, QuantizedWeight):
            return *w4a16.w4a16_linear_add(x, weight, residual, **self._w4a16_levers()), None
        if gain is None:
            return *gemv.linear_add(x, weight, residual, **self._gemv_levers()), None
        return gemv.linear_add_gain(x, weight, residual, gain, **self._gemv_levers())

    def norm_linear(self, residual, ss, norm_weight, eps, weight, silu_mul: bool = False, gained=None, rope=None):
        """RMSNorm(residual) @ W^T with the norm inside the GEMM (then silu_mul, fused with fuse_silu). ``gained``:
        linear_add's residual * norm_weight, the bf16 GEMV's input instead of the residual. Unfused, the projection
        is its own norm_linear call and silu_mul runs beside it, so a fault that repeats the projection repeats that
        call alone (H200, 2026-12-04: repeating the whole call doubled silu_mul too, on fuse_silu's off arm).
        ``rope``: as linear's."""
        fuse_silu = silu_mul and self.levers.on("fuse_silu")
        if silu_mul and not fuse_silu:
            return self.silu_mul(self.norm_linear(residual, ss, norm_weight, eps, weight, gained=gained))
        if isinstance(weight, QuantizedWeight):
            norm = NormIn(ss, norm_weight, eps, self.levers.on("fast_math"))
            y = w4a16.w4a16_linear(residual, weight, norm=norm, silu_mul=fuse_silu, rope=rope, **self._w4a16_levers())
        else:
            norm = NormIn(ss, norm_weight, eps, self.levers.on("fast_math"), gained=gained is not None)
            y = gemv.linear(residual if gained is None else gained, weight, triton_gemv=True, norm=norm,
                            silu_mul=fuse_silu, rope=rope, **self._gemv_levers())
        return y

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return fused.argmax(logits, pdl=self.levers.on("pdl"))
