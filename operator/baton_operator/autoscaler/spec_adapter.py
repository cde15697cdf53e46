"""``spec.autoscaling`` (the CRD's camelCase JSON) -> :class:`AutoscalingPolicy`.

Takes the JSON form (a Kopf body's ``spec["autoscaling"]`` or the CRD model's
``model_dump(by_alias=True)``), so the policy stays independent of the CRD models. Required
fields are the ones the CRD always fills (its schema defaults); the optional ones are extensions
the CRD may grow: ``prefill.targetQueuedPromptTokens``, ``decode.targetRunningRequests``,
``ratio.{minPrefillPerDecode,maxPrefillPerDecode}``, ``maxMetricAgeSeconds``.

Aggregated mode has one pool (role ``engine``) with the decode bounds, sized by the larger of
the queue-depth and the KV-usage recommendations. A ``minReplicas`` of 0 turns scale to zero on
(``scaleToZeroIdleSeconds``); in disaggregated mode both pools must have it (the CRD says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from baton_engine.contract import ROLE_AGGREGATED, ROLE_DECODE, ROLE_PREFILL

from .policy_types import AutoscalingPolicy, PoolPolicy, RatioBounds, ScaleToZero, StepPolicy

#: Samples older than this many decision intervals are stale (unless maxMetricAgeSeconds is set).
STALE_AFTER_INTERVALS = 3
#: scaleToZeroIdleSeconds when a body without the CRD's defaults leaves it out.
DEFAULT_IDLE_S = 300.0

Mode = Literal["disaggregated", "aggregated"]


def _obj(raw: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must be an object")
    return raw


def _number(obj: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> float | None:
    value = obj.get(key)
    if value is None:
        if required:
            raise ValueError(f"{where}.{key}: required")
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}.{key}: must be a number, got {value!r}")
    return float(value)


def _int(obj: Mapping[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if value is None:
        raise ValueError(f"{where}.{key}: required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key}: must be an integer, got {value!r}")
    return value


def _step(raw: Any, where: str) -> StepPolicy:
    obj = _obj(raw, where)
    window = _number(obj, "stabilizationWindowSeconds", where)
    return StepPolicy(max_step=_int(obj, "maxStep", where), stabilization_window_s=window or 0.0)


def policy_from_spec(autoscaling: Mapping[str, Any], mode: Mode = "disaggregated") -> AutoscalingPolicy:
    """Build the policy; a missing or mistyped field is an error naming its path."""
    root = "spec.autoscaling"
    spec = _obj(autoscaling, root)
    up = _step(spec.get("scaleUp"), f"{root}.scaleUp")
    down = _step(spec.get("scaleDown"), f"{root}.scaleDown")
    prefill = _obj(spec.get("prefill"), f"{root}.prefill")
    decode = _obj(spec.get("decode"), f"{root}.decode")
    where_p, where_d = f"{root}.prefill", f"{root}.decode"
    queue = _number(prefill, "targetQueueDepth", where_p)
    tokens = _number(prefill, "targetQueuedPromptTokens", where_p, required=False)
    kv = _number(decode, "targetKVUsage", where_d)
    running = _number(decode, "targetRunningRequests", where_d, required=False)

    def pool(role: str, bounds: Mapping[str, Any], where: str, **targets: float | None) -> PoolPolicy:
        """A pool sized between the min/max replicas of `bounds` by the given targets."""
        low, high = _int(bounds, "minReplicas", where), _int(bounds, "maxReplicas", where)
        return PoolPolicy(role, low, high, up, down, **targets)

    queue_targets = {"target_queue_depth": queue, "target_queued_tokens": tokens}
    kv_targets = {"target_kv_usage": kv, "target_running_requests": running}
    if mode == "aggregated":
        pools: tuple[PoolPolicy, ...] = (
            pool(ROLE_AGGREGATED, decode, where_d, **queue_targets, **kv_targets),
        )
        ratio = None
    elif mode == "disaggregated":
        pools = (
            pool(ROLE_PREFILL, prefill, where_p, **queue_targets),
            pool(ROLE_DECODE, decode, where_d, **kv_targets),
        )
        ratio = None
        if spec.get("ratio") is not None:
            r = _obj(spec["ratio"], f"{root}.ratio")
            ratio = RatioBounds(
                _number(r, "minPrefillPerDecode", f"{root}.ratio", required=False),
                _number(r, "maxPrefillPerDecode", f"{root}.ratio", required=False),
            )
    else:
        raise ValueError(f"spec.mode: must be disaggregated or aggregated, got {mode!r}")

    max_age = _number(spec, "maxMetricAgeSeconds", root, required=False)
    if max_age is None:
        interval = _number(spec, "intervalSeconds", root)
        max_age = STALE_AFTER_INTERVALS * (interval or 0.0)
    zero = None
    if any(p.min_replicas == 0 for p in pools):
        idle = _number(spec, "scaleToZeroIdleSeconds", root, required=False)
        zero = ScaleToZero(idle_s=DEFAULT_IDLE_S if idle is None else idle)
    return AutoscalingPolicy(pools=pools, ratio=ratio, max_metric_age_s=max_age, scale_to_zero=zero)
