"""Paged attention in Triton: split-K decode (graph-capturable) and varlen prefill over the cache.

Both read K/V from one layer's paged cache ``[2, num_blocks, block_size, kv_heads, head_dim]``
through a ``[rows, max_blocks]`` int32 block table, so prefix-cached context, earlier chunks and
the step's own tokens (written first by `rotary_cache_write`) are read the same way. Nothing
here reads device values on the host, so decode runs inside a captured graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    cache_ptr,  # [2, NB, BS, KVH, D]
    block_table_ptr,  # [B, MAXB] int32
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] (NUM_SPLITS == 1) or partial [B, H, S, D] fp32
    lse_ptr,  # [B, H, S] fp32
    v_offset,  # elements between the K and the V half of the cache
    stride_bt,
    stride_qt,
    scale_log2,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    H: tl.constexpr = KVH * GROUP
    seq_len = tl.load(seq_lens_ptr + row)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * HEAD_DIM + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    n_base = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + n_base
        n_mask = n < end
        page = tl.load(block_table_ptr + row * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_off = (slot * KVH + kvh)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + v_offset + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    result = acc / safe_l[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + (row * H + heads)[:, None] * HEAD_DIM + d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        base = (row * H + heads) * NUM_SPLITS + split
        tl.store(out_ptr + base[:, None] * HEAD_DIM + d[None, :], result, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + base, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    partial_ptr,  # [B, H, S, D] fp32
    lse_ptr,  # [B, H, S]
    out_ptr,  # [B, H, D]
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    bh = tl.program_id(0)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + bh * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top)
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    part = tl.load(
        partial_ptr + (bh * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :],
        mask=s_mask[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    result = tl.sum(part * w[:, None], 0)
    tl.store(out_ptr + bh * HEAD_DIM + d, result.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _precision(dtype: torch.dtype) -> str | None:
    # float32 runs must not silently drop to tf32 (greedy parity is checked in float32); 16-bit
    # operands take the backend's default (the argument only matters for float32 operands).
    return "ieee" if dtype == torch.float32 else None


def decode_num_splits(
    batch: int, num_kv_heads: int, max_len: int, block_n: int = 64, target: int = 264
) -> int:
    """Splits of the sequence axis so that a small batch still fills the GPU (fixed per graph size)."""
    programs = batch * num_kv_heads
    splits = max(1, -(-target // programs))
    return int(min(splits, max(1, -(-max_len // block_n)), 64))


class DecodeWorkspace:
    """Scratch for split-K partial results, allocated once per (batch, splits) so graphs can reuse it."""

    def __init__(
        self, batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
    ) -> None:
        self.num_splits = num_splits
        shape = (batch, num_heads, max(num_splits, 1))
        self.partial = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
        self.lse = torch.empty(shape, dtype=torch.float32, device=device)


def paged_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    workspace: DecodeWorkspace,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """One query token per row. q: [B, H, D]; block_tables: [B, max_blocks] int32; seq_lens: [B] int32.

    A row with seq_len 0 (graph padding) yields zeros.
    """
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = layer_cache.shape
    group = num_heads // num_kv_heads
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "q heads must be packed (row stride may differ)"
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device) if out is None else out
    splits = workspace.num_splits
    head_pad = triton.next_power_of_2(head_dim)
    # Measured on an H200 (bench.gpu_tune, bf16): few warps and 2 stages when each program
    # walks a whole row (large batch); 8 warps and 4 stages for short split-K slices.
    if num_warps is None:
        num_warps = 2 if splits == 1 else 8
    if num_stages is None:
        num_stages = 2 if splits == 1 else 4
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q,
        layer_cache,
        block_tables,
        seq_lens,
        out if splits == 1 else workspace.partial,
        workspace.lse,
        layer_cache.stride(0),
        block_tables.stride(0),
        q.stride(0),
        scale * _LOG2E,
        NUM_SPLITS=splits,
        BLOCK_SIZE=block_size,
        KVH=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_pad,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(batch * num_heads,)](
            workspace.partial,
            workspace.lse,
            out,
            NUM_SPLITS=splits,
            SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_pad,
            num_warps=4,
        )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    cache_ptr,
    block_table_ptr,  # [B, MAXB] int32
    query_start_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    tile_row_ptr,  # [tiles] int32
    tile_start_ptr,  # [tiles] int32 (query offset inside the row)
    out_ptr,  # [T, H, D]
    v_offset,
    stride_bt,
    stride_qt,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    H: tl.constexpr = KVH * GROUP
    kvh = head // GROUP
    row = tl.load(tile_row_ptr + tile)
    q_off = tl.load(tile_start_ptr + tile)
    q_begin = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + row)
    context = seq_len - q_len  # tokens cached before this step

    m = q_off + tl.arange(0, BLOCK_M)
    m_mask = m < q_len
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_begin + m)[:, None] * stride_qt + head * HEAD_DIM + d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = context + m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    key_end = tl.minimum(context + q_off + BLOCK_M, seq_len)
    n_base = tl.arange(0, BLOCK_N)
    for n0 in range(0, key_end, BLOCK_N):
        n = n0 + n_base
        n_mask = n < key_end
        page = tl.load(block_table_ptr + row * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_off = (slot * KVH + kvh)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + v_offset + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + ((q_begin + m) * H + head)[:, None] * HEAD_DIM + d[None, :],
        result.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


PREFILL_BLOCK_M = 64


def prefill_tiles(
    query_lens: list[int] | tuple[int, ...], block_m: int = PREFILL_BLOCK_M
) -> tuple[list[int], list[int]]:
    """(row, query offset) of every BLOCK_M tile of every row — planned on the host once per step."""
    rows: list[int] = []
    starts: list[int] = []
    for row, length in enumerate(query_lens):
        for start in range(0, int(length), block_m):
            rows.append(row)
            starts.append(start)
    return rows, starts


def paged_prefill_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    tile_rows: torch.Tensor,
    tile_starts: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention of any number of query tokens per row over the row's cached positions.

    q: [T, H, D]; a row's queries are its last ``query_len`` positions of ``seq_len``.
    """
    tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = layer_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "q heads must be packed (row stride may differ)"
    out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device) if out is None else out
    num_tiles = tile_rows.shape[0]
    if num_tiles == 0:
        return out
    head_pad = triton.next_power_of_2(head_dim)
    if block_n is None:
        block_n = 64 if head_pad <= 64 else 32
    _prefill_kernel[(num_tiles, num_heads)](
        q,
        layer_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        tile_rows,
        tile_starts,
        out,
        layer_cache.stride(0),
        block_tables.stride(0),
        q.stride(0),
        scale * _LOG2E,
        BLOCK_SIZE=block_size,
        KVH=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_pad,
        BLOCK_M=PREFILL_BLOCK_M,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
