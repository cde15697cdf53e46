"""Why a pool's pods are stuck, from their status: pure, for the InferenceDeployment's conditions.

A Deployment only says that its pods are not Ready; the pods say why: the scheduler found no
node (PodScheduled=False, Unschedulable, with the scheduler's message), the image cannot be
pulled, a container crash-loops or cannot be created (a missing Secret), or a container that
started never became Ready. Each kind of problem is a condition reason; the message names the
pool, the pod and the kubelet's or the scheduler's own words.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Problem kinds (condition reasons), most telling first: the first found names the condition.
UNSCHEDULABLE = "PodsUnschedulable"
IMAGE_PULL = "ImagePullFailing"
CRASH_LOOP = "CrashLooping"
CONFIG_ERROR = "ContainerConfigError"
NEVER_READY = "PodsNeverReady"
ORDER = (UNSCHEDULABLE, IMAGE_PULL, CONFIG_ERROR, CRASH_LOOP, NEVER_READY)
#: Every reason a `Stuck` may carry (the docs' troubleshooting page lists each).
STUCK_REASONS = frozenset(ORDER)
#: Waiting reasons of the kubelet, by problem kind.
WAITING: dict[str, str] = {
    "ErrImagePull": IMAGE_PULL,
    "ImagePullBackOff": IMAGE_PULL,
    "InvalidImageName": IMAGE_PULL,
    "ErrImageNeverPull": IMAGE_PULL,
    "CrashLoopBackOff": CRASH_LOOP,
    "CreateContainerConfigError": CONFIG_ERROR,
    "CreateContainerError": CONFIG_ERROR,
}
#: A container that passed its startup probe and is still not Ready this long after it started
#: never reached readiness (a few failed probes are normal: draining, a busy engine).
NEVER_READY_S = 120.0
MAX_MESSAGE = 2048


@dataclass(frozen=True)
class Problem:
    kind: str  # one of ORDER
    pool: str  # the role: prefill, decode, engine, router
    pod: str
    detail: str

    def describe(self) -> str:
        return f"{self.pool}: pod {self.pod} {self.detail}"


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, Mapping):
            return None
        obj = obj.get(key)
    return obj


def _time(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def pod_problem(pod: Mapping[str, Any], pool: str, now: dt.datetime) -> Problem | None:
    """The problem of one pod, or None (Ready, on its way, or being deleted)."""
    name = str(_get(pod, "metadata", "name") or "")
    if _get(pod, "metadata", "deletionTimestamp") is not None:
        return None
    for cond in _get(pod, "status", "conditions") or ():
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            if cond.get("reason") == "Unschedulable":
                return Problem(
                    UNSCHEDULABLE, pool, name, f"is unschedulable: {cond.get('message') or ''}".strip()
                )
    statuses = [
        *(_get(pod, "status", "initContainerStatuses") or ()),
        *(_get(pod, "status", "containerStatuses") or ()),
    ]
    for status in statuses:
        waiting = _get(status, "state", "waiting") or {}
        kind = WAITING.get(str(waiting.get("reason")))
        if kind is None:
            continue
        detail = f"container {status.get('name')}: {waiting.get('reason')}"
        if kind == CRASH_LOOP:
            detail += f" (restarted {int(status.get('restartCount') or 0)} times"
            last = _get(status, "lastState", "terminated") or {}
            if last:
                detail += f", last exit {last.get('exitCode')} {last.get('reason') or ''}".rstrip()
            detail += ")"
        if waiting.get("message"):
            detail += f": {waiting['message']}"
        return Problem(kind, pool, name, detail)
    for status in _get(pod, "status", "containerStatuses") or ():
        started = _get(status, "state", "running", "startedAt")
        started_at = _time(started)
        if status.get("started") and not status.get("ready") and started_at is not None:
            if (now - started_at).total_seconds() >= NEVER_READY_S:
                # Worded without the time since: the message must not change at every refresh.
                detail = (
                    f"container {status.get('name')}: running since {started}, not Ready "
                    f"{NEVER_READY_S:.0f} s later (its readiness probe fails)"
                )
                return Problem(NEVER_READY, pool, name, detail)
    return None


def pool_problems(pods: Mapping[str, Iterable[Mapping[str, Any]]], now: dt.datetime) -> list[Problem]:
    """Every problem of every pool's pods (pool -> its pods), pools and pods in name order."""
    found = []
    for pool in sorted(pods):
        for pod in sorted(pods[pool], key=lambda p: str(_get(p, "metadata", "name"))):
            problem = pod_problem(pod, pool, now)
            if problem is not None:
                found.append(problem)
    return found


@dataclass(frozen=True)
class Stuck:
    """What the conditions say of stuck pools: the most telling kind, and every problem."""

    reason: str  # one of STUCK_REASONS
    message: str


def summary(problems: Sequence[Problem]) -> Stuck | None:
    """The conditions' reason and message for `problems`; None when there are none."""
    if not problems:
        return None
    kind = min((p.kind for p in problems), key=ORDER.index)
    first = [p for p in problems if p.kind == kind]
    rest = [p for p in problems if p.kind != kind]
    message = "; ".join(p.describe() for p in [*first, *rest])
    return Stuck(kind, message if len(message) <= MAX_MESSAGE else message[: MAX_MESSAGE - 3] + "...")
