"""Fused element-wise kernels of the decoder step (Triton): each saves passes over activations.

* `fused_add_rms_norm`: ``residual += x`` then RMSNorm of the sum, one read and two writes.
* `rotary_cache_write`: rotates q in place and k, and stores the rotated k and v in the cache
  at each token's slot (slot < 0 = padding, skipped), in one launch instead of six; into an FP8
  cache divided by the layer's K/V scales and rounded as `quantization.fp8.cast_saturated` does.
* `silu_and_mul`: ``silu(gate) * up`` from the fused gate_up projection.

Rounding matches the torch reference: the norm is computed in float32 and cast to the model
dtype before the weight multiply, as `RMSNorm` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_engine.model.kernels.kernel_registry import KernelCase, launch_scenario
from baton_engine.model.kernels.launch_table import LaunchTable, launch_table_for
from baton_engine.model.kernels.triton_fp8 import min_normal_exponent, round_to_fp8_grid
from baton_engine.model.quantization.fp8 import FP8_DTYPES, fp8_max


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + row * N + cols, mask=mask, other=0.0)
        tl.store(residual_ptr + row * N + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    var = tl.sum(x32 * x32, 0) / N
    normed = (x32 * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * N + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    launch: LaunchTable | None = None,
) -> torch.Tensor:
    """RMSNorm of [T, N] rows."""
    out = torch.empty_like(x) if out is None else out
    n = x.shape[-1]
    tuned = (launch_table_for(x.device) if launch is None else launch).rms_norm
    _rms_norm_kernel[(x.shape[0],)](
        x, x, weight, out, eps, N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=False,
        num_warps=tuned.num_warps, num_stages=tuned.num_stages,
    )  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    launch: LaunchTable | None = None,
) -> torch.Tensor:
    """``residual += x`` (in place) and return RMSNorm(residual)."""
    out = torch.empty_like(x) if out is None else out
    n = x.shape[-1]
    tuned = (launch_table_for(x.device) if launch is None else launch).rms_norm
    _rms_norm_kernel[(x.shape[0],)](
        x, residual, weight, out, eps, N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=True,
        num_warps=tuned.num_warps, num_stages=tuned.num_stages,
    )  # fmt: skip
    return out


@launch_scenario("_rms_norm_kernel")
def _rms_norm_launches(case: KernelCase) -> None:
    """The decoder's norms over hidden-size rows: the first layer's, then add + norm."""
    x = torch.zeros(4, case.model.hidden_size, dtype=case.dtype)
    weight = torch.zeros(case.model.hidden_size, dtype=case.dtype)
    rms_norm(x, weight, 1e-5, launch=case.launch)
    fused_add_rms_norm(x, torch.zeros_like(x), weight, 1e-5, launch=case.launch)


@triton.jit
def _rotary_cache_kernel(
    qkv_ptr,  # [T, (H + 2 * KVH) * D]: q heads, then k heads, then v heads
    positions_ptr,  # [T] int64
    cos_ptr,  # [max_pos, D] (both halves equal)
    sin_ptr,
    slots_ptr,  # [T] int64
    cache_ptr,  # [2, NB, BS, KVH, D]
    v_offset,
    kv_scale_ptr,  # [2] float32 (K, V) scales of an FP8 cache (KV_FP8 only)
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    D: tl.constexpr = 2 * HALF
    ROW: tl.constexpr = (H + 2 * KVH) * D
    pos = tl.load(positions_ptr + token)
    j = tl.arange(0, HALF_PAD)
    j_mask = j < HALF
    cos = tl.load(cos_ptr + pos * D + j, mask=j_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * D + j, mask=j_mask, other=0.0).to(tl.float32)
    h = tl.arange(0, HEADS_PAD)
    base = qkv_ptr + token * ROW
    # q and k heads are contiguous: rotate H + KVH heads in one tile.
    rot_mask = (h < H + KVH)[:, None] & j_mask[None, :]
    first = tl.load(base + h[:, None] * D + j[None, :], mask=rot_mask, other=0.0)
    second = tl.load(base + h[:, None] * D + HALF + j[None, :], mask=rot_mask, other=0.0)
    f32 = first.to(tl.float32)
    s32 = second.to(tl.float32)
    new_first = (f32 * cos[None, :] - s32 * sin[None, :]).to(first.dtype)
    new_second = (s32 * cos[None, :] + f32 * sin[None, :]).to(first.dtype)
    q_mask = (h < H)[:, None] & j_mask[None, :]
    tl.store(base + h[:, None] * D + j[None, :], new_first, mask=q_mask)
    tl.store(base + h[:, None] * D + HALF + j[None, :], new_second, mask=q_mask)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        k_mask = (h >= H)[:, None] & rot_mask
        kv_head = h - H
        dst = cache_ptr + (slot * KVH + kv_head)[:, None] * D + j[None, :]
        kv = tl.arange(0, HEADS_PAD)
        v_mask = (kv < KVH)[:, None] & j_mask[None, :]
        v_src = base + ((H + KVH) + kv)[:, None] * D + j[None, :]
        v_dst = cache_ptr + v_offset + (slot * KVH + kv)[:, None] * D + j[None, :]
        v_first = tl.load(v_src, mask=v_mask, other=0.0)
        v_second = tl.load(v_src + HALF, mask=v_mask, other=0.0)
        if KV_FP8:
            k_scale = tl.load(kv_scale_ptr)
            v_scale = tl.load(kv_scale_ptr + 1)
            tl.store(dst, _to_fp8(new_first, k_scale, FP8_MAX, MIN_NORMAL_EXP, cache_ptr), mask=k_mask)
            tl.store(
                dst + HALF, _to_fp8(new_second, k_scale, FP8_MAX, MIN_NORMAL_EXP, cache_ptr), mask=k_mask
            )
            tl.store(v_dst, _to_fp8(v_first, v_scale, FP8_MAX, MIN_NORMAL_EXP, cache_ptr), mask=v_mask)
            tl.store(
                v_dst + HALF, _to_fp8(v_second, v_scale, FP8_MAX, MIN_NORMAL_EXP, cache_ptr), mask=v_mask
            )
        else:
            tl.store(dst, new_first, mask=k_mask)
            tl.store(dst + HALF, new_second, mask=k_mask)
            tl.store(v_dst, v_first, mask=v_mask)
            tl.store(v_dst + HALF, v_second, mask=v_mask)


@triton.jit
def _to_fp8(x, scale, FP8_MAX: tl.constexpr, MIN_NORMAL_EXP: tl.constexpr, cache_ptr):
    """`x / scale` saturated and rounded into the cache's FP8 format."""
    # tl.div_rn: the IEEE division torch's reference cache write does (`/` is approximate on
    # NVIDIA GPUs), so both store the same bytes.
    scaled = tl.minimum(tl.maximum(tl.div_rn(x.to(tl.float32), scale), -FP8_MAX), FP8_MAX)
    return round_to_fp8_grid(scaled, MIN_NORMAL_EXP).to(cache_ptr.dtype.element_ty)


def rotary_cache_write(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_scale: torch.Tensor | None = None,
    launch: LaunchTable | None = None,
) -> None:
    """Rotate q (in place inside `qkv`) and k; write rotated k and v to `layer_cache` at the slots.

    qkv: [T, (H + 2 * KVH) * D] contiguous; cos/sin: [max_positions, D] rotary tables; kv_scale:
    the layer's [2] float32 (K, V) scales when `layer_cache` is FP8 (values stored divided by them).
    """
    tokens = qkv.shape[0]
    if tokens == 0:
        return
    half = head_dim // 2
    kv_fp8 = layer_cache.dtype in FP8_DTYPES
    if (kv_scale is None) == kv_fp8:
        raise ValueError(f"a {layer_cache.dtype} KV cache needs (K, V) scales exactly when it is FP8")
    tuned = (launch_table_for(qkv.device) if launch is None else launch).rotary
    _rotary_cache_kernel[(tokens,)](
        qkv,
        positions,
        cos,
        sin,
        slot_mapping,
        layer_cache,
        layer_cache.stride(0),
        layer_cache if kv_scale is None else kv_scale,
        H=num_heads,
        KVH=num_kv_heads,
        HALF=half,
        HALF_PAD=triton.next_power_of_2(half),
        HEADS_PAD=triton.next_power_of_2(num_heads + num_kv_heads),
        KV_FP8=kv_fp8,
        FP8_MAX=fp8_max(layer_cache.dtype) if kv_fp8 else 0.0,
        MIN_NORMAL_EXP=min_normal_exponent(layer_cache.dtype) if kv_fp8 else 0,
        num_warps=tuned.num_warps,
        num_stages=tuned.num_stages,
    )


@launch_scenario("_rotary_cache_kernel")
def _rotary_launches(case: KernelCase) -> None:
    """Rotary embedding and cache write of a step's tokens (rotary tables in the model dtype)."""
    m = case.model
    tokens = 4
    cos = torch.zeros(64, m.head_dim, dtype=case.dtype)
    for cache, kv_scale in case.kv_caches():
        rotary_cache_write(
            case.qkv(tokens), torch.zeros(tokens, dtype=torch.int64), cos, torch.zeros_like(cos),
            torch.zeros(tokens, dtype=torch.int64), cache, m.num_heads, m.num_kv_heads, m.head_dim,
            kv_scale, launch=case.launch,
        )  # fmt: skip


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_up_ptr + row * 2 * N + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    # Two roundings like the reference: silu(gate) in the model dtype, then the product.
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    tl.store(out_ptr + row * N + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(
    gate_up: torch.Tensor, out: torch.Tensor | None = None, launch: LaunchTable | None = None
) -> torch.Tensor:
    """[T, 2N] (gate then up) -> [T, N]."""
    tokens, width = gate_up.shape
    n = width // 2
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    if tokens:
        tuned = (launch_table_for(gate_up.device) if launch is None else launch).silu
        assert tuned.block_n is not None
        _silu_mul_kernel[(tokens, triton.cdiv(n, tuned.block_n))](
            gate_up, out, N=n, BLOCK=tuned.block_n, num_warps=tuned.num_warps, num_stages=tuned.num_stages
        )
    return out


@launch_scenario("_silu_mul_kernel")
def _silu_launches(case: KernelCase) -> None:
    """The MLP's activation over the fused gate_up projection."""
    silu_and_mul(torch.zeros(4, 2 * case.model.intermediate_size, dtype=case.dtype), launch=case.launch)
