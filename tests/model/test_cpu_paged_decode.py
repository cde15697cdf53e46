"""The C decode-attention kernel on CPU against the gather path and a float64 reference.

Mixed steps as the engine builds them: single-token decode rows (the kernel's), rows verifying
several tokens and prefill chunks (the gather path's), block tables scattered over the pool,
slots past a row's length holding NaN. Then its build: cached, shared by concurrent builders,
refused cleanly when there is no compiler or the compiler fails.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from baton_engine.model.attention import cpu_paged_decode
from baton_engine.model.attention.batch import AttentionBatch
from baton_engine.model.attention.torch_backend import TorchAttentionBackend, _Plan
from tests.model.test_torch_attention import _batch as gather_path_batch

NUM_BLOCKS = 160


def _batch(
    context: list[int], query_lens: list[int], num_decode: int, block: int, gen: np.random.Generator
) -> AttentionBatch:
    """Tables scattered over the pool; entries past a row's blocks name the NaN block."""
    needed = [(c + q + block - 1) // block for c, q in zip(context, query_lens, strict=True)]
    pool = gen.permutation(NUM_BLOCKS - 1)
    tables = np.full((len(context), max(needed) + 2), NUM_BLOCKS - 1, dtype=np.int64)
    for row, count in enumerate(needed):
        tables[row, :count] = pool[sum(needed[:row]) : sum(needed[: row + 1])]
    return gather_path_batch(context, query_lens, num_decode, tables, block)


def _reference(q: torch.Tensor, cache: torch.Tensor, batch: AttentionBatch, scale: float) -> torch.Tensor:
    """float64, row by row: keys and values read slot by slot, causal by position."""
    kv_heads, dim = cache.shape[-2], cache.shape[-1]
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    k_cache = cache[0].reshape(-1, kv_heads, dim).double()
    v_cache = cache[1].reshape(-1, kv_heads, dim).double()
    for row in range(batch.num_rows):
        start, end = int(batch.query_start_loc[row]), int(batch.query_start_loc[row + 1])
        slots = torch.from_numpy(batch.slots_of(row, int(batch.seq_lens[row])))
        keys = k_cache[slots].repeat_interleave(group, dim=1)
        values = v_cache[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[start:end].double(), keys) * scale
        pos = torch.from_numpy(batch.positions_host[start:end])
        scores = scores.masked_fill(
            torch.arange(len(slots))[None, None, :] > pos[None, :, None], float("-inf")
        )
        out[start:end] = torch.einsum("htl,lhd->thd", scores.softmax(-1), values)
    return out


def _step(
    dtype: torch.dtype, kv_heads: int, group: int, dim: int, block: int, seed: int, nan_tails: bool = True
) -> tuple[AttentionBatch, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = np.random.default_rng(seed)
    # decode rows: 1 token of context, a block boundary either side, long rows; two verify rows;
    # then a prefill from 0 and one continuing earlier chunks
    context = [0, block - 1, block, 2 * block - 1, 5, 300, 77, 40, 9, 0, 3 * block + 1]
    query_lens = [1, 1, 1, 1, 1, 1, 1, 3, 4, 7, 5]
    batch = _batch(context, query_lens, 9, block, gen)
    tokens = int(batch.query_start_loc[-1])
    heads = kv_heads * group
    cache = torch.from_numpy(gen.standard_normal((2, NUM_BLOCKS, block, kv_heads, dim))).to(dtype)
    cache[:, NUM_BLOCKS - 1] = float("nan")
    # the kernel's rows read nothing past their length: there the cache holds NaN (the gather
    # path reads whole blocks and relies on the zeroing of fresh blocks instead)
    for row in range(7 if nan_tails else 0):
        length = int(batch.seq_lens[row])
        last = int(batch.block_tables_host[row, (length - 1) // block])
        cache[:, last, (length - 1) % block + 1 :] = float("nan")
    # q as the model hands it over: a view into the fused qkv projection's output
    qkv = torch.from_numpy(gen.standard_normal((tokens, (heads + 2 * kv_heads) * dim))).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    return batch, cache, q, k, v


@pytest.fixture(scope="module")
def kernel() -> cpu_paged_decode.PagedDecodeKernel:
    built = cpu_paged_decode.paged_decode_kernel()
    assert built is not None, "this machine has a C compiler: the kernel must build"
    return built


@pytest.mark.parametrize(
    ("dtype", "kv_heads", "group", "dim", "block"),
    [
        (torch.float32, 3, 3, 64, 16),  # SmolLM2-135M
        (torch.float32, 2, 8, 128, 16),  # Llama-3-8B's head layout
        (torch.float32, 1, 1, 64, 4),
        (torch.float32, 4, 16, 256, 64),  # every limit at once
        (torch.bfloat16, 3, 3, 64, 16),
        (torch.bfloat16, 2, 4, 128, 32),
    ],
)
def test_kernel_rows_match_the_gather_path_and_the_reference(
    kernel: cpu_paged_decode.PagedDecodeKernel,
    dtype: torch.dtype,
    kv_heads: int,
    group: int,
    dim: int,
    block: int,
) -> None:
    batch, cache, q, k, v = _step(dtype, kv_heads, group, dim, block, seed=dim + group)
    assert kernel.supports(dtype, kv_heads * group, kv_heads, dim, block)
    scale = dim**-0.5
    native = TorchAttentionBackend(torch.device("cpu"))
    plan = native.prepare(batch)
    assert isinstance(plan, _Plan) and plan.decode is not None and plan.decode.native is not None
    assert plan.decode.native.query_tokens.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert plan.decode.native.seq_lens.tolist() == [1, block, block + 1, 2 * block, 6, 301, 78]
    # the verify rows (tokens 7-9 and 10-13) are the gather path's
    assert sorted(int(t) for g in plan.decode.groups for t in g.out_tokens) == list(range(7, 14))
    native_cache = cache.clone()
    out = native.forward(q, k, v, native_cache, batch, plan, scale=scale)
    assert plan.decode.fallback is None

    gather = TorchAttentionBackend(torch.device("cpu"), native_decode=False)
    gather_cache = cache.clone()
    expected = gather.forward(q, k, v, gather_cache, batch, gather.prepare(batch), scale=scale)
    torch.testing.assert_close(native_cache, gather_cache, rtol=0, atol=0, equal_nan=True)
    assert not torch.isnan(out).any()
    # rows the kernel did not serve are the gather path's bit for bit
    assert torch.equal(out[7:], expected[7:])
    exact = _reference(q, native_cache, batch, scale)[:7]
    if dtype == torch.float32:
        torch.testing.assert_close(out[:7].double(), exact, rtol=0, atol=2e-6)
    else:  # one rounding of a float32 result to bfloat16
        torch.testing.assert_close(out[:7].double(), exact, rtol=2**-8, atol=1e-4)


def test_thread_count_does_not_change_a_bit(kernel: cpu_paged_decode.PagedDecodeKernel) -> None:
    batch, cache, q, k, v = _step(torch.float32, 3, 3, 64, 16, seed=11)
    backend = TorchAttentionBackend(torch.device("cpu"))
    plan = backend.prepare(batch)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.forward(q, k, v, cache.clone(), batch, plan, scale=0.125)
        torch.set_num_threads(2)
        two = backend.forward(q, k, v, cache.clone(), batch, plan, scale=0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize(("dtype", "dim"), [(torch.float64, 16), (torch.float32, 96)])
def test_unsupported_cache_falls_back_to_the_gather_path(
    kernel: cpu_paged_decode.PagedDecodeKernel, dtype: torch.dtype, dim: int
) -> None:
    """A dtype or head size the kernel was not built for: the step's single-token rows are
    planned as groups on the spot, and the backend plans no kernel rows from then on."""
    batch, cache, q, k, v = _step(dtype, 2, 3, dim, 8, seed=2, nan_tails=False)
    backend = TorchAttentionBackend(torch.device("cpu"))
    plan = backend.prepare(batch)
    assert isinstance(plan, _Plan) and plan.decode is not None and plan.decode.native is not None
    layer_cache = cache.clone()
    out = backend.forward(q, k, v, layer_cache, batch, plan, scale=0.25)
    assert plan.decode.fallback is not None
    assert sorted(int(t) for g in plan.decode.fallback.groups for t in g.out_tokens) == list(range(7))
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5  # float32: SDPA's own rounding
    torch.testing.assert_close(
        out.double(), _reference(q, layer_cache, batch, 0.25), rtol=tolerance, atol=tolerance
    )
    # the next layer reuses the fallback plan; the next step plans no kernel rows at all
    again = backend.forward(q, k, v, cache.clone(), batch, plan, scale=0.25)
    assert torch.equal(again, out)
    next_plan = backend.prepare(batch)
    assert isinstance(next_plan, _Plan) and next_plan.decode is not None
    assert next_plan.decode.native is None
    assert sorted(int(t) for g in next_plan.decode.groups for t in g.out_tokens) == list(range(14))


def test_limits_reported_by_the_library(kernel: cpu_paged_decode.PagedDecodeKernel) -> None:
    assert (kernel.max_group, kernel.head_dims, kernel.max_block) == (16, {64, 128, 256}, 64)
    assert not kernel.supports(torch.float32, 17, 1, 64, 16)
    assert not kernel.supports(torch.float32, 4, 4, 512, 16)
    assert not kernel.supports(torch.float32, 4, 4, 96, 16)
    assert not kernel.supports(torch.float32, 4, 4, 64, 128)
    assert not kernel.supports(torch.float16, 4, 4, 64, 16)
    assert not kernel.supports(torch.float32, 6, 4, 64, 16)  # 6 heads do not share 4 KV heads


def test_build_is_cached_and_concurrent_builders_share_it(tmp_path: Path) -> None:
    compiler = cpu_paged_decode._compiler()
    assert compiler is not None
    paths: list[Path] = []
    builders = [
        threading.Thread(target=lambda: paths.append(cpu_paged_decode.build(compiler, tmp_path)))
        for _ in range(2)
    ]
    for builder in builders:
        builder.start()
    for builder in builders:
        builder.join()
    assert len(paths) == 2 and paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no partial file left behind
    built_at = paths[0].stat().st_mtime_ns
    assert cpu_paged_decode.build(compiler, tmp_path) == paths[0]
    assert paths[0].stat().st_mtime_ns == built_at
    loaded = cpu_paged_decode.load(paths[0])
    assert loaded.head_dims == {64, 128, 256}


def test_no_compiler_means_the_torch_path_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=cpu_paged_decode.__name__):
        assert cpu_paged_decode.paged_decode_kernel.__wrapped__() is None
    assert [r.getMessage() for r in caplog.records] == [
        "no C compiler (cc, or $CC): CPU decode attention uses the torch path"
    ]


def test_a_failing_build_means_the_torch_path_with_the_compiler_error(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    broken = tmp_path / "cpu_paged_decode.c"
    broken.write_text("int baton_paged_decode_f32(void) { return undefined_name; }\n")
    monkeypatch.setattr(cpu_paged_decode, "SOURCE", broken)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=cpu_paged_decode.__name__):
        assert cpu_paged_decode.paged_decode_kernel.__wrapped__() is None
    (record,) = caplog.records
    assert "building the CPU decode attention kernel failed" in record.getMessage()
    assert "undefined_name" in record.getMessage()
    assert list((tmp_path / "cache" / "baton" / "kernels").iterdir()) == []
