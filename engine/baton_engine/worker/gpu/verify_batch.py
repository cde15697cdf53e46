"""Lay out a speculative verify step with a fixed query length per row, for captured graphs.

A verify step is a step of decode rows only, some carrying drafts (query length 1 + drafts).
The GPU runner captures graphs for a few query lengths Q (`verify_query_lens`); a step runs in
the graph of the smallest Q that holds its longest row and the smallest batch size that holds its
rows. Every row gets Q token slots: its real tokens first, then padding (token 0, position 0,
slot -1 so nothing is written to the cache, masked out of attention); padding rows have
seq_len 0 and query length 0. `logits_index` maps the step's `logits_indices` (into the packed
tokens) to the padded token order, so logits come out exactly as the packed forward's would.
Pure numpy: tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from baton_engine.core.scheduler_output import SchedulerOutput

Int64Array = npt.NDArray[np.int64]
Int32Array = npt.NDArray[np.int32]


def verify_query_lens(num_speculative_tokens: int) -> tuple[int, ...]:
    """Query lengths to capture verify graphs for: 2, 3, 5, 9, 17, ... up to K + 1, and K + 1.

    Each step pads to the next captured length, so a row computes at most about twice the
    tokens it needs (cheap: a small batch's step is bound by reading the weights)."""
    if num_speculative_tokens <= 0:
        return ()
    top = num_speculative_tokens + 1
    lens = {top}
    q = 2
    while q < top:
        lens.add(q)
        q = 2 * q - 1
    return tuple(sorted(lens))


def is_verify_step(step: SchedulerOutput) -> bool:
    """Decode rows only, at least one of them carrying drafts."""
    return step.num_rows > 0 and step.num_decode_rows == step.num_rows and step.num_tokens > step.num_rows


def smallest_fit(sizes: tuple[int, ...] | list[int], need: int) -> int | None:
    """The smallest of the ascending `sizes` that is >= `need`, or None."""
    for size in sizes:
        if size >= need:
            return size
    return None


@dataclass
class VerifyInputs:
    """One verify step laid out as `batch` rows of `query_len` tokens."""

    batch: int
    query_len: int
    num_rows: int
    input_ids: Int64Array  # [batch * query_len]
    positions: Int64Array
    slots: Int64Array
    seq_lens: Int32Array  # [batch]
    query_lens: Int32Array
    block_tables: Int32Array  # [num_rows, width] (rows past num_rows keep stale tables, never read)
    logits_index: Int64Array  # [len(step.logits_indices)] into the padded tokens


def plan_verify(step: SchedulerOutput, query_len: int, batch: int, max_blocks: int) -> VerifyInputs:
    """Pad `step` (a verify step) to `batch` rows of `query_len` tokens."""
    rows = step.num_rows
    query_lens = np.asarray(step.query_lens, dtype=np.int64)
    if not is_verify_step(step):
        raise ValueError("plan_verify needs a step of decode rows only, with drafts")
    if rows > batch or int(query_lens.max()) > query_len:
        raise ValueError(
            f"a verify step of {rows} rows with up to {int(query_lens.max())} tokens does not fit "
            f"batch={batch}, query_len={query_len}"
        )
    starts = np.asarray(step.query_start_loc, dtype=np.int64)[:rows]
    row_of_token = np.repeat(np.arange(rows, dtype=np.int64), query_lens)
    offset_in_row = np.arange(step.num_tokens, dtype=np.int64) - starts[row_of_token]
    padded = row_of_token * query_len + offset_in_row  # packed token -> padded slot

    size = batch * query_len
    input_ids = np.zeros(size, dtype=np.int64)
    positions = np.zeros(size, dtype=np.int64)
    slots = np.full(size, -1, dtype=np.int64)
    input_ids[padded] = step.input_ids
    positions[padded] = step.positions
    slots[padded] = step.slot_mapping
    seq_lens = np.zeros(batch, dtype=np.int32)
    seq_lens[:rows] = step.seq_lens
    lens = np.zeros(batch, dtype=np.int32)
    lens[:rows] = query_lens
    tables = np.asarray(step.block_tables, dtype=np.int32)[:, :max_blocks]
    return VerifyInputs(
        batch=batch,
        query_len=query_len,
        num_rows=rows,
        input_ids=input_ids,
        positions=positions,
        slots=slots,
        seq_lens=seq_lens,
        query_lens=lens,
        block_tables=tables,
        logits_index=padded[np.asarray(step.logits_indices, dtype=np.int64)],
    )
