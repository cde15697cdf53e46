"""Counters the scheduler keeps for metrics: prefix-cache hits and speculative acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up in the prefix cache at admission, and how many were hits."""

    num_requests: int = 0
    queried_tokens: int = 0
    hit_tokens: int = 0

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
    num_forwards: int = 0
    """Decode rows that carried at least one draft."""
    num_draft_tokens: int = 0
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
