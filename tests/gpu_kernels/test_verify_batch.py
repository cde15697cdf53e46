"""Verify-step layout for captured graphs (pure numpy; the GPU half is in tests/gpu)."""

from __future__ import annotations

import pytest

from baton_engine.core.scheduler_output import SchedulerOutput
from baton_engine.worker.gpu.verify_batch import is_verify_step, plan_verify, smallest_fit, verify_query_lens
from tests.gpu_kernels.verify_steps import verify_step

BS = 4


def _verify_step(seq_lens: list[int], drafts: list[int], tables: list[list[int]]) -> SchedulerOutput:
    return verify_step(seq_lens, drafts, tables, BS)


def test_query_lens_double_then_end_at_k_plus_one() -> None:
    assert verify_query_lens(0) == ()
    assert verify_query_lens(1) == (2,)
    assert verify_query_lens(4) == (2, 3, 5)
    assert verify_query_lens(6) == (2, 3, 5, 7)
    assert verify_query_lens(8) == (2, 3, 5, 9)
    assert verify_query_lens(16) == (2, 3, 5, 9, 17)
    assert smallest_fit((2, 3, 5, 9), 4) == 5
    assert smallest_fit((2, 3, 5, 9), 10) is None


def test_rows_are_padded_to_the_window_and_the_batch() -> None:
    # Row 0: 2 drafts ending at 7; row 1: a plain decode row at 5; row 2: 3 drafts ending at 12.
    step = _verify_step([7, 5, 12], [2, 0, 3], [[7, 2, 0], [3, 9, 0], [4, 1, 6]])
    assert is_verify_step(step)
    inputs = plan_verify(step, query_len=5, batch=4, max_blocks=3)
    assert (inputs.batch, inputs.query_len, inputs.num_rows) == (4, 5, 3)
    assert inputs.input_ids.tolist() == [
        0, 1, 2, 0, 0,
        100, 0, 0, 0, 0,
        200, 201, 202, 203, 0,
        0, 0, 0, 0, 0,
    ]  # fmt: skip
    assert inputs.positions.tolist() == [
        4, 5, 6, 0, 0,
        4, 0, 0, 0, 0,
        8, 9, 10, 11, 0,
        0, 0, 0, 0, 0,
    ]  # fmt: skip
    assert inputs.slots.tolist() == [
        8, 9, 10, -1, -1,
        36, -1, -1, -1, -1,
        24, 25, 26, 27, -1,
        -1, -1, -1, -1, -1,
    ]  # fmt: skip
    assert inputs.seq_lens.tolist() == [7, 5, 12, 0]
    assert inputs.query_lens.tolist() == [3, 1, 4, 0]
    assert inputs.block_tables.tolist() == [[7, 2, 0], [3, 9, 0], [4, 1, 6]]
    # Logits come back in the packed order: row 0's 3 positions, row 1's, row 2's 4.
    assert inputs.logits_index.tolist() == [0, 1, 2, 5, 10, 11, 12, 13]


def test_steps_that_do_not_fit_are_refused() -> None:
    step = _verify_step([7, 12], [2, 3], [[7, 2, 0], [4, 1, 6]])
    with pytest.raises(ValueError, match="2 rows with up to 4 tokens does not fit batch=2, query_len=3"):
        plan_verify(step, query_len=3, batch=2, max_blocks=3)
    with pytest.raises(ValueError, match="2 rows with up to 4 tokens does not fit batch=1, query_len=5"):
        plan_verify(step, query_len=5, batch=1, max_blocks=3)
    plain = _verify_step([7, 12], [0, 0], [[7, 2, 0], [4, 1, 6]])
    assert not is_verify_step(plain)
    with pytest.raises(ValueError, match="decode rows only, with drafts"):
        plan_verify(plain, query_len=2, batch=2, max_blocks=3)
