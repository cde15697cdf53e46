"""The autoscaling policy: a pure function (policy, observations, history, now) -> decision.

Per pool (role), every tick:

1. A pool below ``min_replicas`` or above ``max_replicas`` is brought inside at once.
2. Measure: only ready pods count. Samples older than ``max_metric_age_s`` are stale, failed
   scrapes are unknown; neither is ever read as zero load. If no ready pod has a fresh sample, or
   more than ``max_unknown_fraction`` of them lack one, the pool holds.
3. Recommend: one number per configured target, the largest wins, clamped to [min, max]:
   queue depth ``ceil(total waiting / target)``, queued prompt tokens likewise, KV usage
   ``ceil(ready pods * mean usage / target)`` (the HPA ratio), running ``ceil(total / target)``.
   Unknown pods are assumed to carry the known pods' mean load.
4. Prefill:decode ratio bounds raise the lagging pool's recommendation.
5. Stabilise: scale up to the lowest recommendation of the up-window (at once without one), by
   at most ``max_step``, unless a pod of the pool is Pending unschedulable (no GPU to put a new
   one on either). Scale down to the highest recommendation of the down-window, only once the
   history covers that window, no pod is unknown, and the last scale-down is a window ago; by at
   most ``max_step`` — so at most one scale-down per window.

Which mode applies (builtin / external / off) is the caller's business: ``decide`` is for builtin.
Reason strings are stable: tests and users read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from baton_engine.contract import ROLE_DECODE, ROLE_PREFILL

from .policy_types import (
    Action,
    AutoscalingPolicy,
    Decision,
    History,
    Observations,
    PodSample,
    PoolMetrics,
    PoolPolicy,
    Recommendation,
    RoleDecision,
    ScaleAction,
)

# Float noise must not add a replica: 0.9 * 2 / 0.6 is 3.0000000000000004.
_EPS = 1e-9


def _ceil(x: float) -> int:
    return max(0, math.ceil(x - _EPS))


def _num(x: float) -> str:
    """Counts and seconds: integral values without a fraction, others to two decimals."""
    return str(round(x)) if abs(x - round(x)) < _EPS else f"{x:.2f}"


def _pods(n: int, kind: str = "") -> str:
    noun = "pod" if n == 1 else "pods"
    return f"{n} {kind} {noun}" if kind else f"{n} {noun}"


@dataclass
class _Measured:
    """One pool's measurement: a recommendation with its explanation, or why there is none."""

    metrics: PoolMetrics | None
    recommended: int | None = None
    terms: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    no_data: str | None = None

    def explain(self) -> str:
        return f"recommend {self.recommended} ({', '.join(self.terms + self.notes)})"


def _sum_or_none(values: list[float | None]) -> float | None:
    if any(v is None for v in values):
        return None
    return sum(v for v in values if v is not None)


def _pool_metrics(samples: list[PodSample], policy: AutoscalingPolicy, now: float) -> PoolMetrics:
    """Totals over the ready pods; pods without a fresh sample are assumed at the known mean."""
    ready = [s for s in samples if s.ready]
    fresh = [s for s in ready if now - s.scraped_at <= policy.max_metric_age_s]
    loads = [s.load for s in fresh if s.load is not None]
    counts = (len(ready), len(loads), len(fresh) - len(loads), len(ready) - len(fresh))
    oldest = max((now - s.scraped_at for s in ready), default=None)
    if not loads:
        return PoolMetrics(*counts, None, None, None, None, oldest)
    scale = len(ready) / len(loads)
    tokens = _sum_or_none([x.queued_prompt_tokens for x in loads])
    return PoolMetrics(
        *counts,
        waiting=sum(x.waiting for x in loads) * scale,
        running=sum(x.running for x in loads) * scale,
        kv_usage=sum(x.kv_usage for x in loads) / len(loads),
        queued_prompt_tokens=tokens * scale if tokens is not None else None,
        oldest_sample_age_s=oldest,
    )


def _why_no_data(m: PoolMetrics, policy: AutoscalingPolicy) -> str | None:
    if m.ready_pods == 0:
        return "no ready pods to measure"
    unusable = m.ready_pods - m.known_pods
    if m.known_pods and unusable / m.ready_pods <= policy.max_unknown_fraction:
        return None
    parts = [f"{m.unknown_pods} unknown"] if m.unknown_pods else []
    if m.stale_pods:
        parts.append(f"{m.stale_pods} older than {_num(policy.max_metric_age_s)}s")
    return (
        f"no usable metrics from {unusable} of {_pods(m.ready_pods, 'ready')} ({', '.join(parts)}), "
        f"above the {policy.max_unknown_fraction:.0%} limit"
    )


def _measure(pool: PoolPolicy, samples: list[PodSample], policy: AutoscalingPolicy, now: float) -> _Measured:
    metrics = _pool_metrics(samples, policy, now)
    no_data = _why_no_data(metrics, policy)
    if no_data is not None:
        return _Measured(metrics, no_data=no_data)
    ready, unusable = metrics.ready_pods, metrics.ready_pods - metrics.known_pods
    # With a known pod, the totals are set (see _pool_metrics).
    waiting, running, kv_usage = metrics.waiting or 0.0, metrics.running or 0.0, metrics.kv_usage or 0.0
    tokens = metrics.queued_prompt_tokens

    measured = _Measured(metrics)
    candidates: list[int] = []
    if pool.target_queue_depth is not None:
        n = _ceil(waiting / pool.target_queue_depth)
        candidates.append(n)
        measured.terms.append(f"queue depth {_num(waiting)} / target {_num(pool.target_queue_depth)} -> {n}")
    if pool.target_queued_tokens is not None:
        if tokens is None:
            measured.notes.append("queued prompt tokens not exported")
        else:
            n = _ceil(tokens / pool.target_queued_tokens)
            candidates.append(n)
            measured.terms.append(
                f"queued prompt tokens {_num(tokens)} / target {_num(pool.target_queued_tokens)} -> {n}"
            )
    if pool.target_kv_usage is not None:
        n = _ceil(ready * kv_usage / pool.target_kv_usage)
        candidates.append(n)
        measured.terms.append(
            f"KV usage {kv_usage:.2f} x {_pods(ready)} / target {pool.target_kv_usage:.2f} -> {n}"
        )
    if pool.target_running_requests is not None:
        n = _ceil(running / pool.target_running_requests)
        candidates.append(n)
        measured.terms.append(
            f"running requests {_num(running)} / target {_num(pool.target_running_requests)} -> {n}"
        )
    if not candidates:
        measured.no_data = "no signal: " + ", ".join(measured.notes)
        return measured
    if unusable:
        measured.notes.append(f"{unusable} of {_pods(ready, 'ready')} unknown, assumed at the known mean")
    raw = max(candidates)
    measured.recommended = min(max(raw, pool.min_replicas), pool.max_replicas)
    if raw < pool.min_replicas:
        measured.notes.append(f"raised to minReplicas {pool.min_replicas}")
    elif raw > pool.max_replicas:
        measured.notes.append(f"capped at maxReplicas {pool.max_replicas}")
    return measured


def _apply_ratio(policy: AutoscalingPolicy, measured: dict[str, _Measured]) -> None:
    if policy.ratio is None or ROLE_PREFILL not in measured or ROLE_DECODE not in measured:
        return
    prefill, decode = measured[ROLE_PREFILL], measured[ROLE_DECODE]
    if prefill.recommended is None or decode.recommended is None:
        return
    lo, hi = policy.ratio.min_prefill_per_decode, policy.ratio.max_prefill_per_decode
    if lo is not None and prefill.recommended < lo * decode.recommended - _EPS:
        want = _ceil(lo * decode.recommended)
        limit = policy.pool(ROLE_PREFILL).max_replicas
        prefill.recommended = min(want, limit)
        capped = f" (capped at maxReplicas {limit})" if want > limit else ""
        prefill.notes.append(f"raised to {prefill.recommended} by prefill:decode >= {lo:g}{capped}")
    if hi is not None and prefill.recommended > hi * decode.recommended + _EPS:
        want = _ceil(prefill.recommended / hi)
        limit = policy.pool(ROLE_DECODE).max_replicas
        decode.recommended = min(want, limit)
        capped = f" (capped at maxReplicas {limit})" if want > limit else ""
        decode.notes.append(f"raised to {decode.recommended} by prefill:decode <= {hi:g}{capped}")


def _stabilise(
    pool: PoolPolicy,
    current: int,
    recommended: int,
    explain: str,
    history: History,
    observations: Observations,
    metrics: PoolMetrics,
    now: float,
) -> tuple[int, Action, str]:
    past = [r for r in history.recommendations if r.role == pool.role]
    up_w, down_w = pool.scale_up.stabilization_window_s, pool.scale_down.stabilization_window_s
    up_target = min([recommended] + [r.replicas for r in past if r.at >= now - up_w])
    down_target = max([recommended] + [r.replicas for r in past if r.at >= now - down_w])
    up_note = f"; lowest in the last {_num(up_w)}s: {up_target}" if up_target != recommended else ""
    down_note = f"; highest in the last {_num(down_w)}s: {down_target}"

    if up_target > current:
        blocked = [p for p in observations.pending if p.role == pool.role and p.unschedulable]
        if blocked:
            return (
                current,
                "hold",
                f"hold at {current}: {explain}{up_note}; scale-up to {up_target} blocked: "
                f"{_pods(len(blocked))} Pending ({blocked[0].reason})",
            )
        desired = min(up_target, current + pool.scale_up.max_step)
        step = f"; limited by maxStep {pool.scale_up.max_step}" if desired < up_target else ""
        return desired, "up", f"scale up {current} -> {desired}: {explain}{up_note}{step}"
    if recommended > current:
        return current, "hold", f"hold at {current}: {explain}{up_note}"

    if down_target < current:
        covered_s = now - min((r.at for r in past), default=now)
        if covered_s < down_w - _EPS:
            return (
                current,
                "hold",
                f"hold at {current}: {explain}; scale-down waits for {_num(down_w)}s of "
                f"recommendations (have {_num(covered_s)}s)",
            )
        if metrics.known_pods < metrics.ready_pods:
            return (
                current,
                "hold",
                f"hold at {current}: {explain}; scale-down held while "
                f"{metrics.ready_pods - metrics.known_pods} of {_pods(metrics.ready_pods, 'ready')} "
                "are unknown",
            )
        last_down = max(
            (a.at for a in history.actions if a.role == pool.role and a.to_replicas < a.from_replicas),
            default=None,
        )
        if last_down is not None and now - last_down < down_w - _EPS:
            return (
                current,
                "hold",
                f"hold at {current}: {explain}; last scale-down {_num(now - last_down)}s ago, "
                f"next after {_num(down_w)}s",
            )
        desired = max(down_target, current - pool.scale_down.max_step)
        step = f"; limited by maxStep {pool.scale_down.max_step}" if desired > down_target else ""
        return desired, "down", f"scale down {current} -> {desired}: {explain}{down_note}{step}"
    if recommended < current:
        return current, "hold", f"hold at {current}: {explain}{down_note}"
    return current, "hold", f"hold at {current}: {explain}"


def _prune(history: History, policy: AutoscalingPolicy, now: float) -> History:
    """Keep each pool's records within its longest window, plus the newest older recommendation
    (it proves the down-window is covered)."""
    recommendations: list[Recommendation] = []
    actions: list[ScaleAction] = []
    for pool in policy.pools:
        horizon = now - max(pool.scale_up.stabilization_window_s, pool.scale_down.stabilization_window_s)
        mine = [r for r in history.recommendations if r.role == pool.role]
        newest_older = max((r for r in mine if r.at < horizon), key=lambda r: r.at, default=None)
        recommendations += ([newest_older] if newest_older else []) + [r for r in mine if r.at >= horizon]
        actions += [a for a in history.actions if a.role == pool.role and a.at >= horizon]
    return History(
        tuple(sorted(recommendations, key=lambda r: r.at)), tuple(sorted(actions, key=lambda a: a.at))
    )


def decide(
    policy: AutoscalingPolicy, observations: Observations, history: History, now: float
) -> tuple[Decision, History]:
    """One autoscaling decision for one InferenceDeployment, and the history to pass next time."""
    for pool in policy.pools:
        if pool.role not in observations.replicas:
            raise ValueError(f"Observations.replicas: no entry for role {pool.role!r}")
    measured = {
        pool.role: _measure(pool, [s for s in observations.samples if s.role == pool.role], policy, now)
        for pool in policy.pools
    }
    _apply_ratio(policy, measured)

    roles: list[RoleDecision] = []
    new_recs = list(history.recommendations)
    new_actions = list(history.actions)
    for pool in policy.pools:
        current = observations.replicas[pool.role]
        m = measured[pool.role]
        action: Action
        if current < pool.min_replicas:
            desired, action = pool.min_replicas, "up"
            reason = f"scale up {current} -> {desired}: below minReplicas {pool.min_replicas}"
        elif current > pool.max_replicas:
            desired, action = pool.max_replicas, "down"
            reason = f"scale down {current} -> {desired}: above maxReplicas {pool.max_replicas}"
        elif m.recommended is None or m.metrics is None:
            desired, action, reason = current, "hold", f"hold at {current}: {m.no_data}"
        else:
            desired, action, reason = _stabilise(
                pool, current, m.recommended, m.explain(), history, observations, m.metrics, now
            )
        if m.recommended is not None:
            new_recs.append(Recommendation(now, pool.role, m.recommended))
        if action != "hold":
            new_actions.append(ScaleAction(now, pool.role, current, desired))
        roles.append(RoleDecision(pool.role, current, desired, action, reason, m.recommended, m.metrics))
    decision = Decision(now, tuple(roles))
    return decision, _prune(History(tuple(new_recs), tuple(new_actions)), policy, now)
