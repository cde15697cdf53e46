"""Small builders for the autoscaler policy's inputs (simulated time: NOW and seconds before it)."""

from __future__ import annotations

from baton_operator.autoscaler.policy_types import (
    AutoscalingPolicy,
    EngineLoad,
    History,
    Observations,
    PendingPod,
    PodSample,
    PoolPolicy,
    RatioBounds,
    Recommendation,
    ScaleAction,
    StepPolicy,
)

NOW = 10_000.0
UP = StepPolicy(max_step=2, stabilization_window_s=0)
DOWN = StepPolicy(max_step=1, stabilization_window_s=60)
GPU_REASON = "Unschedulable: 0/2 nodes are available: 2 Insufficient amd.com/gpu."


def prefill_pool(**over: object) -> PoolPolicy:
    fields: dict[str, object] = {
        "role": "prefill",
        "min_replicas": 1,
        "max_replicas": 6,
        "scale_up": UP,
        "scale_down": DOWN,
        "target_queue_depth": 4.0,
    }
    fields.update(over)
    return PoolPolicy(**fields)  # type: ignore[arg-type,unused-ignore]


def decode_pool(**over: object) -> PoolPolicy:
    fields: dict[str, object] = {
        "role": "decode",
        "min_replicas": 1,
        "max_replicas": 6,
        "scale_up": UP,
        "scale_down": DOWN,
        "target_kv_usage": 0.6,
    }
    fields.update(over)
    return PoolPolicy(**fields)  # type: ignore[arg-type,unused-ignore]


def policy(*pools: PoolPolicy, ratio: RatioBounds | None = None) -> AutoscalingPolicy:
    return AutoscalingPolicy(pools=pools or (prefill_pool(),), ratio=ratio, max_metric_age_s=60.0)


def sample(
    pod: str,
    role: str = "prefill",
    *,
    waiting: float = 0,
    running: float = 0,
    kv: float = 0.0,
    tokens: float | None = None,
    at: float = NOW,
    ready: bool = True,
) -> PodSample:
    return PodSample(pod, role, ready, at, EngineLoad(waiting, running, kv, queued_prompt_tokens=tokens))


def unknown(pod: str, role: str = "prefill", *, at: float = NOW, error: str = "HTTP 500") -> PodSample:
    return PodSample(pod, role, True, at, None, error)


def pending(pod: str, role: str = "prefill", *, unschedulable: bool = True) -> PendingPod:
    return PendingPod(pod, role, GPU_REASON if unschedulable else "ContainerCreating", unschedulable)


def observe(
    replicas: dict[str, int], *samples: PodSample, pending: tuple[PendingPod, ...] = ()
) -> Observations:
    return Observations(replicas=replicas, samples=samples, pending=pending)


def recs(role: str, *points: tuple[float, int]) -> tuple[Recommendation, ...]:
    """Recommendations at (seconds before NOW, replicas)."""
    return tuple(Recommendation(NOW - ago, role, n) for ago, n in points)


def steady(role: str, replicas: int, *, span: float = 90, every: float = 15) -> tuple[Recommendation, ...]:
    """A history that has recommended ``replicas`` every ``every`` s for the last ``span`` s."""
    points = []
    ago = span
    while ago > 0:
        points.append((ago, replicas))
        ago -= every
    return recs(role, *points)


def history(*parts: tuple[Recommendation, ...], actions: tuple[ScaleAction, ...] = ()) -> History:
    merged: tuple[Recommendation, ...] = ()
    for part in parts:
        merged += part
    return History(tuple(sorted(merged, key=lambda r: r.at)), actions)


def scaled_down(role: str, ago: float, frm: int, to: int) -> ScaleAction:
    return ScaleAction(NOW - ago, role, frm, to)
