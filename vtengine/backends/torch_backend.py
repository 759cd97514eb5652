"""The torch backend: reference implementations of every op the model calls.

These are the oracle for the Triton kernels (vtengine/kernels/) and run real models on CPU. Each method is one
op at the boundary the Triton backend overrides; shapes follow vLLM/nano-vllm conventions:

- tokens are flattened: a step of T tokens has hidden states [T, H];
- KV cache per layer: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim];
- block_tables [B, max_blocks] int32 (-1 padded), context_lens [B] int32 = tokens in the cache per sequence
  (including the ones written this step);
- prefill: cu_seqlens_q [B+1] int32 (new tokens per sequence), the sequence's first new token sits at
  position context_len - q_len, so a cached prefix is attended to.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vtengine.levers import ResolvedLevers, resolve
from vtengine.quant import QuantizedWeight, dequantize


class TorchBackend:
    name = "torch"
    # CUDA-graph capture needs a decode step with no host synchronisation; these references read context lengths on
    # the host (decode_attention) and mask by value (store_kv), so a graph captured over them would be invalid.
    HOST_SYNC_OPS = ("decode_attention", "store_kv")

    @property
    def capturable(self) -> bool:
        """Whether a decode step through this backend can be captured in a CUDA graph: none of its decode ops is
        a host-synchronising reference (HOST_SYNC_OPS)."""
        return not any(self.host_sync_ops())

    def host_sync_ops(self) -> list[str]:
        """The decode ops this backend runs through the (host-synchronising) torch references."""
        return [op for op in self.HOST_SYNC_OPS if getattr(self, op).__func__ is getattr(TorchBackend, op)]

    def __init__(self, levers: ResolvedLevers | None = None):
        self.levers = levers if levers is not None else resolve()

    # -- elementwise / norms -------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (out * weight.float()).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """residual += x; return (rms_norm(residual), residual). The sum is rounded to x.dtype first, as HF does."""
        summed = (x.float() + residual.float()).to(x.dtype)
        return self.rms_norm(summed, weight, eps), summed

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (gate first) -> silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)

    def fuses_norm(self, tokens: int, weight) -> bool:
        """Whether the decoder takes the fused add + RMSNorm path (linear_add, norm_linear; the lever fuse_norm):
        never in the reference."""
        return False

    def rope_out(self, tokens: int, weight, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                 cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6):
        """What the qkv projection takes as ``rope=`` to run the qkv epilogue in its own epilogue (the lever
        fuse_rope), or None: the decoder then runs qkv_epilogue after it. Never in the reference."""
        return None

    def gate_up_silu(self, x: torch.Tensor, weight) -> torch.Tensor:
        """The MLP's first half: silu_mul(linear(x, gate_up weight)), [T, I] (a backend may fuse the two)."""
        return self.silu_mul(self.linear(x, weight))

    def rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
        """Neox-style rotary embedding (rotate halves), as Llama/Qwen3 in HF.

        q [T, Hq, D], k [T, Hkv, D], positions [T] int, cos_sin [max_pos, D] (cos in [:, :D/2], sin in [:, D/2:]).
        Returns new (q, k)."""
        half = q.shape[-1] // 2
        cs = cos_sin[positions.long()].float()
        cos, sin = cs[:, None, :half], cs[:, None, half:]

        def rot(x):
            xf = x.float()
            x1, x2 = xf[..., :half], xf[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        return rot(q), rot(k)

    # -- KV cache -------------------------------------------------------------------------------------------
    def store_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Write k, v [T, Hkv, D] into the paged cache at flat slots (block * block_size + offset); -1 skips."""
        nb, bs = k_cache.shape[:2]
        keep = slot_mapping >= 0
        slots = slot_mapping[keep].long()
        k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
        v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)

    def qkv_epilogue(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                     cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
        """After the qkv projection: split qkv [T, (Hq + 2 Hkv) x D] into heads, RMSNorm q and k per head (Qwen3;
        None skips), rotate them, store k and v in the paged cache; returns q [T, Hq, D]. Composed from this
        backend's own ops, so a backend that routes only some of them still composes its routed ones."""
        t, d = qkv.shape[0], k_cache.shape[-1]
        q, k, v = qkv.split([num_q_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
        q, k, v = q.reshape(t, num_q_heads, d), k.reshape(t, num_kv_heads, d), v.reshape(t, num_kv_heads, d)
        if q_norm is not None:
            q = self.rms_norm(q.reshape(t * num_q_heads, d), q_norm, eps).reshape(t, num_q_heads, d)
            k = self.rms_norm(k.reshape(t * num_kv_heads, d), k_norm, eps).reshape(t, num_kv_heads, d)
        q, k = self.rope(q, k, positions, cos_sin)
        self.store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    @staticmethod
    def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
        """The first ``length`` cached tokens of one sequence: [length, Hkv, D]."""
        bs = cache.shape[1]
        nblocks = (length + bs - 1) // bs
        blocks = block_table[:nblocks].long()
        return cache[blocks].reshape(-1, *cache.shape[2:])[:length]

    # -- attention ------------------------------------------------------------------------------------------
    def _attend(self, q, k, v, scale, causal_offset):
        """q [Lq, Hq, D], k/v [Lk, Hkv, D]; query i may see keys j <= i + causal_offset. fp32 math."""
        hq, hkv = q.shape[1], k.shape[1]
        group = hq // hkv
        qf = q.float().transpose(0, 1)                                       # [Hq, Lq, D]
        kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)       # [Hq, Lk, D]
        vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
        s = torch.matmul(qf, kf.transpose(1, 2)) * scale
        lq, lk = q.shape[0], k.shape[0]
        mask = torch.arange(lk)[None, :] > (torch.arange(lq)[:, None] + causal_offset)
        s = s.masked_fill(mask.to(s.device), float("-inf"))
        p = torch.softmax(s, dim=-1)
        return torch.matmul(p, vf).transpose(0, 1).to(q.dtype)              # [Lq, Hq, D]

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                          scale: float) -> torch.Tensor:
        """Causal varlen attention of new tokens q [T, Hq, D] over the paged cache (already holding them)."""
        out = torch.empty_like(q)
        cu = cu_seqlens_q.tolist()
        for b in range(len(cu) - 1):
            s, e = cu[b], cu[b + 1]
            ctx = int(context_lens[b])
            k = self.gather_kv(k_cache, block_tables[b], ctx)
            v = self.gather_kv(v_cache, block_tables[b], ctx)
            out[s:e] = self._attend(q[s:e], k, v, scale, causal_offset=ctx - (e - s))
        return out

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         max_context_len: int | None = None) -> torch.Tensor:
        """One new token per sequence: q [B, Hq, D] over its whole cached context. ``max_context_len`` is a host-side
        upper bound on context_lens (split-KV kernels size their splits from it; the reference ignores it)."""
        out = torch.empty_like(q)
        for b in range(q.shape[0]):
            ctx = int(context_lens[b])
            k = self.gather_kv(k_cache, block_tables[b], ctx)
            v = self.gather_kv(v_cache, block_tables[b], ctx)
            out[b:b + 1] = self._attend(q[b:b + 1], k, v, scale, causal_offset=ctx)
        return out

    # -- projections ----------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight) -> torch.Tensor:
        """x [T, K] @ W^T with W [N, K] dense (x's dtype) or a QuantizedWeight (W4A16: dequantized on the fly)."""
        if isinstance(weight, QuantizedWeight):
            w = dequantize(weight, dtype=torch.float32)
            return (x.float() @ w.t()).to(x.dtype)
        if x.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cpu":
            return (x.float() @ weight.float().t()).to(x.dtype)
        return x @ weight.t()

    # -- sampling ------------------------------------------------------------------------------------------
    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """argmax over the vocab, lowest index on ties; logits [B, V] -> [B] int64."""
        return logits.float().argmax(dim=-1)


def rope_cos_sin(head_dim: int, max_pos: int, theta: float, device=None, rope_scaling: dict | None = None):
    """cos/sin table [max_pos, head_dim] in fp32 (cos in the first half, sin in the second), HF's inv_freq."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
    t = torch.arange(max_pos, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def _llama3_inv_freq(inv_freq, cfg):
    factor, lo, hi = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
    old = cfg["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen <= old / lo) & (wavelen >= old / hi)
    return torch.where(is_mid, mid, scaled)
