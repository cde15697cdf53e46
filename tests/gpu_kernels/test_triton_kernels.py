"""Triton kernels (on `kernel_device`) against the torch reference, on small random shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton_engine.model.kernels.triton_attention import (
    DecodeWorkspace,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tiles,
)
from baton_engine.model.kernels.triton_fused import (
    fused_add_rms_norm,
    rms_norm,
    rotary_cache_write,
    silu_and_mul,
)
from baton_engine.model.layers import RMSNorm
from baton_engine.model.rope import apply_rotary

BLOCK_SIZE = 4
KV_HEADS = 2
HEADS = 4
HEAD_DIM = 16


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def _paged_cache(
    seq_lens: list[int], gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """A shuffled block layout holding random K/V (drawn from `gen`, on the CPU), on `device`;
    returns cache, block table, per-row slot lists."""
    max_blocks = max(-(-n // BLOCK_SIZE) for n in seq_lens)
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 3
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    for row, n in enumerate(seq_lens):
        blocks = [order.pop() for _ in range(-(-n // BLOCK_SIZE))]
        table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append((torch.tensor(blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(device))
    return cache.to(device), table.to(device), slots


def _reference(
    q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, q_positions: torch.Tensor
) -> torch.Tensor:
    """q: [n_q, H, D] at absolute positions q_positions, keys = slots (positions 0..len-1)."""
    keys = cache[0].reshape(-1, KV_HEADS, HEAD_DIM)[slots].transpose(0, 1)
    values = cache[1].reshape(-1, KV_HEADS, HEAD_DIM)[slots].transpose(0, 1)
    mask = torch.arange(len(slots), device=q.device)[None, :] <= q_positions.to(q.device)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize(("num_splits", "head_major"), [(1, False), (3, False), (3, True)])
def test_decode_matches_reference(num_splits: int, head_major: bool, kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    seq_lens = [5, 1, 37, 150, 0]  # 150: 3 splits of 64 keys see keys; the last row is graph padding
    cache, table, slots = _paged_cache([max(n, 1) for n in seq_lens], gen, kernel_device)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    workspace = DecodeWorkspace(len(seq_lens), HEADS, HEAD_DIM, num_splits, kernel_device)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=kernel_device)
    paged_decode_attention(q, cache, table, lens, HEAD_DIM**-0.5, workspace, out=out, head_major=head_major)
    # The last split of each (row, kv head) merged the splits and reset its counter: a second
    # launch (a graph replay) finds them at zero and gives the same result.
    assert int(workspace.arrivals.count_nonzero()) == 0
    again = paged_decode_attention(q, cache, table, lens, HEAD_DIM**-0.5, workspace, head_major=head_major)
    assert torch.equal(again, out)
    for row, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[row], torch.zeros_like(out[row]))
            continue
        ref = _reference(q[row : row + 1], cache, slots[row][:n], torch.tensor([n - 1]))
        assert _rel_err(out[row : row + 1], ref) < 1e-5


def test_prefill_over_cached_context_matches_reference(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    # (cached context, new query tokens): fresh prompt, prefix hit + chunk, decode row, long chunk.
    rows = [(0, 9), (6, 5), (12, 1), (3, 70)]
    seq_lens = [c + n for c, n in rows]
    cache, table, slots = _paged_cache(seq_lens, gen, kernel_device)
    query_lens = [n for _, n in rows]
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    tile_rows, tile_starts = prefill_tiles(query_lens)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(
        q,
        cache,
        table,
        starts.to(kernel_device),
        torch.tensor(seq_lens, dtype=torch.int32, device=kernel_device),
        torch.tensor(tile_rows, dtype=torch.int32, device=kernel_device),
        torch.tensor(tile_starts, dtype=torch.int32, device=kernel_device),
        HEAD_DIM**-0.5,
        out=out,
    )
    for row, (context, n) in enumerate(rows):
        a, b = int(starts[row]), int(starts[row + 1])
        ref = _reference(q[a:b], cache, slots[row], torch.arange(context, context + n))
        assert _rel_err(out[a:b], ref) < 1e-5


def test_fused_add_rms_norm_matches_reference(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 48, generator=gen).to(kernel_device)
    residual = torch.randn(5, 48, generator=gen).to(kernel_device)
    norm = RMSNorm(48, 1e-5).requires_grad_(False)
    norm.weight.copy_(torch.randn(48, generator=gen))
    norm.to(kernel_device)
    expected_sum = residual + x
    expected = norm(expected_sum)
    res = residual.clone()
    out = fused_add_rms_norm(x, res, norm.weight.detach(), 1e-5)
    assert torch.allclose(res, expected_sum, atol=0, rtol=0)
    assert _rel_err(out, expected) < 1e-6
    assert _rel_err(rms_norm(x, norm.weight.detach(), 1e-5), norm(x)) < 1e-6


def test_rotary_cache_write_matches_reference(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(4)
    tokens = 3
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(kernel_device)
    angles = torch.rand(20, HEAD_DIM // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(kernel_device)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(kernel_device)
    positions = torch.tensor([0, 7, 19], device=kernel_device)
    slots = torch.tensor([5, -1, 2], device=kernel_device)  # the middle token is padding: no cache write
    cache = torch.full((2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM), 123.0, device=kernel_device)
    q, k, v = qkv.clone().split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q_ref = apply_rotary(q.view(tokens, HEADS, HEAD_DIM), cos[positions][:, None], sin[positions][:, None])
    k_ref = apply_rotary(
        k.reshape(tokens, KV_HEADS, HEAD_DIM), cos[positions][:, None], sin[positions][:, None]
    )
    rotary_cache_write(qkv, positions, cos, sin, slots, cache, HEADS, KV_HEADS, HEAD_DIM)
    assert _rel_err(qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM), q_ref) < 1e-6
    flat_k = cache[0].view(-1, KV_HEADS, HEAD_DIM)
    flat_v = cache[1].view(-1, KV_HEADS, HEAD_DIM)
    for t, slot in ((0, 5), (2, 2)):
        assert _rel_err(flat_k[slot], k_ref[t]) < 1e-6
        assert torch.equal(flat_v[slot], v[t].view(KV_HEADS, HEAD_DIM))
    untouched = [s for s in range(2 * BLOCK_SIZE) if s not in (5, 2)]
    assert bool((flat_k[untouched] == 123.0).all()) and bool((flat_v[untouched] == 123.0).all())


def test_silu_and_mul_matches_reference(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(4, 2 * 40, generator=gen).to(kernel_device)
    gate, up = gate_up.chunk(2, dim=-1)
    assert _rel_err(silu_and_mul(gate_up), F.silu(gate) * up) < 1e-6
