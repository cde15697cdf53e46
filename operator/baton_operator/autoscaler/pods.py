"""From engine Pods (as the API server returns them, JSON) to scrape targets and pending pods.

Pods are plain mappings in the API's camelCase shape (``kopf`` bodies, ``kubectl get -o json``,
or a kubernetes-asyncio object passed through ``ApiClient.sanitize_for_serialization``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from baton_engine.contract import DEFAULT_HTTP_PORT, ENGINE_ROLES, LABEL_ROLE, PORT_HTTP, ROLE_ROUTER

from .metrics import ScrapeTarget, metrics_url
from .policy_types import PendingPod


@dataclass(frozen=True)
class PodView:
    """What the autoscaler needs from the engine Pods of one InferenceDeployment."""

    targets: tuple[ScrapeTarget, ...]  # running pods with an IP: scrape these
    pending: tuple[PendingPod, ...]  # not yet running


def _get(obj: Mapping[str, Any], *path: str) -> Any:
    node: Any = obj
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def _condition(pod: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    for cond in _get(pod, "status", "conditions") or ():
        if isinstance(cond, Mapping) and cond.get("type") == kind:
            return cond
    return None


def _http_port(pod: Mapping[str, Any], port_name: str) -> int:
    for container in _get(pod, "spec", "containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == port_name and isinstance(port.get("containerPort"), int):
                return int(port["containerPort"])
    return int(DEFAULT_HTTP_PORT)


def _pending_reason(pod: Mapping[str, Any]) -> tuple[str, bool]:
    scheduled = _condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        reason = scheduled.get("reason") or "NotScheduled"
        message = scheduled.get("message")
        return (f"{reason}: {message}" if message else str(reason)), True
    waiting = [
        s.get("state", {}).get("waiting", {}).get("reason")
        for s in _get(pod, "status", "containerStatuses") or ()
        if isinstance(s, Mapping)
    ]
    return str(next((w for w in waiting if w), "Pending")), False


def view_pods(pods: Iterable[Mapping[str, Any]], *, port_name: str = PORT_HTTP) -> PodView:
    """Sort a deployment's engine Pods into scrape targets and pending pods.

    A pod being deleted counts as not ready (it is draining; the router already stopped sending
    to it). Pods that ended (Succeeded/Failed) or carry no engine role label are left out.
    """
    targets: list[ScrapeTarget] = []
    pending: list[PendingPod] = []
    for pod in pods:
        name = str(_get(pod, "metadata", "name") or "")
        role = _get(pod, "metadata", "labels", LABEL_ROLE)
        if role not in ENGINE_ROLES:
            continue
        phase = _get(pod, "status", "phase")
        if phase == "Pending":
            reason, unschedulable = _pending_reason(pod)
            pending.append(PendingPod(name, role, reason, unschedulable))
            continue
        ip = _get(pod, "status", "podIP")
        if phase != "Running" or not ip:
            continue
        ready_cond = _condition(pod, "Ready")
        ready = (
            ready_cond is not None
            and ready_cond.get("status") == "True"
            and _get(pod, "metadata", "deletionTimestamp") is None
        )
        targets.append(ScrapeTarget(name, role, metrics_url(str(ip), _http_port(pod, port_name)), ready))
    return PodView(tuple(targets), tuple(pending))


def router_targets(
    pods: Iterable[Mapping[str, Any]], *, port_name: str = PORT_HTTP
) -> tuple[ScrapeTarget, ...]:
    """The deployment's running router pods (their /metrics: held requests, requests seen).
    Ready or not: a router with no pool to send to may still be holding requests."""
    targets = []
    for pod in pods:
        if _get(pod, "metadata", "labels", LABEL_ROLE) != ROLE_ROUTER:
            continue
        ip = _get(pod, "status", "podIP")
        if _get(pod, "status", "phase") != "Running" or not ip or _get(pod, "metadata", "deletionTimestamp"):
            continue
        name = str(_get(pod, "metadata", "name") or "")
        targets.append(
            ScrapeTarget(name, ROLE_ROUTER, metrics_url(str(ip), _http_port(pod, port_name)), True)
        )
    return tuple(targets)
