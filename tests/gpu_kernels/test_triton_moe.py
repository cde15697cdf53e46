"""The fused-MoE Triton kernels (on `kernel_device`) against the torch reference experts."""

from __future__ import annotations

import pytest
import torch

from baton_engine.model.config import MoeConfig
from baton_engine.model.kernels.triton_moe import MoeTiles, align_by_expert, alignment_capacity, fused_moe
from baton_engine.model.moe import experts_reference, route
from baton_engine.model.quantization import fp8 as F8


def test_alignment_groups_pairs_by_expert_in_whole_tiles() -> None:
    # 5 tokens, top 2 of 4 experts; expert 2 gets no pair.
    ids = torch.tensor([[1, 0], [3, 1], [0, 1], [1, 3], [0, 3]])
    a = align_by_expert(ids, num_experts=4, block_m=4)
    pad = 10  # T * K: no pair
    # pairs by expert: e0: 1, 4, 8; e1: 0, 3, 5, 6; e3: 2, 7, 9 (each run padded to 4 slots)
    assert a.sorted_pairs.tolist()[:12] == [1, 4, 8, pad, 0, 3, 5, 6, 2, 7, 9, pad]
    assert a.num_padded.tolist() == [12]
    assert a.block_experts.tolist()[:3] == [0, 1, 3]
    assert a.sorted_pairs.numel() == alignment_capacity(10, 4, 4) == 24
    assert set(a.sorted_pairs.tolist()[12:]) == {pad}


def _experts(
    num_experts: int, hidden: int, inter: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5
    return gate_up, down


def _moe_config(num_experts: int, top_k: int, mixtral: bool) -> MoeConfig:
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=0,
        norm_topk_prob=mixtral,
        routing_in_float32=mixtral,
        sparse_layers=(0,),
    )


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k", "mixtral", "tiles"),
    [
        (1, 8, 2, True, None),  # one decode token
        (7, 8, 2, False, None),
        (40, 4, 2, True, MoeTiles(32, 32, 32, 4, 2)),  # several tiles per expert
        (13, 16, 4, False, MoeTiles(16, 32, 64, 4, 2)),  # experts left without pairs
    ],
    ids=["decode", "small", "multi-tile", "sparse"],
)
def test_fused_moe_matches_reference_float32(
    tokens: int,
    num_experts: int,
    top_k: int,
    mixtral: bool,
    tiles: MoeTiles | None,
    kernel_device: torch.device,
) -> None:
    gen = torch.Generator().manual_seed(tokens * 31 + num_experts)
    hidden, inter = 48, 40  # not multiples of the tiles: masks are exercised
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(num_experts, hidden, generator=gen)
    gate_up, down = _experts(num_experts, hidden, inter, gen)
    weights, ids = route(x, router, _moe_config(num_experts, top_k, mixtral))
    assert weights.dtype == torch.float32
    want = experts_reference(x, gate_up, down, weights, ids)
    dev = kernel_device
    got = fused_moe(x.to(dev), gate_up.to(dev), down.to(dev), weights.to(dev), ids.to(dev), tiles=tiles)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_fused_moe_float16_rounds_like_the_reference(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    tokens, hidden, inter, num_experts = 24, 64, 32, 8
    x = torch.randn(tokens, hidden, generator=gen).half()
    router = torch.randn(num_experts, hidden, generator=gen).half()
    gate_up, down = (w.half() for w in _experts(num_experts, hidden, inter, gen))
    weights, ids = route(x, router, _moe_config(num_experts, 2, mixtral=False))
    assert weights.dtype == torch.float16
    want = experts_reference(x.float(), gate_up.float(), down.float(), weights.float(), ids)
    dev = kernel_device
    got = fused_moe(x.to(dev), gate_up.to(dev), down.to(dev), weights.to(dev), ids.to(dev))
    assert got.dtype == torch.float16
    err = (got.cpu().float() - want).abs().max().item()
    assert err < 2e-2 * want.abs().max().item()


def test_fused_moe_with_fp8_experts_matches_dequantized_reference(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(9)
    tokens, hidden, inter, num_experts = 10, 32, 48, 4
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(num_experts, hidden, generator=gen)
    gate_up, down = _experts(num_experts, hidden, inter, gen)
    fmt = torch.float8_e4m3fn
    gu_q, gu_s = zip(*(F8.quantize_weight(w, fmt) for w in gate_up), strict=True)
    dn_q, dn_s = zip(*(F8.quantize_weight(w, fmt) for w in down), strict=True)
    gate_up_q, gate_up_s = torch.stack(gu_q), torch.stack(gu_s)
    down_q, down_s = torch.stack(dn_q), torch.stack(dn_s)
    weights, ids = route(x, router, _moe_config(num_experts, 2, mixtral=True))
    want = experts_reference(
        x,
        gate_up_q.float() * gate_up_s[..., None],
        down_q.float() * down_s[..., None],
        weights,
        ids,
    )
    dev = kernel_device
    got = fused_moe(
        x.to(dev), gate_up_q.to(dev), down_q.to(dev), weights.to(dev), ids.to(dev),
        gate_up_s.to(dev), down_s.to(dev),
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
