"""Kopf handlers: thin wrappers that hand each resource's work to its jobs (`workers`) and keep
the watch caches.

Kopf's own handlers only ask: a created, changed (spec) or resumed resource gets a reconcile
from its reconcile job at once. The owner watch starts, updates and ends the resource's jobs;
the child Deployment watch triggers coalesced status refreshes. Handlers are registered into a
given registry by `register()` (not at import), so tests can build their own operator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kopf

from baton_engine import contract
from baton_operator import metrics, models
from baton_operator.coalesce import Coalescer
from baton_operator.kube import Kube, KubeError
from baton_operator.memo import OperatorMemo
from baton_operator.object_cache import ObjectCache, PodIndex
from baton_operator.reconcile import Caches, refresh_status

#: A child's status changes arrive in bursts (pods scheduled, started, Ready, for three
#: Deployments): the owner's status is recomputed once per burst, this long after its start.
REFRESH_DELAY_S = 0.5
#: Handler ids of the watch-event handlers (their per-event success lines are not logged).
OWNER_EVENTS_ID, CHILD_EVENTS_ID, POD_EVENTS_ID = "owner-events", "child-events", "pod-events"


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


def owner_key(child: Mapping[str, Any]) -> tuple[str, str] | None:
    """(namespace, name) of the InferenceDeployment owning a child, None if none does."""
    meta = child.get("metadata", {})
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == models.KIND and ref.get("apiVersion", "").startswith(f"{models.GROUP}/"):
            return meta.get("namespace", ""), str(ref.get("name"))
    return None


def _cached(cache: ObjectCache | PodIndex, body: Mapping[str, Any], type: str | None) -> bool:
    """Keep `cache` current with one watch event; whether what it holds changed."""
    if type == "DELETED":
        cache.forget(body)
        return True
    return cache.observe(body)


def register(registry: kopf.OperatorRegistry) -> None:
    """Register Baton's handlers into `registry`."""
    group, version, plural = models.GROUP, models.VERSION, models.PLURAL

    @kopf.on.create(group, version, plural, registry=registry, id="reconcile")
    async def on_create(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        memo.workers.request(dict(body), "create")

    @kopf.on.update(group, version, plural, registry=registry, id="reconcile", field="spec")
    async def on_update(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        memo.workers.request(dict(body), "update")

    @kopf.on.resume(group, version, plural, registry=registry, id="reconcile")
    async def on_resume(body: kopf.Body, memo: OperatorMemo, **_: Any) -> None:
        memo.workers.request(dict(body), "resume")

    @kopf.on.event(group, version, plural, registry=registry, id=OWNER_EVENTS_ID)
    async def owner_seen(body: kopf.Body, type: str | None, memo: OperatorMemo, **_: Any) -> None:
        # Every version of every InferenceDeployment, our own status patches included: the
        # cache lets a status refresh read spec and stored status from memory, and tells the
        # jobs which UID is live. The jobs' tasks start here, inside Kopf's handling of this
        # resource, so that their Events go out through Kopf's posting queue.
        snapshot = dict(body)
        if type == "DELETED":
            memo.caches.owners.forget(snapshot)
            memo.workers.forget(snapshot)
            memo.refresher.cancel((body["metadata"]["namespace"], body["metadata"]["name"]))
        else:
            memo.caches.owners.observe(snapshot)
            memo.workers.observe(snapshot)

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        registry=registry,
        labels={contract.LABEL_MANAGED_BY: contract.MANAGED_BY},
        id=CHILD_EVENTS_ID,
    )
    async def child_changed(body: kopf.Body, type: str | None, memo: OperatorMemo, **_: Any) -> None:
        # Unchanged for the operator's own applies (their answers are cached already) and for
        # changes outside spec.replicas and status.
        changed = _cached(memo.caches.deployments, body, type)
        key = owner_key(body)
        if changed and key is not None and type is not None:  # None: the initial listing
            memo.refresher.request(key)

    @kopf.on.event(
        "",
        "v1",
        "pods",
        registry=registry,
        labels={contract.LABEL_MANAGED_BY: contract.MANAGED_BY},
        id=POD_EVENTS_ID,
    )
    async def pod_changed(body: kopf.Body, type: str | None, memo: OperatorMemo, **_: Any) -> None:
        # The pools' pods say why a pool is stuck (unschedulable, image pulls, crash loops).
        pods = memo.caches.pods
        changed = _cached(pods, body, type)
        key = pods.owner(body)
        if changed and key is not None and type is not None:
            memo.refresher.request(key)
            # A KV-key rollout's next step waits for pods to become Ready or to go.
            rolling = memo.caches.rollouts.get(key)
            lease = memo.workers.lease(*key) if rolling is not None and rolling[0] else None
            if lease is not None:
                lease.request("rollout")
