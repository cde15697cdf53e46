"""The contract between the scheduler and the model runner: one step's batch.

The scheduler fills a `SchedulerOutput` per step; the model runner turns it into device tensors,
runs one forward and samples; the scheduler's `postprocess` consumes the sampled tokens. Arrays
are numpy (the scheduler never imports torch). Row order is the persistent batch's order: rows
of running decode requests first, then prefill chunks (so a runner can treat the leading
`num_decode_rows` rows as single-token queries).

Vocabulary used below:

* ``T`` — total query tokens in the step (``sum(query_lens)``), at most `max_num_batched_tokens`.
* ``B`` — requests in the step (rows), at most `max_num_seqs`.
* A *slot* is ``block_id * block_size + offset``: the KV-cache position one token's K/V go to.
* A row *samples* when its query ends at the request's last known token: every decode row, and
  the prefill chunk that completes a prompt. A middle prefill chunk computes KV only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]
Float32Array = npt.NDArray[np.float32]
BoolArray = npt.NDArray[np.bool_]


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, aligned with `SchedulerOutput` rows (length ``B``)."""

    temperature: Float32Array
    """0.0 means greedy for that row."""
    top_p: Float32Array
    """In (0, 1]; 1.0 disables nucleus filtering."""
    top_k: Int32Array
    """-1 or 0 disables top-k."""
    seeds: Int64Array
    """Per-request seed, -1 when unseeded (then the engine's global generator is used)."""
    output_positions: Int32Array
    """Index in the request's *output* of the first token this row samples. A seeded row's random
    stream is keyed by (seed, output position), so preemption or a P/D hand-off never changes it."""
    num_logprobs: Int32Array
    """Top-n logprobs to return for each sampled token; -1 when not requested."""
    all_greedy: bool
    """True when every row is greedy (the runner may skip the sampling kernels)."""


@dataclass
class SchedulerOutput:
    """One engine step: what to run, where its KV goes, and how to sample it."""

    step_id: int
    """Monotonic step counter; the runner echoes it so deferred outputs match their step."""

    req_ids: list[int]
    """Row ``i`` belongs to request ``req_ids[i]`` (length ``B``)."""

    num_decode_rows: int
    """Rows ``[0, num_decode_rows)`` are decode rows (query length 1, or 1 + drafts when
    speculating); the rest are prefill chunks."""

    query_lens: Int32Array
    """Tokens each row feeds this step (length ``B``): 1 for decode, 1 + K with K drafts, or the
    prefill chunk's length."""

    query_start_loc: Int32Array
    """Exclusive prefix sum of `query_lens` (length ``B + 1``); row ``i``'s tokens are
    ``input_ids[query_start_loc[i]:query_start_loc[i+1]]``."""

    num_computed_tokens: Int32Array
    """Tokens of each row whose KV is already in the cache before this step (prefix-cache hits
    plus earlier chunks plus earlier decode steps; length ``B``)."""

    seq_lens: Int32Array
    """KV length of each row after this step: ``num_computed_tokens + query_lens`` (length ``B``).
    Attention for a row reads exactly the first ``seq_lens[i]`` cache positions."""

    input_ids: Int64Array
    """The query tokens of all rows, concatenated (length ``T``). Draft tokens of a speculating
    row follow its last real token."""

    positions: Int64Array
    """Absolute position of each query token in its request (length ``T``)."""

    slot_mapping: Int64Array
    """KV-cache slot each query token writes (length ``T``)."""

    block_tables: Int32Array
    """A ``[B, max_blocks_per_seq]`` view of the persistent batch's block table (rows beyond a
    request's blocks hold 0 and are never read because of `seq_lens`)."""

    logits_indices: Int64Array
    """Indices into the ``T`` query tokens whose hidden states become logits: the last token of
    every sampling row, or all 1 + K positions of a speculating row (in row order)."""

    sample_rows: Int32Array
    """Rows that sample this step, in order; `logits_indices` holds their positions."""

    num_draft_tokens: Int32Array
    """Draft tokens per row (length ``B``); 0 when the row is not speculating."""

    sampling: SamplingBatch
    """How each row samples (per-row parameters; ``all_greedy`` lets a runner skip sampling)."""

    num_prefill_tokens: int = 0
    """Tokens in prefill rows (for metrics and the mixed-batch invariant)."""

    num_decode_tokens: int = 0
    """Tokens in decode rows, drafts included."""

    grammar_bitmask: Int32Array | None = None
    """Structured output: ``[G, ceil(vocab / 32)]`` allowed-token bitmasks of the step's ``G``
    constrained logits rows (bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed); the
    runner sets every other token's logit to -inf before sampling. A verify row of K drafts
    has K + 1 rows here, one per position (the mask after the drafts before it). None when no
    row of the step follows a grammar."""

    grammar_rows: Int64Array | None = None
    """The logits row (an index into `logits_indices`) each `grammar_bitmask` row applies to,
    ascending (length ``G``)."""

    finished_req_ids: list[int] = field(default_factory=list)
    """Requests that finished or were aborted since the last step; a runner drops any per-row
    state it keeps for them (e.g. captured-graph slots, drafter state)."""

    decode_lookahead: bool = False
    """Every decode row already owns the KV slot of its next step's query token (the token it
    samples now; also a row that finishes now), in `block_tables`: a runner may launch the next
    decode step before it is scheduled even where a row's next token opens a new block."""

    @property
    def num_rows(self) -> int:
        return len(self.req_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1]) if len(self.query_start_loc) else 0


@dataclass
class ModelRunnerOutput:
    """What the runner returns for one `SchedulerOutput`; `Scheduler.postprocess` consumes it."""

    step_id: int
    """The `SchedulerOutput.step_id` this answers."""
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    """Steps where some row verified drafts: per sampling row (aligned with `sample_rows`), the
    tokens accepted, 1..K+1 (accepted drafts plus the bonus/corrected token). Empty when
    `sampled_token_array` carries the step's tokens."""
    logprobs: list[list[list[tuple[int, float]]]] | None = None
    """Per sampling row, per accepted token: the sampled token's logprob first, then the top-n
    ``(token id, logprob)`` pairs; None when no row asked for logprobs."""
    sampled_token_array: Int64Array | None = None
    """Steps without drafts: one sampled token per sampling row, as one array — what the runners
    return (they sample into an array; `Scheduler.postprocess` then reads the step's tokens
    without a per-row Python pass). When `sampled_token_ids` is given too, they must agree."""

    def tokens_per_row(self) -> list[list[int]]:
        """The step's tokens per sampling row, whichever form carries them."""
        if self.sampled_token_ids or self.sampled_token_array is None:
            return self.sampled_token_ids
        return [[t] for t in self.sampled_token_array.tolist()]
