"""Reference attention in plain PyTorch: runs on CPU and on any torch device.

Decode rows are batched into one SDPA call over their gathered cache (padded to the longest row,
masked); each prefill chunk gets its own SDPA call — straight over its new K/V when it starts
at position 0, over its gathered cache (prefix hits, earlier chunks) otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from baton_engine.model.attention_batch import AttentionBatch


@dataclass
class _DecodePlan:
    query_index: torch.Tensor  # [rows, max_q] token indices (padding repeats a valid one)
    key_slots: torch.Tensor  # [rows, max_len] cache slots (padding repeats slot of position 0)
    mask: torch.Tensor | None  # [rows, 1, max_q, max_len] True = attend; None when nothing to mask
    single_token: bool  # every row has exactly one query token: outputs are tokens [0, rows)
    valid_tokens: torch.Tensor | None  # token indices of the real (non-padding) queries
    valid_flat: torch.Tensor | None  # their positions in the flattened [rows * max_q] output


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


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def prepare(self, batch: AttentionBatch) -> _Plan:
        decode = self._plan_decode(batch) if batch.num_decode_rows else None
        prefills = [self._plan_prefill(batch, row) for row in range(batch.num_decode_rows, batch.num_rows)]
        return _Plan(decode=decode, prefills=prefills)

    def _plan_decode(self, batch: AttentionBatch) -> _DecodePlan:
        rows = batch.num_decode_rows
        starts = batch.query_start_loc[:rows]
        qlens = batch.query_start_loc[1 : rows + 1] - starts
        seq_lens = batch.seq_lens[:rows]
        max_q = int(qlens.max())
        max_len = int(seq_lens.max())
        # Positions past a row's length read its position 0 (written, finite) and are masked.
        key_pos = np.arange(max_len)[None, :]
        key_pos = np.where(key_pos < seq_lens[:, None], key_pos, 0)
        blocks = np.take_along_axis(batch.block_tables_host[:rows], key_pos // batch.block_size, axis=1)
        key_slots = blocks * batch.block_size + key_pos % batch.block_size
        offsets = np.minimum(np.arange(max_q)[None, :], qlens[:, None] - 1)
        query_index = starts[:, None] + offsets
        query_pos = batch.positions_host[query_index]
        keys = np.arange(max_len)[None, None, :]
        mask_np = keys <= query_pos[:, :, None]
        single = max_q == 1
        need_mask = not (single and bool((seq_lens == max_len).all()))
        mask = torch.from_numpy(mask_np[:, None]).to(self.device) if need_mask else None
        valid_tokens = valid_flat = None
        if not single:
            valid = np.arange(max_q)[None, :] < qlens[:, None]
            valid_flat = torch.from_numpy(np.flatnonzero(valid)).to(self.device)
            valid_tokens = torch.from_numpy(query_index[valid]).to(self.device)
        return _DecodePlan(
            query_index=torch.from_numpy(query_index).to(self.device),
            key_slots=torch.from_numpy(key_slots).to(self.device),
            mask=mask,
            single_token=single,
            valid_tokens=valid_tokens,
            valid_flat=valid_flat,
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
    ) -> torch.Tensor:
        assert isinstance(plan, _Plan)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache = layer_cache[0].view(-1, num_kv_heads, head_dim)
        v_cache = layer_cache[1].view(-1, num_kv_heads, head_dim)
        k_cache.index_copy_(0, batch.slot_mapping, k)
        v_cache.index_copy_(0, batch.slot_mapping, v)
        out = torch.empty_like(q)
        if plan.decode is not None:
            self._decode(q, layer_cache, plan.decode, scale, out)
        for row in plan.prefills:
            out[row.start : row.end] = self._prefill(q, k, v, k_cache, v_cache, row, scale)
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor, layer_cache: torch.Tensor, plan: _DecodePlan, scale: float, out: torch.Tensor
    ) -> None:
        rows, max_q = plan.query_index.shape
        max_len = plan.key_slots.shape[1]
        kv_heads, head_dim = layer_cache.shape[-2], layer_cache.shape[-1]
        group = q.shape[1] // kv_heads
        # One gather for K and V: [2, rows * max_len, kv_heads, dim].
        kv = layer_cache.view(2, -1, kv_heads, head_dim).index_select(1, plan.key_slots.view(-1))
        keys = kv[0].view(rows, max_len, kv_heads, head_dim).transpose(1, 2)
        values = kv[1].view(rows, max_len, kv_heads, head_dim).transpose(1, 2)
        # The query heads sharing a KV head become extra query rows of it, so K/V are never
        # repeated: [rows, kv_heads, group * max_q, dim], head h = kv_head * group + g.
        queries = q[plan.query_index].view(rows, max_q, kv_heads, group, head_dim)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(rows, kv_heads, group * max_q, head_dim)
        mask = plan.mask
        if mask is not None and max_q > 1:
            mask = (
                mask.unsqueeze(2)
                .expand(rows, 1, group, max_q, max_len)
                .reshape(rows, 1, group * max_q, max_len)
            )
        result = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        result = result.view(rows, kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        result = result.reshape(rows, max_q, kv_heads * group, head_dim)
        if plan.single_token:
            out[:rows] = result[:, 0]
        else:
            assert plan.valid_tokens is not None and plan.valid_flat is not None
            flat = result.reshape(rows * max_q, kv_heads * group, head_dim)
            out[plan.valid_tokens] = flat[plan.valid_flat]

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        row: _PrefillRow,
        scale: float,
    ) -> torch.Tensor:
        queries = q[row.start : row.end].transpose(0, 1).unsqueeze(0)
        if row.key_slots is None:
            keys = k[row.start : row.end].transpose(0, 1).unsqueeze(0)
            values = v[row.start : row.end].transpose(0, 1).unsqueeze(0)
            result = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            keys = k_cache[row.key_slots].transpose(0, 1).unsqueeze(0)
            values = v_cache[row.key_slots].transpose(0, 1).unsqueeze(0)
            result = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=row.mask, scale=scale, enable_gqa=True
            )
        return result[0].transpose(0, 1)
