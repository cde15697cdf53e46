"""The attention kernels give the reference's answers under every backend's launch table, on
`kernel_device` (compiled on a GPU — so the AMD table's warps and stages also run on an NVIDIA
GPU — interpreted on the CPU), and dealing a long verify window's rows to several programs
changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton_engine.model.kernels.launch_table import CUDA, ROCM, LaunchTable
from baton_engine.model.kernels.triton_attention import (
    DecodeWorkspace,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_tiles,
)
from baton_engine.model.kernels.triton_multi_query import (
    multi_query_workspace,
    paged_multi_query_attention,
    verify_tile_rows,
)
from tests.gpu_kernels.test_triton_kernels import HEAD_DIM, HEADS, _paged_cache, _reference, _rel_err

TABLES = [CUDA, ROCM]


def _verify(
    q: torch.Tensor,
    cache: torch.Tensor,
    table: torch.Tensor,
    rows: list[tuple[int, int]],
    query_len: int,
    num_splits: int,
    launch: LaunchTable,
) -> torch.Tensor:
    device = q.device
    out = torch.full_like(q, float("nan"))
    paged_multi_query_attention(
        q, cache, table,
        torch.tensor([n for n, _ in rows], dtype=torch.int32, device=device),
        torch.tensor([k for _, k in rows], dtype=torch.int32, device=device),
        query_len, HEAD_DIM**-0.5,
        multi_query_workspace(len(rows), query_len, HEADS, HEAD_DIM, num_splits, device),
        out=out, block_n=16, launch=launch,
    )  # fmt: skip
    return out


@pytest.mark.parametrize("launch", TABLES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference_under(
    launch: LaunchTable, num_splits: int, kernel_device: torch.device
) -> None:
    gen = torch.Generator().manual_seed(11)
    seq_lens = [7, 1, 45, 0]
    cache, table, slots = _paged_cache([max(n, 1) for n in seq_lens], gen, kernel_device)
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=kernel_device)
    workspace = DecodeWorkspace(len(seq_lens), HEADS, HEAD_DIM, num_splits, kernel_device)
    paged_decode_attention(
        q, cache, table, lens, HEAD_DIM**-0.5, workspace, out=out, block_n=16, launch=launch
    )
    for row, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(out[row], torch.zeros_like(out[row]))
            continue
        ref = _reference(q[row : row + 1], cache, slots[row][:n], torch.tensor([n - 1]))
        assert _rel_err(out[row : row + 1], ref) < 1e-5


@pytest.mark.parametrize("launch", TABLES, ids=lambda t: t.name)
def test_prefill_matches_reference_under(launch: LaunchTable, kernel_device: torch.device) -> None:
    gen = torch.Generator().manual_seed(12)
    seq_lens, query_lens = [40, 9], [12, 9]  # 28 tokens of context before the first row's chunk
    cache, table, slots = _paged_cache(seq_lens, gen, kernel_device)
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    rows, starts = prefill_tiles(query_lens)
    out = paged_prefill_attention(
        q, cache, table,
        torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32, device=kernel_device),
        torch.tensor(seq_lens, dtype=torch.int32, device=kernel_device),
        torch.tensor(rows, dtype=torch.int32, device=kernel_device),
        torch.tensor(starts, dtype=torch.int32, device=kernel_device),
        HEAD_DIM**-0.5, block_n=16, launch=launch,
    )  # fmt: skip
    first = 0
    for row, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens, strict=True)):
        positions = torch.arange(seq_len - q_len, seq_len)
        ref = _reference(q[first : first + q_len], cache, slots[row][:seq_len], positions)
        assert _rel_err(out[first : first + q_len], ref) < 1e-5
        first += q_len


@pytest.mark.parametrize("launch", TABLES, ids=lambda t: t.name)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_verify_rows_dealt_to_several_programs_match_the_reference(
    launch: LaunchTable, num_splits: int, kernel_device: torch.device
) -> None:
    """9 tokens x a group of 2 heads = 18 (token, head) rows per kv head: one 32-row program under
    the table's cap of 64, two 16-row programs under a cap of 16 (the second holds 2 real rows)."""
    gen = torch.Generator().manual_seed(13)
    query_len = 9
    rows = [(41, 9), (20, 4), (9, 9), (0, 0)]
    cache, table, slots = _paged_cache([max(n, 1) for n, _ in rows], gen, kernel_device)
    q = torch.randn(len(rows) * query_len, HEADS, HEAD_DIM, generator=gen).to(kernel_device)
    capped = dataclasses.replace(
        launch,
        verify_unsplit=dataclasses.replace(launch.verify_unsplit, block_m=16),
        verify_split=dataclasses.replace(launch.verify_split, block_m=16),
    )
    one = _verify(q, cache, table, rows, query_len, num_splits, launch)
    two = _verify(q, cache, table, rows, query_len, num_splits, capped)
    for row, (seq_len, real) in enumerate(rows):
        first = row * query_len
        padding = slice(first + real, first + query_len)
        assert torch.equal(one[padding], torch.zeros_like(one[padding]))
        assert torch.equal(two[padding], torch.zeros_like(two[padding]))
        if real:
            positions = torch.arange(seq_len - real, seq_len)
            ref = _reference(q[first : first + real], cache, slots[row][:seq_len], positions)
            assert _rel_err(one[first : first + real], ref) < 1e-5
            assert _rel_err(two[first : first + real], ref) < 1e-5
            assert _rel_err(two[first : first + real], one[first : first + real]) < 1e-6


@pytest.mark.parametrize(
    ("pairs", "cap", "rows"),
    [(3, 64, 16), (18, None, 32), (18, 16, 16), (64, 64, 64), (136, 64, 64), (136, None, 256)],
)
def test_verify_tile_rows(pairs: int, cap: int | None, rows: int) -> None:
    assert verify_tile_rows(pairs, cap) == rows
