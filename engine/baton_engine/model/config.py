"""The model's hyper-parameters, independent of the file format they were read from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

ModelFamily = Literal["llama", "qwen2", "qwen3"]

#: Hugging Face `architectures` entries (and GGUF `general.architecture` values) we can run.
SUPPORTED_ARCHITECTURES: dict[str, ModelFamily] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

#: RoPE variants the rotary table implements.
#: "freq_factors" divides each frequency by a per-pair factor (llama.cpp's `rope_freqs` tensor,
#: how GGUF files carry Llama 3.1 scaling); the factors are in ``rope_scaling["factors"]``.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


class UnsupportedArchitectureError(ValueError):
    """The checkpoint describes a model this engine cannot run."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to build its layers and the KV cache."""

    family: ModelFamily
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
