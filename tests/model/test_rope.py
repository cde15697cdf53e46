"""Rotary embeddings: frequencies equal transformers' for default, linear and llama3 scaling."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from baton_engine.model.loader.hf_config import model_config_from_hf
from baton_engine.model.rope import RotaryTable, apply_rotary, inverse_frequencies, rotate_in_place

BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 10,
    "hidden_size": 128,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 16384,
}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_inverse_frequencies(rope: dict[str, Any]) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(**{k: v for k, v in BASE.items() if k != "architectures"}, rope_parameters=rope)
    if rope.get("rope_type", "default") == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")[0]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
        LLAMA3,
    ],
)
def test_inverse_frequencies_equal_transformers(rope: dict[str, Any]) -> None:
    config = model_config_from_hf({**BASE, "rope_parameters": rope})
    assert torch.equal(inverse_frequencies(config), _hf_inverse_frequencies(rope))


def test_gguf_frequency_factors_reproduce_llama3_scaling() -> None:
    plain = _hf_inverse_frequencies({"rope_type": "default", "rope_theta": 500000.0})
    scaled = _hf_inverse_frequencies(LLAMA3)
    factors = tuple((plain / scaled).tolist())
    config = model_config_from_hf(
        {**BASE, "rope_parameters": {"rope_type": "freq_factors", "rope_theta": 500000.0, "factors": factors}}
    )
    torch.testing.assert_close(inverse_frequencies(config), scaled, rtol=1e-6, atol=0)
    assert factors[0] == pytest.approx(1.0) and factors[-1] == pytest.approx(8.0)


def test_rotation_equals_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    config = model_config_from_hf({**BASE, "rope_parameters": LLAMA3})
    table = RotaryTable(config, torch.float64, "cpu")
    positions = torch.tensor([0, 5, 77, 255])
    q = torch.randn(4, 2, 64, dtype=torch.float64)
    k = torch.randn(4, 1, 64, dtype=torch.float64)
    cos, sin = table.lookup(positions)
    expected_q, expected_k = apply_rotary_pos_emb(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        cos[:, 0].unsqueeze(0),
        sin[:, 0].unsqueeze(0),
    )
    assert torch.equal(apply_rotary(q, cos, sin), expected_q[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, cos, sin), expected_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rotation_in_place_is_bit_identical(dtype: torch.dtype) -> None:
    config = model_config_from_hf({**BASE, "rope_parameters": LLAMA3})
    table = RotaryTable(config, dtype, "cpu")
    positions = torch.tensor([0, 5, 77, 255, 16383])
    cos, sin = table.lookup(positions)
    generator = torch.Generator().manual_seed(4)
    # q (2 heads), k (1), v (1) side by side, as the qkv projection writes them
    qkv = torch.randn(5, 4 * 64, generator=generator, dtype=torch.float64).to(dtype)
    expected_q = apply_rotary(qkv[:, :128].reshape(5, 2, 64), cos, sin)
    expected_k = apply_rotary(qkv[:, 128:192].reshape(5, 1, 64), cos, sin)
    v = qkv[:, 192:].clone()
    rotate_in_place(qkv[:, :192].view(5, 3, 64), cos, sin)  # q and k in one call
    assert torch.equal(qkv[:, :128].view(5, 2, 64), expected_q)
    assert torch.equal(qkv[:, 128:192].view(5, 1, 64), expected_k)
    assert torch.equal(qkv[:, 192:], v)  # v untouched
