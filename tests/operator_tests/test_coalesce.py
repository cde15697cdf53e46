"""Per-key coalescing: bursts run once, a request during a run runs once more, keys are
independent, errors do not stop later runs, cancel and close end the tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable

import pytest

from baton_operator.coalesce import Coalescer

DELAY_S = 0.01


class Recorder:
    """Work that records each run's key; a run can be held open until released."""

    def __init__(self) -> None:
        self.runs: list[Hashable] = []
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()
        self.fail_next = False

    async def __call__(self, key: Hashable) -> None:
        self.started.set()
        await self.release.wait()
        self.runs.append(key)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")


async def until_idle(coalescer: Coalescer) -> None:
    async with asyncio.timeout(30):
        while coalescer.pending():
            await asyncio.sleep(DELAY_S)


async def test_a_burst_runs_once() -> None:
    work = Recorder()
    coalescer = Coalescer(work, DELAY_S)
    for _ in range(50):
        coalescer.request(("ns", "a"))
    assert coalescer.pending() == 1
    await until_idle(coalescer)
    assert work.runs == [("ns", "a")]
    assert coalescer.runs == 1


async def test_a_request_during_a_run_runs_exactly_once_more() -> None:
    work = Recorder()
    work.release.clear()
    coalescer = Coalescer(work, DELAY_S)
    coalescer.request("a")
    async with asyncio.timeout(30):
        await work.started.wait()
    for _ in range(10):
        coalescer.request("a")  # the running work may have read stale state: run again, once
    work.release.set()
    await until_idle(coalescer)
    assert work.runs == ["a", "a"]


async def test_keys_are_independent() -> None:
    work = Recorder()
    coalescer = Coalescer(work, DELAY_S)
    for key in ("a", "b", "a", "c", "b"):
        coalescer.request(key)
    assert coalescer.pending() == 3
    await until_idle(coalescer)
    assert sorted(str(k) for k in work.runs) == ["a", "b", "c"]


async def test_a_failing_run_is_logged_and_later_requests_still_run(caplog: pytest.LogCaptureFixture) -> None:
    work = Recorder()
    work.fail_next = True
    coalescer = Coalescer(work, DELAY_S)
    coalescer.request("a")
    await until_idle(coalescer)
    assert "coalesced work for a failed" in caplog.text
    coalescer.request("a")
    await until_idle(coalescer)
    assert work.runs == ["a", "a"]


async def test_cancel_and_close_end_the_tasks() -> None:
    work = Recorder()
    coalescer = Coalescer(work, 60.0)
    coalescer.request("a")
    coalescer.request("b")
    coalescer.cancel("a")
    coalescer.cancel("never-requested")
    assert coalescer.pending() == 1
    await coalescer.close()
    assert coalescer.pending() == 0
    assert work.runs == []
