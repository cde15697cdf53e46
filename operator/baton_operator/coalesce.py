"""Per-key coalescing of repeated work: many requests for one key within a short delay run the
work once, with whatever state is newest when it runs (latest wins).

Each child Deployment moves through several status changes while its pods come up, and an
InferenceDeployment has three of them; refreshing the owner's status once per burst instead of
once per change keeps the operator's event loop and the API server free for applies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    task: asyncio.Task[None]
    again: bool = False  # a request came while the work was running
    running: bool = False


class Coalescer:
    """Runs `work(key)` at most once at a time per key, `delay_s` after the first request of a burst.

    A request while the work waits is absorbed (the run will see the newest state); a request
    while it runs schedules exactly one more run after it. Errors are logged, never raised: the
    next request retries."""

    def __init__(self, work: Callable[[Hashable], Awaitable[None]], delay_s: float) -> None:
        self.work = work
        self.delay_s = delay_s
        self._slots: dict[Hashable, _Slot] = {}
        self.runs = 0  # completed runs, for metrics and tests

    def pending(self) -> int:
        return len(self._slots)

    def request(self, key: Hashable) -> None:
        slot = self._slots.get(key)
        if slot is None:
            self._slots[key] = _Slot(asyncio.create_task(self._run(key), name=f"coalesce {key}"))
        elif slot.running:
            slot.again = True

    def cancel(self, key: Hashable) -> None:
        """Drop a pending or running request (e.g. the object was deleted)."""
        slot = self._slots.pop(key, None)
        if slot is not None:
            slot.task.cancel()

    async def _run(self, key: Hashable) -> None:
        try:
            while True:
                await asyncio.sleep(self.delay_s)
                slot = self._slots[key]
                slot.running, slot.again = True, False
                try:
                    await self.work(key)
                except Exception:
                    log.exception("coalesced work for %s failed", key)
                self.runs += 1
                slot.running = False
                if not slot.again:
                    break
        finally:
            slot_now = self._slots.get(key)
            if slot_now is not None and slot_now.task is asyncio.current_task():
                del self._slots[key]

    async def close(self) -> None:
        """Cancel everything pending and wait for the tasks to end."""
        tasks = [slot.task for slot in self._slots.values()]
        self._slots.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
