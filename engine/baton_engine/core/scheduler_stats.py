"""What the scheduler reports for metrics: a `SchedulerStats` snapshot, built from the counters it
keeps (prefix-cache hits, speculative acceptance)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache at admission, and how many were hits."""

    num_requests: int = 0
    """Admissions looked up (a preempted request counts again when it comes back)."""
    queried_tokens: int = 0
    """Prompt (and, after a preemption, output) tokens of those admissions."""
    hit_tokens: int = 0
    """Of `queried_tokens`, those whose KV came from the prefix cache."""

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_requests += 1
        self.queried_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class SpecDecodeStats:
    """Speculative decoding: drafts proposed vs accepted, per draft position."""

    num_speculative_tokens: int
    """K: the most drafts a row verifies per step."""
    num_forwards: int = 0
    """Decode rows that carried at least one draft."""
    num_draft_tokens: int = 0
    """Draft tokens verified."""
    num_accepted_tokens: int = 0
    """Accepted drafts (the bonus/corrected token is not counted)."""
    accepted_per_position: list[int] = field(default_factory=list)
    """``accepted_per_position[j]``: rows whose draft ``j`` (0-based) was accepted."""

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_forwards += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Mean tokens a speculating row gained per forward (accepted drafts + 1)."""
        return 1.0 + self.num_accepted_tokens / self.num_forwards if self.num_forwards else 0.0


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler (`Scheduler.stats`): gauges now, counters since start."""

    num_waiting: int
    """Requests queued for (re)admission, P/D consumers waiting for their KV included."""
    num_running: int
    """Requests holding a row in the persistent batch."""
    num_held_transfers: int
    """P/D producer: finished requests whose blocks stay leased for a consumer's pull."""
    kv_cache_usage: float
    """Fraction of KV blocks referenced by live requests (0..1; cached free blocks count free)."""
    num_kv_blocks: int
    """KV blocks in the pool."""
    num_used_kv_blocks: int
    """KV blocks referenced by live requests (held producer leases included)."""
    num_preemptions: int
    """Requests preempted (their KV freed, recomputed later), cumulative."""
    prefix_queried_tokens: int
    """Prompt tokens looked up in the prefix cache at admission, cumulative."""
    prefix_hit_tokens: int
    """Prompt tokens served from the prefix cache, cumulative."""
    spec_draft_tokens: int
    """Draft tokens verified, cumulative."""
    spec_accepted_tokens: int
    """Draft tokens accepted, cumulative (the bonus/corrected token not counted)."""
    spec_num_drafts: int
    """Verify rows: decode rows that carried at least one draft, cumulative."""
    spec_accepted_per_position: list[int]
    """``[j]``: verify rows whose draft ``j`` was accepted, cumulative (length K)."""
    num_grammar_requests: int = 0
    """Requests whose output follows a grammar (structured output) right now."""
