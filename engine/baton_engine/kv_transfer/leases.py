"""The producer's lease table: which blocks each prefilled request keeps for a pull, until when.

Thread-safe: the step loop adds leases and may release them (client abort), the serving thread
reads them, ends them on DONE/RELEASE and expires them. A lease being served (`busy`) is never
ended under the reader: a release or expiry that arrives meanwhile takes effect when the read
finishes, so the blocks are never freed while their bytes are being copied out.

Ended leases queue up in `take_ended` for the step loop, which frees the blocks.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from baton_engine.kv_transfer.protocol import FailureReason

_REMEMBER_EXPIRED = 4096


class LeaseEnd(enum.StrEnum):
    DONE = "done"  # the consumer pulled the blocks
    RELEASED = "released"  # a RELEASE message or a local release (client gone)
    EXPIRED = "expired"  # nobody pulled in time


@dataclass
class Lease:
    transfer_id: str
    block_ids: list[int]
    expires_at: float  # on the table's clock
    busy: bool = False
    pending_end: LeaseEnd | None = None


class LeaseTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._added = threading.Condition(self._lock)
        self._leases: dict[str, Lease] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self._ended: list[tuple[str, LeaseEnd]] = []

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def add(self, transfer_id: str, block_ids: list[int], lease_seconds: float) -> float:
        """Hold `block_ids` for `lease_seconds`; returns the expiry on the table's clock."""
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        with self._lock:
            if transfer_id in self._leases:
                raise ValueError(f"transfer id {transfer_id!r} already has a lease")
            expires_at = self._clock() + lease_seconds
            self._leases[transfer_id] = Lease(transfer_id, list(block_ids), expires_at)
            self._added.notify_all()
            return expires_at

    def wait_added(self, transfer_id: str, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for a lease `transfer_id` to be added (or to have been: True
        also if it already ended). A tensor-parallel rank >= 1 gets its leases from rank 0
        between steps, so a consumer may ask before the lease arrived."""
        with self._added:
            return self._added.wait_for(
                lambda: transfer_id in self._leases or transfer_id in self._expired, timeout_s
            )

    def block_ids(self, transfer_id: str) -> list[int] | None:
        with self._lock:
            lease = self._leases.get(transfer_id)
            return None if lease is None else list(lease.block_ids)

    def acquire(self, transfer_id: str) -> Lease | FailureReason:
        """Mark a live lease busy for reading, or say why there is none."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None:
                if transfer_id in self._expired:
                    return FailureReason.LEASE_EXPIRED
                return FailureReason.UNKNOWN_TRANSFER
            if lease.pending_end is not None or lease.expires_at <= self._clock():
                return FailureReason.LEASE_EXPIRED
            lease.busy = True
            return lease

    def done_reading(self, lease: Lease) -> None:
        with self._lock:
            lease.busy = False
            if lease.pending_end is not None:
                self._end_locked(lease, lease.pending_end)

    def end(self, transfer_id: str, how: LeaseEnd) -> bool:
        """End a lease now (or once its current read finishes). False if there is no such lease."""
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.pending_end is not None:
                return False
            if lease.busy:
                lease.pending_end = how
            else:
                self._end_locked(lease, how)
            return True

    def expire(self, on_expired: Callable[[int], None] | None = None) -> list[str]:
        """End every lease past its expiry that is not being read; returns their ids.

        `on_expired(count)` runs under the table's lock, before `take_ended` can report the
        leases: whoever sees them ended (and their blocks freed) also sees them counted."""
        with self._lock:
            now = self._clock()
            due = [
                lease
                for lease in self._leases.values()
                if lease.expires_at <= now and not lease.busy and lease.pending_end is None
            ]
            if due and on_expired is not None:
                on_expired(len(due))
            for lease in due:
                self._end_locked(lease, LeaseEnd.EXPIRED)
            return [lease.transfer_id for lease in due]

    def seconds_to_next_expiry(self) -> float | None:
        with self._lock:
            if not self._leases:
                return None
            return max(0.0, min(lease.expires_at for lease in self._leases.values()) - self._clock())

    def take_ended(self) -> list[tuple[str, LeaseEnd]]:
        """Leases ended since the last call, in order; the step loop frees their blocks."""
        with self._lock:
            ended, self._ended = self._ended, []
            return ended

    def _end_locked(self, lease: Lease, how: LeaseEnd) -> None:
        del self._leases[lease.transfer_id]
        if how is LeaseEnd.EXPIRED:
            self._expired[lease.transfer_id] = None
            if len(self._expired) > _REMEMBER_EXPIRED:
                self._expired.popitem(last=False)
        self._ended.append((lease.transfer_id, how))
