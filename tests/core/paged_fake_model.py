"""A stand-in model for scheduler tests that really goes through the paged KV cache.

Each step it writes every query token's (token id, position) into a fake KV store at
`slot_mapping`, then computes each next token from what it reads back through `block_tables`
and `seq_lens` only. A wrong block reuse, a missed write or a stale prefix hit therefore changes
the generated tokens, and the test compares them with `reference_next_token`, which computes the
same function straight from the token list.
"""

from __future__ import annotations

import zlib

import numpy as np

from baton_engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


def next_token_from(tokens: np.ndarray, positions: np.ndarray, vocab_size: int) -> int:
    digest = zlib.crc32(tokens.astype(np.int64).tobytes() + positions.astype(np.int64).tobytes())
    return digest % vocab_size


def reference_next_token(token_ids: list[int], vocab_size: int) -> int:
    tokens = np.asarray(token_ids, dtype=np.int64)
    return next_token_from(tokens, np.arange(len(tokens), dtype=np.int64), vocab_size)


class PagedFakeModel:
    def __init__(self, num_blocks: int, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.kv_tokens = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.kv_positions = np.full(num_blocks * block_size, -1, dtype=np.int64)

    def _read_context(self, out: SchedulerOutput, row: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        positions = np.arange(length, dtype=np.int64)
        blocks = out.block_tables[row, positions // self.block_size].astype(np.int64)
        slots = blocks * self.block_size + positions % self.block_size
        return self.kv_tokens[slots], self.kv_positions[slots]

    def run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.kv_tokens[out.slot_mapping] = out.input_ids
        self.kv_positions[out.slot_mapping] = out.positions
        sampled: list[list[int]] = []
        for row in out.sample_rows.tolist():
            seq_len = int(out.seq_lens[row])
            drafts = int(out.num_draft_tokens[row])
            start = int(out.query_start_loc[row])
            draft_tokens = out.input_ids[start + 1 : start + 1 + drafts].tolist()
            accepted: list[int] = []
            # Query position j predicts the token after context length seq_len - drafts + j.
            for j in range(drafts + 1):
                tokens, positions = self._read_context(out, row, seq_len - drafts + j)
                target = next_token_from(tokens, positions, self.vocab_size)
                accepted.append(target)
                if j == drafts or draft_tokens[j] != target:
                    break
            sampled.append(accepted)
        return ModelRunnerOutput(step_id=out.step_id, sampled_token_ids=sampled)
