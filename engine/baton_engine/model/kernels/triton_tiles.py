"""Pieces shared by the paged-attention kernels (decode, multi-query decode, prefill) and launchers.

The ``@triton.jit`` helpers are inlined into the kernels that call them, so a kernel built from
them compiles as if written out in full. Each kernel holds a tile of query rows that share one kv
head, walks that head's keys through one row of the block table and keeps an online softmax in
base 2 (scores pre-scaled by ``scale * log2(e)``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from baton_engine.model.kernels.launch_table import LaunchTable

LOG2E = 1.4426950408889634

try:  # grid dependency control: NVIDIA's programmatic dependent launch (sm_90+)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    try:  # and the launch option that asks for it (a kernel launch refuses unknown keywords)
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        _HAS_GDC = False
    else:
        _HAS_GDC = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # a Triton built without NVIDIA's backend: `pdl_supported` says no

    def _no_grid_dependency() -> None:
        pass

    # Stand-ins so `await_producer` still resolves; never compiled (PDL is never set here).
    gdc_wait = gdc_launch_dependents = triton.jit(_no_grid_dependency)
    _HAS_GDC = False


@triton.jit
def await_producer(PDL: tl.constexpr) -> None:
    """The first thing a kernel launched with programmatic dependent launch does (PDL set): wait
    until the kernel before it has finished and its writes are visible, then let the kernel after
    it launch, so that kernel's launch and scheduling overlap this one's work. Nothing before
    this may read or write memory the kernel before it touches. Without PDL: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched with programmatic dependent launch: an NVIDIA
    GPU of compute capability 9.0 or later and a Triton with grid dependency control. AMD GPUs
    have no such launch; their kernels launch one after another as before."""
    if device.type != "cuda" or torch.version.hip is not None or not _HAS_GDC:
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) >= (9, 0)


def scenario_pdl(launch: LaunchTable) -> bool:
    """Whether a kernel scenario launches the engine's PDL kernels with PDL: under the table of
    sm_90 ("cuda"), the compile target where `pdl_supported` holds (sm_80's and AMD's: never)."""
    return launch.name == "cuda"


def pdl_options(pdl: bool) -> dict[str, Any]:
    """Launch keywords for a kernel taking ``PDL`` (`await_producer`): the constant, and Triton's
    ``launch_pdl`` option when it is set (a CUDA-only option, never passed otherwise)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def dot_precision(dtype: torch.dtype) -> str | None:
    # float32 runs must not silently drop to tf32 (greedy parity is checked in float32); 16-bit
    # operands take the backend's default (the argument only matters for float32 operands).
    return "ieee" if dtype == torch.float32 else None


def packed_output(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out`, or a new tensor shaped like `q` ([tokens, H, D]); q's heads must be packed."""
    tokens, num_heads, head_dim = q.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim, "q heads must be packed (row stride may differ)"
    return torch.empty((tokens, num_heads, head_dim), dtype=q.dtype, device=q.device) if out is None else out


def paged_kernel_args(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> tuple[Any, ...]:
    """The leading runtime arguments of every paged-attention kernel, in their order.

    `kv_scale`: the layer's [2] float32 (K, V) scales when `layer_cache` is FP8."""
    if (kv_scale is None) == (layer_cache.dtype in _FP8):
        raise ValueError(f"a {layer_cache.dtype} KV cache needs (K, V) scales exactly when it is FP8")
    return (
        q,
        layer_cache,
        block_tables,
        layer_cache.stride(0),
        block_tables.stride(0),
        q.stride(0),
        scale * LOG2E,
        layer_cache if kv_scale is None else kv_scale,
    )


def paged_kernel_constants(q: torch.Tensor, layer_cache: torch.Tensor, block_n: int) -> dict[str, Any]:
    """The compile-time arguments every paged-attention kernel takes (shared: do not modify)."""
    _, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = layer_cache.shape
    kv_fp8 = layer_cache.dtype in _FP8
    return _constants(num_heads, head_dim, block_size, num_kv_heads, q.dtype, block_n, kv_fp8)


_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)


@functools.cache
def _constants(
    num_heads: int,
    head_dim: int,
    block_size: int,
    num_kv_heads: int,
    dtype: torch.dtype,
    block_n: int,
    kv_fp8: bool,
) -> dict[str, Any]:
    # Cached: host time per launch matters for the kernels launched outside captured graphs.
    return {
        "BLOCK_SIZE": block_size,
        "KVH": num_kv_heads,
        "GROUP": num_heads // num_kv_heads,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(head_dim),
        "BLOCK_N": block_n,
        "PRECISION": dot_precision(dtype),
        "KV_FP8": kv_fp8,
    }


@triton.jit
def split_k_program(seq_lens_ptr, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_MAJOR: tl.constexpr):
    """A split-K program's (row, kv head, split) from its grid position, the row's length and the
    split's keys ``[start, end)``: equal slices of whole BLOCK_N tiles. The grid is (row, kv
    head, split), or (kv head, row, split) with HEAD_MAJOR: a row's kv heads launch together and
    read the same cache rows at once (each key's heads are adjacent in the cache)."""
    if HEAD_MAJOR:
        kvh = tl.program_id(0)
        row = tl.program_id(1)
    else:
        row = tl.program_id(0)
        kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    return row, kvh, split, seq_len, start, tl.minimum(start + per_split, seq_len)


@triton.jit
def attend_paged_keys(
    q,  # [M, HEAD_DIM_PAD] query tile, every row on kv head `kvh`
    q_pos,  # [M] position of each query row (CAUSAL only)
    q_real,  # [M] rows that are real queries (CAUSAL only; None: all), the others see no key
    start,
    end,
    cache_ptr,  # [2, NB, BS, KVH, D]
    v_offset,  # elements between the K and the V half of the cache
    table_row_ptr,  # the row's block table entries (int32)
    kvh,
    scale_log2,
    kv_scale_ptr,  # [2] float32 (K, V) scales (KV_FP8 only)
    BLOCK_SIZE: tl.constexpr,
    KVH: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """Online softmax of `q` over keys ``[start, end)``: returns (row max, row sum, unnormalised acc).

    Without CAUSAL every query row sees every key of the range: each tile gives each row a finite
    maximum, so the rescale needs no guard against ``-inf - -inf``. An FP8 cache is widened to
    q's dtype (exactly) for the dots; its K scale multiplies the scores and its V scale the result.
    """
    M: tl.constexpr = q.shape[0]
    HEAD_DIM_PAD: tl.constexpr = q.shape[1]
    d = tl.arange(0, HEAD_DIM_PAD)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, HEAD_DIM_PAD], tl.float32)
    n_base = tl.arange(0, BLOCK_N)
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(kv_scale_ptr)
    if CAUSAL:
        # The last key each row sees (its own position, inside the range; -1: not a real query),
        # so that one compare per score masks it: on AMD every live lane mask of a 64-wide
        # wavefront holds an SGPR pair, and three masks per score ran them out (spills).
        last_key = tl.minimum(q_pos, end - 1)
        if q_real is not None:
            last_key = tl.where(q_real, last_key, -1)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + n_base
        n_mask = n < end
        page = tl.load(table_row_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
        slot = page.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        kv_off = (slot * KVH + kvh)[:, None] * HEAD_DIM + d[None, :]
        if HEAD_DIM == HEAD_DIM_PAD:
            kv_mask = n_mask[:, None]
        else:
            kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        if CAUSAL:
            s = tl.where(n[None, :] <= last_key[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A query may see no key of this tile (all later than it, or a padding row).
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_ref = m_new
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + v_offset + kv_off, mask=kv_mask, other=0.0)
        if KV_FP8:
            v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr + 1)
    return m_i, l_i, acc


@triton.jit
def store_attention_rows(
    out_ptr,  # [rows, D] (NUM_SPLITS == 1) or fp32 partials [rows, NUM_SPLITS, D]
    lse_ptr,  # [rows, NUM_SPLITS] fp32 (read only when NUM_SPLITS > 1)
    m_i,
    l_i,
    acc,
    out_rows,  # [M] output row (token * H + head) of each tile row
    row_mask,
    split,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Normalise `attend_paged_keys`' result and store it; a row that saw no key gets zeros.

    With split-K, also the slice's log2-sum-exp (-inf when it saw no key) for the reduce.
    """
    d = tl.arange(0, acc.shape[1])
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    result = acc / safe_l[:, None]
    out_mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + out_rows[:, None] * HEAD_DIM + d[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        base = out_rows * NUM_SPLITS + split
        tl.store(out_ptr + base[:, None] * HEAD_DIM + d[None, :], result, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + base, lse, mask=row_mask)
