"""Periodic log line with the speculative acceptance statistics."""

from __future__ import annotations

import logging

from baton_engine.core.scheduler_stats import SpecDecodeStats

log = logging.getLogger("baton_engine.spec_decode")


def format_spec_stats(stats: SpecDecodeStats) -> str:
    per_position = ", ".join(
        f"{count / stats.num_forwards:.3f}" if stats.num_forwards else "0.000"
        for count in stats.accepted_per_position
    )
    return (
        f"spec decode: drafts {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens} "
        f"(acceptance rate {stats.acceptance_rate:.3f}), mean tokens per forward "
        f"{stats.tokens_per_forward:.3f} over {stats.num_forwards} verify rows, "
        f"acceptance by position [{per_position}]"
    )


class SpecDecodeLogger:
    """Logs the cumulative statistics at most every `interval_s`, only when they changed."""

    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._next_at: float | None = None
        self._logged_forwards = 0

    def maybe_log(self, stats: SpecDecodeStats, now: float) -> bool:
        if self._next_at is None:
            self._next_at = now + self.interval_s
            return False
        if now < self._next_at or stats.num_forwards == self._logged_forwards:
            return False
        self._next_at = now + self.interval_s
        self._logged_forwards = stats.num_forwards
        log.info("%s", format_spec_stats(stats))
        return True
