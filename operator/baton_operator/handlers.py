"""Kopf handlers: thin wrappers that call `reconcile` and record metrics and Events.

Handlers are registered into a given registry by `register()` (not at import), so the resync
interval is a run-time option and tests can build their own operator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf

from baton_engine import contract
from baton_operator import autoscale_handler, metrics, models
from baton_operator.coalesce import Coalescer
from baton_operator.events import Event
from baton_operator.kube import Kube, KubeError
from baton_operator.reconcile import (
    Caches,
    InvalidSpec,
    OperatorConfig,
    reconcile,
    refresh_status,
)

RETRY_DELAY_S = 10.0
#: Reconciles running at once. The API server sets the pace of a burst anyway; past this, more
#: at once only hold more state, and finish together, when Kopf opens a TLS connection (a few
#: hundred kB each) per concurrent bookkeeping patch.
MAX_CONCURRENT_RECONCILES = 32
#: A child's status changes arrive in bursts (pods scheduled, started, Ready, for three
#: Deployments): the owner's status is recomputed once per burst, this long after its start.
REFRESH_DELAY_S = 0.5
#: Handler ids of the two watch-event handlers (their per-event success lines are not logged).
OWNER_EVENTS_ID, CHILD_EVENTS_ID = "owner-events", "child-events"


def status_refresher(kube: Kube, caches: Caches, delay_s: float = REFRESH_DELAY_S) -> Coalescer:
    """One coalesced status refresh per (namespace, InferenceDeployment name)."""

    async def refresh(key: Any) -> None:
        namespace, name = key
        metrics.STATUS_REFRESHES.inc()
        try:
            await refresh_status(kube, caches, namespace, name)
        except KubeError as exc:
            metrics.RECONCILE_ERRORS.labels(f"HTTP{exc.status}").inc()

    return Coalescer(refresh, delay_s)


async def _reconcile(trigger: str, body: kopf.Body, memo: kopf.Memo, logger: logging.Logger | Any) -> None:
    kube: Kube = memo["kube"]
    cfg: OperatorConfig = memo["config"]
    slots: asyncio.Semaphore = memo["reconcile_slots"]
    started = time.perf_counter()
    result = "ok"

    def post(event: Event) -> None:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)

    try:
        async with slots:
            outcome = await reconcile(kube, body, cfg, caches=memo["caches"], on_event=post)
    except InvalidSpec as exc:
        result = "invalid"
        metrics.RECONCILE_ERRORS.labels("InvalidSpec").inc()
        kopf.warn(body, reason="InvalidSpec", message=str(exc)[:1024])
        raise kopf.PermanentError(str(exc)) from exc
    except KubeError as exc:
        result = "error"
        metrics.RECONCILE_ERRORS.labels(f"HTTP{exc.status}").inc()
        kopf.warn(body, reason="ReconcileFailed", message=str(exc)[:1024])
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_S) from exc
    finally:
        metrics.RECONCILES.labels(trigger, result).inc()
        metrics.RECONCILE_SECONDS.labels(trigger).observe(time.perf_counter() - started)
    metrics.CHILDREN_APPLIED.inc(outcome.applied)
    if trigger in ("create", "update"):
        message = f"applied {outcome.applied} children ({trigger})"
        kopf.event(body, type="Normal", reason="Reconciled", message=message)
    logger.debug("reconciled (%s): %d children applied", trigger, outcome.applied)


def owner_key(child: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of the InferenceDeployment owning a child, None if none does."""
    meta = child.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == models.KIND and ref.get("apiVersion", "").startswith(f"{models.GROUP}/"):
            return meta.get("namespace", ""), str(ref.get("name"))
    return None


def _without_finalizer(registry: kopf.OperatorRegistry, fn: Any) -> None:
    # Kopf marks every timer and daemon as needing a finalizer (to stop it before deletion).
    # Baton's only re-apply children or patch replicas, which is harmless if it races a
    # deletion, and Baton promises no finalizers (garbage collection deletes the children), so
    # the flag is cleared.
    spawning = registry._spawning
    spawning._handlers = [
        dataclasses.replace(h, requires_finalizer=False) if h.fn is fn else h for h in spawning._handlers
    ]


def register(registry: kopf.OperatorRegistry, resync_seconds: float) -> None:
    """Register Baton's handlers into `registry`."""
    group, version, plural = models.GROUP, models.VERSION, models.PLURAL

    @kopf.on.create(group, version, plural, registry=registry, id="reconcile")
    async def on_create(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        await _reconcile("create", body, memo, logger)

    @kopf.on.update(group, version, plural, registry=registry, id="reconcile", field="spec")
    async def on_update(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        await _reconcile("update", body, memo, logger)

    @kopf.on.resume(group, version, plural, registry=registry, id="reconcile")
    async def on_resume(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        await _reconcile("resume", body, memo, logger)

    @kopf.timer(
        group,
        version,
        plural,
        registry=registry,
        id="resync",
        interval=resync_seconds,
        initial_delay=resync_seconds,
    )
    async def resync(body: kopf.Body, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        await _reconcile("timer", body, memo, logger)

    _without_finalizer(registry, resync)
    _without_finalizer(registry, autoscale_handler.register(registry))

    @kopf.on.event(group, version, plural, registry=registry, id=OWNER_EVENTS_ID)
    async def owner_seen(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
        # Every version of every InferenceDeployment, our own status patches included, so that
        # a status refresh reads its spec and stored status from memory.
        caches: Caches = memo["caches"]
        if type == "DELETED":
            caches.owners.forget(body)
            memo["refresher"].cancel((body["metadata"]["namespace"], body["metadata"]["name"]))
        else:
            caches.owners.observe(body)

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        registry=registry,
        labels={contract.LABEL_MANAGED_BY: contract.MANAGED_BY},
        id=CHILD_EVENTS_ID,
    )
    async def child_changed(body: kopf.Body, type: str | None, memo: kopf.Memo, **_: Any) -> None:
        caches: Caches = memo["caches"]
        if type == "DELETED":
            caches.deployments.forget(body)
            changed = True
        else:
            # False for the operator's own applies (their answers are cached already) and for
            # changes outside spec.replicas and status.
            changed = caches.deployments.observe(body)
        key = owner_key(body)
        if changed and key is not None and type is not None:  # None: the initial listing
            refresher: Coalescer = memo["refresher"]
            refresher.request(key)
