"""One built-in autoscaler tick for one InferenceDeployment: pods -> scrape -> decide -> patch.

Kopf-free (the handler, the tests and the benchmark call it). Replicas are written by
server-side apply of ``spec.replicas`` alone under :data:`FIELD_MANAGER`, so the operator (which
omits replicas unless autoscaling is off) and the autoscaler never fight over the field.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from baton_engine import contract
from baton_operator.events import EventSink
from baton_operator.kube import Kube, KubeError
from baton_operator.workers import ResourceGone, ResourceId

from .collect import collect
from .policy import decide
from .policy_types import Decision, History, PodSample
from .settle import Settled, WriteFailure, resized, settle
from .spec_adapter import policy_from_spec
from .status_record import history_from_dict, history_to_dict, material_change, rfc3339, status_summary

FIELD_MANAGER = "baton-autoscaler"
#: History older than the longest window plus this margin is dropped before it is stored.
HISTORY_MARGIN_S = 60.0


@dataclass
class TickResult:
    decision: Decision
    history: History  # to pass to the next tick: holds exactly the scale actions written
    samples: tuple[PodSample, ...]
    settled: Settled
    status: dict[str, Any] = field(default_factory=dict)
    #: What was not done (refused pool writes, status not saved), for the caller to raise.
    failures: list[str] = field(default_factory=list)
    #: Why status.autoscaling was written (None: nothing new, not written).
    status_change: str | None = None


def stored_history(body: Mapping[str, Any]) -> History:
    """The history a previous operator left in ``status.autoscaling.history`` (empty if none or
    unreadable: a corrupt record must not stop autoscaling, it only restarts the windows)."""
    raw = ((body.get("status") or {}).get("autoscaling") or {}).get("history")
    if not raw:
        return History()
    try:
        return history_from_dict(json.loads(raw))
    except ValueError:
        return History()


def _trim(history: History, keep_s: float, now: float) -> History:
    cutoff = now - keep_s
    return dataclasses.replace(
        history,
        recommendations=tuple(r for r in history.recommendations if r.at >= cutoff),
        actions=tuple(a for a in history.actions if a.at >= cutoff),
    )


def _replicas(deployment: Mapping[str, Any] | None) -> int:
    if deployment is None:
        return 0
    value = (deployment.get("spec") or {}).get("replicas")
    return int(value) if isinstance(value, int) else 1  # the API's default


async def _write_replicas(kube: Kube, namespace: str, name: str, replicas: int) -> WriteFailure | None:
    manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"replicas": replicas},
    }
    try:
        await kube.apply(manifest, field_manager=FIELD_MANAGER)
    except KubeError as exc:
        return WriteFailure(exc.status, exc.reason, exc.message)
    return None


def _no_guard() -> None:
    return None


def rolling_out(pods: Sequence[Mapping[str, Any]], roles: Sequence[str]) -> bool:
    """Whether a pool's pods carry more than one KV-compatibility key: a rollout of a new key is
    under way (see `baton_operator.rollout`), which sets the replicas itself until it is done."""
    keys: dict[str, set[str]] = {}
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        role = labels.get(contract.LABEL_ROLE)
        if role in roles:
            keys.setdefault(str(role), set()).add(str(labels.get(contract.LABEL_KV_COMPAT, "")))
    return any(len(found) > 1 for found in keys.values())


async def autoscale_once(
    kube: Kube,
    body: Mapping[str, Any],
    history: History,
    *,
    client: httpx.AsyncClient | None = None,
    scrape_timeout_s: float = 2.0,
    clock: Callable[[], float] = time.time,
    on_event: EventSink | None = None,
    guard: Callable[[], None] = _no_guard,
) -> TickResult | None:
    """Decide and apply once. None when the deployment is not in builtin mode or a role
    Deployment does not exist yet (the reconcile creates it); raises KubeError when reading
    fails (nothing written then), and ResourceGone, writing nothing more, once `guard` says the
    resource is not the live one or its status patch finds it gone.

    Every resized pool's write is attempted, whatever another's did. The history (returned and
    saved in status) keeps the actions written; each pool's Event (resized or refused) goes to
    `on_event` once all writes are done, before status is saved. What was not done is listed
    in ``failures``: the result comes back regardless, so the caller keeps the history."""
    spec = body.get("spec") or {}
    autoscaling = spec.get("autoscaling") or {}
    if autoscaling.get("mode") != "builtin":
        return None
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    mode = spec.get("mode", "disaggregated")
    policy = policy_from_spec(autoscaling, mode=mode)
    roles = [pool.role for pool in policy.pools]

    deployments = {
        role: await kube.get("apps/v1", "Deployment", namespace, f"{name}-{role}") for role in roles
    }
    if any(d is None for d in deployments.values()):
        return None
    replicas = {role: _replicas(d) for role, d in deployments.items()}
    pods = await kube.list("v1", "Pod", namespace, {contract.LABEL_DEPLOYMENT: name})
    if rolling_out(pods, roles):
        return None  # a KV-key rollout steps the pools' replicas until it is done
    observations = await collect(
        pods,
        replicas,
        client=client,
        timeout_s=scrape_timeout_s,
        clock=clock,
        routers=policy.scale_to_zero is not None,
    )
    now = clock()
    decision, new_history = decide(policy, observations, history, now)

    writes = {}
    for r in resized(decision):
        guard()
        writes[r.role] = await _write_replicas(kube, namespace, f"{name}-{r.role}", r.desired)
    settled = settle(decision, new_history, writes)
    if on_event is not None:
        for event in settled.events:
            on_event(event)
    longest = max(
        max(p.scale_up.stabilization_window_s, p.scale_down.stabilization_window_s) for p in policy.pools
    )
    result = TickResult(
        decision, _trim(settled.history, longest + HISTORY_MARGIN_S, now), observations.samples, settled
    )
    if settled.failed:
        result.failures.append(f"replicas not written: {settled.failure_summary()}")
    scraped = [s.scraped_at for s in observations.samples if s.load is not None]
    result.status = {
        **status_summary(decision),
        "currentReplicas": {r.role: r.current for r in decision.roles},
        "action": decision.action,
        "scrapedAt": rfc3339(max(scraped)) if scraped else None,
        "history": json.dumps(history_to_dict(result.history), separators=(",", ":")),
    }
    stored = (body.get("status") or {}).get("autoscaling") or {}
    result.status_change = material_change(stored, result.status, now)
    if result.status_change is None:
        return result  # nothing new to say: the resource is not rewritten
    # A merge patch merges maps: metrics no longer reported are nulled, not left stale.
    previous = stored.get("metrics") or {}
    metrics_patch: dict[str, Any] = {key: None for key in previous}
    metrics_patch.update(result.status["metrics"])
    guard()
    gone = ResourceGone(ResourceId(namespace, name, str(meta["uid"])))
    patch = {"autoscaling": {**result.status, "metrics": metrics_patch}}
    try:
        answer = await kube.patch_status(namespace, name, patch, field_manager=FIELD_MANAGER)
    except KubeError as exc:
        if exc.status == 404:
            raise gone from exc
        result.failures.append(f"status not saved: {exc}")
        return result
    if answer.get("metadata", {}).get("uid") != meta["uid"]:
        raise gone
    return result
