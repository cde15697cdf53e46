"""The model's hyper-parameters, independent of the file format they were read from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

ModelFamily = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]

#: Hugging Face `architectures` entries (and GGUF `general.architecture` values) we can run.
SUPPORTED_ARCHITECTURES: dict[str, ModelFamily] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

#: RoPE variants the rotary table implements.
#: "freq_factors" divides each frequency by a per-pair factor (llama.cpp's `rope_freqs` tensor,
#: how GGUF files carry Llama 3.1 scaling); the factors are in ``rope_scaling["factors"]``.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


class UnsupportedArchitectureError(ValueError):
    """The checkpoint describes a model this engine cannot run."""


@dataclass(frozen=True)
class MoeConfig:
    """The sparse mixture-of-experts layers of a model (see `model.moe` for the routing rules)."""

    num_experts: int
    num_experts_per_tok: int
    """Experts each token is routed to (top k)."""
    moe_intermediate_size: int
    """Each expert's MLP width."""
    norm_topk_prob: bool
    """Renormalise the k chosen probabilities to sum to 1."""
    routing_in_float32: bool
    """Keep the routing weights in float32 when scaling the experts' outputs (Mixtral) instead of
    casting them to the model dtype first (Qwen3-MoE)."""
    sparse_layers: tuple[int, ...]
    """Layers whose MLP is the MoE block; the others have a dense MLP of `intermediate_size`."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in [1, num_experts "
                f"({self.num_experts})]"
            )


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
    moe: MoeConfig | None = None
    """The mixture-of-experts layers (None: every layer has a dense MLP)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def is_sparse_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

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
