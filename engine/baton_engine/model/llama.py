"""The Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3; Qwen3-MoE and Mixtral, whose
sparse layers' MLP is `moe.SparseMoeBlock`) on flattened tokens.

Module names follow the Hugging Face checkpoints (``model.layers.N.self_attn.o_proj`` ...),
except for the merged ``qkv_proj`` and ``gate_up_proj`` (see `weights.py`). One forward runs a
whole scheduler step: decode rows and prefill chunks concatenated into ``T`` tokens, attention
routed through a backend. Built for one rank of a tensor-parallel group (`TensorParallel`;
the default is the whole model on one rank), each layer holds its rank's shard (`linear.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import cast

import torch
from torch import nn

from baton_engine.model.attention.backend import AttentionBackend
from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.config import ModelConfig
from baton_engine.model.layers import BuildContext, GatedMLP, RMSNorm
from baton_engine.model.linear import (
    QKVParallelLinear,
    QuantizationConfig,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from baton_engine.model.moe import SparseMoeBlock
from baton_engine.model.parallel import SINGLE, TensorParallel, check_model_shape
from baton_engine.model.rope import RotaryTable, apply_rotary, rotate_in_place
from baton_engine.model.weight_source import WeightSource, as_source
from baton_engine.model.weights import load_checkpoint


class SelfAttention(nn.Module):
    """This rank's attention heads: q/k/v column-parallel by heads, o row-parallel."""

    def __init__(self, ctx: BuildContext, prefix: str) -> None:
        super().__init__()
        config = ctx.config
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            bias=config.qkv_bias,
            **ctx.linear(f"{prefix}.qkv_proj"),
        )
        self.num_heads = self.qkv_proj.num_local_heads
        self.num_kv_heads = self.qkv_proj.num_local_kv_heads
        self.split_sizes = list(self.qkv_proj.output_sizes_per_rank)
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim,
            config.hidden_size,
            bias=config.o_bias,
            **ctx.linear(f"{prefix}.o_proj"),
        )
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ctx.dtype, ctx.device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ctx.dtype, ctx.device)
        self.rotate_in_place = False
        """Rotate q and k inside the qkv projection's output (`rope.rotate_in_place`, the same
        bits as `apply_rotary` in fewer passes); the CPU runner turns it on."""

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        backend: AttentionBackend,
        batch: AttentionBatch,
        plan: object,
        kv_scale: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """kv_scale: the layer's [2] (K, V) scales of an FP8 cache (None: a 16-bit cache);
        residual: added to the output projection (in its epilogue where the layer can)."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_flat, k_flat, v_flat = qkv.split(self.split_sizes, dim=-1)
        q = q_flat.reshape(tokens, self.num_heads, self.head_dim)
        k = k_flat.reshape(tokens, self.num_kv_heads, self.head_dim)
        v = v_flat.reshape(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if not self.rotate_in_place:
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        elif self.q_norm is None:  # q and k side by side in qkv: one rotation of both
            heads = self.num_heads + self.num_kv_heads
            rotate_in_place(qkv[:, : heads * self.head_dim].view(tokens, heads, self.head_dim), cos, sin)
        else:
            rotate_in_place(q, cos, sin)
            rotate_in_place(k, cos, sin)
        out = backend.forward(q, k, v, layer_cache, batch, plan, self.scale, kv_scale)
        projected: torch.Tensor = self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim), residual)
        return projected


class DecoderLayer(nn.Module):
    def __init__(self, ctx: BuildContext, prefix: str, index: int) -> None:
        super().__init__()
        config = ctx.config
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype, ctx.device)
        self.self_attn = SelfAttention(ctx, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, ctx.dtype, ctx.device
        )
        self.mlp: GatedMLP | SparseMoeBlock
        if config.moe is not None and config.is_sparse_layer(index):
            self.mlp = SparseMoeBlock(ctx, f"{prefix}.mlp", config.moe)
            return
        self.mlp = GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.mlp_bias,
            prefix=f"{prefix}.mlp",
            dtype=ctx.dtype,
            device=ctx.device,
            parallel=ctx.parallel,
            quantization=ctx.quantization,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        backend: AttentionBackend,
        batch: AttentionBatch,
        plan: object,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        hidden = self.self_attn(
            normed, cos, sin, layer_cache, backend, batch, plan, kv_scale, residual=hidden
        )
        normed = self.post_attention_layernorm(hidden)
        out: torch.Tensor
        if isinstance(self.mlp, GatedMLP):
            out = self.mlp(normed, residual=hidden)
        else:
            out = hidden + self.mlp(normed)
        return out


class DecoderStack(nn.Module):
    def __init__(self, ctx: BuildContext) -> None:
        super().__init__()
        config = ctx.config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size,
            config.hidden_size,
            prefix="model.embed_tokens",
            dtype=ctx.dtype,
            device=ctx.device,
            parallel=ctx.parallel,
        )
        self.layers = nn.ModuleList(
            DecoderLayer(ctx, f"model.layers.{i}", i) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ctx.dtype, ctx.device)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [cast(DecoderLayer, layer) for layer in self.layers]


class CausalLM(nn.Module):
    """Decoder plus LM head. `forward` returns hidden states; `compute_logits` the chosen rows' logits."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        parallel: TensorParallel = SINGLE,
        quantization: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        check_model_shape(config, parallel.size)
        ctx = BuildContext(config, dtype, device, parallel, quantization)
        self.config = config
        self.parallel = parallel
        self.model = DecoderStack(ctx)
        self.lm_head: VocabParallelEmbedding | None = None
        if not config.tie_word_embeddings:
            self.lm_head = VocabParallelEmbedding(
                config.vocab_size,
                config.hidden_size,
                prefix="lm_head",
                dtype=dtype,
                device=device,
                parallel=parallel,
            )
        self.rotary = RotaryTable(config, dtype, device)
        self.logits_packed: torch.Tensor | None = None
        """The LM head's weight (tied: the embedding's) reordered for oneDNN, or None."""

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank holds (the KV cache's head dimension)."""
        return self.model.decoder_layers()[0].self_attn.num_kv_heads

    @property
    def num_local_heads(self) -> int:
        return self.model.decoder_layers()[0].self_attn.num_heads

    @property
    def lm_head_layer(self) -> VocabParallelEmbedding:
        """The (tied or separate) vocabulary projection."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        batch: AttentionBatch,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: [T]; kv_cache: [layers, 2, blocks, block_size, local kv_heads, head_dim];
        kv_scales: [layers, 2] (K, V) scales of an FP8 cache (None: a 16-bit cache)."""
        plan = backend.prepare(batch)
        cos, sin = self.rotary.lookup(batch.positions)
        hidden = self.model.embed_tokens(input_ids)
        for index, layer in enumerate(self.model.decoder_layers()):
            scale = None if kv_scales is None else kv_scales[index]
            hidden = layer(hidden, cos, sin, kv_cache[index], backend, batch, plan, scale)
        normed: torch.Tensor = self.model.norm(hidden)
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab], whole rows on every rank."""
        return self.lm_head_layer.logits(hidden, self.logits_packed)


Weights = Mapping[str, torch.Tensor | WeightSource] | Iterable[tuple[str, torch.Tensor | WeightSource]]
"""Checkpoint tensors by Hugging Face name: a mapping, or (name, tensor) pairs read lazily."""


def build_model(
    config: ModelConfig,
    weights: Weights,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    parallel: TensorParallel = SINGLE,
    quantization: QuantizationConfig | None = None,
) -> CausalLM:
    """A `CausalLM` for rank `parallel.rank`, holding its shard of `weights` in `dtype` on `device`.

    Parameters are allocated once on the device and each checkpoint tensor is copied in shard
    by shard (read lazily when the source allows it), so neither the host nor the device ever
    holds more than this rank's weights plus one tensor in flight.
    """
    model = CausalLM(config, dtype, device, parallel, quantization)
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    load_checkpoint(model, ((name, as_source(w)) for name, w in pairs))
    return model.eval().requires_grad_(False)
