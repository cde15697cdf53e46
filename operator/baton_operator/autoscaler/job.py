"""The built-in autoscaler: a Kopf daemon per resource, deciding every `spec.autoscaling.intervalSeconds`.

The interval is per resource and may change, so the daemon wakes every TICK_SECONDS (IDLE_SECONDS
while the mode is not builtin) and runs a decision once the resource's interval has passed since
the previous one: a decision is late by at most TICK_SECONDS. A daemon's wake-up is a plain
asyncio wait on the daemon's own body (Kopf keeps it current); a Kopf timer firing that often
would run Kopf's whole handler machinery for every resource four times a second, which with
hundreds of resources took a large share of a core.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import kopf

from baton_operator import metrics, models
from baton_operator.autoscaler.policy_types import History
from baton_operator.autoscaler.tick import autoscale_once, stored_history
from baton_operator.events import Event
from baton_operator.kube import Kube, KubeError

TICK_SECONDS = 0.25
#: How often a resource whose mode is not builtin is checked for a switch to builtin.
IDLE_SECONDS = 1.0
SCRAPE_TIMEOUT_S = 2.0


@dataclass
class AutoscalerState:
    """Per resource, in its Kopf memo."""

    next_at: float = 0.0  # monotonic time of the next decision
    history: History | None = None  # None: read from status on the first decision
    ticks: int = field(default=0)


def _interval(spec: Any) -> float:
    value = (spec.get("autoscaling") or {}).get("intervalSeconds", 15)
    return float(value) if isinstance(value, int | float) and value > 0 else 15.0


async def autoscaler_tick(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger | Any) -> float:
    """Decide if the resource's interval has passed; returns the seconds until the next check.

    Raises kopf.TemporaryError, once the decision's history and metrics are kept, when a pool's
    replicas or the status were not written: Kopf logs it and runs the daemon again when the
    next decision is due."""
    mode = (body.get("spec", {}).get("autoscaling") or {}).get("mode")
    state: AutoscalerState = memo.setdefault("autoscaler", AutoscalerState())
    if mode != "builtin":
        state.history = None  # a later switch to builtin starts from what status holds
        return IDLE_SECONDS
    now = time.monotonic()
    if now < state.next_at:
        return TICK_SECONDS
    state.next_at = now + _interval(body.get("spec", {}))
    if state.history is None:
        state.history = stored_history(body)
    kube: Kube = memo["kube"]
    client: httpx.AsyncClient = memo["scrape_client"]
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]

    def post(event: Event) -> None:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])

    try:
        result = await autoscale_once(
            kube, body, state.history, client=client, scrape_timeout_s=SCRAPE_TIMEOUT_S, on_event=post
        )
    except (KubeError, ValueError) as exc:
        metrics.AUTOSCALER_TICKS.labels("error").inc()
        logger.warning("autoscaler tick failed: %s", exc)
        kopf.warn(body, reason="AutoscalerFailed", message=str(exc)[:1024])
        return TICK_SECONDS
    if result is None:
        metrics.AUTOSCALER_TICKS.labels("skipped").inc()
        return TICK_SECONDS
    state.history = result.history
    state.ticks += 1
    settled = result.settled
    metrics.AUTOSCALER.record(
        namespace,
        name,
        result.decision,
        result.samples,
        scaled=settled.scale_actions,
        refused=settled.scale_failures,
    )
    if settled.written:
        logger.info("autoscaler: %s", result.decision.reason)
    if result.failures:
        metrics.AUTOSCALER_TICKS.labels("error").inc()
        delay = max(state.next_at - time.monotonic(), TICK_SECONDS)
        raise kopf.TemporaryError("autoscaler: " + "; ".join(result.failures), delay=delay)
    metrics.AUTOSCALER_TICKS.labels("ok").inc()
    return TICK_SECONDS


def register(registry: kopf.OperatorRegistry) -> Any:
    """Register the daemon; returns its function (the caller clears its finalizer flag)."""

    @kopf.daemon(
        models.GROUP,
        models.VERSION,
        models.PLURAL,
        registry=registry,
        id="autoscaler",
        cancellation_timeout=5.0,
    )
    async def autoscaler(
        body: kopf.Body, memo: kopf.Memo, logger: Any, stopped: kopf.DaemonStopped, **_: Any
    ) -> None:
        while not stopped:
            await stopped.wait(await autoscaler_tick(body, memo, logger))

    return autoscaler
