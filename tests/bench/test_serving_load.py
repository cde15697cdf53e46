"""bench.serving's aiperf command line: the load it asks for (a pure builder; no aiperf needed)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from bench.serving import Settings, aiperf_command


def _command(settings: Settings) -> list[str]:
    return aiperf_command(Path("/venv/bin/aiperf"), "http://127.0.0.1:8000", settings, 16, Path("/art"))


def _value(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_concurrency_comes_with_a_constant_rate_that_paces_the_timing_manager() -> None:
    # Without a rate aiperf's timing manager polls for a free slot in a tight loop (a whole core).
    command = _command(Settings())
    assert _value(command, "--concurrency") == "16"
    assert _value(command, "--request-rate") == "1000"
    assert _value(command, "--arrival-pattern") == "constant"
    assert _value(command, "--url") == "http://127.0.0.1:8000"
    assert _value(command, "--benchmark-duration") == "60"


def test_poll_rate_zero_restores_aiperfs_own_burst_mode() -> None:
    command = _command(replace(Settings(), aiperf_poll_hz=0.0))
    assert "--request-rate" not in command
    assert "--arrival-pattern" not in command
    assert _value(command, "--concurrency") == "16"


def test_a_request_count_replaces_the_duration() -> None:
    command = _command(replace(Settings(), request_count=4, aiperf_poll_hz=250.0))
    assert _value(command, "--request-count") == "16"  # at least one request per stream
    assert "--benchmark-duration" not in command
    assert _value(command, "--request-rate") == "250"
