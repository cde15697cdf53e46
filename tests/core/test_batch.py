from __future__ import annotations

import numpy as np
import pytest

from baton_engine.core.batch import PersistentBatch, ReleasedRow
from baton_engine.core.request import Request
from baton_engine.core.sampling_params import SamplingParams


def rows(batch: PersistentBatch) -> list[int]:
    assert [r.req_id for r in batch.requests] == batch.req_ids
    assert all(batch.row_of(req_id) == row for row, req_id in enumerate(batch.req_ids))
    return batch.req_ids


def make_request(req_id: int) -> Request:
    return Request(req_id, [req_id] * 3, SamplingParams(max_tokens=5, seed=req_id))


def test_regions_stay_dense_and_prefill_order_is_kept() -> None:
    batch = PersistentBatch(max_rows=8, max_blocks_per_request=4)
    requests = [make_request(i) for i in range(6)]
    for request in requests:
        batch.add_row(
            request, [10 * request.req_id, 10 * request.req_id + 1], eos_token_id=0, max_model_len=100
        )
    for request in requests[:3]:
        batch.promote_to_decode(request.req_id)
    assert rows(batch) == [0, 1, 2, 3, 4, 5] and batch.num_decode == 3
    batch.num_computed[0] = 7
    batch.last_token_time[0] = 12.5

    # A decode row: refilled by the last decode row; its counters come back, the request is untouched.
    assert batch.release_row(0) == ReleasedRow(num_computed_tokens=7, last_token_time=12.5)
    assert requests[0].num_computed_tokens == 0 and not batch.has_row(0)
    assert rows(batch) == [2, 1, 3, 4, 5] and batch.num_decode == 2
    assert batch.block_table[:5, :2].tolist() == [[20, 21], [10, 11], [30, 31], [40, 41], [50, 51]]
    assert batch.seed[:5].tolist() == [2, 1, 3, 4, 5]

    # A prefill row: the later prefill rows move up, in order.
    assert batch.release_row(4) == ReleasedRow(num_computed_tokens=0, last_token_time=None)
    assert rows(batch) == [2, 1, 3, 5] and [batch.row_of(3), batch.row_of(5)] == [2, 3]

    batch.promote_to_decode(3)
    batch.append_blocks(batch.row_of(3), [33])
    assert batch.block_table[2].tolist() == [30, 31, 33, 0] and batch.num_blocks[2] == 3
    batch.truncate_blocks(2, 2)
    assert batch.block_table[2].tolist() == [30, 31, 0, 0]
    batch.append_block_per_row(np.array([0, 2]), [25, 36])
    assert batch.block_table[:3, :3].tolist() == [[20, 21, 25], [10, 11, 0], [30, 31, 36]]
    assert batch.num_blocks[:3].tolist() == [3, 2, 3]
    for req_id in (1, 2, 3, 5):
        batch.release_row(req_id)
    assert batch.num_rows == 0 and batch.num_decode == 0 and batch.req_ids == []


def test_row_errors_name_the_request() -> None:
    batch = PersistentBatch(max_rows=1, max_blocks_per_request=1)
    request = make_request(7)
    batch.add_row(request, [3], eos_token_id=None, max_model_len=10)
    with pytest.raises(ValueError, match="request 7 already has row 0"):
        batch.add_row(request, [3], eos_token_id=None, max_model_len=10)
    with pytest.raises(RuntimeError, match="persistent batch is full"):
        batch.add_row(make_request(8), [4], eos_token_id=None, max_model_len=10)
    with pytest.raises(ValueError, match="request 9 has no row in this batch"):
        batch.release_row(9)
    batch.promote_to_decode(7)
    with pytest.raises(ValueError, match="request 7 is already decoding"):
        batch.promote_to_decode(7)
