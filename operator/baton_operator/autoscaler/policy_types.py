"""The autoscaling policy's inputs and outputs: frozen values, independent of the CRD models.

An adapter maps ``spec.autoscaling`` of an InferenceDeployment onto :class:`AutoscalingPolicy`;
the operator turns Pods and scrapes into :class:`Observations`. Times are wall-clock seconds
(``time.time()``), the same clock for scrape times and ``now``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from baton_engine.contract import ENGINE_ROLES

Action = Literal["up", "down", "hold"]


def _check(condition: bool, where: str, problem: str) -> None:
    if not condition:
        raise ValueError(f"{where}: {problem}")


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class StepPolicy:
    """How fast one direction may move.

    Scale-up: by at most ``max_step`` replicas per decision, using the *lowest* recommendation of
    the last ``stabilization_window_s`` (0: act on the current one at once).
    Scale-down: only once the window's recommendations are all below the current size, using the
    *highest* of them (HPA semantics), by at most ``max_step`` replicas per window.
    """

    max_step: int
    stabilization_window_s: float

    def validate(self, where: str) -> None:
        _check(self.max_step >= 1, f"{where}.max_step", f"must be >= 1, got {self.max_step}")
        _check(
            self.stabilization_window_s >= 0,
            f"{where}.stabilization_window_s",
            f"must be >= 0, got {self.stabilization_window_s:g}",
        )


@dataclass(frozen=True)
class PoolPolicy:
    """One pool (role) of engine pods and the load signals that size it.

    Each configured target yields a recommendation; the pool's recommendation is the largest
    (aggregated mode configures both queue depth and KV usage on its single pool).
    """

    role: str
    min_replicas: int
    max_replicas: int
    scale_up: StepPolicy
    scale_down: StepPolicy
    target_queue_depth: float | None = None  # waiting requests per replica
    target_queued_tokens: float | None = None  # queued prompt tokens per replica
    target_kv_usage: float | None = None  # mean KV-cache usage ratio, 0 < t <= 1
    target_running_requests: float | None = None  # running requests per replica

    def validate(self) -> None:
        where = f"PoolPolicy({self.role})"
        _check(self.role in ENGINE_ROLES, f"{where}.role", f"must be one of {', '.join(ENGINE_ROLES)}")
        # 0 only with AutoscalingPolicy.scale_to_zero (checked there): from zero no pod can be
        # measured, the router's held requests wake the pools.
        _check(self.min_replicas >= 0, f"{where}.min_replicas", f"must be >= 0, got {self.min_replicas}")
        _check(
            self.max_replicas >= self.min_replicas,
            f"{where}.max_replicas",
            f"{self.max_replicas} is below min_replicas {self.min_replicas}",
        )
        self.scale_up.validate(f"{where}.scale_up")
        self.scale_down.validate(f"{where}.scale_down")
        targets = {
            "target_queue_depth": self.target_queue_depth,
            "target_queued_tokens": self.target_queued_tokens,
            "target_kv_usage": self.target_kv_usage,
            "target_running_requests": self.target_running_requests,
        }
        _check(any(v is not None for v in targets.values()), where, "needs at least one target")
        for name, value in targets.items():
            if value is not None:
                _check(value > 0, f"{where}.{name}", f"must be > 0, got {value:g}")
        if self.target_kv_usage is not None:
            _check(
                self.target_kv_usage <= 1,
                f"{where}.target_kv_usage",
                f"is a ratio, must be <= 1, got {self.target_kv_usage:g}",
            )


@dataclass(frozen=True)
class RatioBounds:
    """Bounds on prefill replicas per decode replica. The lagging pool is raised to meet them."""

    min_prefill_per_decode: float | None = None
    max_prefill_per_decode: float | None = None

    def validate(self) -> None:
        lo, hi = self.min_prefill_per_decode, self.max_prefill_per_decode
        if lo is not None:
            _check(lo > 0, "RatioBounds.min_prefill_per_decode", f"must be > 0, got {lo:g}")
        if hi is not None:
            _check(hi > 0, "RatioBounds.max_prefill_per_decode", f"must be > 0, got {hi:g}")
        if lo is not None and hi is not None:
            _check(
                lo <= hi,
                "RatioBounds.min_prefill_per_decode",
                f"{lo:g} is above max_prefill_per_decode {hi:g}",
            )


@dataclass(frozen=True)
class ScaleToZero:
    """Every pool goes to zero pods together after ``idle_s`` seconds without a request (none
    arriving at the routers, none held, none queued or running on an engine), and back to one
    pod each as soon as a router holds a request: at once, not after a stabilization window."""

    idle_s: float

    def validate(self) -> None:
        _check(self.idle_s > 0, "ScaleToZero.idle_s", f"must be > 0, got {self.idle_s:g}")


@dataclass(frozen=True)
class AutoscalingPolicy:
    """Everything ``decide`` needs from the spec (builtin mode; the caller handles external/off)."""

    pools: tuple[PoolPolicy, ...]
    ratio: RatioBounds | None = None
    max_metric_age_s: float = 60.0  # older samples are stale: not acted on
    max_unknown_fraction: float = 0.5  # hold a pool when more of its ready pods are unknown
    scale_to_zero: ScaleToZero | None = None  # set exactly when every pool's min_replicas is 0

    def __post_init__(self) -> None:
        _check(len(self.pools) > 0, "AutoscalingPolicy.pools", "must not be empty")
        roles = [p.role for p in self.pools]
        _check(len(set(roles)) == len(roles), "AutoscalingPolicy.pools", f"duplicate role in {roles}")
        for pool in self.pools:
            pool.validate()
        _check(
            self.max_metric_age_s > 0,
            "AutoscalingPolicy.max_metric_age_s",
            f"must be > 0, got {self.max_metric_age_s:g}",
        )
        _check(
            0 <= self.max_unknown_fraction < 1,
            "AutoscalingPolicy.max_unknown_fraction",
            f"must be in [0, 1), got {self.max_unknown_fraction:g}",
        )
        if self.ratio is not None:
            self.ratio.validate()
        at_zero = [p.role for p in self.pools if p.min_replicas == 0]
        if self.scale_to_zero is None:
            _check(not at_zero, "AutoscalingPolicy.pools", f"min_replicas 0 needs scale_to_zero: {at_zero}")
        else:
            self.scale_to_zero.validate()
            others = [p.role for p in self.pools if p.min_replicas > 0]
            _check(
                not others,
                "AutoscalingPolicy.scale_to_zero",
                f"every pool goes to zero together: min_replicas must be 0 for {others}",
            )

    def pool(self, role: str) -> PoolPolicy:
        for pool in self.pools:
            if pool.role == role:
                return pool
        raise KeyError(f"AutoscalingPolicy: no pool for role {role!r}")


# --------------------------------------------------------------------------- observations


@dataclass(frozen=True)
class EngineLoad:
    """What one engine's /metrics said."""

    waiting: float  # requests waiting (queue depth)
    running: float  # requests running
    kv_usage: float  # KV-cache usage ratio 0..1
    queued_prompt_tokens: float | None = None  # when the engine exports it
    kv_blocks: float | None = None
    preemptions_total: float | None = None


@dataclass(frozen=True)
class PodSample:
    """One pod's scrape. ``load is None`` means unknown (unreachable, bad answer): never zero."""

    pod: str
    role: str
    ready: bool
    scraped_at: float  # when the answer (or the failure) came
    load: EngineLoad | None
    error: str | None = None


@dataclass(frozen=True)
class PendingPod:
    """A pod of a pool that is not running yet. ``unschedulable``: PodScheduled=False."""

    pod: str
    role: str
    reason: str  # e.g. "Unschedulable: 0/3 nodes are available: 3 Insufficient amd.com/gpu."
    unschedulable: bool = True


@dataclass(frozen=True)
class RouterDemand:
    """What the deployment's routers said (summed over router pods)."""

    held: float  # requests held now because a pool they need has no pod
    requests: float  # client requests counted since the routers started (any outcome)


@dataclass(frozen=True)
class Observations:
    """The current state: replicas per role (the Deployments' spec.replicas), samples, pending pods,
    and the routers' demand (None: no router could be read)."""

    replicas: Mapping[str, int]
    samples: tuple[PodSample, ...] = ()
    pending: tuple[PendingPod, ...] = ()
    demand: RouterDemand | None = None


# --------------------------------------------------------------------------- history


@dataclass(frozen=True)
class Recommendation:
    at: float
    role: str
    replicas: int


@dataclass(frozen=True)
class ScaleAction:
    at: float
    role: str
    from_replicas: int
    to_replicas: int


@dataclass(frozen=True)
class History:
    """What earlier decisions left behind; ``decide`` returns the next one (the caller keeps it)."""

    recommendations: tuple[Recommendation, ...] = ()
    actions: tuple[ScaleAction, ...] = ()
    active_at: float | None = None  # scale to zero: when a request was last seen (None: never looked)
    router_requests: float | None = None  # the routers' request count then


# --------------------------------------------------------------------------- decision


@dataclass(frozen=True)
class PoolMetrics:
    """The numbers a pool's decision used (shown in status)."""

    ready_pods: int
    known_pods: int  # ready pods with a fresh sample
    unknown_pods: int  # ready pods whose scrape failed
    stale_pods: int  # ready pods whose last sample is older than max_metric_age_s
    waiting: float | None  # total queue depth (unknown pods assumed at the known mean)
    running: float | None
    kv_usage: float | None  # mean over known pods
    queued_prompt_tokens: float | None
    oldest_sample_age_s: float | None


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    desired: int
    action: Action
    reason: str
    recommended: int | None  # this tick's recommendation (None: no usable data)
    metrics: PoolMetrics | None


@dataclass(frozen=True)
class Decision:
    at: float
    roles: tuple[RoleDecision, ...] = field(default_factory=tuple)

    @property
    def desired(self) -> dict[str, int]:
        return {r.role: r.desired for r in self.roles}

    @property
    def action(self) -> Action:
        """ "up" if any pool grows, else "down" if any shrinks, else "hold"."""
        actions = {r.action for r in self.roles}
        if "up" in actions:
            return "up"
        return "down" if "down" in actions else "hold"

    @property
    def reason(self) -> str:
        return " | ".join(f"{r.role}: {r.reason}" for r in self.roles)

    def role(self, role: str) -> RoleDecision:
        for r in self.roles:
            if r.role == role:
                return r
        raise KeyError(f"Decision: no role {role!r}")
