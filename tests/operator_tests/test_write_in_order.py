"""`write_in_order`: children written in order, a bounded number at once, and a crash after K
issued writes leaves exactly those K (the already issued ones are let finish)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pytest

from baton_operator.reconcile import MAX_PARALLEL_WRITES, write_in_order

MANIFESTS = [{"metadata": {"name": f"c{i}"}} for i in range(10)]


class Writes:
    """Records what was issued and completed, and the most writes ever in flight together."""

    def __init__(self, fail_at: str | None = None) -> None:
        self.issued: list[str] = []
        self.completed: list[str] = []
        self.in_flight = 0
        self.peak = 0
        self.fail_at = fail_at

    async def __call__(self, manifest: Mapping[str, Any]) -> str:
        name = manifest["metadata"]["name"]
        self.issued.append(name)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(0.01 * (len(self.issued) % 3))  # out-of-order completion
            if name == self.fail_at:
                raise RuntimeError(f"write {name} failed")
            self.completed.append(name)
            return f"answer {name}"
        finally:
            self.in_flight -= 1


class Crash(Exception):
    pass


async def no_hook(index: int, manifest: Mapping[str, Any]) -> None:
    return None


async def test_all_written_in_order_with_bounded_concurrency() -> None:
    writes = Writes()
    answers = await write_in_order(MANIFESTS, writes, no_hook, 0)
    assert answers == [f"answer c{i}" for i in range(10)]
    assert writes.issued == [f"c{i}" for i in range(10)]
    assert writes.peak == MAX_PARALLEL_WRITES


@pytest.mark.parametrize("k", [0, 1, 3, 4, 5, 9])
async def test_a_crash_before_write_k_leaves_exactly_k(k: int) -> None:
    writes = Writes()
    hooked: list[int] = []

    async def crash_at_k(index: int, manifest: Mapping[str, Any]) -> None:
        hooked.append(index)
        await asyncio.sleep(0)  # a hook may suspend; the order must hold anyway
        if index == 100 + k:
            raise Crash(f"before write {k}")

    with pytest.raises(Crash):
        await write_in_order(MANIFESTS, writes, crash_at_k, 100)
    assert hooked == list(range(100, 100 + k + 1))
    assert sorted(writes.completed) == sorted(f"c{i}" for i in range(k))
    assert writes.in_flight == 0


async def test_a_failed_write_stops_issuing_and_raises_after_the_others_finish() -> None:
    writes = Writes(fail_at="c2")
    with pytest.raises(RuntimeError, match="write c2 failed"):
        await write_in_order(MANIFESTS, writes, no_hook, 0)
    assert writes.in_flight == 0
    # c2 fails (without waiting) while c0, c1 and c3 are in flight: nothing is issued after it,
    # and those three complete.
    assert writes.issued == ["c0", "c1", "c2", "c3"]
    assert sorted(writes.completed) == ["c0", "c1", "c3"]
