"""Fused mixture-of-experts in Triton: token/expert pairs grouped by expert, one grouped GEMM per
projection.

A step's T tokens each pick K experts: T*K (token, expert) *pairs*, pair ``p = t * K + k``.
`align_by_expert` sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M,
so every BLOCK_M tile of the sorted order belongs to one expert (`block_experts`). Then:

1. `_moe_gate_up_kernel`: per tile, ``silu(x W_gate^T) * (x W_up^T)`` for its pairs' tokens with
   its expert's fused gate_up weight ([E, 2I, H]); both halves are computed by the same program,
   so the activation is fused and only [T*K, I] is written.
2. `_moe_down_kernel`: per tile, ``act W_down^T`` ([E, H, I]) times each pair's routing weight,
   written to the pair's row of [T*K, H].
3. The K rows of each token are summed.

Each active expert's weights are read once per tile of its pairs (once per step when it serves at
most BLOCK_M pairs, as in decode), and nothing here reads device values on the host, so a step
runs inside a captured graph. Expert weights may be FP8 with one float32 scale per (expert,
output channel): they are widened to the activations' dtype in the kernel (weight-only FP8).

Rounding follows the reference (transformers' experts): the projections are rounded to the model
dtype, silu(gate) is rounded before the product, the expert's output is rounded before it is
scaled by the routing weight, and the scaling happens in the routing weights' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton_engine.model.kernels.kernel_registry import KernelCase, launch_scenario
from baton_engine.model.kernels.launch_table import LaunchTable, launch_table_for


@dataclass
class MoeAlignment:
    """The step's (token, expert) pairs sorted by expert, padded to whole BLOCK_M tiles."""

    block_m: int
    #: [capacity] int32 pair ids in expert order; padding slots hold T*K (no pair).
    sorted_pairs: torch.Tensor
    #: [capacity // block_m] int32: the expert of each tile (tiles past `num_padded`: unused).
    block_experts: torch.Tensor
    #: [1] int32: slots in use (the padded pair count); tiles at or past it exit at once.
    num_padded: torch.Tensor

    @property
    def max_tiles(self) -> int:
        return self.block_experts.shape[0]


def alignment_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Slots for the padded order: every pair, plus at most BLOCK_M - 1 padding slots for each
    expert that has a pair (at most min(E, pairs) of them), rounded to whole tiles."""
    slots = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-slots // block_m) * block_m


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Group the pairs of `topk_ids` ([T, K] expert ids) by expert (torch ops, device-side)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    capacity = alignment_capacity(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    # A pair's slot: its expert's padded start plus its rank among that expert's pairs.
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert_of_sorted]
    slots = (padded_end - padded)[expert_of_sorted] + rank
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, slots, order.to(torch.int32))
    tile_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, tile_starts, right=True)
    return MoeAlignment(
        block_m=block_m,
        sorted_pairs=sorted_pairs,
        block_experts=block_experts.clamp(max=num_experts - 1).to(torch.int32),
        num_padded=padded_end[-1:].to(torch.int32),
    )


@triton.jit
def _tile_pairs(sorted_pairs_ptr, block_experts_ptr, num_padded_ptr, NUM_PAIRS, BLOCK_M: tl.constexpr):
    """This program's tile: (in use, its pair ids [BLOCK_M], which are real, its expert)."""
    tile = tl.program_id(0)
    in_use = tile * BLOCK_M < tl.load(num_padded_ptr)
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_experts_ptr + tile).to(tl.int64)
    return in_use, pairs, pairs < NUM_PAIRS, expert


@triton.jit
def _moe_gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows [0, I), up rows [I, 2I)
    w_scale_ptr,  # [E, 2I] float32 (W_FP8 only)
    out_ptr,  # [T*K, I]
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    NUM_PAIRS,
    H,
    INTER,
    stride_x,
    stride_we,
    stride_wn,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    in_use, pairs, real, expert = _tile_pairs(
        sorted_pairs_ptr, block_experts_ptr, num_padded_ptr, NUM_PAIRS, BLOCK_M
    )
    if in_use:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < INTER
        k = tl.arange(0, BLOCK_K)
        tokens = (pairs // TOP_K).to(tl.int64)
        x_rows = x_ptr + tokens[:, None] * stride_x
        w_gate = w_ptr + expert * stride_we + n.to(tl.int64)[:, None] * stride_wn
        w_up = w_gate + INTER * stride_wn
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_mask = (k0 + k) < H
            x = tl.load(x_rows + (k0 + k)[None, :], mask=real[:, None] & k_mask[None, :], other=0.0)
            w_mask = n_mask[:, None] & k_mask[None, :]
            wg = tl.load(w_gate + (k0 + k)[None, :], mask=w_mask, other=0.0).to(x.dtype)
            wu = tl.load(w_up + (k0 + k)[None, :], mask=w_mask, other=0.0).to(x.dtype)
            gate = tl.dot(x, tl.trans(wg), gate, input_precision=PRECISION)
            up = tl.dot(x, tl.trans(wu), up, input_precision=PRECISION)
        if W_FP8:
            scales = w_scale_ptr + expert * 2 * INTER + n
            gate = gate * tl.load(scales, mask=n_mask, other=0.0)[None, :]
            up = up * tl.load(scales + INTER, mask=n_mask, other=0.0)[None, :]
        dtype = out_ptr.dtype.element_ty
        g = gate.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        result = (act * up.to(dtype).to(tl.float32)).to(dtype)
        out = out_ptr + pairs.to(tl.int64)[:, None] * INTER + n[None, :]
        tl.store(out, result, mask=real[:, None] & n_mask[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr,  # [T*K, I]
    w_ptr,  # [E, H, I]
    w_scale_ptr,  # [E, H] float32 (W_FP8 only)
    routing_ptr,  # [T*K] routing weights (model dtype or float32)
    out_ptr,  # [T*K, H]
    sorted_pairs_ptr,
    block_experts_ptr,
    num_padded_ptr,
    NUM_PAIRS,
    H,
    INTER,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    in_use, pairs, real, expert = _tile_pairs(
        sorted_pairs_ptr, block_experts_ptr, num_padded_ptr, NUM_PAIRS, BLOCK_M
    )
    if in_use:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < H
        k = tl.arange(0, BLOCK_K)
        rows = pairs.to(tl.int64)
        a_rows = act_ptr + rows[:, None] * INTER
        w_rows = w_ptr + expert * stride_we + n.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k_mask = (k0 + k) < INTER
            a = tl.load(a_rows + (k0 + k)[None, :], mask=real[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + (k0 + k)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision=PRECISION)
        if W_FP8:
            acc = acc * tl.load(w_scale_ptr + expert * H + n, mask=n_mask, other=0.0)[None, :]
        dtype = out_ptr.dtype.element_ty
        weight = tl.load(routing_ptr + rows, mask=real, other=0.0)
        # The expert's output in the model dtype, scaled in the routing weights' dtype.
        expert_out = acc.to(dtype).to(weight.dtype)
        result = (expert_out * weight[:, None]).to(dtype)
        out = out_ptr + rows[:, None] * H + n[None, :]
        tl.store(out, result, mask=real[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class MoeTiles:
    """Tile shape and launch parameters of the two grouped GEMMs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_tiles(num_pairs: int, num_experts: int, launch: LaunchTable) -> MoeTiles:
    """BLOCK_M by the pairs an expert gets on average: decode steps give each active expert a
    few pairs (16-row tiles, the smallest a dot takes, waste the least padding), large prefill
    steps fill 64-row tiles; warps and stages from the backend's `LaunchTable.moe`."""
    per_expert = num_pairs / max(1, num_experts)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    return MoeTiles(block_m, 64, 64, launch.moe.num_warps, launch.moe.num_stages)


def _precision(dtype: torch.dtype) -> str | None:
    # float32 runs must not drop to tf32 (parity is checked in float32).
    return "ieee" if dtype == torch.float32 else None


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    tiles: MoeTiles | None = None,
    launch: LaunchTable | None = None,
) -> torch.Tensor:
    """The experts' weighted sum for each token: [T, H].

    x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I] (16-bit like x, or FP8 with scales [E, 2I] and
    [E, H]); topk_weights / topk_ids: [T, K] (weights in x's dtype or float32). `launch`
    defaults to the table of x's device; `tiles` overrides the tiles it gives.
    """
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    w_fp8 = gate_up_scale is not None
    assert (down_scale is not None) == w_fp8, "both projections are FP8 or neither"
    assert x.stride(1) == 1 and gate_up.is_contiguous() and down.is_contiguous()
    if tokens == 0:
        return torch.zeros_like(x)
    table = launch_table_for(x.device) if launch is None else launch
    t = moe_tiles(num_pairs, num_experts, table) if tiles is None else tiles
    alignment = align_by_expert(topk_ids, num_experts, t.block_m)
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    common = (alignment.sorted_pairs, alignment.block_experts, alignment.num_padded, num_pairs, hidden, inter)
    precision = _precision(x.dtype)
    _moe_gate_up_kernel[(alignment.max_tiles, triton.cdiv(inter, t.block_n))](
        x, gate_up, gate_up_scale if w_fp8 else x, act, *common,
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        TOP_K=top_k, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, W_FP8=w_fp8,
        PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(alignment.max_tiles, triton.cdiv(hidden, t.block_n))](
        act, down, down_scale if w_fp8 else x, topk_weights.reshape(-1).contiguous(), per_pair, *common,
        down.stride(0), down.stride(1),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, W_FP8=w_fp8,
        PRECISION=precision, num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return per_pair.view(tokens, top_k, hidden).sum(dim=1)


#: Token counts of the MoE scenario: decode-sized, mid-sized and prefill-sized steps, one for
#: each tile height `moe_tiles` picks with `_SCENARIO_EXPERTS` experts and top-2 routing.
_SCENARIO_TOKENS = (4, 128, 512)
_SCENARIO_EXPERTS = 8


@launch_scenario("_moe_gate_up_kernel", "_moe_down_kernel")
def _moe_launches(case: KernelCase) -> None:
    """The two grouped GEMMs for each tile height, with 16-bit experts and (16-bit activations on
    a target with FP8) with FP8 experts and their per-channel scales. The expert shapes are
    runtime arguments; the case's hidden size with a 256-wide expert keeps the tensors small."""
    hidden, inter, experts = case.model.hidden_size, 256, _SCENARIO_EXPERTS
    weight_dtypes: list[torch.dtype] = [case.dtype]
    if case.fp8_dtype is not None and case.case_dtype in ("bfloat16", "float16"):
        weight_dtypes.append(case.fp8_dtype)
    for tokens in _SCENARIO_TOKENS:
        x = torch.zeros(tokens, hidden, dtype=case.dtype)
        ids = (torch.arange(tokens * 2, dtype=torch.int64) % experts).view(tokens, 2)
        weights = torch.zeros(tokens, 2, dtype=torch.float32)
        for weight_dtype in weight_dtypes:
            fp8 = weight_dtype != case.dtype
            fused_moe(
                x, torch.zeros(experts, 2 * inter, hidden, dtype=weight_dtype),
                torch.zeros(experts, hidden, inter, dtype=weight_dtype), weights, ids,
                torch.ones(experts, 2 * inter) if fp8 else None, torch.ones(experts, hidden) if fp8 else None,
                launch=case.launch,
            )  # fmt: skip
