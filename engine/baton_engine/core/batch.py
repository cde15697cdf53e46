"""The persistent batch: one row per running request, kept in numpy arrays across steps.

Rows ``[0, num_decode)`` are decoding requests, rows ``[num_decode, num_rows)`` are requests
still prefilling, in admission order. Arrays are updated incrementally — a block id written
when a request crosses a block boundary, a row removed by moving the last row of its region
into the hole — so a step's inputs are numpy slices of these arrays, never rebuilt per step.

The batch owns its rows: the request-id -> row map, the only block table (what the runner
reads; the block ids themselves come from the KV-cache manager), and while a request has a row,
its `num_computed_tokens` and `last_token_time` counters (written back by the scheduler from
`release_row`'s result). It never writes a `Request`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from baton_engine.core.request import Request
from baton_engine.core.scheduler_output import Float32Array, Int32Array, Int64Array


@dataclass(frozen=True)
class ReleasedRow:
    """The counters a row held for its request, handed back when the row goes."""

    num_computed_tokens: int
    last_token_time: float | None
    """None when no output token was appended yet."""


class PersistentBatch:
    def __init__(self, max_rows: int, max_blocks_per_request: int) -> None:
        self.max_rows = max_rows
        self.max_blocks_per_request = max_blocks_per_request
        self.block_table: Int32Array = np.zeros((max_rows, max_blocks_per_request), dtype=np.int32)
        self.num_blocks: Int64Array = np.zeros(max_rows, dtype=np.int64)
        self.num_computed: Int64Array = np.zeros(max_rows, dtype=np.int64)
        self.num_tokens: Int64Array = np.zeros(max_rows, dtype=np.int64)
        self.last_token: Int64Array = np.zeros(max_rows, dtype=np.int64)
        self.prompt_len: Int64Array = np.zeros(max_rows, dtype=np.int64)
        self.stop_len: Int64Array = np.zeros(max_rows, dtype=np.int64)
        """A row finishes (length) once ``num_tokens >= stop_len``."""
        self.eos: Int64Array = np.full(max_rows, -1, dtype=np.int64)
        """EOS id the row stops on; -1 when it ignores EOS (token ids are never negative)."""
        self.has_stop_ids = np.zeros(max_rows, dtype=np.bool_)
        self.has_grammar = np.zeros(max_rows, dtype=np.bool_)
        """The row's request follows a grammar (structured output)."""
        self.num_drafts: Int64Array = np.zeros(max_rows, dtype=np.int64)
        """Draft tokens the scheduler planned for the row this step (0 when not speculating)."""
        self.temperature: Float32Array = np.zeros(max_rows, dtype=np.float32)
        self.top_p: Float32Array = np.ones(max_rows, dtype=np.float32)
        self.top_k: Int32Array = np.full(max_rows, -1, dtype=np.int32)
        self.seed: Int64Array = np.full(max_rows, -1, dtype=np.int64)
        self.num_logprobs: Int32Array = np.full(max_rows, -1, dtype=np.int32)
        self.last_token_time = np.full(max_rows, -1.0, dtype=np.float64)
        self._columns = (
            self.block_table,
            self.num_blocks,
            self.num_computed,
            self.num_tokens,
            self.last_token,
            self.prompt_len,
            self.stop_len,
            self.eos,
            self.has_stop_ids,
            self.has_grammar,
            self.num_drafts,
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.num_logprobs,
            self.last_token_time,
        )
        self.requests: list[Request] = []
        """Row -> its request."""
        self.req_ids: list[int] = []
        """Row -> its request's id (a step's `SchedulerOutput.req_ids` is a slice of it)."""
        self.token_lists: list[list[int]] = []
        """``requests[i].token_ids`` (the same list objects), for appends without attribute
        lookups."""
        self._rows: dict[int, int] = {}
        self.num_decode = 0

    @property
    def num_rows(self) -> int:
        return len(self.requests)

    def row_of(self, req_id: int) -> int:
        """The row of request `req_id` (KeyError when it has none)."""
        return self._rows[req_id]

    def has_row(self, req_id: int) -> bool:
        return req_id in self._rows

    def add_row(
        self, request: Request, block_ids: Sequence[int], eos_token_id: int | None, max_model_len: int
    ) -> int:
        """Append `request` as the last prefill row, its KV in `block_ids` (in table order)."""
        if request.req_id in self._rows:
            raise ValueError(f"request {request.req_id} already has row {self._rows[request.req_id]}")
        row = len(self.requests)
        if row >= self.max_rows:
            raise RuntimeError("persistent batch is full")
        if len(block_ids) > self.max_blocks_per_request:
            raise ValueError(f"request {request.req_id} has more blocks than max_blocks_per_request")
        params = request.sampling_params
        self.block_table[row, : len(block_ids)] = block_ids
        self.block_table[row, len(block_ids) :] = 0
        self.num_blocks[row] = len(block_ids)
        self.num_computed[row] = request.num_computed_tokens
        self.num_tokens[row] = request.num_tokens
        self.last_token[row] = request.token_ids[-1]
        self.prompt_len[row] = request.num_prompt_tokens
        self.stop_len[row] = min(request.num_prompt_tokens + params.max_tokens, max_model_len)
        self.eos[row] = -1 if (params.ignore_eos or eos_token_id is None) else eos_token_id
        self.has_stop_ids[row] = bool(params.stop_token_ids)
        self.has_grammar[row] = params.grammar is not None
        self.num_drafts[row] = 0
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.seed[row] = -1 if params.seed is None else params.seed
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        stamp = request.last_token_time
        self.last_token_time[row] = -1.0 if stamp is None else stamp
        self.requests.append(request)
        self.req_ids.append(request.req_id)
        self.token_lists.append(request.token_ids)
        self._rows[request.req_id] = row
        return row

    def append_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def append_block_per_row(self, rows: Int64Array, block_ids: Sequence[int]) -> None:
        """One block id appended to each of `rows` (vectorised: the decode path's common case)."""
        self.block_table[rows, self.num_blocks[rows]] = block_ids
        self.num_blocks[rows] += 1

    def truncate_blocks(self, row: int, num_blocks: int) -> None:
        self.block_table[row, num_blocks:] = 0
        self.num_blocks[row] = num_blocks

    def _move(self, src: int, dst: int) -> None:
        for column in self._columns:
            column[dst] = column[src]
        self.requests[dst] = self.requests[src]
        self.req_ids[dst] = req_id = self.req_ids[src]
        self.token_lists[dst] = self.token_lists[src]
        self._rows[req_id] = dst

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        pair = [a, b]
        for column in self._columns:
            column[pair] = column[[b, a]]
        requests, ids, lists = self.requests, self.req_ids, self.token_lists
        requests[a], requests[b] = requests[b], requests[a]
        ids[a], ids[b] = ids[b], ids[a]
        lists[a], lists[b] = lists[b], lists[a]
        self._rows[ids[a]] = a
        self._rows[ids[b]] = b

    def promote_to_decode(self, req_id: int) -> None:
        """Move a prefill row that just finished its prompt into the decode region."""
        row = self._rows[req_id]
        if row < self.num_decode:
            raise ValueError(f"request {req_id} is already decoding")
        self._swap(row, self.num_decode)
        self.num_decode += 1

    def _close_gap(self, row: int) -> None:
        """Remove row `row` by shifting the rows after it up by one (keeps their order)."""
        last = len(self.requests) - 1
        if row < last:
            for column in self._columns:
                column[row:last] = column[row + 1 : last + 1]
        del self.requests[row]
        del self.req_ids[row]
        del self.token_lists[row]
        rows = self._rows
        for i in range(row, last):
            rows[self.req_ids[i]] = i

    def release_row(self, req_id: int) -> ReleasedRow:
        """Remove request `req_id`'s row, keeping both regions dense; returns its counters.

        A decode row is refilled with the last decode row (decode order is irrelevant); the
        prefill rows keep their admission order (chunked prefill serves them first come, first
        served).
        """
        row = self._rows.pop(req_id, None)
        if row is None:
            raise ValueError(f"request {req_id} has no row in this batch")
        stamp = float(self.last_token_time[row])
        released = ReleasedRow(int(self.num_computed[row]), None if stamp < 0 else stamp)
        if row < self.num_decode:
            last_decode = self.num_decode - 1
            if row != last_decode:
                self._move(last_decode, row)
            self.num_decode -= 1
            row = last_decode
        self._close_gap(row)
        return released
