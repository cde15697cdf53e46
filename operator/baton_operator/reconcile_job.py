"""The reconcile of one resource as its periodic work (see `workers`): run when an event handler
asks (create, update, resume) and every resync interval, one at a time per resource.

A periodic reconcile reads the resource from the API first, so that it never applies a version
the watch has not caught up with, and learns at once (404, another UID) that the resource is
gone. A failed reconcile is reported in status at once (`reconcile` does that), retried with
back-off, and posted as a Warning Event once per distinct failure, not once per try.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from baton_operator import metrics, models
from baton_operator.events import Event, Poster
from baton_operator.kube import Kube, KubeError
from baton_operator.reconcile import Caches, InvalidSpec, OperatorConfig, failure_of, reconcile
from baton_operator.workers import Lease, ResourceGone

log = logging.getLogger(__name__)

#: First retry delay after a failed reconcile; it doubles with each further failure.
RETRY_DELAY_S = 10.0
MAX_RETRY_DELAY_S = 300.0
#: Trigger of the periodic reconciles (the metrics' label).
TIMER = "timer"
#: Triggers whose successful reconcile posts a `Reconciled` Event.
ANNOUNCED = frozenset({"create", "update"})
INVALID_SPEC = "InvalidSpec"


def retry_delay(failures: int, resync_s: float) -> float:
    """Seconds from the `failures`-th failure in a row to the next try: doubling from
    RETRY_DELAY_S up to MAX_RETRY_DELAY_S, and never later than the next resync would be (a
    failing resource is tried at least as often as a healthy one is resynced)."""
    return min(RETRY_DELAY_S * 2.0 ** (failures - 1), MAX_RETRY_DELAY_S, resync_s)


@dataclass(frozen=True)
class ReconcileSettings:
    """What every resource's reconcile job shares."""

    kube: Kube
    caches: Caches
    config: OperatorConfig
    slots: asyncio.Semaphore  # reconciles in flight at once, across resources
    resync_s: float
    post: Poster


class ReconcileJob:
    """One resource's reconcile schedule: the next periodic run, the failures in a row, the
    failure last posted."""

    name = "reconcile"

    def __init__(self, settings: ReconcileSettings, now: float) -> None:
        self.settings = settings
        self.next_at = now + settings.resync_s  # the first reconcile is an event handler's
        self.failures = 0
        self.reported: str | None = None  # message of the failure Event last posted

    def due(self, lease: Lease, now: float) -> float | None:
        return now if lease.requested is not None else self.next_at

    async def run(self, lease: Lease) -> None:
        s = self.settings
        trigger = lease.take_request() or TIMER
        started = time.perf_counter()
        result = "ok"
        try:
            body = lease.body if trigger != TIMER else await self._fresh(lease)
            async with s.slots:
                outcome = await reconcile(
                    s.kube,
                    body,
                    s.config,
                    caches=s.caches,
                    on_event=lambda event: s.post(body, event),
                    guard=lease.check,
                )
        except ResourceGone:
            result = "gone"
            raise
        except InvalidSpec as exc:
            # The CRD should have refused it; the next spec change (an update) tries again.
            result = "invalid"
            metrics.RECONCILE_ERRORS.labels(INVALID_SPEC).inc()
            self._failed(lease, Event("Warning", "InvalidSpec", str(exc)), self.settings.resync_s)
            return
        except KubeError as exc:
            result = "error"
            metrics.RECONCILE_ERRORS.labels(f"HTTP{exc.status}").inc()
            self.failures += 1
            failure = failure_of(exc)
            warning = Event("Warning", failure.reason, failure.message)
            self._failed(lease, warning, retry_delay(self.failures, s.resync_s))
            return
        finally:
            metrics.RECONCILES.labels(trigger, result).inc()
            metrics.RECONCILE_SECONDS.labels(trigger).observe(time.perf_counter() - started)
        self.failures, self.reported = 0, None
        self.next_at = asyncio.get_running_loop().time() + s.resync_s
        metrics.CHILDREN_APPLIED.inc(outcome.applied)
        if trigger in ANNOUNCED:
            message = f"applied {outcome.applied} children ({trigger})"
            s.post(body, Event("Normal", "Reconciled", message))
        log.debug("%s reconciled (%s): %d children applied", lease.id, trigger, outcome.applied)

    async def _fresh(self, lease: Lease) -> Mapping[str, Any]:
        """The resource as the API has it now; ResourceGone if it has another one or none."""
        rid = lease.id
        body = await self.settings.kube.get(models.API_VERSION, models.KIND, rid.namespace, rid.name)
        if body is None or body.get("metadata", {}).get("uid") != rid.uid:
            raise ResourceGone(rid)
        self.settings.caches.owners.observe(body)
        return body

    def _failed(self, lease: Lease, warning: Event, delay: float) -> None:
        """Schedule the next try; post `warning` unless it repeats the one posted last."""
        self.next_at = asyncio.get_running_loop().time() + delay
        log.warning("%s: reconcile failed (next try in %.0f s): %s", lease.id, delay, warning.message)
        if warning.message != self.reported:
            self.reported = warning.message
            self.settings.post(lease.body, Event(warning.type, warning.reason, warning.message[:1024]))
