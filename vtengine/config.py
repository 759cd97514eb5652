"""Model and engine configuration (not levers: levers live in conf/lever/ and vtengine/levers.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

QUANTS = ("bf16", "mxfp4", "nvfp4")


class ConfigError(ValueError):
    """A bad model name, path, quant or engine setting; the message names the value and what is accepted."""


@dataclass
class ModelConfig:
    """Shapes of a Llama/Qwen3 dense decoder, in HF config.json's vocabulary."""
    arch: str                       # "llama" | "qwen3" (qwen3 = llama + q/k RMSNorm, no qkv bias)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    @property
    def qk_norm(self) -> bool:
        return self.arch == "qwen3"

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        mtype = cfg.get("model_type", "llama")
        if mtype not in ("llama", "qwen3", "mistral"):
            raise ConfigError(f"model_type {mtype!r} is not supported; accepted: 'llama', 'qwen3' (dense)")
        heads = cfg["num_attention_heads"]
        # transformers 5 writes rope settings under rope_parameters instead of top-level rope_theta/rope_scaling
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            arch="qwen3" if mtype == "qwen3" else "llama",
            vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads, num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling, max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False), bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict transformers accepts (used to build the HF oracle from the same weights)."""
        d = {
            "model_type": self.arch, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False,
        }
        if self.rope_scaling:
            d["rope_scaling"] = self.rope_scaling
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_id:
            d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        return d


@dataclass
class EngineConfig:
    model: str = "tiny"                 # a preset name (conf/model/) or a path (HF directory or .gguf file)
    quant: str = "bf16"
    backend: str | None = None          # None: "triton" on CUDA, "torch" on CPU
    triton_kernels: list[str] | None = None   # backend=triton: route only these kernels through Triton (None: all)
    device: str | None = None           # None: "cuda" if available else "cpu"
    dtype: str | None = None            # None: bfloat16 on CUDA, float32 on CPU
    levers: dict[str, Any] = field(default_factory=dict)
    block_size: int = 16
    num_kv_blocks: int | None = None    # None: sized from gpu_memory_utilization (CUDA) or max_model_len (CPU)
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int | None = None     # None: sized from the KV pool (vtengine/engine/llm_engine.py)
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    cuda_graphs: bool = True
    seed: int = 0

    def __post_init__(self):
        if self.quant not in QUANTS:
            raise ConfigError(f"quant {self.quant!r} is not supported; accepted: {list(QUANTS)}")
        if self.block_size not in (16, 32, 64):
            raise ConfigError(f"block_size {self.block_size!r} is not supported; accepted: 16, 32, 64")
        if self.max_num_seqs is not None and (isinstance(self.max_num_seqs, bool)
                                              or not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1):
            raise ConfigError(f"max_num_seqs must be a positive integer (or None: sized from the KV pool), got "
                              f"{self.max_num_seqs!r}")
        if not 0.05 <= self.gpu_memory_utilization <= 0.98:
            raise ConfigError(f"gpu_memory_utilization {self.gpu_memory_utilization!r} must be in [0.05, 0.98]")
