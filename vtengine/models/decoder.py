"""One decoder for Llama and Qwen3 dense models (Qwen3 = Llama + RMSNorm on q and k per head).

Weights arrive as an HF-named state dict. At build time q/k/v are concatenated into one [q+k+v, H] projection and
gate/up into one [2I, H] projection (one GEMM each instead of three and two); with quant=mxfp4|nvfp4 those and
o/down are quantized on load (per row along K, so fusing rows changes no value). Embedding, norms and the LM head
stay in the activation dtype. Every op goes through the backend (torch references or Triton kernels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vtengine.backends.torch_backend import rope_cos_sin
from vtengine.config import ConfigError, ModelConfig
from vtengine.quant import quantize


@dataclass
class AttnContext:
    """What attention needs for one step (see the shape conventions in backends/torch_backend.py)."""
    is_prefill: bool
    slot_mapping: torch.Tensor          # [T] int64 flat cache slots
    context_lens: torch.Tensor          # [B] int32
    block_tables: torch.Tensor          # [B, max_blocks] int32
    cu_seqlens_q: torch.Tensor | None = None   # [B+1] int32 (prefill)
    last_token_idx: torch.Tensor | None = None  # [B] index of each sequence's last token in the flat batch
    max_context_len: int = 0            # host-side bound on context_lens: sizes split-KV without a device sync
    decode: "AttnContext | None" = None  # a mixed step's decoding rows (the batch's last rows): their own context

    def sliced(self, b: int) -> "AttnContext":
        """The first b sequences of a decode context (views: CUDA-graph buffers stay shared)."""
        return AttnContext(False, self.slot_mapping[:b], self.context_lens[:b], self.block_tables[:b],
                           max_context_len=self.max_context_len)


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: object                         # dense [q+k+v, H] or QuantizedWeight
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: object
    post_norm: torch.Tensor
    gate_up: object
    down: object


class DecoderModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], backend, quant: str = "bf16",
                 dtype=torch.float32, device="cpu"):
        self.cfg, self.backend, self.quant, self.dtype, self.device = cfg, backend, quant, dtype, torch.device(device)
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        if hq % hkv:
            raise ConfigError(f"num_attention_heads {hq} is not a multiple of num_key_value_heads {hkv}")
        self.q_size, self.kv_size = hq * d, hkv * d
        self.scale = d ** -0.5

        def take(name):
            if name not in weights:
                raise ConfigError(f"checkpoint is missing the tensor {name!r}")
            return weights.pop(name)

        def dense(t):
            return t.to(device=self.device, dtype=dtype).contiguous()

        def proj(*names):
            w = torch.cat([take(n).to(self.device) for n in names], dim=0) if len(names) > 1 else take(names[0])
            if quant == "bf16":
                return dense(w)
            return quantize(w.to(self.device), quant)

        self.embed = dense(take("model.embed_tokens.weight"))
        self.layers: list[Layer] = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(Layer(
                input_norm=dense(take(p + "input_layernorm.weight")),
                qkv=proj(p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"),
                q_norm=dense(take(p + "self_attn.q_norm.weight")) if cfg.qk_norm else None,
                k_norm=dense(take(p + "self_attn.k_norm.weight")) if cfg.qk_norm else None,
                o=proj(p + "self_attn.o_proj.weight"),
                post_norm=dense(take(p + "post_attention_layernorm.weight")),
                gate_up=proj(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=proj(p + "mlp.down_proj.weight"),
            ))
        self.norm = dense(take("model.norm.weight"))
        head = weights.pop("lm_head.weight", None)
        self.lm_head = self.embed if (cfg.tie_word_embeddings or head is None) else dense(head)
        self.cos_sin = rope_cos_sin(d, cfg.max_position_embeddings, cfg.rope_theta, self.device, cfg.rope_scaling)

    def weight_bytes(self) -> int:
        """Bytes a decode step must read at least once (every weight; the tied head counted once)."""
        def nbytes(w):
            return w.nbytes() if hasattr(w, "fmt") else w.numel() * w.element_size()
        total = sum(nbytes(t) for t in (self.norm,))
        for L in self.layers:
            total += sum(nbytes(w) for w in (L.input_norm, L.qkv, L.o, L.post_norm, L.gate_up, L.down))
        total += nbytes(self.lm_head)
        return total

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttnContext,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Hidden states after the final norm, [T, H] (or [B, H] for the last tokens when ctx.last_token_idx)."""
        be, cfg = self.backend, self.cfg
        t = input_ids.shape[0]
        d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        h = self.embed[input_ids]
        residual, ss, gained = None, None, None
        # the lever fuse_norm: the residual add in the o and down GEMVs, RMSNorm in the qkv and gate_up GEMVs
        fuse = bool(self.layers) and be.fuses_norm(t, self.layers[0].qkv)
        # the norm each down GEMV's residual feeds: the next layer's input norm (the final norm stays separate)
        next_norm = {id(a): b.input_norm for a, b in zip(self.layers, self.layers[1:])}
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            # the lever fuse_rope: the qkv projection runs the qkv epilogue itself (q out, k and v to the cache)
            rope = be.rope_out(t, layer.qkv, hq, hkv, positions, self.cos_sin, k_cache, v_cache, ctx.slot_mapping,
                               layer.q_norm, layer.k_norm, cfg.rms_norm_eps)
            on = {} if rope is None else {"rope": rope}
            if residual is None:
                residual, x = h, be.rms_norm(h, layer.input_norm, cfg.rms_norm_eps)
                qkv = be.linear(x, layer.qkv, **on)
            elif fuse:
                qkv = be.norm_linear(residual, ss, layer.input_norm, cfg.rms_norm_eps, layer.qkv, gained=gained, **on)
            else:
                x, residual = be.add_rms_norm(h, residual, layer.input_norm, cfg.rms_norm_eps)
                qkv = be.linear(x, layer.qkv, **on)
            q = qkv if rope is not None else be.qkv_epilogue(qkv, hq, hkv, positions, self.cos_sin, k_cache, v_cache,
                                                             ctx.slot_mapping, layer.q_norm, layer.k_norm,
                                                             cfg.rms_norm_eps)
            if ctx.is_prefill and ctx.decode is not None:      # a mixed step: prefill rows, then decoding rows
                tp = t - ctx.decode.context_lens.shape[0]
                attn = torch.cat([
                    be.prefill_attention(q[:tp], k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                                         ctx.block_tables, self.scale),
                    be.decode_attention(q[tp:], k_cache, v_cache, ctx.decode.block_tables, ctx.decode.context_lens,
                                        self.scale, max_context_len=ctx.decode.max_context_len)])
            elif ctx.is_prefill:
                attn = be.prefill_attention(q, k_cache, v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                                            ctx.block_tables, self.scale)
            else:
                attn = be.decode_attention(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens, self.scale,
                                           max_context_len=ctx.max_context_len)
            if fuse:
                # each add also hands the next GEMV its input times the next norm's weight (None where it cannot)
                residual, ss, gained = be.linear_add(attn.reshape(t, hq * d), layer.o, residual, layer.post_norm)
                act = be.norm_linear(residual, ss, layer.post_norm, cfg.rms_norm_eps, layer.gate_up, silu_mul=True,
                                     gained=gained)
                following = next_norm.get(id(layer))
                residual, ss, gained = be.linear_add(act, layer.down, residual, following)
                continue
            h = be.linear(attn.reshape(t, hq * d), layer.o)
            x, residual = be.add_rms_norm(h, residual, layer.post_norm, cfg.rms_norm_eps)
            h = be.linear(be.gate_up_silu(x, layer.gate_up), layer.down)
        if fuse:                        # the last down GEMV added the residual already
            if ctx.last_token_idx is not None:
                residual = residual[ctx.last_token_idx]
            return be.rms_norm(residual, self.norm, cfg.rms_norm_eps)
        if ctx.last_token_idx is not None:
            h, residual = h[ctx.last_token_idx], residual[ctx.last_token_idx]
        x, _ = be.add_rms_norm(h, residual, self.norm, cfg.rms_norm_eps)
        return x

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [rows, vocab]; into ``out`` when given (CUDA graphs share one static output buffer)."""
        y = self.backend.linear(hidden, self.lm_head)
        return y.float() if out is None else out.copy_(y)
