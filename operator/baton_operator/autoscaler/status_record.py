"""What the autoscaler records in `status.autoscaling`: its decisions and history as JSON
(camelCase, RFC 3339 times), and when a decision is worth rewriting the resource for.

Keeping the history in status lets a restarted operator honour windows it had already begun.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

from .policy_types import Decision, History, PoolMetrics, Recommendation, ScaleAction


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _metrics(m: PoolMetrics | None) -> dict[str, Any] | None:
    if m is None:
        return None
    return {
        "readyPods": m.ready_pods,
        "knownPods": m.known_pods,
        "unknownPods": m.unknown_pods,
        "stalePods": m.stale_pods,
        "waitingRequests": _round(m.waiting),
        "runningRequests": _round(m.running),
        "kvUsage": _round(m.kv_usage),
        "queuedPromptTokens": _round(m.queued_prompt_tokens),
        "oldestSampleAgeSeconds": _round(m.oldest_sample_age_s, 3),
    }


def decision_status(decision: Decision) -> dict[str, Any]:
    """The ``status.autoscaling.lastDecision`` object."""
    return {
        "time": rfc3339(decision.at),
        "action": decision.action,
        "reason": decision.reason,
        "pools": {
            r.role: {
                "currentReplicas": r.current,
                "desiredReplicas": r.desired,
                "recommendedReplicas": r.recommended,
                "action": r.action,
                "reason": r.reason,
                "metrics": _metrics(r.metrics),
            }
            for r in decision.roles
        },
    }


MAX_REASON_CHARS = 4096


def flat_metrics(decision: Decision) -> dict[str, float]:
    """The numbers each pool's decision used, flat: ``{"prefill.waitingRequests": 14.0, ...}``."""
    flat: dict[str, float] = {}
    for r in decision.roles:
        for key, value in (_metrics(r.metrics) or {}).items():
            if value is not None:
                flat[f"{r.role}.{key}"] = float(value)
    return flat


def status_summary(decision: Decision) -> dict[str, Any]:
    """``status.autoscaling`` in the CRD's flat shape: lastDecision, reason, metrics, time."""
    reason = decision.reason
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 3] + "..."
    return {
        "lastDecision": decision.desired,
        "reason": reason,
        "metrics": flat_metrics(decision),
        "time": rfc3339(decision.at),
    }


def history_to_dict(history: History) -> dict[str, Any]:
    """Compact: recommendations as [unix time, role, replicas], actions as [time, role, from, to];
    with scale to zero also when a request was last seen and the routers' request count then."""
    out: dict[str, Any] = {
        "recommendations": [[round(r.at, 3), r.role, r.replicas] for r in history.recommendations],
        "actions": [[round(a.at, 3), a.role, a.from_replicas, a.to_replicas] for a in history.actions],
    }
    if history.active_at is not None:
        out["activeAt"] = round(history.active_at, 3)
    if history.router_requests is not None:
        out["routerRequests"] = history.router_requests
    return out


def _optional_number(raw: dict[str, Any], key: str) -> float | None:
    value = raw.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"history.{key}: must be a non-negative number, got {value!r}")
    return float(value)


def _row(raw: Any, where: str, width: int) -> tuple[float, str, list[int]]:
    if not isinstance(raw, list) or len(raw) != width:
        raise ValueError(f"{where}: must be a list of {width} items")
    at, role, *counts = raw
    if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
        raise ValueError(f"{where}[0]: must be a unix time, got {at!r}")
    if not isinstance(role, str):
        raise ValueError(f"{where}[1]: must be a role name, got {role!r}")
    for i, n in enumerate(counts, start=2):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{where}[{i}]: must be a replica count, got {n!r}")
    return float(at), role, counts


def history_from_dict(raw: Any) -> History:
    """Inverse of :func:`history_to_dict`; a malformed entry is an error naming it."""
    if not isinstance(raw, dict):
        raise ValueError("history: must be an object")
    recs_raw = raw.get("recommendations", [])
    acts_raw = raw.get("actions", [])
    if not isinstance(recs_raw, list):
        raise ValueError("history.recommendations: must be a list")
    if not isinstance(acts_raw, list):
        raise ValueError("history.actions: must be a list")
    recs = []
    for i, item in enumerate(recs_raw):
        at, role, (n,) = _row(item, f"history.recommendations[{i}]", 3)
        recs.append(Recommendation(at, role, n))
    acts = []
    for i, item in enumerate(acts_raw):
        at, role, (frm, to) = _row(item, f"history.actions[{i}]", 4)
        acts.append(ScaleAction(at, role, frm, to))
    return History(
        tuple(sorted(recs, key=lambda r: r.at)),
        tuple(sorted(acts, key=lambda a: a.at)),
        active_at=_optional_number(raw, "activeAt"),
        router_requests=_optional_number(raw, "routerRequests"),
    )


#: A stored decision is rewritten at least this often, so that the history a restarted operator
#: reads is never older than this (its windows then start from slightly less history).
STATUS_HEARTBEAT_S = 60.0
#: A metric changed materially when it moved by more than this fraction of its stored value...
METRIC_RELATIVE_CHANGE = 0.1
#: ... and by more than this much (KV usage ratios wander by a few hundredths at steady load).
METRIC_ABSOLUTE_CHANGE = 0.05
#: Metrics of the tick, not of the load, never compared: how old a pool's oldest sample was at
#: the decision is the scrape's latency (tens of milliseconds more from a busy engine or node at
#: the same load); a sample too old to act on counts in stalePods, which is compared.
TICK_METRICS = frozenset({"oldestSampleAgeSeconds"})


def _parse(time: Any) -> float | None:
    if not isinstance(time, str):
        return None
    try:
        return datetime.fromisoformat(time.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _metric_moved(old: Any, new: Any) -> bool:
    if not isinstance(old, int | float) or not isinstance(new, int | float):
        return bool(old != new)
    return abs(new - old) > max(METRIC_RELATIVE_CHANGE * abs(old), METRIC_ABSOLUTE_CHANGE)


def material_change(stored: Any, fresh: Any, now: float) -> str | None:
    """Why `fresh` (a tick's ``status.autoscaling``) must be written over `stored`, or None when
    it says nothing new: the decision (replicas asked for, replicas seen, action), a scale action
    in the history, a metric reported or gone, a load metric that moved materially, or a stored
    decision older than STATUS_HEARTBEAT_S. Recommendations, reasons and TICK_METRICS alone do
    not count: at steady load the status (and so the resource's resourceVersion) stays still."""
    if not isinstance(stored, dict) or not stored:
        return "first decision"
    for key in ("lastDecision", "currentReplicas", "action"):
        if stored.get(key) != fresh.get(key):
            return key
    old_history, new_history = stored.get("history"), fresh.get("history")
    try:
        old_actions = json.loads(old_history).get("actions") if isinstance(old_history, str) else None
        new_actions = json.loads(new_history).get("actions") if isinstance(new_history, str) else None
    except (ValueError, AttributeError):
        return "history"
    if old_actions != new_actions:
        return "scale actions"
    old_metrics, new_metrics = stored.get("metrics") or {}, fresh.get("metrics") or {}
    if set(old_metrics) != set(new_metrics):
        return "metrics reported"
    moved = sorted(
        key
        for key in new_metrics
        if key.rsplit(".", 1)[-1] not in TICK_METRICS and _metric_moved(old_metrics[key], new_metrics[key])
    )
    if moved:
        return f"metrics {', '.join(moved)}"
    written = _parse(stored.get("time"))
    if written is None or now - written >= STATUS_HEARTBEAT_S:
        return "heartbeat"
    return None
