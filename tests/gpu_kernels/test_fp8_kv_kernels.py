"""The paged-attention kernels and the rotary cache write (on `kernel_device`) with an FP8 KV
cache: stored bytes as the torch backend stores them, attention as over the dequantized cache."""

from __future__ import annotations

import pytest
import torch

from baton_engine.model.kernels.triton_attention import (
    DecodeWorkspace,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tiles,
)
from baton_engine.model.kernels.triton_fused import rotary_cache_write
from baton_engine.model.kernels.triton_multi_query import multi_query_workspace, paged_multi_query_attention
from baton_engine.model.quantization.fp8 import cast_saturated
from baton_engine.model.rope import apply_rotary
from tests.gpu_kernels.test_triton_kernels import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, _paged_cache

FORMATS = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
SCALES = torch.tensor([0.5, 2.0])  # K, V: neither is 1, so a missing or swapped scale shows


def _fp8_cache(cache: torch.Tensor, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the FP8 cache of a float32 one under SCALES, its float32 dequantization)."""
    stored = torch.stack([cast_saturated(cache[i].cpu() / SCALES[i], fmt) for i in range(2)])
    dequantized = torch.stack([stored[i].float() * SCALES[i] for i in range(2)])
    return stored.to(cache.device), dequantized.to(cache.device)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rotary_cache_write_stores_scaled_fp8(fmt: torch.dtype, kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(4)
    tokens = 3
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen) * 3
    angles = torch.rand(20, HEAD_DIM // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((angles.sin(), angles.sin()), -1)
    positions = torch.tensor([0, 7, 19])
    _, k, v = qkv.clone().split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    k_ref = apply_rotary(
        k.reshape(tokens, KV_HEADS, HEAD_DIM), cos[positions][:, None], sin[positions][:, None]
    )
    cache = torch.zeros((2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=fmt, device=kernel_device)
    dev = kernel_device
    rotary_cache_write(
        qkv.to(dev), positions.to(dev), cos.to(dev), sin.to(dev), torch.tensor([5, -1, 2], device=dev),
        cache, HEADS, KV_HEADS, HEAD_DIM, SCALES.to(dev),
    )  # fmt: skip
    flat = cache.cpu().view(torch.uint8).view(2, -1, KV_HEADS, HEAD_DIM)
    for t, slot in ((0, 5), (2, 2)):
        want_v = cast_saturated(v[t].view(KV_HEADS, HEAD_DIM) / SCALES[1], fmt).view(torch.uint8)
        assert torch.equal(flat[1, slot], want_v)
        # k is rotated in float32 by both: equal up to one rounding step of the rotation itself
        got_k = flat[0, slot].view(fmt).float() * SCALES[0]
        assert float((got_k - k_ref[t]).abs().max()) <= float(k_ref[t].abs().max()) / 8
    assert int(flat[:, [0, 1, 3, 4, 6, 7]].sum()) == 0  # no other slot written (token 1 is padding)


def test_a_cache_without_its_scales_is_refused(kernel_device: torch.device) -> None:
    cache = torch.zeros(
        (2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM), dtype=torch.float8_e4m3fn, device=kernel_device
    )
    qkv = torch.zeros(1, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=kernel_device)
    table = torch.zeros(1, HEAD_DIM, device=kernel_device)
    zero = torch.zeros(1, dtype=torch.int64, device=kernel_device)
    with pytest.raises(ValueError, match="needs \\(K, V\\) scales exactly when it is FP8"):
        rotary_cache_write(qkv, zero, table, table, zero, cache, HEADS, KV_HEADS, HEAD_DIM)


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_prefill_and_verify_attend_over_the_dequantized_cache(
    fmt: torch.dtype, kernel_device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(7)
    seq_lens = [9, 1, 37]
    exact, table, _ = _paged_cache(seq_lens, gen, kernel_device)
    stored, dequantized = _fp8_cache(exact, fmt)
    scales = SCALES.to(kernel_device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=kernel_device)
    scale = HEAD_DIM**-0.5

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    q = torch.randn(3, HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    for splits in (1, 3):
        ws = DecodeWorkspace(3, HEADS, HEAD_DIM, splits, kernel_device)
        want = paged_decode_attention(q, dequantized, table, lens, scale, ws).clone()
        close(paged_decode_attention(q, stored, table, lens, scale, ws, kv_scale=scales), want)

    query_lens = [4, 1, 5]
    qp = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    starts = torch.tensor([0, 4, 5, 10], dtype=torch.int32, device=kernel_device)
    tile_rows, tile_starts = prefill_tiles(query_lens)
    tiles = (
        torch.tensor(tile_rows, dtype=torch.int32, device=kernel_device),
        torch.tensor(tile_starts, dtype=torch.int32, device=kernel_device),
    )
    want = paged_prefill_attention(qp, dequantized, table, starts, lens, *tiles, scale)
    close(paged_prefill_attention(qp, stored, table, starts, lens, *tiles, scale, kv_scale=scales), want)

    query_len = 3
    qv = torch.randn(3 * query_len, HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    qlens = torch.tensor([3, 1, 2], dtype=torch.int32, device=kernel_device)
    ws = multi_query_workspace(3, query_len, HEADS, HEAD_DIM, 2, kernel_device)
    want = paged_multi_query_attention(qv, dequantized, table, lens, qlens, query_len, scale, ws).clone()
    got = paged_multi_query_attention(qv, stored, table, lens, qlens, query_len, scale, ws, kv_scale=scales)
    close(got, want)
