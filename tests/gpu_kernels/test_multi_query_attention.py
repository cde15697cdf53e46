"""The multi-query (verify) decode kernel, on `kernel_device`, against reference attention."""

from __future__ import annotations

import pytest
import torch

from baton_engine.model.kernels.triton_multi_query import multi_query_workspace, paged_multi_query_attention
from tests.gpu_kernels.test_triton_kernels import HEAD_DIM, HEADS, _paged_cache, _reference, _rel_err


@pytest.mark.parametrize("num_splits", [1, 3])
def test_multi_query_matches_reference(num_splits: int, kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(5)
    query_len = 5
    # (seq_len after the step, real query tokens): full window, drafts shorter than the window,
    # a plain decode row, a row whose whole sequence is the window, and a graph padding row.
    rows = [(37, 5), (20, 3), (9, 1), (5, 5), (0, 0)]
    cache, table, slots = _paged_cache([max(n, 1) for n, _ in rows], gen, kernel_device)
    q = torch.randn(len(rows) * query_len, HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    workspace = multi_query_workspace(len(rows), query_len, HEADS, HEAD_DIM, num_splits, kernel_device)
    out = torch.full_like(q, float("nan"))
    paged_multi_query_attention(
        q,
        cache,
        table,
        torch.tensor([n for n, _ in rows], dtype=torch.int32, device=kernel_device),
        torch.tensor([k for _, k in rows], dtype=torch.int32, device=kernel_device),
        query_len,
        HEAD_DIM**-0.5,
        workspace,
        out=out,
        block_n=16,
    )
    for row, (seq_len, real) in enumerate(rows):
        first = row * query_len
        if real:
            positions = torch.arange(seq_len - real, seq_len)
            ref = _reference(q[first : first + real], cache, slots[row][:seq_len], positions)
            assert _rel_err(out[first : first + real], ref) < 1e-5
        padding = out[first + real : first + query_len]
        assert torch.equal(padding, torch.zeros_like(padding))


def test_query_len_one_equals_the_decode_kernel(kernel_device: torch.device) -> None:
    from baton_engine.model.kernels.triton_attention import DecodeWorkspace, paged_decode_attention

    gen = torch.Generator().manual_seed(6)
    seq_lens = [13, 40, 1]
    cache, table, _ = _paged_cache(seq_lens, gen, kernel_device)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=kernel_device)
    ones = torch.ones(3, dtype=torch.int32, device=kernel_device)
    multi = paged_multi_query_attention(
        q, cache, table, lens, ones, 1, HEAD_DIM**-0.5,
        multi_query_workspace(3, 1, HEADS, HEAD_DIM, 2, kernel_device),
    )  # fmt: skip
    single = paged_decode_attention(
        q, cache, table, lens, HEAD_DIM**-0.5, DecodeWorkspace(3, HEADS, HEAD_DIM, 2, kernel_device)
    )
    assert _rel_err(multi, single) < 1e-6


def test_tokens_must_fill_whole_rows(kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(7)
    cache, table, _ = _paged_cache([4, 4], gen, kernel_device)
    q = torch.randn(7, HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    workspace = multi_query_workspace(2, 4, HEADS, HEAD_DIM, 1, kernel_device)
    lens = torch.tensor([4, 4], dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError, match="7 query tokens do not split into rows of query_len=4"):
        paged_multi_query_attention(q, cache, table, lens, lens, 4, 1.0, workspace)
