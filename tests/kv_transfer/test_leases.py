from __future__ import annotations

import pytest

from baton_engine.kv_transfer.leases import Lease, LeaseEnd, LeaseTable
from baton_engine.kv_transfer.protocol import FailureReason


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_add_acquire_done() -> None:
    table = LeaseTable(FakeClock())
    table.add("t1", [4, 5, 6], 30.0)
    assert table.block_ids("t1") == [4, 5, 6]
    lease = table.acquire("t1")
    assert isinstance(lease, Lease) and lease.busy
    table.done_reading(lease)
    assert table.end("t1", LeaseEnd.DONE) is True
    assert table.take_ended() == [("t1", LeaseEnd.DONE)]
    assert table.take_ended() == []
    assert table.acquire("t1") is FailureReason.UNKNOWN_TRANSFER
    assert table.end("t1", LeaseEnd.DONE) is False


def test_duplicate_and_bad_lease() -> None:
    table = LeaseTable(FakeClock())
    table.add("t1", [1], 1.0)
    with pytest.raises(ValueError, match="transfer id 't1' already has a lease"):
        table.add("t1", [2], 1.0)
    with pytest.raises(ValueError, match="lease_seconds must be > 0, got 0"):
        table.add("t2", [2], 0)


def test_expiry_ends_lease_and_is_remembered() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    table.add("old", [1, 2], 5.0)
    table.add("new", [3], 50.0)
    assert table.seconds_to_next_expiry() == 5.0
    clock.now += 4.9
    assert table.expire() == []
    clock.now += 0.1
    assert table.acquire("old") is FailureReason.LEASE_EXPIRED  # due, not yet swept
    assert table.expire() == ["old"]
    assert table.take_ended() == [("old", LeaseEnd.EXPIRED)]
    assert table.acquire("old") is FailureReason.LEASE_EXPIRED
    assert len(table) == 1


def test_release_and_expiry_wait_for_a_read_in_progress() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    table.add("t", [9], 1.0)
    lease = table.acquire("t")
    assert isinstance(lease, Lease)
    clock.now += 10  # past expiry while being read
    assert table.expire() == []
    assert table.end("t", LeaseEnd.RELEASED) is True
    assert table.take_ended() == []  # blocks still being read: not freed yet
    assert table.acquire("t") is FailureReason.LEASE_EXPIRED  # ending: no new reader
    table.done_reading(lease)
    assert table.take_ended() == [("t", LeaseEnd.RELEASED)]
    assert len(table) == 0


def test_expiry_counts_through_the_callback_only_when_leases_expire() -> None:
    clock = FakeClock()
    table = LeaseTable(clock)
    table.add("a", [1], 1.0)
    table.add("b", [2], 1.0)
    table.add("c", [3], 9.0)
    counted: list[int] = []
    assert table.expire(on_expired=counted.append) == []
    clock.now += 1.0
    assert table.expire(on_expired=counted.append) == ["a", "b"]
    assert table.expire(on_expired=counted.append) == []
    assert counted == [2]
    assert table.take_ended() == [("a", LeaseEnd.EXPIRED), ("b", LeaseEnd.EXPIRED)]
