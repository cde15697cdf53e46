"""The built-in autoscaler as one resource's periodic work (see `baton_operator.workers`): a
decision every `spec.autoscaling.intervalSeconds` while the mode is builtin.

The interval is read from the newest version of the resource at each wake-up, so a changed
interval or mode takes effect at once; while the mode is not builtin the job sleeps until the
resource changes. The decision history is kept in memory between decisions (and in status, for
a restarted operator): a refused status write must not lose it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import httpx

from baton_operator import metrics
from baton_operator.autoscaler.policy_types import History
from baton_operator.autoscaler.tick import autoscale_once, stored_history
from baton_operator.events import Event, Poster
from baton_operator.kube import Kube, KubeError
from baton_operator.workers import Lease

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 2.0
DEFAULT_INTERVAL_S = 15.0
#: While every pool is at zero the routers are read this often: a held request wakes the pools
#: within about this long, not an interval later.
ZERO_POLL_S = 1.0


def _autoscaling(body: Mapping[str, Any]) -> Mapping[str, Any]:
    return (body.get("spec") or {}).get("autoscaling") or {}


def interval_of(body: Mapping[str, Any]) -> float:
    value = _autoscaling(body).get("intervalSeconds", DEFAULT_INTERVAL_S)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return float(value) if ok else DEFAULT_INTERVAL_S


class AutoscalerJob:
    """One resource's autoscaler: when it last decided, and the history the policy carries."""

    name = "autoscaler"

    def __init__(self, kube: Kube, client: httpx.AsyncClient, post: Poster) -> None:
        self.kube = kube
        self.client = client  # shared by every resource: one connection pool for the scrapes
        self.post = post
        self.last_at: float | None = None  # event-loop time of the last decision
        self.history: History | None = None  # None: read from status on the next decision
        self.reported: str | None = None  # message of the AutoscalerFailed Event last posted
        self.at_zero = False  # the last decision left every pool at zero pods

    def due(self, lease: Lease, now: float) -> float | None:
        if _autoscaling(lease.body).get("mode") != "builtin":
            self.history = None  # a later switch to builtin starts from what status holds
            return None
        if self.last_at is None:
            return now
        interval = interval_of(lease.body)
        return self.last_at + (min(interval, ZERO_POLL_S) if self.at_zero else interval)

    async def run(self, lease: Lease) -> None:
        body = lease.body
        self.last_at = asyncio.get_running_loop().time()
        if self.history is None:
            self.history = stored_history(body)
        rid = lease.id

        def post(event: Event) -> None:
            self.post(body, Event(event.type, event.reason, event.message[:1024]))

        try:
            result = await autoscale_once(
                self.kube,
                body,
                self.history,
                client=self.client,
                scrape_timeout_s=SCRAPE_TIMEOUT_S,
                on_event=post,
                guard=lease.check,
            )
        except (KubeError, ValueError) as exc:
            metrics.AUTOSCALER_TICKS.labels("error").inc()
            log.warning("%s: autoscaler tick failed: %s", rid, exc)
            if str(exc) != self.reported:
                self.reported = str(exc)
                post(Event("Warning", "AutoscalerFailed", str(exc)))
            return
        self.reported = None
        if result is None:
            metrics.AUTOSCALER_TICKS.labels("skipped").inc()
            return
        self.history = result.history
        self.at_zero = all(r.desired == 0 for r in result.decision.roles)
        settled = result.settled
        metrics.AUTOSCALER.record(
            rid.namespace,
            rid.name,
            result.decision,
            result.samples,
            scaled=settled.scale_actions,
            refused=settled.scale_failures,
        )
        if settled.written:
            log.info("%s: autoscaler: %s", rid, result.decision.reason)
        if result.failures:
            metrics.AUTOSCALER_TICKS.labels("error").inc()
            log.warning("%s: autoscaler: %s", rid, "; ".join(result.failures))
            return
        metrics.AUTOSCALER_TICKS.labels("ok").inc()
