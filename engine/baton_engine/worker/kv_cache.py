"""The engine's one KV-cache tensor (layout: `contract.KV_LAYOUT`) and how many blocks it gets.

With tensor parallelism each rank's cache holds its own KV heads (`num_kv_heads` of the rank);
block ids mean the same on every rank (one scheduler allocates them).
"""

from __future__ import annotations

import torch

from baton_engine.model.config import ModelConfig

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
