"""The engine's one KV-cache tensor (layout: `contract.KV_LAYOUT`), its dtype and per-layer FP8
scales, and how many blocks it gets.

With tensor parallelism each rank's cache holds its own KV heads (`num_kv_heads` of the rank);
block ids mean the same on every rank (one scheduler allocates them).
"""

from __future__ import annotations

import torch

from baton_engine.model.config import ModelConfig
from baton_engine.model.quantization.fp8 import FP8_DTYPES, fp8_dtype_for_device

CPU_KV_CACHE_BYTES = 4 << 30


def kv_cache_shape(
    config: ModelConfig, num_blocks: int, block_size: int, num_kv_heads: int | None = None
) -> tuple[int, ...]:
    """[num_layers, 2 (k, v), num_blocks, block_size, num_kv_heads, head_dim]; `num_kv_heads`:
    the rank's (default: the model's)."""
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return (config.num_layers, 2, num_blocks, block_size, heads, config.head_dim)


def bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    return config.num_layers * 2 * block_size * heads * config.head_dim * element


def default_num_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    memory_utilization: float,
    num_kv_heads: int | None = None,
) -> int:
    """4 GiB worth on CPU; on a GPU, what remains of `memory_utilization` of its memory."""
    per_block = bytes_per_block(config, block_size, dtype, num_kv_heads)
    if device.type == "cpu":
        budget = CPU_KV_CACHE_BYTES
    else:
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - total * (1.0 - memory_utilization))
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache on {device} (one block needs {per_block} bytes); "
            "lower the model size or raise --gpu-memory-utilization"
        )
    return int(blocks)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_kv_heads: int | None = None,
) -> torch.Tensor:
    # Uninitialised on purpose: attention reads only slots written earlier (the torch backend
    # pads gathers with a row's own position-0 slot), and a CPU cache of GiBs stays uncommitted
    # until used.
    shape = kv_cache_shape(config, num_blocks, block_size, num_kv_heads)
    return torch.empty(shape, dtype=dtype, device=device)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`EngineConfig.kv_cache_dtype` as a torch dtype: auto = the model dtype; fp8 = the device's
    FP8 format (e4m3fnuz on MI300, e4m3fn elsewhere)."""
    if name == "auto":
        return model_dtype
    if name == "fp8":
        return fp8_dtype_for_device(device)
    raise ValueError(f"unknown KV-cache dtype {name!r} (choose one of: auto, fp8)")


def is_fp8_cache(kv_cache: torch.Tensor) -> bool:
    return kv_cache.dtype in FP8_DTYPES


def kv_cache_scales(
    num_layers: int, checkpoint_scales: torch.Tensor | None, kv_dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """Per-layer (K, V) scales of an FP8 cache, [num_layers, 2] float32 (None: a 16-bit cache).

    A value is stored as ``value / scale`` rounded to FP8. The checkpoint's calibrated scales are
    for OCP e4m3fn (max 448); fnuz (max 240) stores the same values with twice the scale. Without
    calibrated scales every scale is 1.0 (K and V of a normed model stay far below 240).
    """
    if kv_dtype not in FP8_DTYPES:
        return None
    if checkpoint_scales is None:
        return torch.ones(num_layers, 2, dtype=torch.float32, device=device)
    if tuple(checkpoint_scales.shape) != (num_layers, 2):
        raise ValueError(f"KV-cache scales: expected [{num_layers}, 2], got {tuple(checkpoint_scales.shape)}")
    factor = 2.0 if kv_dtype == torch.float8_e4m3fnuz else 1.0
    return (checkpoint_scales.to(torch.float32) * factor).to(device)
