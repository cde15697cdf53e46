"""FP8 GEMM pieces in Triton: row quantization of activations and the scaled matrix product.

* `quantize_rows`: [M, K] 16-bit activations -> FP8 and one float32 scale per row, dynamic (the
  row's largest magnitude over the format's max) or static (one calibrated scale for all rows).
* `fp8_gemm`: ``C = (A B^T) * a_scale[m] * b_scale[n] (+ bias)`` with B an FP8 weight [N, K] and A
  either FP8 (W8A8, with its row scales) or 16-bit (weight-only FP8: B is converted to A's dtype
  inside the kernel, so only half the weight bytes are read).

Products of FP8 values are exact in float32, so the kernels compute what the reference path
(`quantization.fp8.fp8_linear_reference`) computes, up to the order of the sums. Tensor cores take
FP8 operands natively on sm_89+, gfx942 and gfx950 (``NATIVE_FP8_DOT``); elsewhere (sm_80,
gfx90a, Triton's CPU interpreter) both operands are widened to float16 first, which represents
every E4M3 value exactly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton_engine.model.kernels.kernel_registry import KernelCase, launch_scenario
from baton_engine.model.kernels.launch_table import LaunchTable, launch_table_for
from baton_engine.model.kernels.triton_gemv import (
    ROCM_GEMV,
    SITES,
    TOKEN_BUCKETS,
    GemvLaunch,
    GemvTable,
    gemv,
    gemv_qkv_rope,
    gemv_residual,
    gemv_silu,
    gemv_table_for,
    residual_programs,
)
from baton_engine.model.kernels.triton_tiles import scenario_pdl
from baton_engine.model.quantization.fp8 import FP8_DECODE_MAX_ROWS, MIN_SCALE, fp8_max

#: 1.5 * 2**23: adding and subtracting it rounds a float32 of magnitude below 2**22 to the nearest
#: integer, ties to even (the FPU's rounding), for either sign.
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def round_to_fp8_grid(x, MIN_NORMAL_EXP: tl.constexpr):
    """`x` (float32, within the format's range) rounded to the nearest E4M3 value, ties to even.

    The cast to FP8 that follows is then exact on every backend: Triton's CPU interpreter rounds
    half up and drops the carry into the exponent (124.3 -> 64), GPUs round to nearest even. E4M3
    has 3 mantissa bits, so the grid step at exponent e is 2**(e - 3), and the subnormals below
    2**MIN_NORMAL_EXP (-6 for fn, -7 for fnuz) share the smallest normal's step; the exponent
    also names the format, for the sign of a zero.
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_NORMAL_EXP)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # Multiplying by the power of two 1 / step is exact; a division would be an approximate
    # one on NVIDIA GPUs (Triton's fp32 `/` is div.full.f32, up to 2 ulp off).
    inverse_step = ((127 - (exponent - 3)) << 23).to(tl.float32, bitcast=True)
    rounded = ((x * inverse_step + _ROUND_MAGIC) - _ROUND_MAGIC) * step
    if MIN_NORMAL_EXP == -6:
        # e4m3fn has a negative zero, and torch's cast rounds a tiny negative value to it; the
        # rounding above returns +0 for it (fnuz has no -0: 0x80 is its NaN, +0 is right there).
        rounded = tl.where(x < 0, -tl.abs(rounded), rounded)
    return rounded


def min_normal_exponent(fp8_dtype: torch.dtype) -> int:
    """The exponent of the smallest normal value of an E4M3 format (its bias is 7 or 8)."""
    return -6 if fp8_dtype == torch.float8_e4m3fn else -7


@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] 16/32-bit
    q_ptr,  # [M, K] FP8
    scale_ptr,  # [M] float32 out
    static_scale_ptr,  # [] float32 (STATIC only)
    K,
    stride_x,
    FP8_MAX: tl.constexpr,
    MIN_NORMAL_EXP: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STATIC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.load(static_scale_ptr)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        # IEEE-rounded divisions (tl.div_rn), as torch divides: Triton's `/` on fp32 is an
        # approximate division on NVIDIA GPUs, 1 ulp off the reference's scale now and then.
        scale = tl.div_rn(tl.maximum(tl.max(amax, 0), MIN_SCALE), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = round_to_fp8_grid(tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX), MIN_NORMAL_EXP)
        tl.store(q_ptr + row * K + k0 + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(
    x: torch.Tensor, fp8_dtype: torch.dtype, static_scale: torch.Tensor | None = None, block_k: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] (row stride may differ) -> (q [M, K] contiguous FP8, scale [M] float32)."""
    rows, width = x.shape
    assert x.stride(1) == 1, "activation rows must be contiguous"
    q = torch.empty((rows, width), dtype=fp8_dtype, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](
            x, q, scale, scale if static_scale is None else static_scale, width, x.stride(0),
            FP8_MAX=fp8_max(fp8_dtype), MIN_NORMAL_EXP=min_normal_exponent(fp8_dtype), MIN_SCALE=MIN_SCALE,
            BLOCK_K=min(block_k, triton.next_power_of_2(width)), STATIC=static_scale is not None,
        )  # fmt: skip
    return q, scale


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] FP8 (A_FP8) or 16/32-bit
    a_scale_ptr,  # [M] float32 (A_FP8 only)
    b_ptr,  # [N, K] FP8
    b_scale_ptr,  # [N] float32
    bias_ptr,  # [N] (HAS_BIAS only)
    c_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    A_FP8: tl.constexpr,
    NATIVE_FP8_DOT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Programs walk the output in groups of GROUP_M row tiles, so consecutive programs share
    # their B (weight) tiles in cache.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * tiles_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % group_size) % rows_in_group
    tile_n = (pid % group_size) // rows_in_group

    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    m_mask = m < M
    n_mask = n < N
    a_rows = a_ptr + m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + n.to(tl.int64)[:, None] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + k) < K
        a = tl.load(a_rows + (k0 + k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_rows + (k0 + k)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if A_FP8:
            if not NATIVE_FP8_DOT:
                a = a.to(tl.float16)
                b = b.to(tl.float16)
        else:
            b = b.to(a.dtype)
        # max_num_imprecise_acc=0: on sm_90 Triton's default lets FP8 wgmma chains accumulate
        # in the tensor cores' reduced-precision adder over all of K (1e-3 relative off the
        # float32 sum); 0 adds every instruction's partial into the float32 accumulator.
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION, max_num_imprecise_acc=0)
    b_scale = tl.load(b_scale_ptr + n, mask=n_mask, other=0.0)
    acc = acc * b_scale[None, :]
    if A_FP8:
        a_scale = tl.load(a_scale_ptr + m, mask=m_mask, other=0.0)
        acc = acc * a_scale[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + m.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemmTiles:
    """The tile shape of one `fp8_gemm` launch."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def gemm_tiles(rows: int) -> GemmTiles:
    """Tiles by the number of activation rows: decode-sized products (a few rows) are bound by
    the weight bytes, so narrow N tiles give every SM a slice of the weight to stream; prefill-
    sized ones are bound by the tensor cores and take square tiles."""
    if rows <= 16:
        return GemmTiles(16, 32, 256, 1, 4, 4)
    if rows <= 64:
        return GemmTiles(64, 64, 128, 8, 4, 3)
    return GemmTiles(128, 128, 64, 8, 8, 3)


def fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    native_fp8_dot: bool,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """``(a b^T) * a_scale[:, None] * b_scale[None, :] (+ bias)`` -> [M, N] in `out_dtype`.

    a: [M, K] FP8 with `a_scale` [M], or 16/32-bit with `a_scale` None (weight-only);
    b: [N, K] FP8 contiguous; b_scale: [N] float32.
    """
    rows, depth = a.shape
    cols = b.shape[0]
    assert a.stride(1) == 1 and b.is_contiguous(), "a's rows and b must be contiguous"
    assert b.shape[1] == depth, f"inner dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}"
    out = torch.empty((rows, cols), dtype=out_dtype, device=a.device)
    if rows == 0:
        return out
    t = gemm_tiles(rows) if tiles is None else tiles
    grid = (triton.cdiv(rows, t.block_m) * triton.cdiv(cols, t.block_n),)
    a_fp8 = a_scale is not None
    _fp8_gemm_kernel[grid](
        a, a_scale if a_fp8 else b_scale, b, b_scale, b_scale if bias is None else bias, out,
        rows, cols, depth, a.stride(0), b.stride(0), out.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        A_FP8=a_fp8, NATIVE_FP8_DOT=native_fp8_dot, HAS_BIAS=bias is not None,
        PRECISION="ieee" if a.dtype == torch.float32 else None,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out


#: Activation rows of the FP8 GEMM scenario: one for each tile shape `gemm_tiles` picks.
_SCENARIO_ROWS = (4, 64, 256)


@launch_scenario("_quantize_rows_kernel", "_fp8_gemm_kernel", dtypes=("fp8",))
def _fp8_gemm_launches(case: KernelCase) -> None:
    """An FP8 linear layer (hidden -> hidden) in the target's format, for bfloat16 and float16
    activations: quantized per token and with a static scale, then the W8A8 product and the
    weight-only one (16-bit activations), with and without a bias, for each tile shape."""
    width = case.model.hidden_size
    weight = torch.zeros(width, width, dtype=case.dtype)
    weight_scale = torch.ones(width)
    for activation_dtype in (torch.bfloat16, torch.float16):
        for rows in _SCENARIO_ROWS:
            x = torch.zeros(rows, width, dtype=activation_dtype)
            q, row_scale = quantize_rows(x, case.dtype)
            quantize_rows(x, case.dtype, torch.ones(()))
            for bias in (None, torch.zeros(width, dtype=activation_dtype)):
                fp8_gemm(q, row_scale, weight, weight_scale, bias, activation_dtype, native_fp8_dot=True)
                fp8_gemm(x, None, weight, weight_scale, bias, activation_dtype, native_fp8_dot=True)


# -- FP8 weights in the decode products ----------------------------------------------------------


_TUNED = (
    "measured on the H200 (bench.gpu section fp8_tune, 2026-12-02: each site's launch chosen by "
    "the whole batch-1 8B forward replayed from one graph with PDL, the other sites at their "
    "best; bench/RESULTS.md): the fastest of the launches tried at this site"
)


_FP8_ONE_GENERIC = "an FP8 linear layer of no decoder call site (not measured): the o_proj entry"
_FP8_ONE_ROCM = "the NVIDIA FP8 entry's lanes as half the wavefronts, one stage (LDS); not measured on AMD"
_FP8_FEW = "not run by the engine (FP8_DECODE_MAX_ROWS is 1): a 16-row dot tile as in bf16"

#: One-token launches of the FP8 decode products per call site on NVIDIA (the "lm_head" entry
#: serves an FP8 linear layer of another name: the LM head itself stays 16-bit).
_FP8_CUDA_ONE = {
    "qkv": GemvLaunch(4, 1024, 4, 2, False, _TUNED),
    "o": GemvLaunch(8, 2048, 8, 2, False, _TUNED),
    "gate_up": GemvLaunch(2, 1024, 2, 3, False, _TUNED),
    "down": GemvLaunch(16, 2048, 8, 2, False, _TUNED),
}


def _fp8_table(name: str, one: dict[str, GemvLaunch], few: GemvLaunch) -> GemvTable:
    one = {**one, "lm_head": dataclasses.replace(one["o"], reason=_FP8_ONE_GENERIC)}
    return GemvTable(
        name,
        {(site, bucket): one[site] if bucket == 1 else few for site in SITES for bucket in TOKEN_BUCKETS},
    )


def _rocm(launch: GemvLaunch) -> GemvLaunch:
    return dataclasses.replace(
        launch, num_warps=max(1, launch.num_warps // 2), num_stages=1, reason=_FP8_ONE_ROCM
    )


#: Decode-product launches for FP8 weights (the same kernels as 16-bit ones, with ``w_scale``).
FP8_CUDA_GEMV = _fp8_table("cuda-fp8", _FP8_CUDA_ONE, GemvLaunch(16, 256, 4, 3, True, _FP8_FEW))
FP8_ROCM_GEMV = _fp8_table(
    "rocm-fp8",
    {site: _rocm(launch) for site, launch in _FP8_CUDA_ONE.items()},
    GemvLaunch(16, 256, 2, 2, True, _FP8_FEW),
)

#: The decode-product call site of a linear layer, by the last name of its prefix.
_LAYER_SITES = {"qkv_proj": "qkv", "o_proj": "o", "gate_up_proj": "gate_up", "down_proj": "down"}


def site_of_layer(prefix: str) -> str:
    """The call site whose launch a one-row product of layer `prefix` takes (``...o_proj``: "o");
    "lm_head" (the generic entry) for any other layer."""
    return _LAYER_SITES.get(prefix.rpartition(".")[2], "lm_head")


def fp8_gemv_table_for(launch: LaunchTable) -> GemvTable:
    """The FP8-weight decode products' table of the backend whose launch table is `launch`."""
    return FP8_ROCM_GEMV if gemv_table_for(launch) is ROCM_GEMV else FP8_CUDA_GEMV


def fp8_gemv_table(device: torch.device) -> GemvTable:
    return fp8_gemv_table_for(launch_table_for(device))


def fp8_weight_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    site: str = "lm_head",
) -> torch.Tensor:
    """``(x @ weight^T) * weight_scale (+ bias)`` for at most `FP8_DECODE_MAX_ROWS` rows of 16/32-bit
    `x` and an FP8 `weight` [N, K] with one float32 scale per row, in x's dtype: the decode
    product the fused decoder runs at call site `site` (`site_of_layer`), with that site's launch,
    so a layer sums its rows in the fused decoder's order."""
    launch = fp8_gemv_table(x.device).launch(site, x.shape[0])
    return gemv(x, weight, launch, bias=bias, w_scale=weight_scale)


@launch_scenario(
    "_gemv_kernel", "_gemv_residual_kernel", "_gemv_silu_kernel", "_gemv_qkv_rope_kernel", dtypes=("fp8",)
)
def _fp8_decode_product_launches(case: KernelCase) -> None:
    """A decode step's products over FP8 weights (the target's format, one scale per row) for
    bfloat16 and float16 activations, as `FusedDecoder._forward_few` launches them for an FP8
    model (a 16-bit KV cache; the LM head stays 16-bit), and the plain products the FP8 linear
    layers of the four sites run for a one-row input (`fp8_weight_gemv`, the reference runner's)."""
    m = case.model
    table = fp8_gemv_table_for(case.launch)
    pdl = scenario_pdl(case.launch)  # the products launch with PDL where the engine's do
    h, kvh, d = m.num_heads, m.num_kv_heads, m.head_dim

    def weight(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(rows, cols, dtype=case.dtype), torch.empty(rows, dtype=torch.float32)

    qkv_w, qkv_s = weight((h + 2 * kvh) * d, m.hidden_size)
    o_w, o_s = weight(m.hidden_size, h * d)
    gate_up_w, gate_up_s = weight(2 * m.intermediate_size, m.hidden_size)
    down_w, down_s = weight(m.hidden_size, m.intermediate_size)
    for dtype in (torch.bfloat16, torch.float16):
        tokens = FP8_DECODE_MAX_ROWS
        residual = torch.empty(tokens, m.hidden_size, dtype=dtype)
        norm = torch.empty(m.hidden_size, dtype=dtype)
        cos = torch.empty(64, d, dtype=dtype)
        cache = torch.empty(2, 4, case.block_size, kvh, d, dtype=dtype)
        widest = max(
            residual_programs(m.hidden_size, table.launch("o", tokens)),
            residual_programs(m.hidden_size, table.launch("down", tokens)),
        )
        squares = torch.empty(tokens, widest, dtype=torch.float32)
        positions = torch.zeros(tokens, dtype=torch.int64)
        q = gemv_qkv_rope(
            residual, squares, 1, norm, 1e-5, qkv_w, positions, cos, cos, positions, cache, h, kvh, d,
            table.launch("qkv", tokens), w_scale=qkv_s, pdl=pdl,
        )  # fmt: skip
        partials = gemv_residual(q, o_w, residual, squares, table.launch("o", tokens), w_scale=o_s, pdl=pdl)
        act = gemv_silu(
            residual, squares, partials, norm, 1e-5, gate_up_w, table.launch("gate_up", tokens),
            w_scale=gate_up_s, pdl=pdl,
        )  # fmt: skip
        gemv_residual(act, down_w, residual, squares, table.launch("down", tokens), w_scale=down_s, pdl=pdl)
        fp8_weight_gemv(residual, qkv_w, qkv_s, torch.empty(qkv_w.shape[0], dtype=dtype), "qkv")
        fp8_weight_gemv(q, o_w, o_s, None, "o")
        fp8_weight_gemv(residual, gate_up_w, gate_up_s, None, "gate_up")
        fp8_weight_gemv(act, down_w, down_s, None, "down")
