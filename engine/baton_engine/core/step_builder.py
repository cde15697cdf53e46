"""Turn the persistent batch's rows into one step's `SchedulerOutput` (vectorised numpy)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from baton_engine.core.batch import PersistentBatch
from baton_engine.core.scheduler_output import Int32Array, Int64Array, SamplingBatch, SchedulerOutput


def build_step(
    batch: PersistentBatch,
    *,
    step_id: int,
    num_decode: int,
    chunks: list[int],
    block_size: int,
    drafts: Mapping[int, Sequence[int]] | None,
    finished_req_ids: list[int],
) -> SchedulerOutput:
    """The `SchedulerOutput` for rows ``[0, num_decode + len(chunks))`` of the persistent batch:
    every decode row, then prefill chunks. `drafts` (by request id) fills the draft tokens the
    scheduler planned per decode row (``batch.num_drafts``); None when not speculating."""
    bs = block_size
    b = num_decode + len(chunks)
    query_lens = np.empty(b, dtype=np.int32)
    query_lens[:num_decode] = 1
    speculating = drafts is not None and bool(batch.num_drafts[:num_decode].any())
    num_drafts = np.zeros(b, dtype=np.int32)
    if speculating:
        num_drafts[:num_decode] = batch.num_drafts[:num_decode]
        query_lens[:num_decode] += num_drafts[:num_decode]
    query_lens[num_decode:] = chunks
    query_start_loc = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    computed = batch.num_computed[:b]
    num_computed = computed.astype(np.int32)
    seq_lens = num_computed + query_lens

    if b == num_decode and not speculating:
        positions: Int64Array = computed.copy()
        rows: Int64Array | np.ndarray = np.arange(b)
        input_ids: Int64Array = batch.last_token[:b].copy()
    else:
        rows = np.repeat(np.arange(b), query_lens)
        positions = (
            np.arange(num_tokens, dtype=np.int64)
            - np.repeat(query_start_loc[:-1].astype(np.int64), query_lens)
            + np.repeat(computed, query_lens)
        )
        input_ids = np.empty(num_tokens, dtype=np.int64)
        input_ids[query_start_loc[:num_decode]] = batch.last_token[:num_decode]
        if drafts is not None and speculating:
            req_ids = batch.req_ids
            for row in np.flatnonzero(num_drafts).tolist():
                start = int(query_start_loc[row]) + 1
                k = int(num_drafts[row])
                input_ids[start : start + k] = drafts[req_ids[row]][:k]
        for i, chunk in enumerate(chunks):
            row = num_decode + i
            start_tok = int(computed[row])
            start = int(query_start_loc[row])
            input_ids[start : start + chunk] = batch.token_lists[row][start_tok : start_tok + chunk]
    block_ids = batch.block_table[rows, positions // bs]
    slot_mapping = block_ids.astype(np.int64) * bs + positions % bs

    # Rows that sample: all decode rows, plus prefill chunks reaching the last known token
    # (a prefix of the prefill rows: only the last scheduled chunk can stop short).
    num_sample = num_decode
    for i, chunk in enumerate(chunks):
        row = num_decode + i
        if computed[row] + chunk == batch.num_tokens[row]:
            num_sample += 1
        else:
            break
    sample_rows: Int32Array = np.arange(num_sample, dtype=np.int32)
    if speculating:
        counts = np.ones(num_sample, dtype=np.int64)
        counts[:num_decode] += num_drafts[:num_decode]
        ends = query_start_loc[1 : num_sample + 1].astype(np.int64)
        firsts = np.repeat(ends - counts, counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        logits_indices: Int64Array = firsts + offsets
    else:
        logits_indices = query_start_loc[1 : num_sample + 1].astype(np.int64) - 1

    temperature = batch.temperature[:b].copy()
    sampling = SamplingBatch(
        temperature=temperature,
        top_p=batch.top_p[:b].copy(),
        top_k=batch.top_k[:b].copy(),
        seeds=batch.seed[:b].copy(),
        output_positions=(batch.num_tokens[:b] - batch.prompt_len[:b]).astype(np.int32),
        num_logprobs=batch.num_logprobs[:b].copy(),
        all_greedy=not bool(temperature.any()),
    )
    return SchedulerOutput(
        step_id=step_id,
        req_ids=batch.req_ids[:b],
        num_decode_rows=num_decode,
        query_lens=query_lens,
        query_start_loc=query_start_loc,
        num_computed_tokens=num_computed,
        seq_lens=seq_lens,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=batch.block_table[:b],
        logits_indices=logits_indices,
        sample_rows=sample_rows,
        num_draft_tokens=num_drafts,
        sampling=sampling,
        num_prefill_tokens=num_tokens - int(query_lens[:num_decode].sum()),
        num_decode_tokens=int(query_lens[:num_decode].sum()),
        finished_req_ids=finished_req_ids,
    )
