"""Shared pieces of the KV-transfer tests: small random KV caches and signed params."""

from __future__ import annotations

import time

import torch

from baton_engine.contract import KVTransferParams
from baton_engine.kv_transfer.cache_blocks import cache_spec
from baton_engine.kv_transfer.params import sign_params, verify_params

KEY = b"test-deployment-key"
LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 3, 4, 2, 8, 40


def make_cache(
    seed: int | None = 0,
    *,
    dtype: torch.dtype = torch.float32,
    layers: int = LAYERS,
    block_size: int = BLOCK_SIZE,
    num_blocks: int = NUM_BLOCKS,
) -> torch.Tensor:
    """A [layers, 2, num_blocks, block_size, heads, head_dim] cache: random, or zeros if seed is None."""
    shape = (layers, 2, num_blocks, block_size, KV_HEADS, HEAD_DIM)
    if seed is None:
        return torch.zeros(shape, dtype=dtype)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def signed_params(
    kv: torch.Tensor,
    *,
    port: int,
    transfer_id: str,
    block_ids: list[int],
    engine_id: str = "producer-1",
    key: bytes = KEY,
    **overrides: object,
) -> KVTransferParams:
    spec = cache_spec(kv)
    raw = sign_params(
        key=key,
        engine_id=engine_id,
        host="127.0.0.1",
        port=port,
        transfer_id=transfer_id,
        block_ids=block_ids,
        num_tokens=len(block_ids) * spec.block_size,
        first_token=7,
        spec=spec,
        model="test",
        lease_expires_at=time.time() + 30,
    )
    if overrides:
        raw.update(overrides)
        raw = (
            KVTransferParams.from_dict({k: v for k, v in raw.items() if k != "signature"})
            .signed(key)
            .to_dict()
        )
    return verify_params(raw, key)
