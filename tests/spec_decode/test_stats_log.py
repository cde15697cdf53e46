"""The periodic acceptance log line."""

from __future__ import annotations

import logging

import pytest

from baton_engine.core.scheduler_stats import SpecDecodeStats
from baton_engine.spec_decode.stats_log import SpecDecodeLogger, format_spec_stats


def test_format_and_interval(caplog: pytest.LogCaptureFixture) -> None:
    stats = SpecDecodeStats(3)
    stats.record(3, 2)
    stats.record(3, 0)
    assert format_spec_stats(stats) == (
        "spec decode: drafts 6, accepted 2 (acceptance rate 0.333), mean tokens per forward 2.000 "
        "over 2 verify rows, acceptance by position [0.500, 0.500, 0.000]"
    )
    logger = SpecDecodeLogger(interval_s=10.0)
    with caplog.at_level(logging.INFO, logger="baton_engine.spec_decode"):
        assert not logger.maybe_log(stats, 100.0)  # starts the clock
        assert not logger.maybe_log(stats, 109.0)
        assert logger.maybe_log(stats, 110.0)
        assert not logger.maybe_log(stats, 125.0)  # nothing new since the last line
        stats.record(3, 3)
        assert logger.maybe_log(stats, 125.0)
    assert [r.getMessage() for r in caplog.records][1].endswith(
        "acceptance by position [0.667, 0.667, 0.333]"
    )
    assert len(caplog.records) == 2
