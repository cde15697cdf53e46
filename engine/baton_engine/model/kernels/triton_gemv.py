"""Decode-step matrix products for a few tokens (T <= 8) in Triton, fused with their neighbours.

At batch 1 a decoder step is a sweep over the weights: each projection reads its whole weight
matrix once for a handful of activation rows, so what counts is the weight stream's bandwidth
and the number of launches. Each kernel here is one such stream (``out[T, N] = x[T, K] W[N, K]^T``)
with the element-wise work around it folded in, so a layer is five launches plus attention:

* `gemv_qkv_rope`: RMSNorm of the residual on the way in; the rotary embedding of q and k and
  the K/V cache write on the way out (each program holds the rows j and j + D/2 of one head, the
  pairs the rotation mixes);
* `gemv_residual`: o_proj and down_proj; adds the product into the residual in place and writes
  each program's sum of squares of the new residual rows, from which the next kernel's RMSNorm
  takes its scale (summed in a fixed order: no atomics, the same result every run);
* `gemv_silu`: gate_up with RMSNorm on the way in and ``silu(gate) * up`` on the way out (each
  program holds gate rows c.. and the matching up rows I + c..);
* `gemv`: a plain product (the LM head).

Rounding follows the reference modules: RMSNorm's scale in float32, cast to the model dtype
before the weight multiply; a projection rounds once to the model dtype (bias and residual added
in float32 like cuBLAS's epilogue, then the sum rounded like ``residual + out``).

Weights stay as loaded ([N, K] row-major, the checkpoint layout cuBLAS also reads). A weight may
be stored in another dtype than the activations (FP8) with a float32 scale per output row
(``w_scale``): the product is dequantised in the epilogue, so an FP8 variant is a launch of the
same kernels with ``w_scale`` set.

Launch parameters come from a `GemvTable` (per backend and call site); `bench.gpu` measures the
candidates (``--sections tune``) and the table records the choice with its reason.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton_engine.model.kernels.kernel_registry import KernelCase, launch_scenario
from baton_engine.model.kernels.launch_table import LaunchTable, launch_table_for
from baton_engine.model.kernels.triton_tiles import await_producer, dot_precision, pdl_options, scenario_pdl

#: The most tokens (rows of x) the decode kernels take; larger steps go through torch's matmul.
GEMV_MAX_TOKENS = 8
#: The most tokens of the steps the engine runs through them by default: one. Measured on the
#: H200 (bench.gpu, 2026-12-01 13:41 UTC, 8B shape, 32 layers): at 1 token the FMA products beat
#: the matmul path at every call site (qkv 15.1 vs 21.9 us a layer, o 11.1 vs 13.2, gate_up 58.8
#: vs 62.1, down 30.8 vs 31.8) and the batch-1 step drops from 4.60 to 4.26 ms; at 8 tokens the
#: dot tiles lose to cuBLAS (qkv 27.6 vs 21.2, gate_up 82.0 vs 62.5, down 40.2 vs 32.5) and the
#: 2..8-row steps rise from 4.55-4.74 to 5.69-5.82 ms; they also spill on gfx90a/gfx942.
GEMV_ENGINE_MAX_TOKENS = 1


@dataclass(frozen=True)
class GemvLaunch:
    """How one decode product is launched, and why."""

    #: Output rows per program (for the paired kernels, per half: gate and up, or j and j + D/2).
    block_n: int
    #: Weight columns per loop iteration (a multiple of 8 keeps 16-byte loads for 16-bit weights).
    block_k: int
    num_warps: int
    num_stages: int
    #: Tensor-core dot on a tile padded to 16 token rows (else an FMA loop; T == 1 keeps a
    #: [block_n, block_k] accumulator and reduces it once at the end).
    use_dot: bool
    reason: str


#: Call sites of the decoder, each one kernel: the table is keyed by (site, padded tokens).
SITES = ("qkv", "o", "gate_up", "down", "lm_head")
#: Token counts a table distinguishes: a step of T tokens takes the entry of the next one up.
TOKEN_BUCKETS = (1, 2, 4, 8)


@dataclass(frozen=True)
class GemvTable:
    """Launch parameters of the decode products on one backend: ``entries[(site, tokens)]``."""

    name: str
    entries: dict[tuple[str, int], GemvLaunch]

    def launch(self, site: str, tokens: int) -> GemvLaunch:
        bucket = next(b for b in TOKEN_BUCKETS if b >= tokens)
        return self.entries[(site, bucket)]

    def replaced(self, name: str, changes: dict[tuple[str, int], GemvLaunch]) -> GemvTable:
        return GemvTable(name, {**self.entries, **changes})


def _by_site(name: str, one: dict[str, GemvLaunch], few: GemvLaunch) -> GemvTable:
    """A table with each site's one-token launch and one launch for every larger bucket."""
    entries = {}
    for site in SITES:
        for bucket in TOKEN_BUCKETS:
            entries[(site, bucket)] = one[site] if bucket == 1 else few
    return GemvTable(name, entries)


def _uniform(name: str, one: GemvLaunch, few: GemvLaunch) -> GemvTable:
    return _by_site(name, dict.fromkeys(SITES, one), few)


def _h200(us: float, of_limit: float) -> str:
    return (
        f"measured on the H200 (bench.gpu 8b, 2026-12-01 20:35 UTC, first weight tiles loaded before "
        f"the PDL wait): the fastest of 7 one-token candidates, {us} us a layer, {of_limit} of the "
        "copy-bandwidth limit"
    )


_UNUSED_FEW = "not run by the engine (GEMV_ENGINE_MAX_TOKENS): at 8 tokens these tiles lose to cuBLAS"
_ROWS_4 = GemvLaunch(4, 1024, 4, 2, False, "")
#: NVIDIA (sm_80/sm_90). One token: an FMA loop over 16-byte loads, each program 4 rows x 1024
#: columns per iteration (32 accumulators a thread at 4 warps; qkv: 4 x 512 at 2 warps, twice the
#: programs for its 6144 rows). More tokens: a tensor-core dot of a 16-row tile, 3 stages of
#: weight tiles in flight.
CUDA_GEMV = _by_site(
    "cuda",
    {
        "qkv": GemvLaunch(4, 512, 2, 2, False, _h200(14.84, 0.795)),
        "o": dataclasses.replace(_ROWS_4, reason=_h200(10.59, 0.743)),
        "gate_up": dataclasses.replace(_ROWS_4, reason=_h200(55.95, 0.984)),
        "down": dataclasses.replace(_ROWS_4, reason=_h200(29.23, 0.942)),
        "lm_head": dataclasses.replace(_ROWS_4, reason=_h200(238.3, 1.034)),
    },
    GemvLaunch(16, 256, 4, 3, True, _UNUSED_FEW),
)
#: AMD (CDNA): the same lanes per program (a wavefront is 64 lanes, so half the warps), one
#: stage less (64 KiB of LDS per CU on gfx90a/gfx942); not measured on an AMD GPU yet.
ROCM_GEMV = _uniform(
    "rocm",
    GemvLaunch(8, 512, 2, 1, False, "the NVIDIA entry's 128 lanes as 2 wavefronts; not measured on AMD"),
    GemvLaunch(16, 256, 2, 2, True, "the NVIDIA entry's 128 lanes as 2 wavefronts, one stage less for LDS"),
)


def gemv_table_for(launch: LaunchTable) -> GemvTable:
    """The decode products' table of the backend whose kernel launch table is `launch`."""
    return ROCM_GEMV if launch.name == "rocm" or launch.name.startswith("gfx") else CUDA_GEMV


def default_gemv_table(device: torch.device) -> GemvTable:
    """The table of the device the products run on (`launch_table_for` picks its backend)."""
    return gemv_table_for(launch_table_for(device))


@triton.jit
def _norm_scale(ss_ptr, ss_stride, num_ss, tokens, K, eps, T_PAD: tl.constexpr, NUM_SS_PAD: tl.constexpr):
    """RMSNorm's 1 / rms per token row from the producer's partial sums of squares [T, num_ss],
    summed in index order (the same result on every run)."""
    t = tl.arange(0, T_PAD)
    s = tl.arange(0, NUM_SS_PAD)
    mask = (t < tokens)[:, None] & (s < num_ss)[None, :]
    part = tl.load(ss_ptr + t[:, None] * ss_stride + s[None, :], mask=mask, other=0.0)
    return tl.rsqrt(tl.sum(part, 1) / K + eps)


@triton.jit
def _fold(products, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FOLD: tl.constexpr):
    """[BLOCK_N, BLOCK_K] products -> [BLOCK_N, BLOCK_K // FOLD], each run of FOLD adjacent
    columns summed (FOLD 1: unchanged)."""
    if FOLD == 1:
        return products
    return tl.sum(tl.reshape(products, [BLOCK_N, BLOCK_K // FOLD, FOLD]), 2)


@triton.jit
def _weight_tiles(
    w_ptr, stride_w, rows_a, rows_b, row_mask, k, K, PAIRED: tl.constexpr, EVEN_K: tl.constexpr,
    VEC: tl.constexpr,
):  # fmt: skip
    """The weight tiles ``W[rows_a, k]`` and (PAIRED; else `w_a` again) ``W[rows_b, k]``.

    VEC > 1 declares the tiles' rows contiguous in runs of VEC only (FP8 weights at one token:
    8-byte loads, so the tile has the 16-bit x's layout, 8 values a thread, and x meets the
    weights in registers, not through shared memory with barriers every tile as with Triton's
    16-byte FP8 loads; the hint must be on the pointers: on the columns it is lost)."""
    w_mask = row_mask[:, None] if EVEN_K else row_mask[:, None] & (k < K)[None, :]
    ptrs_a = w_ptr + rows_a[:, None] * stride_w + k[None, :]
    ptrs_b = w_ptr + rows_b[:, None] * stride_w + k[None, :]
    if VEC > 1:
        ptrs_a = tl.max_contiguous(ptrs_a, [1, VEC])
        ptrs_b = tl.max_contiguous(ptrs_b, [1, VEC])
    w_a = tl.load(ptrs_a, mask=w_mask, other=0.0)
    w_b = w_a
    if PAIRED:
        w_b = tl.load(ptrs_b, mask=w_mask, other=0.0)
    return w_a, w_b


@triton.jit
def _activation_tile(
    x_ptr, stride_x, t, t_mask, k, K, norm_ptr, rs, NORM: tl.constexpr, EVEN_K: tl.constexpr
):  # fmt: skip
    """``x[t, k]``; with NORM RMSNorm'ed on the way in: ``norm_w * (x * rs)`` with both products
    rounded to x's dtype, as the reference RMSNorm rounds them."""
    x_mask = t_mask[:, None] if EVEN_K else t_mask[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=x_mask, other=0.0)
    if NORM:
        if EVEN_K:
            nw = tl.load(norm_ptr + k)
        else:
            nw = tl.load(norm_ptr + k, mask=k < K, other=0.0)
        normed = (x.to(tl.float32) * rs[:, None]).to(x.dtype)
        x = (nw.to(tl.float32)[None, :] * normed.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _accumulate(
    acc_a, acc_b, x, w_a, w_b,
    PAIRED: tl.constexpr, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FOLD: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One tile's products added into the accumulators (`_product` says which shapes)."""
    if T_PAD == 1:
        x32 = x.to(tl.float32)
        acc_a += _fold(w_a.to(tl.float32) * x32, BLOCK_N, BLOCK_K, FOLD)
        if PAIRED:
            acc_b += _fold(w_b.to(tl.float32) * x32, BLOCK_N, BLOCK_K, FOLD)
    elif USE_DOT:
        acc_a = tl.dot(x, tl.trans(w_a.to(x.dtype)), acc_a, input_precision=PRECISION)
        if PAIRED:
            acc_b = tl.dot(x, tl.trans(w_b.to(x.dtype)), acc_b, input_precision=PRECISION)
    else:
        x3 = x.to(tl.float32)[:, None, :]
        acc_a += tl.sum(x3 * w_a.to(tl.float32)[None, :, :], 2)
        if PAIRED:
            acc_b += tl.sum(x3 * w_b.to(tl.float32)[None, :, :], 2)
    return acc_a, acc_b


@triton.jit
def _product(
    x_ptr,
    stride_x,
    tokens,
    K,
    w_ptr,
    stride_w,
    rows_a,
    rows_b,
    row_mask,
    norm_ptr,
    ss_ptr,
    ss_stride,
    num_ss,
    eps,
    NORM: tl.constexpr,
    NUM_SS_PAD: tl.constexpr,
    PAIRED: tl.constexpr,
    T_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """``x[T, K] @ W[rows, K]^T`` in float32 as [T_PAD, BLOCK_N], for rows_a and (PAIRED) rows_b.

    With NORM, x is RMSNorm'ed on the way in, its scale from the producer's partial sums of
    squares (`_norm_scale`). The first weight tiles are loaded before the kernel waits for the
    kernel before it (`await_producer`, PDL): the weights are no kernel's output, so under
    programmatic dependent launch their first bytes stream in while that kernel finishes.
    """
    t = tl.arange(0, T_PAD)
    t_mask = t < tokens
    kk = tl.arange(0, BLOCK_K)
    # One-byte (FP8) weights: the one-token branch sums each thread's run of FOLD adjacent
    # products (one 8-byte load, `_weight_tiles`' VEC) before accumulating: one accumulator per
    # load, so fewer registers and more programs in flight per SM; 16-bit weights keep one per weight.
    FOLD: tl.constexpr = 8 if w_ptr.dtype.element_ty.primitive_bitwidth == 8 else 1
    VEC: tl.constexpr = FOLD if T_PAD == 1 else 1
    if T_PAD == 1:
        acc_a = tl.zeros([BLOCK_N, BLOCK_K // FOLD], tl.float32)
        acc_b = tl.zeros([BLOCK_N, BLOCK_K // FOLD], tl.float32)
    else:
        acc_a = tl.zeros([T_PAD, BLOCK_N], tl.float32)
        acc_b = tl.zeros([T_PAD, BLOCK_N], tl.float32)
    first_a, first_b = _weight_tiles(w_ptr, stride_w, rows_a, rows_b, row_mask, kk, K, PAIRED, EVEN_K, VEC)
    await_producer(PDL)
    rs = None
    if NORM:
        rs = _norm_scale(ss_ptr, ss_stride, num_ss, tokens, K, eps, T_PAD, NUM_SS_PAD)
    x = _activation_tile(x_ptr, stride_x, t, t_mask, kk, K, norm_ptr, rs, NORM, EVEN_K)
    acc_a, acc_b = _accumulate(
        acc_a, acc_b, x, first_a, first_b, PAIRED, T_PAD, BLOCK_N, BLOCK_K, FOLD, USE_DOT, PRECISION
    )
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + kk
        w_a, w_b = _weight_tiles(w_ptr, stride_w, rows_a, rows_b, row_mask, k, K, PAIRED, EVEN_K, VEC)
        x = _activation_tile(x_ptr, stride_x, t, t_mask, k, K, norm_ptr, rs, NORM, EVEN_K)
        acc_a, acc_b = _accumulate(
            acc_a, acc_b, x, w_a, w_b, PAIRED, T_PAD, BLOCK_N, BLOCK_K, FOLD, USE_DOT, PRECISION
        )
    if T_PAD == 1:
        out_a = tl.sum(acc_a, 1)[None, :]
        out_b = tl.sum(acc_b, 1)[None, :]
    else:
        out_a = acc_a
        out_b = acc_b
    return out_a, out_b


@triton.jit
def _finish(acc, rows, row_mask, scale_ptr, bias_ptr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The epilogue every product shares: the weight's per-row scale (FP8), then the bias."""
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _plain_product(
    x_ptr, stride_x, tokens, N, K, w_ptr, stride_w, scale_ptr, bias_ptr,
    T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """This program's BLOCK_N output rows of ``x @ W^T`` with the epilogue, in float32 as
    [T_PAD, BLOCK_N] (`gemv`, `gemv_residual`); with the rows, the token rows and their mask."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    acc, _ = _product(
        x_ptr, stride_x, tokens, K, w_ptr, stride_w, rows, rows, row_mask, None, None, 0, 0, 0.0,
        NORM=False, NUM_SS_PAD=1, PAIRED=False, T_PAD=T_PAD, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        EVEN_K=EVEN_K, USE_DOT=USE_DOT, PRECISION=PRECISION, PDL=PDL,
    )  # fmt: skip
    acc = _finish(acc, rows, row_mask, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS)
    t, mask = _token_mask(tokens, row_mask, T_PAD)
    return acc, rows, t, mask


@triton.jit
def _normed_pair(
    x_ptr, stride_x, ss_ptr, ss_stride, num_ss, norm_ptr, eps, tokens, K, w_ptr, stride_w,
    rows_a, rows_b, row_mask, scale_ptr, bias_ptr,
    NUM_SS_PAD: tl.constexpr, T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """``RMSNorm(x) @ W[rows_a]^T`` and ``... W[rows_b]^T`` with their epilogues, in float32 (the
    paired products of `gemv_silu` and `gemv_qkv_rope`): the norm's scale from the producer's
    partial sums of squares, the norm applied to x as the weight tiles stream past."""
    a, b = _product(
        x_ptr, stride_x, tokens, K, w_ptr, stride_w, rows_a, rows_b, row_mask, norm_ptr,
        ss_ptr, ss_stride, num_ss, eps,
        NORM=True, NUM_SS_PAD=NUM_SS_PAD, PAIRED=True, T_PAD=T_PAD, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        EVEN_K=EVEN_K, USE_DOT=USE_DOT, PRECISION=PRECISION, PDL=PDL,
    )  # fmt: skip
    a = _finish(a, rows_a, row_mask, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS)
    b = _finish(b, rows_b, row_mask, scale_ptr, bias_ptr, HAS_SCALE, HAS_BIAS)
    return a, b


@triton.jit
def _token_mask(tokens, row_mask, T_PAD: tl.constexpr):
    """The token rows ``t`` and the [T_PAD, BLOCK_N] mask of real tokens x real output rows."""
    t = tl.arange(0, T_PAD)
    return t, (t < tokens)[:, None] & row_mask[None, :]


@triton.jit
def _gemv_kernel(
    x_ptr, stride_x, w_ptr, stride_w, scale_ptr, bias_ptr, out_ptr, stride_out, tokens, N, K,
    T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    acc, rows, t, mask = _plain_product(
        x_ptr, stride_x, tokens, N, K, w_ptr, stride_w, scale_ptr, bias_ptr,
        T_PAD, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, PRECISION, HAS_SCALE, HAS_BIAS, PDL,
    )  # fmt: skip
    tl.store(out_ptr + t[:, None] * stride_out + rows[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_residual_kernel(
    x_ptr, stride_x, w_ptr, stride_w, scale_ptr, bias_ptr,
    residual_ptr, stride_res,  # [T, N], updated in place: residual += x @ W^T
    ss_ptr, ss_stride,  # [T, programs] fp32: each program's sum of squares of its new residual columns
    tokens, N, K,
    T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    acc, rows, t, mask = _plain_product(
        x_ptr, stride_x, tokens, N, K, w_ptr, stride_w, scale_ptr, bias_ptr,
        T_PAD, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, PRECISION, HAS_SCALE, HAS_BIAS, PDL,
    )  # fmt: skip
    res_ptrs = residual_ptr + t[:, None] * stride_res + rows[None, :]
    residual = tl.load(res_ptrs, mask=mask, other=0.0)
    dtype = residual_ptr.dtype.element_ty
    # The projection rounds to the model dtype, then the sum does (``residual + out``).
    total = (residual.to(tl.float32) + acc.to(dtype).to(tl.float32)).to(dtype)
    tl.store(res_ptrs, total, mask=mask)
    t32 = tl.where(mask, total.to(tl.float32), 0.0)
    tl.store(ss_ptr + t * ss_stride + tl.program_id(0), tl.sum(t32 * t32, 1), mask=t < tokens)


@triton.jit
def _gemv_silu_kernel(
    x_ptr, stride_x,  # [T, K] residual (RMSNorm'ed on the way in)
    ss_ptr, ss_stride, num_ss, norm_ptr, eps,
    w_ptr, stride_w, scale_ptr, bias_ptr,  # w: [2I, K], gate rows then up rows
    out_ptr, stride_out,  # [T, I]
    tokens, INTER, K, NUM_SS_PAD: tl.constexpr,
    T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < INTER
    gate, up = _normed_pair(
        x_ptr, stride_x, ss_ptr, ss_stride, num_ss, norm_ptr, eps, tokens, K, w_ptr, stride_w,
        cols, cols + INTER, col_mask, scale_ptr, bias_ptr,
        NUM_SS_PAD, T_PAD, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, PRECISION, HAS_SCALE, HAS_BIAS, PDL,
    )  # fmt: skip
    dtype = out_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    # Two roundings like the reference: silu(gate) in the model dtype, then the product.
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    t, mask = _token_mask(tokens, col_mask, T_PAD)
    tl.store(out_ptr + t[:, None] * stride_out + cols[None, :], (act * u).to(dtype), mask=mask)


@triton.jit
def _gemv_qkv_rope_kernel(
    x_ptr, stride_x,  # [T, K] residual (RMSNorm'ed on the way in)
    ss_ptr, ss_stride, num_ss, norm_ptr, eps,
    w_ptr, stride_w, scale_ptr, bias_ptr,  # w: [(H + 2 KVH) * D, K], q heads, k heads, v heads
    q_ptr, stride_q,  # [T, H * D] rotated queries
    positions_ptr,  # [T] int64
    cos_ptr, sin_ptr,  # [max_pos, D] (both halves equal)
    slots_ptr,  # [T] int64, < 0: padding (no cache write)
    cache_ptr, v_offset,  # [2, NB, BS, KVH, D]
    tokens, K, H: tl.constexpr, KVH: tl.constexpr, HALF: tl.constexpr, NUM_SS_PAD: tl.constexpr,
    T_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    D: tl.constexpr = 2 * HALF
    BLOCKS: tl.constexpr = HALF // BLOCK_N
    pid = tl.program_id(0)
    head = pid // BLOCKS
    j = (pid % BLOCKS) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = head * D + j
    row_mask = j < HALF
    first, second = _normed_pair(
        x_ptr, stride_x, ss_ptr, ss_stride, num_ss, norm_ptr, eps, tokens, K, w_ptr, stride_w,
        rows, rows + HALF, row_mask, scale_ptr, bias_ptr,
        NUM_SS_PAD, T_PAD, BLOCK_N, BLOCK_K, EVEN_K, USE_DOT, PRECISION, HAS_SCALE, HAS_BIAS, PDL,
    )  # fmt: skip
    dtype = q_ptr.dtype.element_ty
    a = first.to(dtype)
    b = second.to(dtype)
    t, tm = _token_mask(tokens, row_mask, T_PAD)
    t_mask = t < tokens
    if head < H + KVH:  # q or k: rotate (j pairs with j + HALF)
        pos = tl.load(positions_ptr + t, mask=t_mask, other=0)
        table = pos[:, None] * D + j[None, :]
        cos = tl.load(cos_ptr + table, mask=tm, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + table, mask=tm, other=0.0).to(tl.float32)
        a32 = a.to(tl.float32)
        b32 = b.to(tl.float32)
        a = (a32 * cos - b32 * sin).to(dtype)
        b = (b32 * cos + a32 * sin).to(dtype)
    if head < H:
        dst = q_ptr + t[:, None] * stride_q + rows[None, :]
        tl.store(dst, a, mask=tm)
        tl.store(dst + HALF, b, mask=tm)
    else:
        slot = tl.load(slots_ptr + t, mask=t_mask, other=-1)
        mask = (slot >= 0)[:, None] & row_mask[None, :]
        kv_head = head - H
        base = cache_ptr
        if head >= H + KVH:  # a v head
            kv_head = head - H - KVH
            base = cache_ptr + v_offset
        dst = base + (slot * KVH + kv_head)[:, None] * D + j[None, :]
        tl.store(dst, a, mask=mask)
        tl.store(dst + HALF, b, mask=mask)


@triton.jit
def _sum_squares_kernel(x_ptr, stride_x, ss_ptr, ss_stride, K, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """ss[t, 0] = sum of x[t]^2 (the first layer's RMSNorm input has no producer kernel)."""
    await_producer(PDL)
    t = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + t * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(ss_ptr + t * ss_stride, tl.sum(acc, 0))


# -- launchers ------------------------------------------------------------------------------------
@functools.cache
def _shape_constants(tokens: int, k: int, launch: GemvLaunch, dtype: torch.dtype) -> dict[str, object]:
    use_dot = launch.use_dot and tokens > 1 and launch.block_n >= 16
    t_pad = max(16, triton.next_power_of_2(tokens)) if use_dot else triton.next_power_of_2(tokens)
    block_k = min(launch.block_k, max(16, triton.next_power_of_2(k)))
    return {
        "T_PAD": t_pad,
        "BLOCK_K": block_k,
        "EVEN_K": k % block_k == 0,
        "USE_DOT": use_dot,
        "PRECISION": dot_precision(dtype),
        "num_warps": launch.num_warps,
        "num_stages": launch.num_stages,
    }


def _constants(
    tokens: int,
    k: int,
    launch: GemvLaunch,
    x: torch.Tensor,
    w_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    num_partials: int | None = None,
    pdl: bool = False,
) -> dict[str, object]:
    """Every kernel's compile-time arguments and launch options; `num_partials` for the kernels
    with a norm prologue, `pdl` to launch with programmatic dependent launch (`pdl_supported`)."""
    constants = {
        "BLOCK_N": launch.block_n,
        "HAS_SCALE": w_scale is not None,
        "HAS_BIAS": bias is not None,
        **_shape_constants(tokens, k, launch, x.dtype),
        **pdl_options(pdl),
    }
    if num_partials is not None:
        constants["NUM_SS_PAD"] = triton.next_power_of_2(num_partials)
    return constants


def _normed_args(
    x: torch.Tensor,
    sum_squares: torch.Tensor,
    num_partials: int,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    w_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> tuple[object, ...]:
    """The leading arguments of the kernels with a norm prologue (`_normed_pair`'s inputs)."""
    return (
        x, x.stride(0), sum_squares, sum_squares.stride(0), num_partials, norm_weight, eps,
        weight, weight.stride(0), w_scale, bias,
    )  # fmt: skip


def _check(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    tokens, k = x.shape
    if not 0 < tokens <= GEMV_MAX_TOKENS:
        raise ValueError(f"decode products take 1..{GEMV_MAX_TOKENS} token rows, got {tokens}")
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must share K, rows packed")
    return tokens, k


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    launch: GemvLaunch,
    bias: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``x @ weight^T (* w_scale) (+ bias)`` for T <= 8 rows, in x's dtype. `pdl`: launch with
    programmatic dependent launch (every launcher here; `pdl_supported`)."""
    tokens, k = _check(x, weight)
    n = weight.shape[0]
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device) if out is None else out
    _gemv_kernel[(triton.cdiv(n, launch.block_n),)](
        x, x.stride(0), weight, weight.stride(0), w_scale, bias, out, out.stride(0), tokens, n, k,
        **_constants(tokens, k, launch, x, w_scale, bias, pdl=pdl),
    )  # fmt: skip
    return out


def residual_programs(n: int, launch: GemvLaunch) -> int:
    """Programs of a `gemv_residual` launch: the partial sums of squares it leaves per row."""
    return -(-n // launch.block_n)


def gemv_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    residual: torch.Tensor,
    sum_squares: torch.Tensor,
    launch: GemvLaunch,
    bias: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    pdl: bool = False,
) -> int:
    """``residual += x @ weight^T`` in place; writes each program's sum of squares of the new
    residual into ``sum_squares[:, :programs]`` and returns the programs (`residual_programs`)."""
    tokens, k = _check(x, weight)
    n = weight.shape[0]
    programs = residual_programs(n, launch)
    if residual.shape != (tokens, n) or sum_squares.shape[1] < programs:
        raise ValueError(f"residual must be [{tokens}, {n}] and sum_squares at least {programs} wide")
    _gemv_residual_kernel[(programs,)](
        x, x.stride(0), weight, weight.stride(0), w_scale, bias, residual, residual.stride(0),
        sum_squares, sum_squares.stride(0), tokens, n, k,
        **_constants(tokens, k, launch, x, w_scale, bias, pdl=pdl),
    )  # fmt: skip
    return programs


def sum_squares(x: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> int:
    """``out[t, 0] = sum(x[t]^2)``: the partial sums a first `gemv_silu`/`gemv_qkv_rope` reads
    when no `gemv_residual` produced x. Returns 1 (the number of partials)."""
    tokens, k = x.shape
    _sum_squares_kernel[(tokens,)](
        x, x.stride(0), out, out.stride(0), k, BLOCK=min(1024, triton.next_power_of_2(k)), **pdl_options(pdl)
    )
    return 1


def gemv_silu(
    x: torch.Tensor,
    sum_squares: torch.Tensor,
    num_partials: int,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    launch: GemvLaunch,
    bias: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """``silu(g) * u`` where ``[g | u] = RMSNorm(x) @ weight^T`` (weight: gate rows, then up)."""
    tokens, k = _check(x, weight)
    inter = weight.shape[0] // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device) if out is None else out
    _gemv_silu_kernel[(triton.cdiv(inter, launch.block_n),)](
        *_normed_args(x, sum_squares, num_partials, norm_weight, eps, weight, w_scale, bias),
        out, out.stride(0), tokens, inter, k,
        **_constants(tokens, k, launch, x, w_scale, bias, num_partials, pdl),
    )  # fmt: skip
    return out


def gemv_qkv_rope(
    x: torch.Tensor,
    sum_squares: torch.Tensor,
    num_partials: int,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    layer_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    launch: GemvLaunch,
    bias: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    q_out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """RMSNorm(x) @ W_qkv^T, rotated, with k and v written to `layer_cache` at the slots.

    Returns the rotated queries [T, H * D].
    """
    tokens, k = _check(x, weight)
    half = head_dim // 2
    if head_dim % 2 or weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"weight {tuple(weight.shape)} is not q, k, v of head dim {head_dim}")
    if q_out is None:
        q_out = torch.empty((tokens, num_heads * head_dim), dtype=x.dtype, device=x.device)
    block_n = min(launch.block_n, triton.next_power_of_2(half))
    while half % block_n:
        block_n //= 2
    launch_here = launch if block_n == launch.block_n else _with_block_n(launch, block_n)
    programs = (num_heads + 2 * num_kv_heads) * (half // block_n)
    _gemv_qkv_rope_kernel[(programs,)](
        *_normed_args(x, sum_squares, num_partials, norm_weight, eps, weight, w_scale, bias),
        q_out, q_out.stride(0), positions, cos, sin, slot_mapping, layer_cache, layer_cache.stride(0),
        tokens, k, H=num_heads, KVH=num_kv_heads, HALF=half,
        **_constants(tokens, k, launch_here, x, w_scale, bias, num_partials, pdl),
    )  # fmt: skip
    return q_out


@functools.cache
def _with_block_n(launch: GemvLaunch, block_n: int) -> GemvLaunch:
    return dataclasses.replace(launch, block_n=block_n)


#: Output rows of the scenario's LM head (the model shapes carry no vocabulary size; N is a
#: runtime argument of the kernel, so any multiple of 16 compiles the same kernel).
SCENARIO_LM_HEAD_ROWS = 1024


@launch_scenario(
    "_gemv_kernel",
    "_gemv_residual_kernel",
    "_gemv_silu_kernel",
    "_gemv_qkv_rope_kernel",
    "_sum_squares_kernel",
)
def _decode_product_launches(case: KernelCase) -> None:
    """Two layers of a decode step's products at the token buckets the engine runs them for
    (`GEMV_ENGINE_MAX_TOKENS`), in the order and with the
    partial-sum counts of `FusedDecoder._forward_few` (the first layer's norm reads one partial,
    the others the programs of the product before them), then the LM head.

    Tensors are `torch.empty` at the model's shapes: the launches are captured, never run, so no
    weight is touched (a 70B gate_up at float32 is 1.9 GB of address space, not of memory).
    """
    m = case.model
    table = gemv_table_for(case.launch)
    pdl = scenario_pdl(case.launch)
    dtype = case.dtype
    h, kvh, d = m.num_heads, m.num_kv_heads, m.head_dim

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    qkv_weight = empty((h + 2 * kvh) * d, m.hidden_size)
    o_weight = empty(m.hidden_size, h * d)
    gate_up_weight = empty(2 * m.intermediate_size, m.hidden_size)
    down_weight = empty(m.hidden_size, m.intermediate_size)
    norm = empty(m.hidden_size)
    cos = empty(64, d)
    cache = case.kv_cache()
    for tokens in (b for b in TOKEN_BUCKETS if b <= GEMV_ENGINE_MAX_TOKENS):
        residual = empty(tokens, m.hidden_size)
        widest = max(
            residual_programs(m.hidden_size, table.launch("o", tokens)),
            residual_programs(m.hidden_size, table.launch("down", tokens)),
        )
        squares = torch.empty(tokens, widest, dtype=torch.float32)
        positions = torch.zeros(tokens, dtype=torch.int64)
        partials = sum_squares(residual, squares, pdl=pdl)
        for _layer in range(2):
            q = gemv_qkv_rope(
                residual, squares, partials, norm, 1e-5, qkv_weight, positions, cos, cos, positions, cache,
                h, kvh, d, table.launch("qkv", tokens), pdl=pdl,
            )  # fmt: skip
            partials = gemv_residual(q, o_weight, residual, squares, table.launch("o", tokens), pdl=pdl)
            act = gemv_silu(
                residual, squares, partials, norm, 1e-5, gate_up_weight, table.launch("gate_up", tokens),
                pdl=pdl,
            )  # fmt: skip
            down = table.launch("down", tokens)
            partials = gemv_residual(act, down_weight, residual, squares, down, pdl=pdl)
        gemv(residual, empty(SCENARIO_LM_HEAD_ROWS, m.hidden_size), table.launch("lm_head", tokens), pdl=pdl)
