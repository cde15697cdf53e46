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

from baton_engine.model.kernels.kernel_registry import KernelCase, launch_scenario
from baton_engine.model.kernels.launch_table import Launch, LaunchTable, launch_table_for
from baton_engine.model.kernels.triton_tiles import (
    attend_paged_keys,
    await_producer,
    packed_output,
    paged_kernel_args,
    paged_kernel_constants,
    pdl_options,
    scenario_pdl,
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
    kv_scale_ptr,  # [2] float32 (K, V) scales of an FP8 cache (KV_FP8 only)
    seq_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] (NUM_SPLITS == 1) or partial [B, H, S, D] fp32
    lse_ptr,  # [B, H, S] fp32
    merged_ptr,  # [B, H, D]: the merged result (NUM_SPLITS > 1)
    arrivals_ptr,  # [B * KVH] int32, zero between launches: splits of (row, kv head) finished
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KVH: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    HEAD_MAJOR: tl.constexpr,
    KV_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    # The lengths are the step's inputs, which no kernel of the step writes: read before waiting
    # for the kernel before this one (PDL), whose q and K/V this program reads after.
    row, kvh, split, seq_len, start, end = split_k_program(seq_lens_ptr, NUM_SPLITS, BLOCK_N, HEAD_MAJOR)
    await_producer(PDL)
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
        cache_ptr, v_offset, block_table_ptr + row * stride_bt, kvh, scale_log2, kv_scale_ptr,
        BLOCK_SIZE=BLOCK_SIZE, KVH=KVH, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL=False, PRECISION=PRECISION,
        KV_FP8=KV_FP8,
    )  # fmt: skip
    store_attention_rows(
        out_ptr, lse_ptr, m_i, l_i, acc, row * H + heads, g_mask, split, NUM_SPLITS, HEAD_DIM
    )
    if NUM_SPLITS > 1:
        # The last split of (row, kv head) to finish merges the group's splits: no reduce launch.
        # The barrier orders every thread's partial stores before the counter's release; the
        # acquire side of the last arrival makes the other splits' stores visible to its loads.
        tl.debug_barrier()
        counter = arrivals_ptr + row * KVH + kvh
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == NUM_SPLITS - 1:
            tl.store(counter, 0)  # ready for the next launch (the graph replays this kernel)
            first = row * H + kvh * GROUP
            _merge_splits(
                out_ptr, lse_ptr, merged_ptr, first,
                GROUP, GROUP_P2, NUM_SPLITS, SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD,
            )  # fmt: skip


@triton.jit
def _merge_splits(
    partial_ptr,  # [rows, S, D] fp32
    lse_ptr,  # [rows, S]
    out_ptr,  # [rows, D]
    first,  # the first of the ROWS (token * H + head) rows merged
    ROWS: tl.constexpr,
    ROWS_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """``out[r] = sum_s partial[r, s] * 2^(lse[r, s] - lse_r)`` for ROWS rows from `first`: the
    splits' results weighted by their share of each row's softmax sum (splits that saw no key
    have lse -inf and weight 0). Loads bypass the SM's L1 (``.cg``): the partials may have been
    written by other programs of the same launch."""
    r = tl.arange(0, ROWS_PAD)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM_PAD)
    r_mask = r < ROWS
    rs_mask = r_mask[:, None] & (s < NUM_SPLITS)[None, :]
    rs = (first + r)[:, None] * NUM_SPLITS + s[None, :]
    lse = tl.load(lse_ptr + rs, mask=rs_mask, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2(lse - top[:, None])
    w = w / tl.maximum(tl.sum(w, 1), 1e-30)[:, None]
    part = tl.load(
        partial_ptr + rs[:, :, None] * HEAD_DIM + d[None, None, :],
        mask=rs_mask[:, :, None] & (d < HEAD_DIM)[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    result = tl.sum(part * w[:, :, None], 1)
    rd = (first + r)[:, None] * HEAD_DIM + d[None, :]
    rd_mask = r_mask[:, None] & (d < HEAD_DIM)[None, :]
    tl.store(out_ptr + rd, result.to(out_ptr.dtype.element_ty), mask=rd_mask)


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
    _merge_splits(
        partial_ptr, lse_ptr, out_ptr, tl.program_id(0), 1, 1, NUM_SPLITS, SPLITS_PAD, HEAD_DIM, HEAD_DIM_PAD
    )


def decode_num_splits(
    batch: int, num_kv_heads: int, max_len: int, block_n: int = 64, target: int = 264
) -> int:
    """Splits of the sequence axis so that a small batch still fills the GPU (fixed per graph size)."""
    programs = batch * num_kv_heads
    splits = max(1, -(-target // programs))
    return int(min(splits, max(1, -(-max_len // block_n)), 64))


class DecodeWorkspace:
    """Scratch for split-K partial results, allocated once per (batch, splits) so graphs can reuse it.

    `arrivals` counts the finished splits of each (row, kv head) for the decode kernel's in-kernel
    merge; the last split resets its counter, so it is zero between launches."""

    def __init__(
        self, batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
    ) -> None:
        self.num_splits = num_splits
        shape = (batch, num_heads, max(num_splits, 1))
        self.partial = torch.empty((*shape, head_dim), dtype=torch.float32, device=device)
        self.lse = torch.empty(shape, dtype=torch.float32, device=device)
        self.arrivals = torch.zeros(batch * num_heads, dtype=torch.int32, device=device)


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
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
    unsplit: Launch,
    split: Launch,
    reduce: Launch | None,
    extra_args: tuple[Any, ...] = (),
    kv_scale: torch.Tensor | None = None,
    programs_per_kv_head: int = 1,
    head_major: bool = False,
    **kernel_constants: Any,
) -> None:
    """Run a split-K paged kernel over (row, kv head x `programs_per_kv_head`, split) — (kv head x
    `programs_per_kv_head`, row, split) with `head_major` — and merge its splits into `out`.

    Without splits the kernel writes `out` directly; otherwise fp32 partials and their log2-sum-exp
    go to `workspace` and the reduce kernel combines them — or, with `reduce` None, the kernel
    merges them itself (its last split per row and kv head; `extra_args` give it `out`). Unset
    tiles, warps and stages come from the launch table's entry for the case (`unsplit` or `split`).
    """
    splits = workspace.num_splits
    tuned = unsplit if splits == 1 else split
    assert tuned.block_n is not None
    constants = paged_kernel_constants(q, layer_cache, tuned.block_n if block_n is None else block_n)
    head_programs = layer_cache.shape[3] * programs_per_kv_head
    grid = (head_programs, rows, splits) if head_major else (rows, head_programs, splits)
    kernel[grid](
        *paged_kernel_args(q, layer_cache, block_tables, scale, kv_scale),
        seq_lens,
        out if splits == 1 else workspace.partial,
        workspace.lse,
        *extra_args,
        NUM_SPLITS=splits,
        num_warps=tuned.num_warps if num_warps is None else num_warps,
        num_stages=tuned.num_stages if num_stages is None else num_stages,
        **kernel_constants,
        **constants,
    )
    if splits == 1 or reduce is None:
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
        num_warps=reduce.num_warps,
        num_stages=reduce.num_stages,
    )


def paged_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    workspace: DecodeWorkspace,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: torch.Tensor | None = None,
    launch: LaunchTable | None = None,
    head_major: bool = False,
    pdl: bool = False,
) -> torch.Tensor:
    """One query token per row. q: [B, H, D]; block_tables: [B, max_blocks] int32; seq_lens: [B] int32;
    kv_scale: the layer's [2] (K, V) scales when the cache is FP8.

    A row with seq_len 0 (graph padding) yields zeros. `launch` defaults to the table of q's device;
    `block_n`, `num_warps` and `num_stages` override its entry (tuning sweeps). `head_major`: launch
    a row's kv heads together (`split_k_program`). `pdl`: launch with programmatic dependent
    launch (`pdl_supported`). With split-K the kernel's last split per row and kv head merges the
    splits into `out` (one launch).
    """
    batch, num_heads, _ = q.shape
    num_kv_heads = layer_cache.shape[3]
    out = packed_output(q, out)
    table = launch_table_for(q.device) if launch is None else launch
    group = num_heads // num_kv_heads
    launch_split_k(
        _decode_split_kernel, batch, out, workspace, q, layer_cache, block_tables, seq_lens, scale, block_n,
        num_warps, num_stages, table.decode_unsplit, table.decode_split, None, (out, workspace.arrivals),
        kv_scale=kv_scale, head_major=head_major, HEAD_MAJOR=head_major,
        SPLITS_PAD=max(2, triton.next_power_of_2(workspace.num_splits)),
        GROUP_PAD=max(16, triton.next_power_of_2(group)), GROUP_P2=triton.next_power_of_2(group),
        **pdl_options(pdl),
    )  # fmt: skip
    return out


#: Graph batch sizes whose decode launches differ: the engine's largest (256 rows: one program
#: per row and kv head, no split) and one row (split-K over the whole context, then the reduce).
SCENARIO_DECODE_BATCHES = (256, 1)


@launch_scenario("_decode_split_kernel")
def _decode_launches(case: KernelCase) -> None:
    m = case.model
    for batch in SCENARIO_DECODE_BATCHES:
        splits = decode_num_splits(
            batch, m.num_kv_heads, case.max_model_len, case.launch.decode_split.block_n or 64
        )
        workspace = DecodeWorkspace(batch, m.num_heads, m.head_dim, splits, torch.device("cpu"))
        for cache, kv_scale in case.kv_caches():
            paged_decode_attention(
                case.q(batch), cache, case.block_tables(batch), torch.zeros(batch, dtype=torch.int32),
                m.head_dim**-0.5, workspace, kv_scale=kv_scale, launch=case.launch,
                # PDL as the engine launches it: in the decode products' one-token steps.
                pdl=scenario_pdl(case.launch) and batch == 1 and kv_scale is None,
            )  # fmt: skip


@triton.jit
def _prefill_kernel(
    q_ptr,  # [T, H, D]
    cache_ptr,  # [2, NB, BS, KVH, D]
    block_table_ptr,  # [B, MAXB] int32
    v_offset,  # elements between the K and the V half of the cache
    stride_bt,
    stride_qt,
    scale_log2,
    kv_scale_ptr,  # [2] float32 (K, V) scales of an FP8 cache (KV_FP8 only)
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
    KV_FP8: tl.constexpr,
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
        cache_ptr, v_offset, block_table_ptr + row * stride_bt, kvh, scale_log2, kv_scale_ptr,
        BLOCK_SIZE=BLOCK_SIZE, KVH=KVH, HEAD_DIM=HEAD_DIM, BLOCK_N=BLOCK_N, CAUSAL=True, PRECISION=PRECISION,
        KV_FP8=KV_FP8,
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
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_scale: torch.Tensor | None = None,
    launch: LaunchTable | None = None,
) -> torch.Tensor:
    """Causal attention of any number of query tokens per row over the row's cached positions.

    q: [T, H, D]; a row's queries are its last ``query_len`` positions of ``seq_len``; kv_scale:
    the layer's [2] (K, V) scales when the cache is FP8. `launch` defaults to the table of q's
    device; the other keywords override its entry.
    """
    num_heads, head_dim = q.shape[1:]
    out = packed_output(q, out)
    num_tiles = tile_rows.shape[0]
    if num_tiles == 0:
        return out
    tuned = (launch_table_for(q.device) if launch is None else launch).prefill(
        triton.next_power_of_2(head_dim)
    )
    assert tuned.block_n is not None
    _prefill_kernel[(num_tiles, num_heads)](
        *paged_kernel_args(q, layer_cache, block_tables, scale, kv_scale),
        query_start_loc,
        seq_lens,
        tile_rows,
        tile_starts,
        out,
        BLOCK_M=PREFILL_BLOCK_M,
        num_warps=tuned.num_warps if num_warps is None else num_warps,
        num_stages=tuned.num_stages if num_stages is None else num_stages,
        **paged_kernel_constants(q, layer_cache, tuned.block_n if block_n is None else block_n),
    )
    return out


@launch_scenario("_prefill_kernel")
def _prefill_launches(case: KernelCase) -> None:
    """A prefill chunk of two rows (the launch's shape does not depend on the token count)."""
    query_lens = (100, 28)
    rows, starts = prefill_tiles(query_lens)
    tokens = sum(query_lens)
    query_start_loc = torch.tensor([0, query_lens[0], tokens], dtype=torch.int32)
    for cache, kv_scale in case.kv_caches():
        paged_prefill_attention(
            case.q(tokens), cache, case.block_tables(len(query_lens)), query_start_loc,
            torch.tensor(query_lens, dtype=torch.int32), torch.tensor(rows, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), case.model.head_dim**-0.5, kv_scale=kv_scale,
            launch=case.launch,
        )  # fmt: skip
