"""The decoder's GPU forward: the `CausalLM`'s weights driven through Triton kernels.

The model already merges q/k/v and gate/up into single projections. Steps of more than
`gemv_max_tokens` tokens (`GEMV_ENGINE_MAX_TOKENS`: 1) run the model's layers (through their
quantization methods) with the fused element-wise kernels between them, 9 launches a layer:
add+norm, qkv, rotary+cache write, attention, o_proj, add+norm, gate_up, silu*mul, down (a sparse
layer's MLP is the MoE block: router, top-k, two grouped expert GEMMs). Single-token decode steps
(up to `GEMV_MAX_TOKENS` tokens when asked) of a dense model on one rank with a 16/32-bit cache,
its projections unquantized or FP8 (`Fp8LinearMethod`: the products read the FP8 weights and
apply their per-row scales, the arithmetic of the layers' own one-row products), are weight
sweeps: they run the decode products of `triton_gemv` on the layers' weights with the
element-wise work folded in, 5 launches a layer (norm+qkv+rotary+cache write, split-K attention
merging its own splits, o_proj+residual, norm+gate_up+silu*mul, down+residual); on NVIDIA sm_90+
they launch with programmatic dependent launch, each product loading its first weight tiles while
the kernel before it finishes. It holds no weights of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from baton_engine.model.kernels.launch_table import launch_table_for
from baton_engine.model.kernels.triton_attention import (
    DecodeWorkspace,
    paged_decode_attention,
    paged_prefill_attention,
)
from baton_engine.model.kernels.triton_fp8 import fp8_gemv_table
from baton_engine.model.kernels.triton_fused import (
    fused_add_rms_norm,
    rms_norm,
    rotary_cache_write,
    silu_and_mul,
)
from baton_engine.model.kernels.triton_gemv import (
    GEMV_ENGINE_MAX_TOKENS,
    GemvTable,
    default_gemv_table,
    gemv,
    gemv_qkv_rope,
    gemv_residual,
    gemv_silu,
    residual_programs,
    sum_squares,
)
from baton_engine.model.kernels.triton_multi_query import paged_multi_query_attention
from baton_engine.model.kernels.triton_tiles import pdl_supported
from baton_engine.model.layers import GatedMLP
from baton_engine.model.linear import ParallelLinear, UnquantizedLinearMethod
from baton_engine.model.llama import CausalLM
from baton_engine.model.moe import SparseMoeBlock
from baton_engine.model.quantization.fp8_linear import Fp8LinearMethod


@dataclass
class DecodeMeta:
    """One query token per row (graph-capturable: device tensors only)."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    workspace: DecodeWorkspace


@dataclass
class VerifyMeta:
    """A fixed number of query tokens per row (speculative verify; graph-capturable)."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_lens: torch.Tensor  # [B] int32, real tokens of each row (<= query_len)
    query_len: int  # token slots per row: the step's tokens are [B * query_len]
    workspace: DecodeWorkspace


@dataclass
class PrefillMeta:
    """Any query length per row (prefill chunks, mixed steps, speculative rows)."""

    block_tables: torch.Tensor
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor
    tile_rows: torch.Tensor  # [tiles] int32
    tile_starts: torch.Tensor


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv_proj: ParallelLinear
    o_proj: ParallelLinear
    post_norm: torch.Tensor
    mlp: GatedMLP | SparseMoeBlock
    """The dense MLP (gate_up, silu * up, down: the model's projections around the fused kernel)
    or the MoE block (router and Triton fused experts)."""
    q_norm: nn.Module | None
    k_norm: nn.Module | None


class FusedDecoder:
    """This rank's forward: its heads and MLP shard; the row-parallel projections all-reduce
    (inside captured graphs too) and the LM head all-gathers the vocabulary."""

    def __init__(
        self,
        model: CausalLM,
        gemv_table: GemvTable | None = None,
        decode_gemv: bool = True,
        gemv_max_tokens: int = GEMV_ENGINE_MAX_TOKENS,
        pdl: bool | None = None,
    ) -> None:
        """`decode_gemv`: steps of at most `gemv_max_tokens` tokens (<= `GEMV_MAX_TOKENS`) take
        the decode products, for models whose projections are unquantized and on one rank (the
        products add into the residual in place, with no all-reduce) and without q/k norms
        (whose per-head norm needs a head's whole row). `pdl`: launch those steps' kernels with
        programmatic dependent launch, each kernel's launch overlapping the one before it (None:
        where the device supports it, `pdl_supported`: NVIDIA sm_90+; never on AMD)."""
        config = model.config
        self.config = config
        self.eps = config.rms_norm_eps
        self.num_heads = model.num_local_heads
        self.num_kv_heads = model.num_local_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_size = self.num_heads * config.head_dim
        self.embed = model.model.embed_tokens
        self.final_norm = model.model.norm.weight
        self.lm_head = model.lm_head_layer
        self.vocab_size = config.vocab_size
        self.cos = model.rotary.cos
        # Launch parameters of the device the weights live on (AMD and NVIDIA differ).
        self.launch = launch_table_for(self.embed.weight.device)
        self.sin = model.rotary.sin
        self.gemv_table = default_gemv_table(self.embed.weight.device) if gemv_table is None else gemv_table
        self.layers: list[_Layer] = []
        for layer in model.model.decoder_layers():
            attn = layer.self_attn
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight,
                    qkv_proj=attn.qkv_proj,
                    o_proj=attn.o_proj,
                    post_norm=layer.post_attention_layernorm.weight,
                    mlp=layer.mlp,
                    q_norm=attn.q_norm,
                    k_norm=attn.k_norm,
                )
            )
        dense = all(isinstance(x.mlp, GatedMLP) for x in self.layers)
        projections = [p for x in self.layers for p in (x.qkv_proj, x.o_proj)] + [
            p
            for x in self.layers
            if isinstance(x.mlp, GatedMLP)
            for p in (x.mlp.gate_up_proj, x.mlp.down_proj)
        ]
        methods = {type(p.quant_method) for p in projections}
        fp8_weights = methods == {Fp8LinearMethod}
        plain = (
            dense
            and not self.lm_head.parallel.is_parallel
            and not any(p.parallel.is_parallel for p in projections)
            and (methods == {UnquantizedLinearMethod} or fp8_weights)
        )
        self.gemv_max_tokens = gemv_max_tokens if decode_gemv and plain and not config.qk_norm else 0
        # The projections' launches: FP8 weights take their own table (twice the columns a loop
        # for the same bytes); the LM head stays 16-bit and keeps the 16-bit table's entry.
        self.projection_table = fp8_gemv_table(self.embed.weight.device) if fp8_weights else self.gemv_table
        self.pdl = pdl_supported(self.embed.weight.device) if pdl is None else pdl

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: DecodeMeta | VerifyMeta | PrefillMeta,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [T, hidden]; writes the step's K/V into `kv_cache` (FP8 with
        `kv_scales` [layers, 2], else 16/32-bit)."""
        tokens = input_ids.shape[0]
        if 0 < tokens <= self.gemv_max_tokens and kv_scales is None:  # the products write 16/32-bit K/V
            return self._forward_few(input_ids, positions, slot_mapping, kv_cache, meta)
        residual = self.embed(input_ids)
        mlp_out: torch.Tensor | None = None
        h, d = self.num_heads, self.head_dim
        launch = self.launch
        for index, layer in enumerate(self.layers):
            if mlp_out is None:
                normed = rms_norm(residual, layer.input_norm, self.eps, launch=launch)
            else:
                normed = fused_add_rms_norm(mlp_out, residual, layer.input_norm, self.eps, launch=launch)
            qkv = layer.qkv_proj(normed)
            if layer.q_norm is not None and layer.k_norm is not None:
                kv_size = self.num_kv_heads * d
                q_view = qkv[:, : self.q_size].view(tokens, h, d)
                k_view = qkv[:, self.q_size : self.q_size + kv_size].view(tokens, self.num_kv_heads, d)
                q_view.copy_(layer.q_norm(q_view))
                k_view.copy_(layer.k_norm(k_view))
            layer_cache = kv_cache[index]
            kv_scale = None if kv_scales is None else kv_scales[index]
            rotary_cache_write(
                qkv, positions, self.cos, self.sin, slot_mapping, layer_cache, h, self.num_kv_heads, d,
                kv_scale, launch,
            )  # fmt: skip
            attn = self._attention(qkv[:, : self.q_size].view(tokens, h, d), layer_cache, meta, kv_scale)
            attn_out = layer.o_proj(attn.view(tokens, self.q_size))
            normed = fused_add_rms_norm(attn_out, residual, layer.post_norm, self.eps, launch=launch)
            mlp = layer.mlp
            if isinstance(mlp, SparseMoeBlock):
                mlp_out = mlp(normed)
            else:
                mlp_out = mlp.down_proj(silu_and_mul(mlp.gate_up_proj(normed), launch=launch))
        assert mlp_out is not None
        return fused_add_rms_norm(mlp_out, residual, self.final_norm, self.eps, launch=launch)

    def _forward_few(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: DecodeMeta | VerifyMeta | PrefillMeta,
    ) -> torch.Tensor:
        """`forward` for a few tokens: the residual is updated in place by the o_proj and down
        products, which leave per-program sums of squares for the next product's RMSNorm."""
        tokens = input_ids.shape[0]
        table = self.projection_table
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        residual = self.embed(input_ids)
        hidden_size = residual.shape[1]
        widest = max(
            residual_programs(hidden_size, table.launch("o", tokens)),
            residual_programs(hidden_size, table.launch("down", tokens)),
        )
        squares = torch.empty((tokens, widest), dtype=torch.float32, device=residual.device)
        pdl = self.pdl
        partials = sum_squares(residual, squares, pdl=pdl)
        for index, layer in enumerate(self.layers):
            layer_cache = kv_cache[index]
            mlp = layer.mlp
            assert isinstance(mlp, GatedMLP)  # gemv_max_tokens is 0 for sparse models
            qkv, o, gate_up, down = layer.qkv_proj, layer.o_proj, mlp.gate_up_proj, mlp.down_proj
            q_flat = gemv_qkv_rope(
                residual, squares, partials, layer.input_norm, self.eps, qkv.weight,
                positions, self.cos, self.sin, slot_mapping, layer_cache, h, kvh, d,
                table.launch("qkv", tokens), bias=qkv.bias, w_scale=_weight_scale(qkv), pdl=pdl,
            )  # fmt: skip
            attn = self._attention(q_flat.view(tokens, h, d), layer_cache, meta, pdl=pdl)
            partials = gemv_residual(
                attn.view(tokens, self.q_size), o.weight, residual, squares, table.launch("o", tokens),
                bias=o.bias, w_scale=_weight_scale(o), pdl=pdl,
            )  # fmt: skip
            act = gemv_silu(
                residual, squares, partials, layer.post_norm, self.eps, gate_up.weight,
                table.launch("gate_up", tokens), bias=gate_up.bias, w_scale=_weight_scale(gate_up), pdl=pdl,
            )  # fmt: skip
            partials = gemv_residual(
                act, down.weight, residual, squares, table.launch("down", tokens), bias=down.bias,
                w_scale=_weight_scale(down), pdl=pdl,
            )  # fmt: skip
        return rms_norm(residual, self.final_norm, self.eps, launch=self.launch)

    def _attention(
        self,
        q: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: DecodeMeta | VerifyMeta | PrefillMeta,
        kv_scale: torch.Tensor | None = None,
        pdl: bool = False,
    ) -> torch.Tensor:
        launch = self.launch
        if isinstance(meta, DecodeMeta):
            return paged_decode_attention(
                q, layer_cache, meta.block_tables, meta.seq_lens, self.scale, meta.workspace,
                kv_scale=kv_scale, launch=launch, pdl=pdl,
            )  # fmt: skip
        if isinstance(meta, VerifyMeta):
            return paged_multi_query_attention(
                q, layer_cache, meta.block_tables, meta.seq_lens, meta.query_lens, meta.query_len,
                self.scale, meta.workspace, kv_scale=kv_scale, launch=launch,
            )  # fmt: skip
        return paged_prefill_attention(
            q, layer_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.tile_rows,
            meta.tile_starts, self.scale, kv_scale=kv_scale, launch=launch,
        )  # fmt: skip

    @property
    def lm_weight(self) -> torch.Tensor:
        """This rank's LM-head rows (the whole ``[vocab, hidden]`` matrix on one rank)."""
        return self.lm_head.weight

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, vocab]; into `out` (contiguous [T, vocab]) when given, so graphs can share it."""
        head = self.lm_head
        if head.parallel.is_parallel:
            logits = head.logits(hidden)
            return logits if out is None else out.copy_(logits)
        tokens = hidden.shape[0]
        if 0 < tokens <= self.gemv_max_tokens:
            return gemv(hidden, head.weight, self.gemv_table.launch("lm_head", tokens), out=out, pdl=self.pdl)
        if out is None:
            return F.linear(hidden, head.weight)
        return torch.mm(hidden, head.weight.t(), out=out)


def _weight_scale(layer: ParallelLinear) -> torch.Tensor | None:
    """An FP8 projection's per-row float32 scale (None for a 16-bit one)."""
    if isinstance(layer.quant_method, Fp8LinearMethod):
        return cast(torch.Tensor, layer.weight_scale)
    return None
