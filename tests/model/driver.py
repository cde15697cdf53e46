"""A TEST-ONLY stand-in for the scheduler: runs prompts through a `ModelRunner` step by step.

It allocates blocks contiguously (never freeing them), reuses full prompt blocks of earlier
sequences (a dictionary keyed by the token prefix), chunks prefills under a token budget and
puts decode rows before prefill chunks, exactly as `SchedulerOutput` prescribes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from baton_engine.core.scheduler_output import SamplingBatch, SchedulerOutput
from baton_engine.worker.model_runner import ModelRunner
from baton_support.model_logits import prefill_logits

__all__ = ["TestDriver", "prefill_logits"]


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = -1
    num_logprobs: int = -1


@dataclass
class _Seq:
    req_id: int
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling
    tokens: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def outputs(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_new_tokens

    @property
    def in_decode(self) -> bool:
        return self.num_computed >= len(self.prompt)


@dataclass
class DriverStats:
    steps: int = 0
    prefix_hit_tokens: int = 0
    chunked_prefill_rows: int = 0
    mixed_steps: int = 0
    drafts_proposed: int = 0
    drafts_accepted: int = 0


class TestDriver:
    __test__ = False  # not a pytest class

    def __init__(
        self,
        runner: ModelRunner,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        drafter: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.drafter = drafter  # tokens so far -> draft tokens to verify in the next decode step
        self.runner = runner
        self.block_size = runner.block_size
        self.budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.next_block = 1  # block 0 stays unused: block tables pad with 0
        self.prefix_blocks: dict[tuple[int, ...], int] = {}
        self.stats = DriverStats()
        self.step_id = 0

    def generate(
        self, prompts: list[list[int]], max_new_tokens: list[int], sampling: list[Sampling] | None = None
    ) -> list[_Seq]:
        sampling = sampling or [Sampling() for _ in prompts]
        waiting = [
            _Seq(i, list(p), n, s, tokens=list(p))
            for i, (p, n, s) in enumerate(zip(prompts, max_new_tokens, sampling, strict=True))
        ]
        finished: list[_Seq] = []
        running: list[_Seq] = []
        while waiting or running:
            while waiting and len(running) < self.max_num_seqs:
                seq = waiting.pop(0)
                self._admit(seq)
                running.append(seq)
            self._step(running)
            for seq in [s for s in running if s.done]:
                running.remove(seq)
                finished.append(seq)
        return sorted(finished, key=lambda s: s.req_id)

    def _admit(self, seq: _Seq) -> None:
        bs = self.block_size
        # The last prompt token is always computed, so a hit covers at most len - 1 tokens.
        for index in range((len(seq.prompt) - 1) // bs):
            block = self.prefix_blocks.get(tuple(seq.prompt[: (index + 1) * bs]))
            if block is None:
                break
            seq.blocks.append(block)
        seq.num_computed = len(seq.blocks) * bs
        self.stats.prefix_hit_tokens += seq.num_computed

    def _slot(self, seq: _Seq, position: int) -> int:
        while len(seq.blocks) <= position // self.block_size:
            seq.blocks.append(self.next_block)
            self.next_block += 1
        if self.next_block > self.runner.num_blocks:
            raise RuntimeError("test driver ran out of KV blocks")
        return seq.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def _step(self, running: list[_Seq]) -> None:
        decodes = [s for s in running if s.in_decode]
        rows: list[tuple[_Seq, list[int], bool, int]] = []  # (seq, tokens fed, samples, drafts)
        for seq in decodes:
            drafts = self.drafter(seq.tokens) if self.drafter else []
            rows.append((seq, [seq.tokens[-1], *drafts], True, len(drafts)))
            self.stats.drafts_proposed += len(drafts)
        budget = self.budget - sum(len(fed) for _, fed, _, _ in rows)
        for seq in running:
            if seq.in_decode or budget <= 0:
                continue
            chunk = min(len(seq.prompt) - seq.num_computed, budget)
            budget -= chunk
            completes = seq.num_computed + chunk == len(seq.prompt)
            if not completes:
                self.stats.chunked_prefill_rows += 1
            rows.append((seq, seq.tokens[seq.num_computed : seq.num_computed + chunk], completes, 0))
        step = self._build(rows, len(decodes))
        out = self.runner.execute(step)
        self.stats.steps += 1
        if decodes and len(rows) > len(decodes):
            self.stats.mixed_steps += 1
        sampling_rows = [(seq, drafts) for seq, _, samples, drafts in rows if samples]
        sampled = out.tokens_per_row()
        assert len(sampled) == len(sampling_rows)
        decoding = {seq.req_id for seq in decodes}
        for seq, fed, _, _ in rows:
            if seq.req_id not in decoding:
                seq.num_computed += len(fed)
                self._publish_prompt_blocks(seq)
        for index, ((seq, drafts), tokens) in enumerate(zip(sampling_rows, sampled, strict=True)):
            assert 1 <= len(tokens) <= 1 + drafts
            if seq.req_id in decoding:
                # KV is valid for the fed token and the accepted drafts, not the rejected ones.
                seq.num_computed += len(tokens)
                self.stats.drafts_accepted += len(tokens) - 1
            tokens = tokens[: seq.max_new_tokens - len(seq.outputs)]
            seq.tokens.extend(tokens)
            if out.logprobs is not None:
                seq.logprobs.extend(out.logprobs[index][: len(tokens)])

    def _publish_prompt_blocks(self, seq: _Seq) -> None:
        bs = self.block_size
        full = min(seq.num_computed, len(seq.prompt)) // bs
        for index in range(full):
            self.prefix_blocks.setdefault(tuple(seq.prompt[: (index + 1) * bs]), seq.blocks[index])

    def _build(self, rows: list[tuple[_Seq, list[int], bool, int]], num_decode_rows: int) -> SchedulerOutput:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        computed: list[int] = []
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        for row, (seq, fed, samples, drafts) in enumerate(rows):
            start = seq.num_computed
            for offset, token in enumerate(fed):
                input_ids.append(token)
                positions.append(start + offset)
                slots.append(self._slot(seq, start + offset))
            query_lens.append(len(fed))
            computed.append(start)
            if samples:
                logits_indices.extend(range(len(input_ids) - 1 - drafts, len(input_ids)))
                sample_rows.append(row)
        width = max(len(seq.blocks) for seq, _, _, _ in rows)
        tables = np.zeros((len(rows), width), dtype=np.int32)
        for row, (seq, _, _, _) in enumerate(rows):
            tables[row, : len(seq.blocks)] = seq.blocks
        qlens = np.asarray(query_lens, dtype=np.int32)
        seqs = [seq for seq, _, _, _ in rows]
        samplers = [seq.sampling for seq in seqs]
        step = SchedulerOutput(
            step_id=self.step_id,
            req_ids=[seq.req_id for seq in seqs],
            num_decode_rows=num_decode_rows,
            query_lens=qlens,
            query_start_loc=np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32),
            num_computed_tokens=np.asarray(computed, dtype=np.int32),
            seq_lens=np.asarray(computed, dtype=np.int32) + qlens,
            input_ids=np.asarray(input_ids, dtype=np.int64),
            positions=np.asarray(positions, dtype=np.int64),
            slot_mapping=np.asarray(slots, dtype=np.int64),
            block_tables=tables,
            logits_indices=np.asarray(logits_indices, dtype=np.int64),
            sample_rows=np.asarray(sample_rows, dtype=np.int32),
            num_draft_tokens=np.asarray([drafts for _, _, _, drafts in rows], dtype=np.int32),
            sampling=SamplingBatch(
                temperature=np.asarray([s.temperature for s in samplers], dtype=np.float32),
                top_p=np.asarray([s.top_p for s in samplers], dtype=np.float32),
                top_k=np.asarray([s.top_k for s in samplers], dtype=np.int32),
                seeds=np.asarray([s.seed for s in samplers], dtype=np.int64),
                output_positions=np.asarray([len(seq.outputs) for seq in seqs], dtype=np.int32),
                num_logprobs=np.asarray([s.num_logprobs for s in samplers], dtype=np.int32),
                all_greedy=all(s.temperature == 0 for s in samplers),
            ),
            num_prefill_tokens=int(qlens[num_decode_rows:].sum()),
            num_decode_tokens=int(qlens[:num_decode_rows].sum()),
        )
        self.step_id += 1
        return step
