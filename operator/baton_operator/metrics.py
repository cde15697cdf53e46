"""The operator's Prometheus metrics (served on contract.DEFAULT_OPERATOR_METRICS_PORT)."""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from baton_operator.autoscaler.telemetry import AutoscalerMetrics

RECONCILES = Counter(
    "baton_operator_reconciles",
    "Reconciles of InferenceDeployments, by trigger and result.",
    ["trigger", "result"],
)
RECONCILE_SECONDS = Histogram(
    "baton_operator_reconcile_duration_seconds",
    "Wall time of one reconcile (all child applies and the status patch).",
    ["trigger"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RECONCILE_ERRORS = Counter(
    "baton_operator_reconcile_errors", "Reconciles that failed, by error type.", ["error"]
)
STATUS_PATCHES = Counter(
    "baton_operator_status_patches",
    "Status computations, by result: written (patched) or unchanged (no request sent).",
    ["result"],
)
STATUS_REFRESHES = Counter(
    "baton_operator_status_refreshes", "Coalesced status refreshes run after child Deployment changes."
)
API_REQUESTS = Counter(
    "baton_operator_api_requests",
    "Requests the operator's own client sent to the API server (Kopf's watches not included).",
    ["verb", "resource"],
)


def count_api_request(verb: str, resource: str) -> None:
    """The operator's `Kube` request hook."""
    API_REQUESTS.labels(verb, resource).inc()


CHILDREN_APPLIED = Counter("baton_operator_children_applied", "Child objects server-side applied.")
ACTIVE = Gauge("baton_operator_active", "1 while this replica is the active peer (processing events).")
AUTOSCALER = AutoscalerMetrics(REGISTRY)
AUTOSCALER_TICKS = Counter(
    "baton_autoscaler_ticks", "Built-in autoscaler ticks, by result (ok, skipped, error).", ["result"]
)
