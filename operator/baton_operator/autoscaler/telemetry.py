"""What the operator reports about autoscaling: Prometheus metrics and Kubernetes Event texts."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from .policy_types import Decision, PodSample, RoleDecision

M_SCALE_ACTIONS = "baton_autoscaler_scale_actions_total"
M_DECISIONS = "baton_autoscaler_decisions_total"
M_DESIRED = "baton_autoscaler_desired_replicas"
M_CURRENT = "baton_autoscaler_current_replicas"
M_SCRAPE_FAILURES = "baton_autoscaler_scrape_failures_total"
M_SCALE_FAILURES = "baton_autoscaler_scale_failures_total"

_KEY = ["namespace", "deployment"]

EVENT_REASONS = {"up": "ScaledUp", "down": "ScaledDown"}


class AutoscalerMetrics:
    """The autoscaler's series in the operator's registry, labelled by resource and role."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.scale_actions = Counter(
            M_SCALE_ACTIONS.removesuffix("_total"),
            "Scale actions taken by the built-in autoscaler (replicas written).",
            [*_KEY, "role", "direction"],
            registry=registry,
        )
        self.scale_failures = Counter(
            M_SCALE_FAILURES.removesuffix("_total"),
            "Scale actions decided but not written (the API server refused or did not answer).",
            [*_KEY, "role", "direction"],
            registry=registry,
        )
        self.decisions = Counter(
            M_DECISIONS.removesuffix("_total"),
            "Autoscaling decisions, by overall action.",
            [*_KEY, "action"],
            registry=registry,
        )
        self.desired = Gauge(
            M_DESIRED, "Replicas the last decision asked for.", [*_KEY, "role"], registry=registry
        )
        self.current = Gauge(
            M_CURRENT, "Replicas when the last decision was made.", [*_KEY, "role"], registry=registry
        )
        self.scrape_failures = Counter(
            M_SCRAPE_FAILURES.removesuffix("_total"),
            "Engine /metrics scrapes that failed (the pod counted as unknown).",
            [*_KEY, "role"],
            registry=registry,
        )
        self._roles: dict[tuple[str, str], set[str]] = {}

    def record(
        self,
        namespace: str,
        deployment: str,
        decision: Decision,
        samples: Iterable[PodSample] = (),
        *,
        scaled: Iterable[tuple[str, str]],
        refused: Iterable[tuple[str, str]] = (),
    ) -> None:
        """One decision; `scaled` and `refused` are the (role, direction) of the resizes written
        and of those the API server refused (see ``settle``)."""
        self.decisions.labels(namespace, deployment, decision.action).inc()
        roles = self._roles.setdefault((namespace, deployment), set())
        for r in decision.roles:
            roles.add(r.role)
            self.desired.labels(namespace, deployment, r.role).set(r.desired)
            self.current.labels(namespace, deployment, r.role).set(r.current)
        for role, direction in scaled:
            self.scale_actions.labels(namespace, deployment, role, direction).inc()
        for role, direction in refused:
            self.scale_failures.labels(namespace, deployment, role, direction).inc()
        for s in samples:
            if s.load is None:
                self.scrape_failures.labels(namespace, deployment, s.role).inc()

    def forget(self, namespace: str, deployment: str) -> None:
        """Drop a deleted resource's gauges (counters stay: they are history)."""
        for role in self._roles.pop((namespace, deployment), set()):
            for gauge in (self.desired, self.current):
                try:
                    gauge.remove(namespace, deployment, role)
                except KeyError:
                    pass


def scale_event(role: RoleDecision) -> tuple[str, str] | None:
    """(reason, message) of the Kubernetes Event for a pool's resize; None when it holds."""
    if role.action not in EVENT_REASONS:
        return None
    return EVENT_REASONS[role.action], f"{role.role}: {role.reason}"
