"""The shared condition waiter: returns the first truthy value, and at the deadline says what it
waited for and what it saw last."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from baton_support.wait import WaitTimeout, async_wait_for, wait_for


def test_returns_the_first_truthy_value() -> None:
    values = iter([None, 0, [], {"ready": True}])
    assert wait_for(lambda: next(values), interval=0) == {"ready": True}


def test_timeout_names_what_was_awaited_and_the_last_value() -> None:
    seen: list[int] = []

    def running_requests() -> list[int]:
        seen.append(len(seen))
        return []  # falsy: still waiting

    with pytest.raises(WaitTimeout) as caught:
        wait_for(running_requests, timeout=0.05, interval=0.01, message="the engine to idle")
    assert str(caught.value) == "timed out after 0.05 s waiting for the engine to idle; last value: []"
    assert isinstance(caught.value, AssertionError)
    assert (caught.value.message, caught.value.last_value) == ("the engine to idle", [])
    assert len(seen) >= 2  # polled until the deadline, and once after it


def test_a_condition_that_raises_ends_the_wait_with_its_error() -> None:
    def exited() -> bool:
        raise RuntimeError("server exited with 1")

    with pytest.raises(RuntimeError, match="server exited with 1"):
        wait_for(exited, timeout=30)


def test_async_wait_accepts_coroutine_and_plain_conditions() -> None:
    async def main() -> tuple[int, str]:
        count = itertools.count()

        async def ready() -> int:
            await asyncio.sleep(0)
            return max(0, next(count) - 2)

        first = await async_wait_for(ready, interval=0)
        second = await async_wait_for(lambda: "plain", interval=0)
        return first, second

    assert asyncio.run(main()) == (1, "plain")


def test_async_timeout_reports_the_last_value() -> None:
    async def ready() -> bool:
        return False

    with pytest.raises(WaitTimeout) as caught:
        asyncio.run(async_wait_for(ready, timeout=0.02, message="/ready to answer 200"))
    assert str(caught.value) == "timed out after 0.02 s waiting for /ready to answer 200; last value: False"
