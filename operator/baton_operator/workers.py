"""Per-resource periodic work (the resync reconcile, the built-in autoscaler) that ends with the
resource and never acts for a UID other than the live one.

Why not Kopf's timers and daemons: Kopf requires a finalizer for them and stops them only when
it sees a deletion timestamp. Baton promises no finalizers (deleting a resource must complete
with the operator uninstalled), and a resource without finalizers never shows a deletion
timestamp: it disappears with one DELETED watch event, after which Kopf forgets it and leaves
its timers and daemons running, re-applying children the garbage collector then deletes, or,
once the name is re-created, force-applying children owned by the dead UID, which the garbage
collector deletes together with the new resource's pods.

So the operator owns these tasks. The owner watch (Kopf's `on.event`) feeds `ResourceWorkers`:
the first version of a UID starts that resource's jobs, each newer version is handed to them,
its DELETED event or another UID taking its name stops them. A job asks its `Lease` before each
write whether the resource is still the live one (the owner cache, fed by the same watch), and a
job that learns from the API that the UID is gone (404, another UID) ends the lease. While
`active()` is false (another operator replica is the active peer) no job runs.

Kopf-free and clock-agnostic apart from asyncio, so the loop is tested with plain jobs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

#: After a job fails unexpectedly (a bug, not an API error it handles), it runs again no sooner.
ERROR_DELAY_S = 5.0
#: How often a job waiting for the operator to become the active peer checks again.
INACTIVE_POLL_S = 1.0


@dataclass(frozen=True)
class ResourceId:
    """One resource: its name, and the UID that tells it from an earlier one of that name."""

    namespace: str
    name: str
    uid: str

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> ResourceId:
        meta = body["metadata"]
        return cls(str(meta["namespace"]), str(meta["name"]), str(meta["uid"]))

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


class ResourceGone(Exception):
    """The resource a piece of work was started for is no longer the live one: it was deleted,
    or another UID took its name. Not an error: the work stops, nothing is retried."""

    def __init__(self, resource: ResourceId) -> None:
        super().__init__(f"{resource} is gone")
        self.resource = resource


#: Whether a resource is the live one under its name (the owner cache's view of the watch).
IsLive = Callable[[ResourceId], bool]


class Lease:
    """One live resource as its jobs see it: the newest version the watch showed, whether it is
    still the live one, a pending reconcile request, and the jobs' wake-ups."""

    def __init__(self, resource: ResourceId, body: Mapping[str, Any], is_live: IsLive) -> None:
        self.id = resource
        self.body: Mapping[str, Any] = body
        self._is_live = is_live
        self._ended = False
        self._wakes: list[asyncio.Event] = []
        self.requested: str | None = None  # trigger of a reconcile an event handler asked for

    def live(self) -> bool:
        """Still the live resource of its name: not ended, and the watch shows this UID."""
        return not self._ended and self._is_live(self.id)

    def check(self) -> None:
        """Raise ResourceGone unless `live()`: called before every write made for the resource."""
        if not self.live():
            raise ResourceGone(self.id)

    def end(self) -> None:
        """No more work for this resource (deleted, replaced, or the API says it is gone)."""
        self._ended = True
        self.wake()

    @property
    def ended(self) -> bool:
        return self._ended

    def update(self, body: Mapping[str, Any]) -> None:
        self.body = body
        self.wake()

    def request(self, trigger: str) -> None:
        """Ask for a reconcile now; a request already pending keeps its trigger."""
        if self.requested is None:
            self.requested = trigger
        self.wake()

    def take_request(self) -> str | None:
        trigger, self.requested = self.requested, None
        return trigger

    def wake(self) -> None:
        for event in self._wakes:
            event.set()

    def _wake_event(self) -> asyncio.Event:
        event = asyncio.Event()
        self._wakes.append(event)
        return event


class Job(Protocol):
    """One kind of periodic work of one resource (an instance per resource: it holds that
    resource's schedule, e.g. its next run and its failure count)."""

    name: str

    def due(self, lease: Lease, now: float) -> float | None:
        """Event-loop time of the next run; None: not until something wakes the lease (a newer
        body, a request)."""

    async def run(self, lease: Lease) -> None:
        """One run. Raises ResourceGone when the API shows the resource is gone; handles (and
        reports) its own API errors otherwise."""


JobFactory = Callable[[ResourceId], Sequence[Job]]


class ResourceWorkers:
    """The periodic jobs of every live resource, started and stopped by the owner watch."""

    def __init__(self, jobs: JobFactory, is_live: IsLive, active: Callable[[], bool] = lambda: True) -> None:
        self._jobs = jobs
        self._is_live = is_live
        self._active = active
        self._leases: dict[tuple[str, str], Lease] = {}  # (namespace, name) -> the live resource's
        self._tasks: set[asyncio.Task[None]] = set()  # every job task still running, ended leases' too

    def __len__(self) -> int:
        return len(self._leases)

    def lease(self, namespace: str, name: str) -> Lease | None:
        return self._leases.get((namespace, name))

    def observe(self, body: Mapping[str, Any]) -> Lease | None:
        """A version of a resource from the watch (or the initial listing). Starts its jobs when
        its UID is the live one and has none yet (ending another UID's), or hands them the body.
        None when the version is not of the live resource (a late event of an older UID)."""
        resource = ResourceId.of(body)
        if not self._is_live(resource):
            return None
        held = self._leases.get(resource.key)
        if held is not None and held.id == resource and not held.ended:
            held.update(body)
            return held
        if held is not None:
            self._stop(held)
        lease = Lease(resource, body, self._is_live)
        for job in self._jobs(resource):
            task = asyncio.create_task(self._drive(lease, job), name=f"{job.name} of {resource}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._leases[resource.key] = lease
        return lease

    def forget(self, body: Mapping[str, Any]) -> None:
        """The resource's DELETED event: its jobs end (another UID's, under that name, do not)."""
        resource = ResourceId.of(body)
        held = self._leases.get(resource.key)
        if held is not None and held.id == resource:
            self._stop(held)

    def request(self, body: Mapping[str, Any], trigger: str) -> bool:
        """Ask the resource's jobs for a reconcile now (create, update, resume); False when the
        body is not of the live resource."""
        lease = self.observe(body)
        if lease is None:
            return False
        lease.request(trigger)
        return True

    def _stop(self, lease: Lease) -> None:
        lease.end()
        if self._leases.get(lease.id.key) is lease:
            del self._leases[lease.id.key]
        # The tasks end by themselves at their next check of the lease (a run in progress stops
        # at its next write); cancelling one mid-request would only leave that request unknown.

    async def close(self) -> None:
        """End every lease and cancel every job (the operator is stopping); wait for them."""
        for lease in list(self._leases.values()):
            lease.end()
        self._leases.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _drive(self, lease: Lease, job: Job) -> None:
        loop = asyncio.get_running_loop()
        wake = lease._wake_event()
        not_before = 0.0
        while True:
            wake.clear()
            if not lease.live():
                return
            now = loop.time()
            due = job.due(lease, now)
            if due is not None:
                due = max(due, not_before)
            if due is not None and due <= now:
                if not self._active():
                    await _wait(wake, INACTIVE_POLL_S)
                    continue
                try:
                    await job.run(lease)
                except ResourceGone:
                    lease.end()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("%s of %s failed", job.name, lease.id)
                    not_before = loop.time() + ERROR_DELAY_S
                continue
            await _wait(wake, None if due is None else due - now)


async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except TimeoutError:
        pass
