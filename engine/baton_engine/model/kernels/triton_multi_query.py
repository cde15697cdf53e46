"""Multi-query paged decode attention in Triton: a fixed number of query tokens per row.

A speculative verify step feeds each row its last real token plus K drafts. Laid out with a
fixed query length Q per row (token ``row * Q + j``), the step has static shapes and runs inside
a captured graph like a plain decode step. Row ``row`` has ``query_lens[row] <= Q`` real tokens
at positions ``seq_len - query_len .. seq_len - 1``; each attends causally to the cache up to its
own position (its own K/V and the earlier drafts' were written before attention). Slots
``j >= query_len`` are padding: they see no key and yield zeros, as do rows with seq_len 0.

One program handles one (row, kv head, split of the key axis) and the ``Q * GROUP`` (token, query
head) pairs that share the kv head, so each K/V tile is loaded once for the whole verify window.
When those pairs exceed the launch table's `block_m` (long windows over large groups: 17 tokens x
8 heads), they are dealt out to several programs of BLOCK_M pairs each, which read the same K/V:
a 256-row tile would not fit in registers. Split-K partial results are combined by the decode
path's reduce kernel (per token and head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_engine.model.kernels.kernel_registry import CASE_VERIFY_QUERY_LENS, KernelCase, launch_scenario
from baton_engine.model.kernels.launch_table import LaunchTable, launch_table_for
from baton_engine.model.kernels.triton_attention import (
    SCENARIO_DECODE_BATCHES,
    DecodeWorkspace,
    decode_num_splits,
    launch_split_k,
)
from baton_engine.model.kernels.triton_tiles import (
    attend_paged_keys,
    packed_output,
    split_k_program,
    store_attention_rows,
)


@triton.jit
def _multi_query_split_kernel(
    q_ptr,  # [B * Q, H, D]
    cache_ptr,  # [2, NB, BS, KVH, D]
    block_table_ptr,  # [B, MAXB] int32
    v_offset,  # elements between the K and the V half of the cache
    stride_bt,
    stride_qt,
    scale_log2,
    kv_scale_ptr,  # [2] float32 (K, V) scales of an FP8 cache (KV_FP8 only)
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B * Q, H, D] (NUM_SPLITS == 1) or partial [B * Q, H, S, D] fp32
    lse_ptr,  # [B * Q, H, S] fp32
    query_lens_ptr,  # [B] int32, each <= Q
    QUERY_LEN: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    M_TILES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    row, head_tile, split, seq_len, start, end = split_k_program(seq_lens_ptr, NUM_SPLITS, BLOCK_N, False)
    H: tl.constexpr = KVH * GROUP
    kvh = head_tile // M_TILES
    query_len = tl.load(query_lens_ptr + row)
    context = seq_len - query_len

    # Tile rows: m = j * GROUP + g is query token j of the row, head g of this kv head's group.
    m = (head_tile % M_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
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
    m_i, l_i, acc = attend_paged_keys(
        q, context + j, real, start, end,
        cache_ptr, v_offset, block_table_ptr + row * stride_bt, kvh, scale_log2, kv_scale_ptr,
        BLOCK_SIZE=BLOCK_SIZE, KVH=KVH, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL=True, PRECISION=PRECISION,
        KV_FP8=KV_FP8,
    )  # fmt: skip
    store_attention_rows(
        out_ptr, lse_ptr, m_i, l_i, acc, token * H + heads, in_window, split, NUM_SPLITS, HEAD_DIM
    )


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
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: torch.Tensor | None = None,
    launch: LaunchTable | None = None,
) -> torch.Tensor:
    """q: [B * query_len, H, D], row-major by (row, token); query_lens: [B] int32 (<= query_len);
    kv_scale: the layer's [2] (K, V) scales when the cache is FP8.

    Returns [B * query_len, H, D]; padding tokens (j >= query_lens[row]) and rows with seq_len 0
    get zeros. `launch` defaults to the table of q's device; the other keywords override it.
    """
    tokens, num_heads, _ = q.shape
    num_kv_heads = layer_cache.shape[3]
    if query_len < 1 or tokens % query_len:
        raise ValueError(f"{tokens} query tokens do not split into rows of query_len={query_len}")
    batch = tokens // query_len
    out = packed_output(q, out)
    if batch == 0:
        return out
    table = launch_table_for(q.device) if launch is None else launch
    tuned = table.verify_unsplit if workspace.num_splits == 1 else table.verify_split
    pairs = query_len * (num_heads // num_kv_heads)
    block_m = verify_tile_rows(pairs, tuned.block_m)
    if kv_scale is not None and num_stages is None:
        # FP8 keys and values are widened in registers: sm_90's 3-stage split tiles (8 warps,
        # head dim 128, 32 rows) spill 16 bytes with them; one stage fewer does not (bench.amd_compile).
        num_stages = max(1, tuned.num_stages - 1)
    launch_split_k(
        _multi_query_split_kernel, batch, out, workspace, q, layer_cache, block_tables, seq_lens, scale,
        block_n, num_warps, num_stages, table.verify_unsplit, table.verify_split, table.split_reduce,
        (query_lens,), kv_scale, programs_per_kv_head=-(-pairs // block_m),
        QUERY_LEN=query_len, BLOCK_M=block_m, M_TILES=-(-pairs // block_m),
    )  # fmt: skip
    return out


def verify_tile_rows(pairs: int, block_m: int | None) -> int:
    """Rows of a verify program's tile: a kv head's (token, head) pairs, padded to a power of two
    (at least 16, a dot's smallest side), at most `block_m`."""
    rows = max(16, int(triton.next_power_of_2(pairs)))
    return rows if block_m is None else min(rows, block_m)


@launch_scenario("_multi_query_split_kernel", "_decode_reduce_kernel")
def _verify_launches(case: KernelCase) -> None:
    """Verify graphs at the largest and the smallest batch (no split / split-K), for each tile
    height the captured query lengths give (the longest query length of each)."""
    m = case.model
    caps = (case.launch.verify_unsplit.block_m, case.launch.verify_split.block_m)
    longest = {tuple(verify_tile_rows(q * m.group, cap) for cap in caps): q for q in CASE_VERIFY_QUERY_LENS}
    for query_len in sorted(longest.values()):
        for batch in SCENARIO_DECODE_BATCHES:
            splits = decode_num_splits(
                batch, m.num_kv_heads, case.max_model_len, case.launch.verify_split.block_n or 64
            )
            workspace = multi_query_workspace(
                batch, query_len, m.num_heads, m.head_dim, splits, torch.device("cpu")
            )
            for cache, kv_scale in case.kv_caches():
                paged_multi_query_attention(
                    case.q(batch * query_len), cache, case.block_tables(batch),
                    torch.zeros(batch, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32), query_len,
                    m.head_dim**-0.5, workspace, kv_scale=kv_scale, launch=case.launch,
                )  # fmt: skip
