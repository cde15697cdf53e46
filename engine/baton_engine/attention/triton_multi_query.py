"""Multi-query paged decode attention in Triton: a fixed number of query tokens per row.

A speculative verify step feeds each row its last real token plus K drafts. Laid out with a
fixed query length Q per row (token ``row * Q + j``), the step has static shapes and runs inside
a captured graph like a plain decode step. Row ``row`` has ``query_lens[row] <= Q`` real tokens
at positions ``seq_len - query_len .. seq_len - 1``; each attends causally to the cache up to its
own position (its own K/V and the earlier drafts' were written before attention). Slots
``j >= query_len`` are padding: they see no key and yield zeros, as do rows with seq_len 0.

One program handles one (row, kv head, split of the key axis) and all ``Q * GROUP`` query heads
that share the kv head, so each K/V tile is loaded once for the whole verify window. Split-K
partial results are combined by the decode path's reduce kernel (per token and head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_engine.attention.triton_attention import _LOG2E, DecodeWorkspace, _decode_reduce_kernel, _precision


@triton.jit
def _multi_query_split_kernel(
    q_ptr,  # [B * Q, H, D]
    cache_ptr,  # [2, NB, BS, KVH, D]
    block_table_ptr,  # [B, MAXB] int32
    seq_lens_ptr,  # [B] int32
    query_lens_ptr,  # [B] int32, each <= Q
    out_ptr,  # [B * Q, H, D] (NUM_SPLITS == 1) or partial [B * Q, H, S, D] fp32
    lse_ptr,  # [B * Q, H, S] fp32
    v_offset,
    stride_bt,
    stride_qt,
    scale_log2,
    QUERY_LEN: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    M_PAD: tl.constexpr,
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
    query_len = tl.load(query_lens_ptr + row)
    context = seq_len - query_len
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    # Tile rows: m = j * GROUP + g is query token j of the row, head g of this kv head's group.
    m = tl.arange(0, M_PAD)
    j = m // GROUP
    g = m % GROUP
    in_window = m < QUERY_LEN * GROUP
    real = in_window & (j < query_len)
    token = row * QUERY_LEN + j
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + heads[:, None] * HEAD_DIM + d[None, :],
        mask=real[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = context + j
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, HEAD_DIM_PAD], tl.float32)
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
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :] & real[:, None]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A query may see no key of this tile (split before its position, or padding).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + v_offset + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    result = acc / safe_l[:, None]
    out_mask = in_window[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + (token * H + heads)[:, None] * HEAD_DIM + d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        base = (token * H + heads) * NUM_SPLITS + split
        tl.store(out_ptr + base[:, None] * HEAD_DIM + d[None, :], result, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + base, lse, mask=in_window)


def multi_query_workspace(
    batch: int, query_len: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
) -> DecodeWorkspace:
    """Split-K scratch for `batch` rows of `query_len` tokens (one graph's worth)."""
    return DecodeWorkspace(batch * query_len, num_heads, head_dim, num_splits, device)


def paged_multi_query_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_lens: torch.Tensor,
    query_len: int,
    scale: float,
    workspace: DecodeWorkspace,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q: [B * query_len, H, D], row-major by (row, token); query_lens: [B] int32 (<= query_len).

    Returns [B * query_len, H, D]; padding tokens (j >= query_lens[row]) and rows with seq_len 0
    get zeros.
    """
    tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = layer_cache.shape
    if query_len < 1 or tokens % query_len:
        raise ValueError(f"{tokens} query tokens do not split into rows of query_len={query_len}")
    batch = tokens // query_len
    group = num_heads // num_kv_heads
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "q heads must be packed (row stride may differ)"
    out = torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device) if out is None else out
    if batch == 0:
        return out
    splits = workspace.num_splits
    head_pad = triton.next_power_of_2(head_dim)
    if num_warps is None:
        num_warps = 4 if splits == 1 else 8
    if num_stages is None:
        num_stages = 2 if splits == 1 else 3
    _multi_query_split_kernel[(batch, num_kv_heads, splits)](
        q,
        layer_cache,
        block_tables,
        seq_lens,
        query_lens,
        out if splits == 1 else workspace.partial,
        workspace.lse,
        layer_cache.stride(0),
        block_tables.stride(0),
        q.stride(0),
        scale * _LOG2E,
        QUERY_LEN=query_len,
        NUM_SPLITS=splits,
        BLOCK_SIZE=block_size,
        KVH=num_kv_heads,
        GROUP=group,
        M_PAD=max(16, triton.next_power_of_2(query_len * group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_pad,
        BLOCK_N=block_n,
        PRECISION=_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(tokens * num_heads,)](
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
