"""Paged attention in Triton: split-K decode (graph-capturable) and varlen prefill over the cache.

Both read K/V from one layer's paged cache ``[2, num_blocks, block_size, kv_heads, head_dim]``
through a ``[rows, max_blocks]`` int32 block table, so prefix-cached context, earlier chunks and
the step's own tokens (written first by `rotary_cache_write`) are read the same way. Nothing
here reads device values on the host, so decode runs inside a captured graph.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from baton_engine.model.kernels.triton_tiles import (
    attend_paged_keys,
    packed_output,
    paged_kernel_args,
    paged_kernel_constants,
    split_k_program,
    store_attention_rows,
)


@triton.jit
def _decode_split_kernel(
    q_ptr,  # [B, H, D]
    cache_ptr,  # [2, NB, BS, KVH, D]
    block_table_ptr,  # [B, MAXB] int32
    v_offset,  # elements between the K and the V half of the cache
    stride_bt,
    stride_qt,
    scale_log2,
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] (NUM_SPLITS == 1) or partial [B, H, S, D] fp32
    lse_ptr,  # [B, H, S] fp32
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
):
    row, kvh, split, seq_len, start, end = split_k_program(seq_lens_ptr, NUM_SPLITS, BLOCK_N, HEAD_MAJOR)
    H: tl.constexpr = KVH * GROUP

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
    m_i, l_i, acc = attend_paged_keys(
        q, None, None, start, end,
        cache_ptr, v_offset, block_table_ptr + row * stride_bt, kvh, scale_log2,
        BLOCK_SIZE=BLOCK_SIZE, KVH=KVH, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL=False, PRECISION=PRECISION,
    )  # fmt: skip
    store_attention_rows(
        out_ptr, lse_ptr, m_i, l_i, acc, row * H + heads, g_mask, split, NUM_SPLITS, HEAD_DIM
    )


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


def launch_split_k(
    kernel: Any,
    rows: int,
    out: torch.Tensor,
    workspace: DecodeWorkspace,
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_n: int,
    num_warps: int | None,
    num_stages: int | None,
    tuned_unsplit: tuple[int, int],
    tuned_split: tuple[int, int],
    extra_args: tuple[Any, ...] = (),
    head_major: bool = False,
    **kernel_constants: Any,
) -> None:
    """Run a split-K paged kernel over (row, kv head, split) — (kv head, row, split) with
    `head_major` — and merge its splits into `out`.

    Without splits the kernel writes `out` directly; otherwise fp32 partials and their log2-sum-exp
    go to `workspace` and the reduce kernel combines them. Unset warps and stages come from the
    kernel's tuned (warps, stages) for its case.
    """
    splits = workspace.num_splits
    warps, stages = tuned_unsplit if splits == 1 else tuned_split
    constants = paged_kernel_constants(q, layer_cache, block_n)
    grid = (layer_cache.shape[3], rows, splits) if head_major else (rows, layer_cache.shape[3], splits)
    kernel[grid](
        *paged_kernel_args(q, layer_cache, block_tables, scale),
        seq_lens,
        out if splits == 1 else workspace.partial,
        workspace.lse,
        *extra_args,
        NUM_SPLITS=splits,
        num_warps=warps if num_warps is None else num_warps,
        num_stages=stages if num_stages is None else num_stages,
        **kernel_constants,
        **constants,
    )
    if splits == 1:
        return
    queries, num_heads, head_dim = out.shape
    _decode_reduce_kernel[(queries * num_heads,)](
        workspace.partial,
        workspace.lse,
        out,
        NUM_SPLITS=splits,
        SPLITS_PAD=max(2, triton.next_power_of_2(splits)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=constants["HEAD_DIM_PAD"],
        num_warps=4,
    )


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
    head_major: bool = False,
) -> torch.Tensor:
    """One query token per row. q: [B, H, D]; block_tables: [B, max_blocks] int32; seq_lens: [B] int32.

    A row with seq_len 0 (graph padding) yields zeros. `head_major`: launch a row's kv heads
    together (`split_k_program`).
    """
    batch, num_heads, _ = q.shape
    num_kv_heads = layer_cache.shape[3]
    out = packed_output(q, out)
    # Measured on an H200 (bench.gpu_tune, bf16), as (warps, stages): few warps and 2 stages when
    # each program walks a whole row (large batch); 8 warps and 4 stages for short split-K slices.
    launch_split_k(
        _decode_split_kernel, batch, out, workspace, q, layer_cache, block_tables, seq_lens, scale, block_n,
        num_warps, num_stages, (2, 2), (8, 4), head_major=head_major, HEAD_MAJOR=head_major,
        GROUP_PAD=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
    )  # fmt: skip
    return out


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    cache_ptr,  # [2, NB, BS, KVH, D]
    block_table_ptr,  # [B, MAXB] int32
    v_offset,  # elements between the K and the V half of the cache
    stride_bt,
    stride_qt,
    scale_log2,
    query_start_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    tile_row_ptr,  # [tiles] int32
    tile_start_ptr,  # [tiles] int32 (query offset inside the row)
    out_ptr,  # [T, H, D]
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
    key_end = tl.minimum(context + q_off + BLOCK_M, seq_len)
    m_i, l_i, acc = attend_paged_keys(
        q, context + m, None, 0, key_end,
        cache_ptr, v_offset, block_table_ptr + row * stride_bt, kvh, scale_log2,
        BLOCK_SIZE=BLOCK_SIZE, KVH=KVH, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL=True, PRECISION=PRECISION,
    )  # fmt: skip
    store_attention_rows(out_ptr, None, m_i, l_i, acc, (q_begin + m) * H + head, m_mask, 0, 1, HEAD_DIM)


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
    num_heads, head_dim = q.shape[1:]
    out = packed_output(q, out)
    num_tiles = tile_rows.shape[0]
    if num_tiles == 0:
        return out
    if block_n is None:
        block_n = 64 if triton.next_power_of_2(head_dim) <= 64 else 32
    _prefill_kernel[(num_tiles, num_heads)](
        *paged_kernel_args(q, layer_cache, block_tables, scale),
        query_start_loc,
        seq_lens,
        tile_rows,
        tile_starts,
        out,
        BLOCK_M=PREFILL_BLOCK_M,
        num_warps=num_warps,
        num_stages=num_stages,
        **paged_kernel_constants(q, layer_cache, block_n),
    )
    return out
