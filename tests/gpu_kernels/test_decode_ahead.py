"""Decode-ahead prediction and matching (pure numpy; the GPU half is in tests/gpu)."""

from __future__ import annotations

import dataclasses

import numpy as np

from baton_engine.core.scheduler_output import SchedulerOutput
from baton_engine.worker.gpu.decode_ahead import match_rows, plan_next_decode
from tests.gpu_kernels.verify_steps import verify_step

BS = 4


def _decode_step(
    req_ids: list[int], inputs: list[int], seq_lens: list[int], tables: list[list[int]]
) -> SchedulerOutput:
    """A plain decode step: a verify step without drafts, with these sequences and input ids."""
    step = verify_step(seq_lens, [0] * len(req_ids), tables, BS)
    return dataclasses.replace(step, req_ids=req_ids, input_ids=np.asarray(inputs, dtype=np.int64))


TABLES = [[7, 2, 0], [3, 9, 5], [4, 0, 0]]


def test_prediction_is_the_next_scheduled_step() -> None:
    step = _decode_step([10, 11, 12], [1, 2, 3], [6, 10, 2], TABLES)
    plan = plan_next_decode(step, BS, max_model_len=64)
    assert plan is not None
    following = _decode_step([10, 11, 12], [40, 41, 42], [7, 11, 3], TABLES)
    assert plan.input_ids.tolist() == [-1, -1, -1]
    assert match_rows(plan, following, BS) is None  # the sampled tokens are not known yet
    plan.input_ids[:] = [40, 41, 42]
    assert plan.positions.tolist() == [6, 10, 2]
    assert plan.slots.tolist() == [2 * BS + 2, 5 * BS + 2, 4 * BS + 2]
    assert plan.seq_lens.tolist() == [7, 11, 3]
    assert match_rows(plan, following, BS).tolist() == [0, 1, 2]
    # Row 11 finished and the others were reordered: still the predicted computation.
    subset = _decode_step([12, 10], [42, 40], [3, 7], [TABLES[2], TABLES[0]])
    assert match_rows(plan, subset, BS).tolist() == [2, 0]


def test_any_difference_rejects_the_prediction() -> None:
    step = _decode_step([10, 11], [1, 2], [6, 10], TABLES[:2])
    plan = plan_next_decode(step, BS, max_model_len=64)
    assert plan is not None
    plan.input_ids[:] = [40, 41]
    assert match_rows(plan, _decode_step([10, 11], [40, 99], [7, 11], TABLES[:2]), BS) is None
    assert match_rows(plan, _decode_step([10, 13], [40, 41], [7, 11], TABLES[:2]), BS) is None
    assert match_rows(plan, _decode_step([10, 11], [40, 41], [7, 11], [[7, 8, 0], TABLES[1]]), BS) is None


def test_no_prediction_at_a_block_boundary_or_the_length_limit() -> None:
    boundary = _decode_step([10, 11], [1, 2], [6, 8], TABLES[:2])  # row 11's next token opens block 2
    assert plan_next_decode(boundary, BS, max_model_len=64) is None
    at_limit = _decode_step([10], [1], [7], TABLES[:1])
    assert plan_next_decode(at_limit, BS, max_model_len=7) is None


def test_a_row_the_plan_lacks_or_a_repeated_row_is_not_the_prediction() -> None:
    step = _decode_step([10, 11], [1, 2], [6, 10], TABLES[:2])
    plan = plan_next_decode(step, BS, max_model_len=64)
    assert plan is not None
    plan.input_ids[:] = [40, 41]
    assert match_rows(plan, _decode_step([10, 11], [40, 41], [7, 11], TABLES[:2]), BS).tolist() == [0, 1]
    joined = _decode_step([10, 11, 12], [40, 41, 42], [7, 11, 3], TABLES)
    assert match_rows(plan, joined, BS) is None
    repeated = _decode_step([10, 10], [40, 40], [7, 7], [TABLES[0], TABLES[0]])
    assert match_rows(plan, repeated, BS) is None
