"""Test helpers for structured output."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")


class CallerExecutor(Executor):
    """Runs each submitted call at once, on the caller's thread: a `StructuredOutputManager`
    given it compiles in `add`, for tests that drive a `Scheduler` step by step and want
    grammars ready at the first step."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # the future carries it, as a thread's would
            future.set_exception(exc)
        return future


class GatedExecutor(Executor):
    """Holds every submitted call until `release`, then runs them on the caller's thread of
    `release`: a compile that is still running for as long as a test needs."""

    def __init__(self) -> None:
        self._held: list[tuple[Future[Any], Callable[[], Any]]] = []

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        self._held.append((future, lambda: fn(*args, **kwargs)))
        return future

    @property
    def num_held(self) -> int:
        return len(self._held)

    def release(self) -> None:
        held, self._held = self._held, []
        for future, call in held:
            try:
                future.set_result(call())
            except Exception as exc:
                future.set_exception(exc)
