"""GGUF loading checked against safetensors: tiny models written as llama.cpp would write them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from baton_engine.model.loader.model_loading import load_model
from baton_engine.model.rope import inverse_frequencies
from baton_support.tiny_models import PARITY, parity_model

VOCAB = PARITY.vocab_size

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF:
        return HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_PARTS[part]}.{kind}"


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter: each head's rows go from [first half, second half] to interleaved pairs.
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _write_gguf(model: Any, family: str, path: Path, rope_factors: np.ndarray | None = None) -> None:
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), family)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = [*alphabet, "ab"] + [f"<extra_{i}>" for i in range(VOCAB - len(alphabet) - 1)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(alphabet) + 1) + [3] * (VOCAB - len(alphabet) - 1))
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(VOCAB - 1)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.to(torch.float32).numpy()
        if family == "llama" and ".q_proj." in name:
            array = _permute(array, config.num_attention_heads)
        elif family == "llama" and ".k_proj." in name:
            array = _permute(array, config.num_key_value_heads)
        if name.endswith("mlp.down_proj.weight"):
            array = array.astype(np.float16)  # exercise the dequantize path
        writer.add_tensor(_gguf_name(name), array)
    if rope_factors is not None:
        writer.add_tensor("rope_freqs.weight", rope_factors.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gguf_weights_equal_the_safetensors_weights(family: str, tmp_path: Path) -> None:
    model = parity_model(family, seed=4).save(tmp_path / "hf")
    llama_factors = None
    if family == "llama":
        from_hf = load_model(str(tmp_path / "hf"), "cpu", torch.float32)
        plain = inverse_frequencies(dataclasses.replace(from_hf.config, rope_scaling=None))
        llama_factors = (plain / inverse_frequencies(from_hf.config)).numpy()
    _write_gguf(model, family, tmp_path / "tiny.gguf", llama_factors)

    reference = load_model(str(tmp_path / "hf"), "cpu", torch.float32)
    loaded = load_model(str(tmp_path / "tiny.gguf"), "cpu", torch.float32)
    assert loaded.source.format == "gguf"
    assert loaded.config.family == family
    assert loaded.config.tie_word_embeddings == reference.config.tie_word_embeddings
    assert (loaded.config.qkv_bias, loaded.config.qk_norm) == (
        reference.config.qkv_bias,
        reference.config.qk_norm,
    )
    expected = reference.model.state_dict()
    got = loaded.model.state_dict()
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if name.endswith("gate_up_proj.weight") or "down_proj" in name:
            tolerance = 1e-3 if "down_proj" in name else 0.0
            torch.testing.assert_close(got[name], value, rtol=tolerance, atol=tolerance)
        else:
            assert torch.equal(got[name], value), name
    # rope_freqs reproduce the llama3 frequencies up to float32 rounding.
    torch.testing.assert_close(
        inverse_frequencies(loaded.config), inverse_frequencies(reference.config), rtol=1e-6, atol=0
    )
    torch.testing.assert_close(loaded.model.rotary.cos, reference.model.rotary.cos, rtol=0, atol=5e-5)
    assert loaded.tokenizer is not None
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert loaded.tokenizer.encode("abc") == [len(alphabet), alphabet.index("c")]
    assert loaded.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "hi"
