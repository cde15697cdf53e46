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

With scale to zero (every pool's ``min_replicas`` 0) a request seen anywhere (arriving at a
router, held by one, queued or running on an engine) restarts the idle clock; once it has run
``idle_s`` every pool goes to zero together, and while they are at zero a request held by a
router brings every pool back to one pod at once. Otherwise the pools never go below one pod.

Which mode applies (builtin / external / off) is the caller's business: ``decide`` is for builtin.
Reason strings are stable: tests and users read them.
"""

from __future__ import annotations

import dataclasses
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
    ScaleToZero,
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


def _measure(
    pool: PoolPolicy, samples: list[PodSample], policy: AutoscalingPolicy, now: float, floor: int
) -> _Measured:
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
    measured.recommended = min(max(raw, floor), pool.max_replicas)
    if raw < floor:
        measured.notes.append(
            f"raised to minReplicas {pool.min_replicas}"
            if floor == pool.min_replicas
            else "kept at 1 until idle"
        )
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
    return dataclasses.replace(
        history,
        recommendations=tuple(sorted(recommendations, key=lambda r: r.at)),
        actions=tuple(sorted(actions, key=lambda a: a.at)),
    )


@dataclass(frozen=True)
class _Idle:
    """Scale to zero's view of this tick."""

    active_at: float | None  # when a request was last seen (None: the routers are unreadable)
    requests: float | None  # the routers' count now
    waking: str | None  # why the pools must come back from zero (None: no demand seen)


def _arrivals(before: float, now: float) -> float:
    """Requests the routers saw since `before`; a count that went down is a router that
    restarted (its counter began again at zero): what it shows now arrived since."""
    return now - before if now >= before else now


def _idle(zero: ScaleToZero, observations: Observations, history: History, now: float) -> _Idle:
    demand = observations.demand
    engines_busy = any(
        s.load is not None and (s.load.waiting > 0 or s.load.running > 0) for s in observations.samples
    )
    if demand is None:
        # No router answered: not idle (a request may be arriving), and nothing to wake for.
        return _Idle(None, history.router_requests, None)
    arrived = history.router_requests is not None and _arrivals(history.router_requests, demand.requests) > 0
    active = demand.held > 0 or arrived or engines_busy or history.active_at is None
    waking = None
    if demand.held > 0:
        waking = f"woken by {_num(demand.held)} waiting request{'s' if demand.held != 1 else ''}"
    elif arrived:
        waking = "woken by requests the routers refused while at zero"
    return _Idle(now if active else history.active_at, demand.requests, waking)


def _zero_decision(
    policy: AutoscalingPolicy,
    zero: ScaleToZero,
    observations: Observations,
    idle: _Idle,
    measured: dict[str, _Measured],
    now: float,
) -> list[RoleDecision] | None:
    """Every pool's decision when scale to zero decides (wake, stay at zero, go to zero)."""
    current = {pool.role: observations.replicas[pool.role] for pool in policy.pools}
    idle_for = f"idle {_num(zero.idle_s)} s"

    def each(desired: int, action: Action, reason: str) -> list[RoleDecision]:
        return [
            RoleDecision(
                role,
                n,
                desired,
                action if desired != n else "hold",
                reason,
                measured[role].recommended,
                measured[role].metrics,
            )  # fmt: skip
            for role, n in current.items()
        ]

    if all(n == 0 for n in current.values()):
        if idle.waking is not None:
            return each(1, "up", f"scale up 0 -> 1: {idle.waking}")
        if idle.active_at is None:
            return each(0, "hold", "hold at 0: scaled to zero; the routers' metrics are unknown")
        return each(0, "hold", f"hold at 0: scaled to zero ({idle_for}); no request waiting")
    if idle.active_at is not None and now - idle.active_at >= zero.idle_s - _EPS:
        return [
            RoleDecision(
                role,
                n,
                0,
                "down" if n else "hold",
                f"scale down {n} -> 0: scaled to zero ({idle_for})" if n else "hold at 0: scaled to zero",
                measured[role].recommended,
                measured[role].metrics,
            )  # fmt: skip
            for role, n in current.items()
        ]
    return None


def decide(
    policy: AutoscalingPolicy, observations: Observations, history: History, now: float
) -> tuple[Decision, History]:
    """One autoscaling decision for one InferenceDeployment, and the history to pass next time."""
    for pool in policy.pools:
        if pool.role not in observations.replicas:
            raise ValueError(f"Observations.replicas: no entry for role {pool.role!r}")
    zero = policy.scale_to_zero
    # With scale to zero, only the idle rule takes a pool below one pod.
    floors = {pool.role: max(pool.min_replicas, 1 if zero else 0) for pool in policy.pools}
    measured = {
        pool.role: _measure(
            pool, [s for s in observations.samples if s.role == pool.role], policy, now, floors[pool.role]
        )
        for pool in policy.pools
    }
    _apply_ratio(policy, measured)
    idle = _idle(zero, observations, history, now) if zero is not None else None
    zero_roles = (
        _zero_decision(policy, zero, observations, idle, measured, now)
        if zero is not None and idle is not None
        else None
    )

    roles: list[RoleDecision] = []
    new_recs = list(history.recommendations)
    new_actions = list(history.actions)
    for pool in policy.pools:
        current = observations.replicas[pool.role]
        m = measured[pool.role]
        floor = floors[pool.role]
        action: Action
        if zero_roles is not None:
            decided = next(r for r in zero_roles if r.role == pool.role)
            desired, action, reason = decided.desired, decided.action, decided.reason
        elif current < floor:
            desired, action = floor, "up"
            below = f"minReplicas {pool.min_replicas}" if floor == pool.min_replicas else "1 until idle"
            reason = f"scale up {current} -> {desired}: below {below}"
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
    kept = History(
        tuple(new_recs),
        tuple(new_actions),
        active_at=idle.active_at if idle is not None else None,
        router_requests=idle.requests if idle is not None else None,
    )
    return decision, _prune(kept, policy, now)
