"""`bench.limits`: the physical limits bench.gpu reports its figures against, on round numbers."""

from __future__ import annotations

import pytest

from bench.limits import Ceilings, DecoderCost, prefill_limit_s, run_limit_s, step_limit_s

# 1 GB/s and 1 GFLOP/s: a limit in seconds reads as GB or GFLOP.
UNIT = Ceilings(copy_bytes_per_s=1e9, matmul_flops_per_s=1e9)


def test_cost_of_a_shape() -> None:
    cost = DecoderCost.of(
        weight_bytes=2_000, element_bytes=2, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8
    )
    assert cost.flops_per_token == 2_000.0  # 1000 weight elements, 2 FLOPs each
    assert cost.kv_bytes_per_token == 2 * 3 * 2 * 8 * 2  # K and V, layers, kv heads, dims, bytes
    assert cost.attention_flops_per_context_token == 4.0 * 3 * 4 * 8


COST = DecoderCost(
    weight_bytes=10**9, flops_per_token=1e6, kv_bytes_per_token=10**3, attention_flops_per_context_token=10.0
)


def test_a_decode_step_is_bound_by_its_bytes_until_the_batch_is_large() -> None:
    # Batch 1 at 1000 positions: 1 GB of weights + 1 MB of K/V; 1e6 + 1e4 FLOPs.
    assert step_limit_s(COST, UNIT, [1000]) == pytest.approx(1.001)
    # 3000 rows at 1 position: 1.003 GB read, but 3e9 + 3e4 FLOPs.
    assert step_limit_s(COST, UNIT, [1] * 3000) == pytest.approx(3.00003)


def test_prefill_counts_causal_attention_and_the_kv_it_writes() -> None:
    # 2 prompts of 1000: 2e9 FLOPs of products, (500500 * 2) * 10 of attention; 1 GB + 2 MB moved.
    assert prefill_limit_s(COST, UNIT, [1000, 1000]) == pytest.approx(2.01001)
    assert prefill_limit_s(COST, Ceilings(1e9, 1e15), [1000, 1000]) == pytest.approx(1.002)


def test_a_run_sums_prefill_and_one_step_per_later_token() -> None:
    fast_flops = Ceilings(copy_bytes_per_s=1e9, matmul_flops_per_s=1e15)
    prefill = prefill_limit_s(COST, fast_flops, [10, 20])
    # Outputs of 3 and 1 tokens: steps 1 and 2 decode the first request only (contexts 11, 12).
    assert prefill == pytest.approx(1.00003)
    expected = prefill + (1e9 + 11e3) / 1e9 + (1e9 + 12e3) / 1e9
    assert run_limit_s(COST, fast_flops, [10, 20], [3, 1]) == pytest.approx(expected)
    assert run_limit_s(COST, fast_flops, [10, 20], [1, 1]) == pytest.approx(prefill)
