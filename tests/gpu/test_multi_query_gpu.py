"""The multi-query (verify) decode kernel on the GPU, bfloat16, Llama-3.2-1B attention shape,
against float32 reference attention; and inside a captured graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton_engine.model.kernels.triton_multi_query import multi_query_workspace, paged_multi_query_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 64, 16


def _case(
    rows: list[tuple[int, int]], query_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = [-(-max(n, 1) // BLOCK) for n, _ in rows]
    num_blocks = sum(blocks) + 4
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
    order = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    table = torch.zeros(len(rows), max(blocks), dtype=torch.int32, device="cuda")
    slots = []
    for row, ((n, _), count) in enumerate(zip(rows, blocks, strict=True)):
        ids = [order.pop() for _ in range(count)]
        table[row, :count] = torch.tensor(ids, dtype=torch.int32)
        pos = torch.arange(n)
        slots.append((torch.tensor(ids)[pos // BLOCK] * BLOCK + pos % BLOCK).cuda())
    q = torch.randn(len(rows) * query_len, HEADS, HEAD_DIM, generator=gen, device="cuda").bfloat16()
    seq_lens = torch.tensor([n for n, _ in rows], dtype=torch.int32, device="cuda")
    query_lens = torch.tensor([k for _, k in rows], dtype=torch.int32, device="cuda")
    return cache, table, q, seq_lens, query_lens, slots


def _reference(
    q: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    keys = cache[0].reshape(-1, KV_HEADS, HEAD_DIM)[slots].float().transpose(0, 1)
    values = cache[1].reshape(-1, KV_HEADS, HEAD_DIM)[slots].float().transpose(0, 1)
    mask = torch.arange(len(slots), device="cuda")[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), keys, values, attn_mask=mask, scale=HEAD_DIM**-0.5, enable_gqa=True
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("num_splits", [1, 5])
def test_bf16_matches_reference(num_splits: int) -> None:
    query_len = 9
    rows = [(512, 9), (300, 4), (77, 1), (9, 9), (0, 0)]
    cache, table, q, seq_lens, query_lens, slots = _case(rows, query_len, seed=1)
    workspace = multi_query_workspace(len(rows), query_len, HEADS, HEAD_DIM, num_splits, torch.device("cuda"))
    out = paged_multi_query_attention(
        q, cache, table, seq_lens, query_lens, query_len, HEAD_DIM**-0.5, workspace
    )
    for row, (n, real) in enumerate(rows):
        first = row * query_len
        if real:
            positions = torch.arange(n - real, n, device="cuda")
            ref = _reference(q[first : first + real], cache, slots[row], positions)
            got = out[first : first + real].float()
            assert float((got - ref).norm() / ref.norm()) < 1e-2
        assert torch.count_nonzero(out[first + real : first + query_len]) == 0


def test_replays_in_a_captured_graph() -> None:
    query_len = 5
    rows = [(200, 5), (64, 2)]
    cache, table, q, seq_lens, query_lens, slots = _case(rows, query_len, seed=2)
    workspace = multi_query_workspace(len(rows), query_len, HEADS, HEAD_DIM, 3, torch.device("cuda"))
    out = torch.empty_like(q)

    def run() -> None:
        paged_multi_query_attention(
            q, cache, table, seq_lens, query_lens, query_len, HEAD_DIM**-0.5, workspace, out=out
        )

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    out.zero_()
    seq_lens.copy_(torch.tensor([201, 66], dtype=torch.int32))  # new lengths, same buffers
    query_lens.copy_(torch.tensor([5, 3], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    for row, (n, real) in enumerate([(201, 5), (66, 3)]):
        first = row * query_len
        positions = torch.arange(n - real, n, device="cuda")
        pos = torch.arange(n, device="cuda")
        row_slots = table[row].long()[pos // BLOCK] * BLOCK + pos % BLOCK
        ref = _reference(q[first : first + real], cache, row_slots, positions)
        assert float((out[first : first + real].float() - ref).norm() / ref.norm()) < 1e-2
