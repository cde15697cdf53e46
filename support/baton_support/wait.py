"""The one condition waiter of the tests and benchmarks.

`wait_for` polls a condition until it returns something truthy and returns that value; at the
deadline it raises `WaitTimeout`, whose message says what was awaited and the last value seen
(so a failure in CI reads "waiting for the engine to go idle ...; last value: {...}" instead of a
bare timeout). A condition may raise to stop the wait early (a process it watches exited): the
exception propagates unchanged. `async_wait_for` is the same for event-loop code: the condition
may be a plain function or return an awaitable.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_INTERVAL_S = 0.05
"""Polls a loaded machine can afford: a condition often asks another process (an HTTP stats call
that waits for the engine core's step), and polling faster only steals that process's CPU."""


class WaitTimeout(AssertionError):
    """A condition stayed falsy until the deadline (an AssertionError: pytest shows it as a
    failed check)."""

    def __init__(self, message: str, timeout: float, last_value: object) -> None:
        super().__init__(f"timed out after {timeout:g} s waiting for {message}; last value: {last_value!r}")
        self.message = message
        self.timeout = timeout
        self.last_value = last_value


def wait_for(
    condition: Callable[[], T | None],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    interval: float = DEFAULT_INTERVAL_S,
    message: str = "condition",
) -> T:
    """Call `condition` every `interval` seconds until it returns a truthy value; return it.

    The condition is always called at least once, and once more after the deadline passed (a
    loaded machine may have slept past it while the condition became true)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(message, timeout, value)
        time.sleep(interval)


async def async_wait_for(
    condition: Callable[[], T | None | Awaitable[T | None]],
    timeout: float = DEFAULT_TIMEOUT_S,
    *,
    interval: float = DEFAULT_INTERVAL_S,
    message: str = "condition",
) -> T:
    """`wait_for` for coroutines: awaits the condition's result when it is awaitable, and sleeps
    with `asyncio.sleep` so the event loop keeps running whatever the condition waits on."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        value = await result if inspect.isawaitable(result) else result
        if value:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(message, timeout, value)
        await asyncio.sleep(interval)
