"""The persistent batch: one row per running sequence, kept in numpy arrays across steps.

Rows ``[0, num_decode)`` are decoding sequences, rows ``[num_decode, num_rows)`` are sequences
still prefilling, in admission order. Arrays are updated incrementally — a block id written
when a sequence crosses a block boundary, a row removed by moving the last row of its region
into the hole — so a step's inputs are numpy slices of these arrays, never rebuilt per step.
"""

from __future__ import annotations

import numpy as np

from baton_engine.core.request import Request
from baton_engine.core.scheduler_output import Float32Array, Int32Array, Int64Array


class BatchState:
    def __init__(self, max_rows: int, max_blocks_per_seq: int) -> None:
        self.max_rows = max_rows
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_table: Int32Array = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
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
        self.seqs: list[Request] = []
        self.seq_ids: list[int] = []
        self.token_lists: list[list[int]] = []
        """``seqs[i].token_ids`` (the same list objects), for appends without attribute lookups."""
        self.num_decode = 0

    @property
    def num_rows(self) -> int:
        return len(self.seqs)

    def add_row(self, seq: Request, eos_token_id: int | None, max_model_len: int) -> int:
        """Append `seq` as the last prefill row; copies its state into the arrays."""
        row = len(self.seqs)
        if row >= self.max_rows:
            raise RuntimeError("persistent batch is full")
        if len(seq.block_table) > self.max_blocks_per_seq:
            raise ValueError(f"sequence {seq.seq_id} has more blocks than max_blocks_per_seq")
        params = seq.sampling_params
        blocks = seq.block_table
        self.block_table[row, : len(blocks)] = blocks
        self.block_table[row, len(blocks) :] = 0
        self.num_blocks[row] = len(blocks)
        self.num_computed[row] = seq.num_computed_tokens
        self.num_tokens[row] = seq.num_tokens
        self.last_token[row] = seq.token_ids[-1]
        self.prompt_len[row] = seq.num_prompt_tokens
        self.stop_len[row] = min(seq.num_prompt_tokens + params.max_tokens, max_model_len)
        self.eos[row] = -1 if (params.ignore_eos or eos_token_id is None) else eos_token_id
        self.has_stop_ids[row] = bool(params.stop_token_ids)
        self.has_grammar[row] = params.grammar is not None
        self.num_drafts[row] = 0
        self.temperature[row] = params.temperature
        self.top_p[row] = params.top_p
        self.top_k[row] = params.top_k
        self.seed[row] = -1 if params.seed is None else params.seed
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.last_token_time[row] = -1.0 if seq.last_token_time is None else seq.last_token_time
        self.seqs.append(seq)
        self.seq_ids.append(seq.seq_id)
        self.token_lists.append(seq.token_ids)
        seq._batch = self
        seq._row = row
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def truncate_blocks(self, row: int, num_blocks: int) -> None:
        self.block_table[row, num_blocks:] = 0
        self.num_blocks[row] = num_blocks

    def _move(self, src: int, dst: int) -> None:
        for column in self._columns:
            column[dst] = column[src]
        seq = self.seqs[src]
        self.seqs[dst] = seq
        self.seq_ids[dst] = self.seq_ids[src]
        self.token_lists[dst] = self.token_lists[src]
        seq._row = dst

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        pair = [a, b]
        for column in self._columns:
            column[pair] = column[[b, a]]
        seqs, ids, lists = self.seqs, self.seq_ids, self.token_lists
        seqs[a], seqs[b] = seqs[b], seqs[a]
        ids[a], ids[b] = ids[b], ids[a]
        lists[a], lists[b] = lists[b], lists[a]
        seqs[a]._row = a
        seqs[b]._row = b

    def promote_to_decode(self, seq: Request) -> None:
        """Move a prefill row that just finished its prompt into the decode region."""
        row = seq._row
        if row < self.num_decode:
            raise ValueError(f"sequence {seq.seq_id} is already decoding")
        self._swap(row, self.num_decode)
        self.num_decode += 1

    def _close_gap(self, row: int) -> None:
        """Remove row `row` by shifting the rows after it up by one (keeps their order)."""
        last = len(self.seqs) - 1
        if row < last:
            for column in self._columns:
                column[row:last] = column[row + 1 : last + 1]
        del self.seqs[row]
        del self.seq_ids[row]
        del self.token_lists[row]
        for i in range(row, last):
            self.seqs[i]._row = i

    def release_row(self, seq: Request) -> None:
        """Remove `seq`'s row (copying its counters back to it), keeping both regions dense.

        A decode row is refilled with the last decode row (decode order is irrelevant); the
        prefill rows keep their admission order (chunked prefill serves them first come, first
        served).
        """
        row = seq._row
        if seq._batch is not self or self.seqs[row] is not seq:
            raise ValueError(f"sequence {seq.seq_id} has no row in this batch")
        seq._batch = None
        seq._row = -1
        seq._num_computed_tokens = int(self.num_computed[row])
        stamp = float(self.last_token_time[row])
        seq._last_token_time = None if stamp < 0 else stamp
        if row < self.num_decode:
            last_decode = self.num_decode - 1
            if row != last_decode:
                self._move(last_decode, row)
            self.num_decode -= 1
            row = last_decode
        self._close_gap(row)
