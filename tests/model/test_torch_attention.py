"""The torch attention backend against plain per-row causal attention over the same cache.

One mixed step: single-token decode rows of very different lengths (so they are cut into
several groups), multi-token decode rows (speculative verification), a prefill chunk that starts
at position 0 and one that continues earlier chunks. Block tables are scattered over the pool.
"""

from __future__ import annotations

import numpy as np
import torch

from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.attention.torch_backend import (
    GROUP_COST_IN_BLOCKS,
    TorchAttentionBackend,
    _group_cuts,
)

BLOCK = 4
KV_HEADS, HEADS_PER_KV, DIM = 2, 3, 8
NUM_BLOCKS = 200


def _batch(
    context: list[int], query_lens: list[int], num_decode: int, tables: np.ndarray, block: int = BLOCK
) -> AttentionBatch:
    """The step of rows with `context` cached tokens and `query_lens` new ones, through `tables`."""
    seq_lens = [c + q for c, q in zip(context, query_lens, strict=True)]
    positions = np.concatenate([np.arange(c, s) for c, s in zip(context, seq_lens, strict=True)])
    rows = np.repeat(np.arange(len(context)), query_lens)
    slots = tables[rows, positions // block] * block + positions % block
    return AttentionBatch(
        block_size=block,
        num_decode_rows=num_decode,
        query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64),
        seq_lens=np.asarray(seq_lens, dtype=np.int64),
        num_computed_tokens=np.asarray(context, dtype=np.int64),
        positions_host=positions.astype(np.int64),
        block_tables_host=tables.astype(np.int64),
        slot_mapping=torch.from_numpy(slots.astype(np.int64)),
        positions=torch.from_numpy(positions.astype(np.int64)),
    )


def _reference(q: torch.Tensor, cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """Row by row: keys and values read slot by slot, causal by position, K/V heads repeated."""
    out = torch.empty_like(q)
    k_cache = cache[0].reshape(-1, KV_HEADS, DIM)
    v_cache = cache[1].reshape(-1, KV_HEADS, DIM)
    for row in range(batch.num_rows):
        start, end = int(batch.query_start_loc[row]), int(batch.query_start_loc[row + 1])
        slots = torch.from_numpy(batch.slots_of(row, int(batch.seq_lens[row])))
        keys = k_cache[slots].repeat_interleave(HEADS_PER_KV, dim=1)  # [len, heads, dim]
        values = v_cache[slots].repeat_interleave(HEADS_PER_KV, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[start:end], keys) * scale
        pos = torch.from_numpy(batch.positions_host[start:end])
        scores = scores.masked_fill(
            torch.arange(len(slots))[None, None, :] > pos[None, :, None], float("-inf")
        )
        out[start:end] = torch.einsum("htl,lhd->thd", scores.softmax(-1), values)
    return out


def test_mixed_step_matches_per_row_attention() -> None:
    gen = np.random.default_rng(3)
    # decode rows: lengths 1..150 tokens (three groups at least), two of them verify 3 and 4 tokens
    context = [149, 3, 0, 40, 41, 90, 7, 120, 60, 0, 13]
    query_lens = [1, 1, 1, 1, 4, 1, 3, 1, 1, 9, 6]
    num_decode = 9
    needed = [(c + q + BLOCK - 1) // BLOCK for c, q in zip(context, query_lens, strict=True)]
    pool = gen.permutation(NUM_BLOCKS)
    tables = np.zeros((len(context), max(needed)), dtype=np.int64)  # unused entries hold 0
    for row, count in enumerate(needed):
        tables[row, :count] = pool[sum(needed[:row]) : sum(needed[: row + 1])]
    batch = _batch(context, query_lens, num_decode, tables)
    tokens = int(batch.query_start_loc[-1])

    cache = torch.from_numpy(gen.standard_normal((2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM)))
    q = torch.from_numpy(gen.standard_normal((tokens, KV_HEADS * HEADS_PER_KV, DIM)))
    k = torch.from_numpy(gen.standard_normal((tokens, KV_HEADS, DIM)))
    v = torch.from_numpy(gen.standard_normal((tokens, KV_HEADS, DIM)))

    backend = TorchAttentionBackend(torch.device("cpu"), native_decode=False)
    plan = backend.prepare(batch)
    assert plan.decode is not None
    assert len(plan.decode.groups) >= 3
    assert sorted(int(t) for g in plan.decode.groups for t in g.out_tokens) == list(
        range(int(batch.query_start_loc[num_decode]))
    )
    layer_cache = cache.clone()
    out = backend.forward(q, k, v, layer_cache, batch, plan, scale=DIM**-0.5)

    # blocks whose position-0 slot this step writes are zeroed first; nothing else outside the
    # written slots changes
    fresh = sorted(
        int(tables[row, pos // BLOCK])
        for row, (c, ql) in enumerate(zip(context, query_lens, strict=True))
        for pos in range(c, c + ql)
        if pos % BLOCK == 0
    )
    assert plan.fresh_blocks is not None
    assert plan.fresh_blocks.tolist() == fresh
    written = cache.clone()
    written[:, fresh] = 0.0
    written[0].view(-1, KV_HEADS, DIM)[batch.slot_mapping] = k
    written[1].view(-1, KV_HEADS, DIM)[batch.slot_mapping] = v
    assert torch.equal(layer_cache, written)
    expected = _reference(q, written, batch, DIM**-0.5)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)

    # the same plan again (as the next layer would): the reused gather buffer gives the same result
    again = backend.forward(q, k, v, layer_cache, batch, plan, scale=DIM**-0.5)
    assert torch.equal(again, out)


def test_rows_are_grouped_only_when_padding_costs_more_than_a_group() -> None:
    assert _group_cuts(np.array([5, 5, 5, 5])) == []
    assert _group_cuts(np.array([1, 2, 3, 4])) == []  # saving 6 blocks < one group's cost
    assert _group_cuts(np.array([1, 1, 1, 1, 40, 40])) == [4]  # saving 156 blocks
    lengths = np.array([1] * 3 + [1 + GROUP_COST_IN_BLOCKS] * 2)
    # cutting saves 3 * GROUP_COST_IN_BLOCKS blocks for one group more: worth it
    assert _group_cuts(lengths) == [3]


def test_unwritten_slots_holding_nan_do_not_reach_the_output() -> None:
    """An uninitialised cache may hold NaN or inf where a block was never written; decode gathers
    whole blocks, so the fresh block of each row is zeroed before its first slot is written."""
    gen = np.random.default_rng(5)
    context, query_lens = [0, 0], [1, 1]
    tables = np.array([[2], [5]], dtype=np.int64)
    batch = _batch(context, query_lens, 2, tables)
    cache = torch.full((2, NUM_BLOCKS, BLOCK, KV_HEADS, DIM), float("nan"), dtype=torch.float64)
    q = torch.from_numpy(gen.standard_normal((2, KV_HEADS * HEADS_PER_KV, DIM)))
    k = torch.from_numpy(gen.standard_normal((2, KV_HEADS, DIM)))
    v = torch.from_numpy(gen.standard_normal((2, KV_HEADS, DIM)))
    backend = TorchAttentionBackend(torch.device("cpu"), native_decode=False)
    plan = backend.prepare(batch)
    assert plan.fresh_blocks is not None and plan.fresh_blocks.tolist() == [2, 5]
    out = backend.forward(q, k, v, cache, batch, plan, scale=DIM**-0.5)
    # one key each: attention returns the row's own value, repeated over the KV head's query heads
    torch.testing.assert_close(out, v.repeat_interleave(HEADS_PER_KV, dim=1), rtol=1e-12, atol=1e-12)
    assert int(torch.isnan(cache[:, [2, 5]]).sum()) == 0
    assert bool(torch.isnan(cache[:, 3]).all())
