"""The benchmark's GPU half on CPU with a tiny shape: verify-step timing runs through the real
scheduler and runner, and the projection arithmetic is exact."""

from __future__ import annotations

import pytest

from bench.speculative import TINY_SHAPE, Trace, project, verify_step_costs


def test_verify_step_costs_run_through_the_engine() -> None:
    costs = verify_step_costs(
        TINY_SHAPE, "cpu", batch_size=2, context_len=20, ks=[0, 1, 3], repeats=1, dtype_name="float32"
    )
    assert sorted(costs) == [0, 1, 3]
    assert all(cost > 0 for cost in costs.values())


def test_projection_from_an_acceptance_trace() -> None:
    # 10 decode row-steps: 2 without drafts, 8 verify rows that accepted 0, 1, 2 or 4 drafts.
    trace = Trace(drafts=[4] * 8, accepted=[0, 0, 1, 1, 2, 2, 4, 4], decode_row_steps=10, forwards=5)
    costs = {0: 10.0, 1: 11.0, 2: 12.0, 4: 16.0, 8: 30.0}
    projection = project(trace, costs, k_measured=4)
    # K=1: 2 + (1+0)*2 + (1+1)*6 = 16 tokens over 10 row-steps.
    assert projection["projection_by_k"]["1"] == {
        "tokens_per_row_step": 1.6,
        "verify_ms": 11.0,
        "speedup": 1.455,
    }
    # K=2: 2 + 2 + 4 + 3*4 = 20 -> 2.0 tokens, x 10/12.
    assert projection["projection_by_k"]["2"]["speedup"] == pytest.approx(1.667, abs=1e-3)
    # K=4: 2 + 2 + 4 + 6 + 10 = 24 -> 2.4 tokens, x 10/16 = 1.5; K=8 exceeds the traced K.
    assert projection["projection_by_k"]["4"]["speedup"] == 1.5
    assert "8" not in projection["projection_by_k"]
    assert projection["best_k_gpu"] == 2 and projection["speedup_gpu_projected"] == 1.667
