"""Reading blocks out of, and writing blocks into, the engine's one KV-cache tensor.

The tensor is ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (`contract.KV_LAYOUT`).
Both sides work on its byte view ``[layers, 2, num_blocks, row_bytes]`` so any dtype (bfloat16
included) travels as raw bytes, and copy whole runs of consecutive block ids at a time.

Host-side copies use numpy, not torch: torch's CPU copy kernels parallelise over OpenMP, whose
spinning threads collapse (seconds instead of milliseconds) on a machine whose cores are busy
with the step loop, and a KV copy is memory-bound anyway.

A chunk on the wire is the requested blocks ``[first, first + count)`` of one pull, laid out
``[layers, 2, count, row_bytes]`` (C order). A pull of a head slice (P/D across TP sizes) sends
``[layers, 2, count, block_size, heads, head_bytes]``: the same layout for a cache of those heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from baton_engine import contract
from baton_engine.kv_transfer.protocol import CacheSpec, block_runs


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_spec(kv_cache: torch.Tensor) -> CacheSpec:
    """The spec of a KV-cache tensor; raises ValueError if it is not in the contract layout."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"KV cache must be [layers, 2, num_blocks, block_size, kv_heads, head_dim] "
            f"({contract.KV_LAYOUT}), got shape {tuple(kv_cache.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("KV cache must be contiguous")
    layers, _, _, block_size, heads, head_dim = kv_cache.shape
    return CacheSpec(
        num_layers=layers,
        block_size=block_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=dtype_name(kv_cache.dtype),
    )


def byte_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[layers, 2, num_blocks, row_bytes]`` uint8 view sharing the cache's memory."""
    layers, _, num_blocks = kv_cache.shape[:3]
    return kv_cache.view(torch.uint8).view(layers, 2, num_blocks, -1)


Heads = tuple[int, int]
"""(first head, count) of a cache's KV heads."""


def head_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[layers, 2, num_blocks, block_size, kv_heads, head_bytes]`` uint8 view of the cache."""
    layers, _, num_blocks, block_size, heads = kv_cache.shape[:5]
    return kv_cache.view(torch.uint8).view(layers, 2, num_blocks, block_size, heads, -1)


def check_block_ids(ids: Sequence[int], num_blocks: int, what: str) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"{what}: block id {bad[0]} outside [0, {num_blocks})")


class BlockGatherer:
    """Gathers blocks into host staging buffers ready to send (producer side).

    A ring of `depth` buffers of `chunk_blocks` blocks each. On a GPU the buffers are pinned and
    `start` only enqueues the gather and the device-to-host copy on a side stream, so the copy of
    the next chunk overlaps the send of the current one; `wait` blocks until a chunk's bytes are
    on the host. The caller must not reuse a slot before the send of its previous content is
    done (it tracks that per slot).
    """

    def __init__(self, kv_cache: torch.Tensor, chunk_blocks: int, depth: int) -> None:
        self.spec = cache_spec(kv_cache)
        self.kv_bytes = byte_view(kv_cache)
        self.kv_heads = head_view(kv_cache)
        self.kv_np = self.kv_bytes.numpy() if kv_cache.device.type == "cpu" else None
        self.num_blocks = kv_cache.shape[2]
        self.chunk_blocks = chunk_blocks
        self.depth = depth
        self.device = kv_cache.device
        on_gpu = self.device.type != "cpu"
        # Flat buffers, so that the first n blocks of a slot form a contiguous [L, 2, n, row]
        # (the last chunk of a pull is usually shorter).
        flat = chunk_blocks * self.spec.block_bytes
        self.host = [torch.empty(flat, dtype=torch.uint8, pin_memory=on_gpu) for _ in range(depth)]
        self.stream: torch.cuda.Stream | None = None
        self.events: list[torch.cuda.Event] = []
        self.device_stage: list[torch.Tensor] = []
        if on_gpu:
            self.device_stage = [
                torch.empty(flat, dtype=torch.uint8, device=self.device) for _ in range(depth)
            ]
            # torch's stubs leave these constructors untyped
            self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            self.events = [torch.cuda.Event() for _ in range(depth)]  # type: ignore[no-untyped-call]

    def _view(self, flat: torch.Tensor, n: int, heads: Heads | None) -> torch.Tensor:
        spec = self.spec
        if heads is None:
            return flat[: n * spec.block_bytes].view(spec.num_layers, 2, n, spec.row_bytes)
        head_bytes = spec.head_dim * spec.element_size
        size = spec.num_layers * 2 * n * spec.block_size * heads[1] * head_bytes
        return flat[:size].view(spec.num_layers, 2, n, spec.block_size, heads[1], head_bytes)

    def start(self, slot: int, ids: Sequence[int], heads: Heads | None = None) -> torch.Tensor:
        """Begin staging blocks `ids` (of every head, or of `heads` only) into `slot`; returns
        the contiguous host tensor ``[L, 2, len(ids), ...]`` (ready once `wait(slot)` returns)."""
        n = len(ids)
        host = self._view(self.host[slot], n, heads)
        runs = block_runs(list(ids))
        if heads is not None:
            h0, hn = heads
            if self.stream is None:
                out_heads, cache_heads = host.numpy(), self.kv_heads.numpy()
                for pos, first, count in runs:
                    out_heads[:, :, pos : pos + count] = cache_heads[
                        :, :, first : first + count, :, h0 : h0 + hn
                    ]
                return host
            stage = self._view(self.device_stage[slot], n, heads)
            with torch.cuda.stream(self.stream):
                for pos, first, count in runs:
                    stage[:, :, pos : pos + count].copy_(
                        self.kv_heads[:, :, first : first + count, :, h0 : h0 + hn]
                    )
                host.copy_(stage, non_blocking=True)
                self.events[slot].record(self.stream)
            return host
        if self.stream is None:
            out, cache = host.numpy(), self.kv_np
            assert cache is not None  # a CPU cache is read through numpy
            for pos, first, count in runs:
                out[:, :, pos : pos + count] = cache[:, :, first : first + count]
            return host
        stage = self._view(self.device_stage[slot], n, None)
        # The forward that wrote these blocks finished before the lease existed (its sampled
        # token was read back on the host), so the side stream needs no wait on the main one.
        with torch.cuda.stream(self.stream):
            for pos, first, count in runs:
                stage[:, :, pos : pos + count].copy_(self.kv_bytes[:, :, first : first + count])
            host.copy_(stage, non_blocking=True)
            self.events[slot].record(self.stream)
        return host

    def wait(self, slot: int) -> None:
        if self.stream is not None:
            self.events[slot].synchronize()


class BlockScatterer:
    """Writes received chunks into this engine's own blocks (consumer side)."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.spec = cache_spec(kv_cache)
        self.kv_bytes = byte_view(kv_cache)
        self.kv_heads = head_view(kv_cache)
        self.num_blocks = kv_cache.shape[2]
        self.device = kv_cache.device

    def write(self, payload: memoryview, dst_ids: Sequence[int], heads: Heads | None = None) -> None:
        """Copy one chunk ``[L, 2, len(dst_ids), ...]`` into blocks `dst_ids` of the cache (of
        every head, or of `heads` only)."""
        n = len(dst_ids)
        spec = self.spec
        head_count = spec.num_kv_heads if heads is None else heads[1]
        expected = n * spec.num_layers * 2 * spec.block_size * head_count * spec.head_dim * spec.element_size
        if len(payload) != expected:
            raise ValueError(f"chunk of {len(payload)} bytes, expected {expected} for {n} blocks")
        runs = block_runs(list(dst_ids))
        if heads is not None:
            h0, hn = heads
            head_shape = (spec.num_layers, 2, n, spec.block_size, hn, -1)
            if self.device.type == "cpu":
                src_np = np.frombuffer(payload, dtype=np.uint8).reshape(head_shape)
                cache = self.kv_heads.numpy()
                for pos, first, count in runs:
                    cache[:, :, first : first + count, :, h0 : h0 + hn] = src_np[:, :, pos : pos + count]
                return
            src = torch.frombuffer(payload, dtype=torch.uint8).view(head_shape).to(self.device)
            for pos, first, count in runs:
                self.kv_heads[:, :, first : first + count, :, h0 : h0 + hn].copy_(
                    src[:, :, pos : pos + count]
                )
            return
        shape = (spec.num_layers, 2, n, spec.row_bytes)
        if self.device.type == "cpu":
            src_np = np.frombuffer(payload, dtype=np.uint8).reshape(shape)
            cache = self.kv_bytes.numpy()
            for pos, first, count in runs:
                cache[:, :, first : first + count] = src_np[:, :, pos : pos + count]
            return
        src = torch.frombuffer(payload, dtype=torch.uint8).view(shape).to(self.device)
        for pos, first, count in runs:
            self.kv_bytes[:, :, first : first + count].copy_(src[:, :, pos : pos + count])

    def finish(self) -> None:
        """Make every write visible to the step loop's stream (no-op on CPU)."""
        if self.device.type != "cpu":
            torch.cuda.synchronize(self.device)
