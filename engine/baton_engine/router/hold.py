"""Requests held while a pool they need has no pod (scaled to zero, or all pods restarting).

A request that needs a pool with no endpoint waits here until one appears, for at most
``timeout_s``; at most ``capacity`` requests wait at once. A request that finds the queue full,
or waits out its timeout, is answered 503 with ``Retry-After``: the wait is bounded in time and
in memory. The number waiting is exported (``contract.M_ROUTER_HELD``) for the operator's
autoscaler, which scales pools up from zero as soon as it sees it above 0.

Single-threaded: the router's event loop runs both the waiters and the registry's listeners.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict

from baton_engine.router.endpoints import Endpoint, EndpointRegistry, EventKind
from baton_engine.router.metrics import RouterMetrics


class PoolUnavailable(Exception):
    """The request could not be held until a pod came: answer 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class HoldQueue:
    """Bounded waiting room for requests whose pool is empty."""

    def __init__(
        self,
        registry: EndpointRegistry,
        metrics: RouterMetrics,
        *,
        capacity: int,
        timeout_s: float,
        retry_after_s: float,
    ) -> None:
        if capacity < 0 or timeout_s <= 0 or retry_after_s <= 0:
            raise ValueError("hold queue: capacity must be >= 0, timeout and retry-after positive")
        self.registry = registry
        self.metrics = metrics
        self.capacity = capacity
        self.timeout_s = timeout_s
        self.retry_after_s = max(1, math.ceil(retry_after_s))
        self.held = 0
        self._waiters: defaultdict[str, set[asyncio.Future[None]]] = defaultdict(set)
        registry.subscribe(self._on_endpoint)

    def _on_endpoint(self, kind: EventKind, endpoint: Endpoint) -> None:
        if kind != "added":
            return
        for waiter in self._waiters.pop(endpoint.role, set()):
            if not waiter.done():
                waiter.set_result(None)

    async def until_available(self, role: str) -> float:
        """Return once `role` has an endpoint (the seconds held, 0.0 if it had one); raise
        PoolUnavailable when the queue is full or the wait times out."""
        if self.registry.by_role(role):
            return 0.0
        if self.held >= self.capacity:
            self.metrics.held_total.labels(outcome="rejected").inc()
            if self.capacity == 0:
                raise PoolUnavailable(f"no {role} pod available", self.retry_after_s)
            raise PoolUnavailable(
                f"no {role} pod available and {self.held} requests already wait for one "
                f"(the router holds at most {self.capacity})",
                self.retry_after_s,
            )
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        deadline = started + self.timeout_s
        self.held += 1
        self.metrics.held.set(self.held)
        outcome = "cancelled"
        try:
            while not self.registry.by_role(role):
                left = deadline - time.monotonic()
                if left <= 0:
                    outcome = "timeout"
                    raise PoolUnavailable(
                        f"no {role} pod became available within {self.timeout_s:g} s", self.retry_after_s
                    )
                waiter: asyncio.Future[None] = loop.create_future()
                self._waiters[role].add(waiter)
                try:
                    await asyncio.wait_for(waiter, timeout=left)
                except TimeoutError:
                    pass
                finally:
                    self._waiters[role].discard(waiter)
            outcome = "released"
            waited = time.monotonic() - started
            self.metrics.hold_seconds.observe(waited)
            return waited
        finally:
            self.held -= 1
            self.metrics.held.set(self.held)
            self.metrics.held_total.labels(outcome=outcome).inc()
