"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3) on flattened tokens.

Module names follow the Hugging Face checkpoints (``model.layers.N.self_attn.o_proj`` ...),
except for the fused ``qkv_proj`` and ``gate_up_proj`` (see `weights.py`). One forward runs a
whole scheduler step: decode rows and prefill chunks concatenated into ``T`` tokens, attention
routed through a backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton_engine.model.attention.backend import AttentionBackend
from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.config import ModelConfig
from baton_engine.model.layers import Embedding, GatedMLP, Linear, RMSNorm, onednn_linear
from baton_engine.model.rope import RotaryTable, apply_rotary
from baton_engine.model.weights import fuse_checkpoint_weights


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        backend: AttentionBackend,
        batch: AttentionBatch,
        plan: object,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        q_flat, k_flat, v_flat = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q_flat.reshape(tokens, self.num_heads, self.head_dim)
        k = k_flat.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v_flat.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        out = backend.forward(q, k, v, layer_cache, batch, plan, self.scale)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        backend: AttentionBackend,
        batch: AttentionBatch,
        plan: object,
    ) -> torch.Tensor:
        residual = hidden
        hidden = self.self_attn(self.input_layernorm(hidden), cos, sin, layer_cache, backend, batch, plan)
        hidden = residual + hidden
        residual = hidden
        hidden = self.mlp(self.post_attention_layernorm(hidden))
        return residual + hidden


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Decoder plus LM head. `forward` returns hidden states; `compute_logits` the chosen rows' logits."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryTable(config, dtype, device)
        self.logits_packed: torch.Tensor | None = None
        """The LM head's weight (tied: the embedding's) reordered for oneDNN, or None."""

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """input_ids: [T]; kv_cache: [layers, 2, blocks, block_size, kv_heads, head_dim]."""
        plan = backend.prepare(batch)
        cos, sin = self.rotary.lookup(batch.positions)
        hidden = self.model.embed_tokens(input_ids)
        for index, layer in enumerate(self.model.layers):
            hidden = layer(hidden, cos, sin, kv_cache[index], backend, batch, plan)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_packed is not None:
            return onednn_linear(hidden, self.logits_packed, None)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)


def build_model(
    config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str
) -> CausalLM:
    """A `CausalLM` holding `weights` (Hugging Face names), cast to `dtype` on `device`.

    The skeleton's parameters are uninitialised (untouched) CPU memory, replaced by the loaded
    tensors, so the device never holds two copies of the weights.
    """
    weights = fuse_checkpoint_weights(weights, config)
    model = CausalLM(config, dtype, device)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - weights.keys())
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weights the model needs, e.g. {missing[:3]}")
    state = {name: weights[name].to(device=device, dtype=dtype) for name in expected}
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)
