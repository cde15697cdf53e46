"""The parallel layers' sharding, checked rank by rank without collectives: every rank loads its
shard from the full checkpoint tensor, and the ranks' pieces put together give the unsharded
layer's output exactly (column-parallel: concatenated; row-parallel: summed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from baton_engine.model.config import ModelConfig
from baton_engine.model.linear import (
    ColumnParallelLinear,
    ParallelLinear,
    ParamSharding,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from baton_engine.model.parallel import (
    Shard,
    TensorParallel,
    TensorParallelShapeError,
    check_model_shape,
    kv_head_shard,
    vocab_shard,
)
from baton_engine.model.weight_source import TensorSource

F64 = torch.float64


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float64 matrix products of different shapes round differently in the last bits.
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _ranks(size: int) -> list[TensorParallel]:
    # No group: the shard arithmetic needs none, and these tests call no collective.
    return [TensorParallel(rank=r, size=size) for r in range(size)]


def test_kv_heads_are_split_then_replicated() -> None:
    assert [kv_head_shard(4, 2, r) for r in range(2)] == [Shard(0, 2), Shard(2, 2)]
    assert [kv_head_shard(2, 2, r) for r in range(2)] == [Shard(0, 1), Shard(1, 1)]
    # 8 ranks over 2 KV heads: head 0 on ranks 0-3, head 1 on ranks 4-7.
    assert [kv_head_shard(2, 8, r).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {kv_head_shard(2, 8, r).length for r in range(8)} == {1}
    with pytest.raises(TensorParallelShapeError) as info:
        kv_head_shard(3, 2, 0)
    assert str(info.value) == (
        "--tensor-parallel-size 2 does not divide the model's 3 key/value heads (num_key_value_heads)"
    )
    with pytest.raises(TensorParallelShapeError) as info:
        kv_head_shard(2, 3, 0)
    assert "exceeds the model's 2 key/value heads (num_key_value_heads) and is not a multiple" in str(
        info.value
    )


def test_vocab_shards_pad_the_last_rank() -> None:
    assert [vocab_shard(10, 3, r) for r in range(3)] == [(Shard(0, 4), 4), (Shard(4, 4), 4), (Shard(8, 2), 4)]
    assert vocab_shard(12, 3, 2) == (Shard(8, 4), 4)


def test_model_shape_is_checked_with_the_dimension_named() -> None:
    smollm2_like = ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
        num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=8192, tie_word_embeddings=True,
    )  # fmt: skip
    check_model_shape(smollm2_like, 1)
    check_model_shape(smollm2_like, 3)
    with pytest.raises(TensorParallelShapeError) as info:
        check_model_shape(smollm2_like, 2)
    assert str(info.value) == (
        "--tensor-parallel-size 2 does not divide the model's 9 attention heads (num_attention_heads)"
    )
    with pytest.raises(TensorParallelShapeError) as info:
        check_model_shape(dataclasses.replace(smollm2_like, num_heads=12, intermediate_size=1538), 6)
    assert (
        str(info.value)
        == "--tensor-parallel-size 6 does not divide the model's 1538 MLP features (intermediate_size)"
    )


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_qkv_shards_concatenate_to_the_full_projection_per_head(size: int) -> None:
    hidden, head_dim, heads, kv_heads = 16, 4, 8, 2
    gen = torch.Generator().manual_seed(size)
    q = torch.randn(heads * head_dim, hidden, generator=gen, dtype=F64)
    k = torch.randn(kv_heads * head_dim, hidden, generator=gen, dtype=F64)
    v = torch.randn(kv_heads * head_dim, hidden, generator=gen, dtype=F64)
    bias = [torch.randn(w.shape[0], generator=gen, dtype=F64) for w in (q, k, v)]
    x = torch.randn(5, hidden, generator=gen, dtype=F64)
    full_q, full_k, full_v = (F.linear(x, w, b) for w, b in zip((q, k, v), bias, strict=True))
    got_q, got_k, got_v = [], [], []
    for tp in _ranks(size):
        layer = QKVParallelLinear(
            hidden, head_dim, heads, kv_heads, bias=True, prefix="qkv", dtype=F64, device="cpu", parallel=tp
        )
        for part, (w, b) in enumerate(zip((q, k, v), bias, strict=True)):
            layer.load_weight("weight", TensorSource(w), part)
            layer.load_weight("bias", TensorSource(b), part)
        out_q, out_k, out_v = layer(x).split(list(layer.output_sizes_per_rank), dim=-1)
        assert layer.num_local_heads == heads // size
        assert layer.num_local_kv_heads == max(1, kv_heads // size)
        got_q.append(out_q)
        kv = layer.kv_head_shard
        # Each rank's k/v heads are exactly the global heads its shard names.
        _close(out_k, full_k[:, kv.start * head_dim : kv.stop * head_dim])
        _close(out_v, full_v[:, kv.start * head_dim : kv.stop * head_dim])
        if kv.start * head_dim not in [s for s, _ in got_k]:
            got_k.append((kv.start * head_dim, out_k))
            got_v.append((kv.start * head_dim, out_v))
    _close(torch.cat(got_q, dim=-1), full_q)
    _close(torch.cat([t for _, t in sorted(got_k, key=lambda p: p[0])], dim=-1), full_k)
    _close(torch.cat([t for _, t in sorted(got_v, key=lambda p: p[0])], dim=-1), full_v)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_merged_column_and_row_shards_rebuild_the_gated_mlp(size: int) -> None:
    hidden, inter = 8, 16
    gen = torch.Generator().manual_seed(7)
    gate, up = (torch.randn(inter, hidden, generator=gen, dtype=F64) for _ in range(2))
    down = torch.randn(hidden, inter, generator=gen, dtype=F64)
    down_bias = torch.randn(hidden, generator=gen, dtype=F64)
    x = torch.randn(3, hidden, generator=gen, dtype=F64)
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down, down_bias)
    partials = []
    for tp in _ranks(size):
        gate_up = ColumnParallelLinear(
            hidden, (inter, inter), bias=False, prefix="gate_up", dtype=F64, device="cpu", parallel=tp,
            part_names=("gate_proj", "up_proj"),
        )  # fmt: skip
        gate_up.load_weight("weight", TensorSource(gate), 0)
        gate_up.load_weight("weight", TensorSource(up), 1)
        row = RowParallelLinear(inter, hidden, bias=True, prefix="down", dtype=F64, device="cpu", parallel=tp)
        row.load_weight("weight", TensorSource(down))
        row.load_weight("bias", TensorSource(down_bias))
        assert row.weight.shape == (hidden, inter // size)
        g, u = gate_up(x).chunk(2, dim=-1)
        partials.append(row.quant_method.apply(row, F.silu(g) * u, None))
    got = torch.stack(partials).sum(0) + down_bias
    _close(got, want)
    if size == 1:  # one rank: the very same arithmetic as an unsharded layer, bias included
        assert torch.equal(row(F.silu(g) * u), want)


@pytest.mark.parametrize("size", [1, 3])
def test_vocab_shards_rebuild_embedding_and_logits(size: int) -> None:
    vocab, hidden = 10, 4
    gen = torch.Generator().manual_seed(3)
    table = torch.randn(vocab, hidden, generator=gen, dtype=F64)
    ids = torch.tensor([0, 3, 4, 9, 8])
    hidden_states = torch.randn(2, hidden, generator=gen, dtype=F64)
    rows, logits = [], []
    for tp in _ranks(size):
        layer = VocabParallelEmbedding(vocab, hidden, prefix="embed", dtype=F64, device="cpu", parallel=tp)
        layer.load_weight("weight", TensorSource(table))
        local = ids - layer.shard.start
        inside = (local >= 0) & (local < layer.shard.length)
        rows.append(
            torch.where(
                inside.unsqueeze(-1), F.embedding(local.clamp(0, layer.rows_per_rank - 1), layer.weight), 0.0
            )
        )
        logits.append(F.linear(hidden_states, layer.weight))
        assert torch.equal(
            layer.weight[layer.shard.length :],
            torch.zeros(layer.rows_per_rank - layer.shard.length, hidden, dtype=F64),
        )
    assert torch.equal(torch.stack(rows).sum(0), F.embedding(ids, table))
    _close(torch.cat(logits, dim=-1)[:, :vocab], F.linear(hidden_states, table))


def test_load_errors_name_the_parameter_and_part() -> None:
    layer = QKVParallelLinear(
        16, 4, 4, 2, bias=False, prefix="model.layers.0.self_attn.qkv_proj", dtype=F64, device="cpu"
    )
    with pytest.raises(ValueError) as info:
        layer.load_weight("weight", TensorSource(torch.zeros(12, 16)), 1)
    assert str(info.value) == (
        "model.layers.0.self_attn.qkv_proj.weight (k_proj): checkpoint has 12 output features, the model 8"
    )
    with pytest.raises(ValueError) as info:
        layer.load_weight("weight", TensorSource(torch.zeros(16, 15)), 0)
    assert str(info.value) == (
        "model.layers.0.self_attn.qkv_proj.weight (q_proj): checkpoint has 15 input features, the model 16"
    )
    with pytest.raises(ValueError) as info:
        layer.load_weight("weight", TensorSource(torch.zeros(16, 16)))
    assert (
        str(info.value) == "model.layers.0.self_attn.qkv_proj.weight: a merged layer loads one part at a time"
    )


class _ScaledMethod:
    """A stand-in quantized method (weights stored transposed and halved, a per-part scale): the
    layers must create, load, finish and apply whatever a method registers."""

    def create_weights(self, layer: ParallelLinear, dtype: torch.dtype, device: torch.device | str) -> None:
        weight = torch.empty(
            layer.output_size_per_rank, layer.input_size_per_rank, dtype=dtype, device=device
        )
        layer.add_parameter("weight", weight, ParamSharding(output_dim=0, input_dim=1))
        scale = torch.empty(layer.num_parts, dtype=dtype, device=device)
        layer.add_parameter("weight_scale", scale, ParamSharding(per_part=True))

    def process_weights_after_loading(self, layer: ParallelLinear) -> None:
        rows = torch.repeat_interleave(layer.weight_scale, torch.tensor(layer.output_sizes_per_rank))
        layer.register_buffer("scaled_t", (layer.weight * rows[:, None] / 2).t().contiguous())

    def apply(self, layer: ParallelLinear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = 2 * x @ layer.scaled_t
        return out if bias is None else out + bias


def test_a_quantization_method_owns_the_weights() -> None:
    gen = torch.Generator().manual_seed(5)
    gate, up = (torch.randn(6, 4, generator=gen, dtype=F64) for _ in range(2))
    x = torch.randn(2, 4, generator=gen, dtype=F64)
    for tp in _ranks(2):
        layer = ColumnParallelLinear(
            4, (6, 6), bias=False, prefix="mlp.gate_up_proj", dtype=F64, device="cpu", parallel=tp,
            quant_method=_ScaledMethod(), part_names=("gate_proj", "up_proj"),
        )  # fmt: skip
        assert set(layer.shardings) == {"weight", "weight_scale"}
        for part, (w, scale) in enumerate(((gate, 0.5), (up, 3.0))):
            layer.load_weight("weight", TensorSource(w), part)
            layer.load_weight("weight_scale", TensorSource(torch.tensor(scale, dtype=F64)), part)
        layer.process_weights_after_loading()
        rows = slice(tp.rank * 3, tp.rank * 3 + 3)
        want = torch.cat([F.linear(x, gate[rows] * 0.5), F.linear(x, up[rows] * 3.0)], dim=-1)
        _close(layer(x), want)
