"""Hand-built verify steps (decode rows carrying drafts) for the verify-path tests."""

from __future__ import annotations

import numpy as np

from baton_engine.core.scheduler_output import SamplingBatch, SchedulerOutput


def verify_step(
    seq_lens: list[int], drafts: list[int], tables: list[list[int]], block_size: int
) -> SchedulerOutput:
    """Decode rows; row i feeds 1 + drafts[i] tokens ending at seq_lens[i] (ids = 100 * row + j)."""
    rows = len(seq_lens)
    query_lens = np.asarray(drafts, dtype=np.int32) + 1
    lens = np.asarray(seq_lens, dtype=np.int32)
    table = np.asarray(tables, dtype=np.int32)
    row_of = np.repeat(np.arange(rows), query_lens)
    starts = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    offset = np.arange(int(query_lens.sum())) - starts[row_of]
    pos = (lens - query_lens)[row_of].astype(np.int64) + offset
    return SchedulerOutput(
        step_id=0,
        req_ids=list(range(rows)),
        num_decode_rows=rows,
        query_lens=query_lens,
        query_start_loc=starts,
        num_computed_tokens=lens - query_lens,
        seq_lens=lens,
        input_ids=(100 * row_of + offset).astype(np.int64),
        positions=pos,
        slot_mapping=table[row_of, pos // block_size].astype(np.int64) * block_size + pos % block_size,
        block_tables=table,
        logits_indices=np.arange(int(query_lens.sum()), dtype=np.int64),
        sample_rows=np.arange(rows, dtype=np.int32),
        num_draft_tokens=np.asarray(drafts, dtype=np.int32),
        sampling=SamplingBatch(
            temperature=np.zeros(rows, np.float32),
            top_p=np.ones(rows, np.float32),
            top_k=np.full(rows, -1, np.int32),
            seeds=np.full(rows, -1, np.int64),
            output_positions=np.zeros(rows, np.int32),
            num_logprobs=np.full(rows, -1, np.int32),
            all_greedy=True,
        ),
    )
