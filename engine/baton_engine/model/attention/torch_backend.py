"""Reference attention in plain PyTorch: runs on CPU and on any torch device.

Decode rows read their cache through the block tables: per layer, one gather of whole blocks
into a reusable buffer, then one SDPA call. Rows are sorted by length and cut into groups so that
short rows are not padded to the longest one (padding is gathered, attended and masked: pure
waste). Each prefill chunk gets its own SDPA call — straight over its new K/V when it starts at
position 0, over its gathered cache (prefix hits, earlier chunks) otherwise.

On CPU, single-token decode rows of a float32 or bfloat16 cache go to the C kernel of
`cpu_paged_decode` instead (K and V read once, no gather) when it could be built; rows verifying
several tokens, FP8 caches and shapes past its limits keep the gather path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.attention.cpu_paged_decode import DecodeRows, PagedDecodeKernel, paged_decode_kernel
from baton_engine.model.quantization.fp8 import cast_saturated

GROUP_COST_IN_BLOCKS = 8
"""What one more decode group (one more gather and SDPA call per layer) costs, in gathered
blocks. On CPU a call's fixed cost is tens of microseconds; gathering and attending one block of
16 tokens costs a few."""


@dataclass
class _DecodeGroup:
    rows: int
    max_q: int
    blocks_per_row: int
    block_index: torch.Tensor  # [rows * blocks_per_row] cache blocks (padding repeats a real one)
    query_index: torch.Tensor  # [rows, max_q] token indices (padding repeats a valid one)
    allowed: torch.Tensor  # [rows, max_q, blocks_per_row * block_size] True = attend
    out_tokens: torch.Tensor  # token indices receiving the group's real (non-padding) outputs
    out_flat: torch.Tensor | None  # their positions in the flattened [rows * max_q] result; None: [:, 0]
    _mask: torch.Tensor | None = None

    def mask(self, heads_per_kv: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive SDPA mask [rows, 1, heads_per_kv * max_q or 1, len], built once per step."""
        if self._mask is None:
            mask = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            mask.masked_fill_(~self.allowed, float("-inf"))
            if self.max_q > 1:  # query row g * max_q + i is head g of the KV head, query i
                mask = mask.unsqueeze(1).expand(self.rows, heads_per_kv, self.max_q, mask.shape[-1])
                mask = mask.reshape(self.rows, heads_per_kv * self.max_q, -1)
            self._mask = mask.unsqueeze(1)
        return self._mask


@dataclass
class _DecodePlan:
    groups: list[_DecodeGroup]
    buffer_blocks: int  # the largest group's gathered blocks (the buffer is reused group by group)
    native: DecodeRows | None = None  # single-token rows for the C kernel (not in `groups`)
    native_members: npt.NDArray[np.int64] | None = None  # their row indices, for the fallback
    fallback: _DecodePlan | None = None  # `native` rows as gather groups, planned when needed


@dataclass
class _PrefillRow:
    start: int
    end: int
    key_slots: torch.Tensor | None  # None: the chunk starts at 0, attend over its own K/V
    mask: torch.Tensor | None  # [q, len] True = attend


@dataclass
class _Plan:
    decode: _DecodePlan | None
    prefills: list[_PrefillRow]
    fresh_blocks: torch.Tensor | None  # blocks whose first slot is written this step


def _fresh_blocks(batch: AttentionBatch) -> npt.NDArray[np.int64]:
    """Blocks that receive their position-0 slot this step.

    Decode gathers whole blocks, so a row's last block is read past its last written slot. Those
    slots are masked, but an additive mask does not neutralise NaN or inf, and an uninitialised
    cache can hold either: such blocks are zeroed before their first write.
    """
    qlens = np.diff(batch.query_start_loc)
    rows = np.repeat(np.arange(batch.num_rows), qlens)
    starts = batch.positions_host % batch.block_size == 0
    return np.unique(batch.block_tables_host[rows[starts], batch.positions_host[starts] // batch.block_size])


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, device: torch.device, native_decode: bool = True) -> None:
        """native_decode: on a CPU device, route single-token decode rows to the C kernel where
        it builds (False: always the gather path, the reference the kernel is tested against)."""
        self.device = device
        self._buffer: torch.Tensor | None = None
        self._kernel: PagedDecodeKernel | None = None
        if native_decode and device.type == "cpu":
            self._kernel = paged_decode_kernel()

    def prepare(self, batch: AttentionBatch) -> _Plan:
        decode = self._plan_decode(batch) if batch.num_decode_rows else None
        prefills = [self._plan_prefill(batch, row) for row in range(batch.num_decode_rows, batch.num_rows)]
        fresh = _fresh_blocks(batch)
        fresh_blocks = torch.from_numpy(fresh).to(self.device) if len(fresh) else None
        return _Plan(decode=decode, prefills=prefills, fresh_blocks=fresh_blocks)

    def _plan_decode(self, batch: AttentionBatch) -> _DecodePlan:
        rows = np.arange(batch.num_decode_rows)
        if self._kernel is None:
            return self._plan_decode_groups(batch, rows)
        single = np.diff(batch.query_start_loc[: batch.num_decode_rows + 1]) == 1
        plan = self._plan_decode_groups(batch, rows[~single])
        members = rows[single]
        if len(members):
            plan.native = DecodeRows(
                block_tables=np.ascontiguousarray(batch.block_tables_host[members]),
                seq_lens=np.ascontiguousarray(batch.seq_lens[members]),
                query_tokens=np.ascontiguousarray(batch.query_start_loc[members]),
            )
            plan.native_members = members
        return plan

    def _plan_decode_groups(self, batch: AttentionBatch, rows: npt.NDArray[np.int64]) -> _DecodePlan:
        if not len(rows):
            return _DecodePlan([], 0)
        bs = batch.block_size
        num_blocks = (batch.seq_lens[rows] + bs - 1) // bs
        by_length = np.argsort(num_blocks, kind="stable")
        groups = [
            self._plan_decode_group(batch, members)
            for members in np.split(rows[by_length], _group_cuts(num_blocks[by_length]))
        ]
        return _DecodePlan(groups, max(g.rows * g.blocks_per_row for g in groups))

    def _plan_decode_group(self, batch: AttentionBatch, members: npt.NDArray[np.int64]) -> _DecodeGroup:
        bs = batch.block_size
        starts = batch.query_start_loc[members]
        qlens = batch.query_start_loc[members + 1] - starts
        seq_lens = batch.seq_lens[members]
        max_q = int(qlens.max())
        nb = int(((seq_lens + bs - 1) // bs).max())
        # Blocks past a row's own go back to its first block (written, finite); they are masked.
        block_pos = np.arange(nb)[None, :]
        own = block_pos < ((seq_lens + bs - 1) // bs)[:, None]
        blocks = np.where(own, batch.block_tables_host[members, :nb], batch.block_tables_host[members, :1])
        offsets = np.minimum(np.arange(max_q)[None, :], qlens[:, None] - 1)
        query_index = starts[:, None] + offsets
        query_pos = batch.positions_host[query_index]
        allowed = np.arange(nb * bs)[None, None, :] <= query_pos[:, :, None]  # [rows, max_q, len]
        out_flat = None
        if max_q == 1:
            out_tokens = starts
        else:
            valid = np.arange(max_q)[None, :] < qlens[:, None]
            out_flat = torch.from_numpy(np.flatnonzero(valid)).to(self.device)
            out_tokens = query_index[valid]
        return _DecodeGroup(
            rows=len(members),
            max_q=max_q,
            blocks_per_row=nb,
            block_index=torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1)).to(self.device),
            query_index=torch.from_numpy(query_index).to(self.device),
            allowed=torch.from_numpy(allowed).to(self.device),
            out_tokens=torch.from_numpy(np.ascontiguousarray(out_tokens)).to(self.device),
            out_flat=out_flat,
        )

    def _plan_prefill(self, batch: AttentionBatch, row: int) -> _PrefillRow:
        start = int(batch.query_start_loc[row])
        end = int(batch.query_start_loc[row + 1])
        if int(batch.num_computed_tokens[row]) == 0:
            return _PrefillRow(start, end, None, None)
        length = int(batch.seq_lens[row])
        slots = torch.from_numpy(batch.slots_of(row, length)).to(self.device)
        query_pos = batch.positions_host[start:end]
        mask = np.arange(length)[None, :] <= query_pos[:, None]
        return _PrefillRow(start, end, slots, torch.from_numpy(mask).to(self.device))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        batch: AttentionBatch,
        plan: object,
        scale: float,
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert isinstance(plan, _Plan)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache = layer_cache[0].view(-1, num_kv_heads, head_dim)
        v_cache = layer_cache[1].view(-1, num_kv_heads, head_dim)
        if kv_scale is None:
            if plan.fresh_blocks is not None:
                layer_cache.index_fill_(1, plan.fresh_blocks, 0.0)
            k_cache.index_copy_(0, batch.slot_mapping, k)
            v_cache.index_copy_(0, batch.slot_mapping, v)
        else:
            k = cast_saturated(k.to(torch.float32) / kv_scale[0], layer_cache.dtype)
            v = cast_saturated(v.to(torch.float32) / kv_scale[1], layer_cache.dtype)
            # Through byte views: CPU torch has no FP8 index_copy_ or index_fill_, and a zero
            # byte is +0.0 in both FP8 formats.
            cache_bytes = layer_cache.view(torch.uint8)
            if plan.fresh_blocks is not None:
                cache_bytes.index_fill_(1, plan.fresh_blocks, 0)
            cache_bytes[0].view(-1, num_kv_heads, head_dim).index_copy_(
                0, batch.slot_mapping, k.view(torch.uint8)
            )
            cache_bytes[1].view(-1, num_kv_heads, head_dim).index_copy_(
                0, batch.slot_mapping, v.view(torch.uint8)
            )
            # Every row attends over the stored values, this step's own tokens included.
            k, v = _dequantized(k, kv_scale[0], q.dtype), _dequantized(v, kv_scale[1], q.dtype)
        out = torch.empty_like(q)
        if plan.decode is not None:
            decode = plan.decode
            if decode.native is not None:
                if (
                    self._kernel is not None
                    and kv_scale is None
                    and self._kernel.supports(
                        layer_cache.dtype, q.shape[1], num_kv_heads, head_dim, batch.block_size
                    )
                ):
                    self._kernel(q, layer_cache, decode.native, scale, out)
                else:  # this model or cache is not the kernel's: plan its rows as groups from now on
                    self._kernel = None
                    assert decode.native_members is not None
                    if decode.fallback is None:
                        decode.fallback = self._plan_decode_groups(batch, decode.native_members)
                    self._decode(q, layer_cache, decode.fallback, scale, out, kv_scale)
            self._decode(q, layer_cache, decode, scale, out, kv_scale)
        for row in plan.prefills:
            out[row.start : row.end] = self._prefill(q, k, v, k_cache, v_cache, row, scale, kv_scale)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        layer_cache: torch.Tensor,
        plan: _DecodePlan,
        scale: float,
        out: torch.Tensor,
        kv_scale: torch.Tensor | None,
    ) -> None:
        if not plan.groups:
            return
        _, num_blocks, block_size, kv_heads, head_dim = layer_cache.shape
        heads_per_kv = q.shape[1] // kv_heads
        blocks = layer_cache.view(2, num_blocks, block_size * kv_heads * head_dim)
        buffer = self._gather_buffer(2 * plan.buffer_blocks * blocks.shape[-1], layer_cache)
        for group in plan.groups:
            rows, max_q = group.rows, group.max_q
            length = group.blocks_per_row * block_size
            # One gather of whole blocks for K and V, into the reused buffer (a fresh tensor of
            # this size per layer would cost page faults and zeroing every time).
            kv = buffer[: 2 * group.block_index.numel() * blocks.shape[-1]].view(2, -1, blocks.shape[-1])
            torch.index_select(blocks, 1, group.block_index, out=kv)
            keys = kv[0].view(rows, length, kv_heads, head_dim).transpose(1, 2)
            values = kv[1].view(rows, length, kv_heads, head_dim).transpose(1, 2)
            if kv_scale is not None:
                keys = _dequantized(keys, kv_scale[0], q.dtype)
                values = _dequantized(values, kv_scale[1], q.dtype)
            # The query heads sharing a KV head become extra query rows of it, so K/V are never
            # repeated: [rows, kv_heads, heads_per_kv * max_q, dim], head h = kv_head * g + i.
            # index_select, not q[index]: advanced indexing runs a parallel loop even over these
            # few kilobytes, and waking a passive OpenMP thread costs more than the copy.
            queries = q.index_select(0, group.query_index.view(-1))
            queries = queries.view(rows, max_q, kv_heads, heads_per_kv, head_dim)
            queries = queries.permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, heads_per_kv * max_q, head_dim)
            mask = group.mask(heads_per_kv, q.dtype)
            result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
            result = result.view(rows, kv_heads, heads_per_kv, max_q, head_dim).permute(0, 3, 1, 2, 4)
            if group.out_flat is None:
                out.index_copy_(0, group.out_tokens, result[:, 0].reshape(rows, -1, head_dim))
            else:
                flat = result.reshape(rows * max_q, kv_heads * heads_per_kv, head_dim)
                out.index_copy_(0, group.out_tokens, flat.index_select(0, group.out_flat))

    def _gather_buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffer
        if (
            buffer is None
            or buffer.numel() < numel
            or buffer.dtype != like.dtype
            or buffer.device != like.device
        ):
            buffer = self._buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buffer

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        row: _PrefillRow,
        scale: float,
        kv_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        queries = q[row.start : row.end].transpose(0, 1).unsqueeze(0)
        if row.key_slots is None:
            keys = k[row.start : row.end].transpose(0, 1).unsqueeze(0)
            values = v[row.start : row.end].transpose(0, 1).unsqueeze(0)
            result = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            keys = k_cache.index_select(0, row.key_slots).transpose(0, 1).unsqueeze(0)
            values = v_cache.index_select(0, row.key_slots).transpose(0, 1).unsqueeze(0)
            if kv_scale is not None:
                keys = _dequantized(keys, kv_scale[0], q.dtype)
                values = _dequantized(values, kv_scale[1], q.dtype)
            result = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=row.mask, scale=scale, enable_gqa=True
            )
        return result[0].transpose(0, 1)


def _dequantized(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (stored.to(torch.float32) * scale).to(dtype)


def _group_cuts(sorted_blocks: npt.NDArray[np.int64]) -> list[int]:
    """Where to cut rows sorted by length (in blocks) into groups, minimising gathered blocks plus
    `GROUP_COST_IN_BLOCKS` per group. A group is padded to its last (longest) row."""
    n = len(sorted_blocks)
    best = np.zeros(n + 1)  # best[j]: cost of the first j rows
    cut = np.zeros(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        # the last group is rows [i, j): cost best[i] + (j - i) * sorted_blocks[j - 1]
        starts = np.arange(j)
        costs = best[:j] + (j - starts) * sorted_blocks[j - 1] + GROUP_COST_IN_BLOCKS
        i = int(costs.argmin())
        best[j], cut[j] = costs[i], i
    cuts: list[int] = []
    j = n
    while j > 0:
        j = int(cut[j])
        if j > 0:
            cuts.append(j)
    return cuts[::-1]
