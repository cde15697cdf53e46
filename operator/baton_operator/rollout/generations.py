"""The two generations of a KV-compatibility key change, with Kubernetes primitives.

Each engine pool keeps its Deployment (`NAME-prefill`, `NAME-decode`: the name HPA, KEDA and
users know). When the key changes, the Deployment gets the new pod template and its ReplicaSets
of the old key are *released* from it: their labels stop matching the Deployment's selector, so
the Deployment controller lets go of them (and stops counting or scaling them) while they keep
their pods. A released ReplicaSet is the old generation; the operator owns it (an owner
reference, so garbage collection still removes it with the resource) and scales it down, step by
step, while the Deployment grows the new generation (`plan.steps`). When its pods are gone it is
deleted. Pods of every generation keep their role label, so Services, PodDisruptionBudgets, the
router's Pod watch and InferencePools see both; the router pairs them by key.

The switch is ordered so that the Deployment controller never acts on a half-made change: the
Deployment is first applied paused with the new template (no new ReplicaSet, no scaling), then
its old ReplicaSets are released, then it is applied unpaused with the first step's replicas.

A rollback (the spec's key is again that of a released generation) takes that generation back:
its ReplicaSets get their role label again and the Deployment controller adopts them (their
template is the Deployment's again, so they are its new ReplicaSet, as `kubectl rollout undo`
would reuse one), while the generation rolled back from is released and drained as any old one.

Without the operator owning replicas (`autoscaling.mode: external`: HPA or KEDA do) there is no
stepping: each pool rolls with its Deployment's own strategy, decode first (prefill stays paused
until no decode pod of the old key is left).

This module is pure: what the cluster shows in, what to do out (`rollout.controller` does it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_engine import contract

from .plan import Counts, Decision, Observed, Step, advance, steps

#: On a released ReplicaSet instead of `baton.dev/role` (so the Deployment's selector no longer
#: matches it): the pool it belongs to.
LABEL_RETIRING = "baton.dev/retiring"
#: On a released ReplicaSet: the pool's replicas when its generation was released (the rollout's
#: target while the autoscaler holds).
ANNOTATION_TARGET = "baton.dev/rollout-target"
POOLS = (contract.ROLE_PREFILL, contract.ROLE_DECODE)


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _labels(obj: Mapping[str, Any]) -> Mapping[str, str]:
    labels = _meta(obj).get("labels")
    return labels if isinstance(labels, Mapping) else {}


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _ready(pod: Mapping[str, Any]) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return bool(cond.get("status") == "True")
    return False


def _controller_uid(obj: Mapping[str, Any]) -> str | None:
    for ref in _meta(obj).get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref.get("uid"))
    return None


@dataclass(frozen=True)
class ReplicaSetView:
    name: str
    key: str  # the KV-compatibility key of its pods ("" for pods from before keys)
    replicas: int  # spec.replicas
    created: str  # creationTimestamp (RFC 3339 sorts as text)
    target: int | None = None  # released ones: ANNOTATION_TARGET
    resource_version: str = ""


@dataclass(frozen=True)
class PoolView:
    """One pool (role) as the cluster shows it, against the key its pods should have."""

    role: str
    key: str  # the spec's key for this pool
    deployment: Mapping[str, Any] | None  # the pool's Deployment (None: not created yet)
    releasable: tuple[ReplicaSetView, ...] = ()  # the Deployment's ReplicaSets of another key, scaled up
    #: The Deployment's ReplicaSets at 0 replicas (its revision history): a paused Deployment with
    #: nothing else would scale the newest of them up, so the switch deletes them first.
    history: tuple[ReplicaSetView, ...] = ()
    retiring: tuple[ReplicaSetView, ...] = ()  # released ReplicaSets (the old generation)
    #: Released ReplicaSets of the spec's key (a rollback): the Deployment takes them back.
    adoptable: tuple[ReplicaSetView, ...] = ()
    new_replicas: int = 0  # spec.replicas summed over the Deployment's ReplicaSets of the key
    new_pods: int = 0  # pods of the key, not terminating
    new_ready: int = 0  # ... Ready
    old_pods: int = 0  # pods of another key that still exist, draining ones included
    old_ready: int = 0  # ... Ready and not terminating
    old_keys: tuple[str, ...] = ()

    @property
    def rolling(self) -> bool:
        return bool(self.releasable or self.retiring or self.adoptable or self.old_pods)

    @property
    def replicas(self) -> int | None:
        """The Deployment's spec.replicas (None without a Deployment)."""
        if self.deployment is None:
            return None
        value = (self.deployment.get("spec") or {}).get("replicas")
        return value if isinstance(value, int) else 1


def pool_view(
    role: str,
    key: str,
    deployment: Mapping[str, Any] | None,
    replica_sets: Sequence[Mapping[str, Any]],
    pods: Sequence[Mapping[str, Any]],
    owner_uid: str,
) -> PoolView:
    """Sort one pool's ReplicaSets and pods (all of the resource's may be passed) by generation."""
    deployment_uid = None if deployment is None else str(_meta(deployment).get("uid"))
    releasable: list[ReplicaSetView] = []
    history: list[ReplicaSetView] = []
    retiring: list[ReplicaSetView] = []
    adoptable: list[ReplicaSetView] = []
    new_replicas = 0
    for rs in replica_sets:
        labels, meta = _labels(rs), _meta(rs)
        annotations = meta.get("annotations") or {}
        target = annotations.get(ANNOTATION_TARGET)
        view = ReplicaSetView(
            name=str(meta.get("name")),
            key=str(labels.get(contract.LABEL_KV_COMPAT, "")),
            replicas=_int((rs.get("spec") or {}).get("replicas")),
            created=str(meta.get("creationTimestamp", "")),
            target=int(target) if isinstance(target, str) and target.isdigit() else None,
            resource_version=str(meta.get("resourceVersion", "")),
        )
        owned_by_pool = deployment_uid is not None and _controller_uid(rs) == deployment_uid
        if owned_by_pool and labels.get(contract.LABEL_ROLE) == role:
            if view.replicas == 0:
                history.append(view)
            elif view.key == key:
                new_replicas += view.replicas
            else:
                releasable.append(view)
        elif labels.get(contract.LABEL_ROLE) == role and _controller_uid(rs) is None and view.key == key:
            new_replicas += view.replicas  # taken back (a rollback), not adopted yet
        elif labels.get(LABEL_RETIRING) == role and any(
            ref.get("uid") == owner_uid for ref in meta.get("ownerReferences") or []
        ):
            (adoptable if view.key == key else retiring).append(view)
    new = [p for p in pods if _labels(p).get(contract.LABEL_ROLE) == role]
    mine = [p for p in new if _labels(p).get(contract.LABEL_KV_COMPAT, "") == key]
    others = [p for p in new if _labels(p).get(contract.LABEL_KV_COMPAT, "") != key]
    live = [p for p in mine if not _meta(p).get("deletionTimestamp")]
    return PoolView(
        role=role,
        key=key,
        deployment=deployment,
        releasable=tuple(sorted(releasable, key=lambda r: r.created)),
        history=tuple(sorted(history, key=lambda r: r.created)),
        retiring=tuple(sorted(retiring, key=lambda r: r.created)),
        adoptable=tuple(sorted(adoptable, key=lambda r: r.created)),
        new_replicas=new_replicas,
        new_pods=len(live),
        new_ready=sum(1 for p in live if _ready(p)),
        old_pods=len(others),
        old_ready=sum(1 for p in others if _ready(p) and not _meta(p).get("deletionTimestamp")),
        old_keys=tuple(sorted({str(_labels(p).get(contract.LABEL_KV_COMPAT, "")) for p in others})),
    )


@dataclass(frozen=True)
class PoolAction:
    """What to do to one pool in this pass."""

    paused: bool = False  # apply its Deployment paused (the switch, or external mode's wait)
    replicas: int | None = None  # the Deployment's replicas to set (None: leave them)
    release: tuple[ReplicaSetView, ...] = ()  # ReplicaSets to release (the switch)
    forget: tuple[str, ...] = ()  # the Deployment's revision history, deleted before the release
    target: int = 0  # recorded on the released ReplicaSets
    retiring_replicas: dict[str, int] = field(default_factory=dict)  # released RS name -> replicas
    delete: tuple[str, ...] = ()  # released ReplicaSets with nothing left: delete
    adopt: tuple[ReplicaSetView, ...] = ()  # released ReplicaSets to give back (a rollback)
    #: With `adopt`: the Deployment's replicas before they are given back (its own of the key
    #: and theirs), so that it neither scales them down nor adds pods meanwhile.
    adopt_replicas: int | None = None


@dataclass(frozen=True)
class RolloutPlan:
    """One pass of the rollout: per pool what to do, and where the rollout stands."""

    pools: Mapping[str, PoolAction]
    active: bool  # a key change is being rolled out
    decision: Decision | None = None  # the step (stepped rollouts)
    message: str = ""  # for the Progressing condition and Events

    @property
    def switching(self) -> bool:
        return any(a.release or a.adopt for a in self.pools.values())


def _share(total: int, retiring: Sequence[ReplicaSetView]) -> dict[str, int]:
    """`total` old pods over the released ReplicaSets, the newest keeping its pods longest."""
    out: dict[str, int] = {}
    left = total
    for rs in reversed(retiring):
        out[rs.name] = min(rs.replicas, left)
        left -= out[rs.name]
    return out


def _describe(views: Mapping[str, PoolView]) -> str:
    parts = []
    for role in POOLS:
        v = views[role]
        parts.append(f"{role}: {v.new_ready}/{v.new_pods} new Ready, {v.old_pods} old")
    return "; ".join(parts)


def plan(
    views: Mapping[str, PoolView],
    *,
    mode: str,
    targets: Mapping[str, int],
    surge: Mapping[str, bool],
) -> RolloutPlan:
    """What one pass does. `targets`: each pool's replicas when the rollout is done (off mode:
    the spec's; builtin: the count in force when the key changed); `surge`: whether a pool has
    spare capacity (no accelerators) to add a pod before removing one."""
    if not any(v.rolling for v in views.values()):
        return RolloutPlan({role: PoolAction() for role in views}, active=False)
    new_keys = sorted({v.key for v in views.values()})
    old_keys = sorted(
        {k for v in views.values() for k in v.old_keys}
        | {r.key for v in views.values() for r in (*v.releasable, *v.retiring)}
    )
    shown = ", ".join(k or "(none)" for k in old_keys) or "(none)"
    head = f"KV-compatibility key {shown} -> {', '.join(new_keys)}"
    if mode == "external":
        # HPA or KEDA own the replicas: each pool rolls with its own strategy, decode first.
        decode = views[contract.ROLE_DECODE]
        waiting = bool(decode.releasable or decode.old_pods)
        actions = {role: PoolAction(paused=role == contract.ROLE_PREFILL and waiting) for role in views}
        note = "decode first, prefill waits" if waiting else "prefill"
        return RolloutPlan(actions, active=True, message=f"{head}: rolling {note}; {_describe(views)}")
    if any(v.releasable or v.adoptable for v in views.values()):
        # The switch: the Deployments take the new template paused, their old ReplicaSets go
        # (and, rolling back, the released ones of the key come back).
        actions = {
            role: PoolAction(
                paused=bool(v.releasable or v.adoptable),
                replicas=v.replicas,
                release=v.releasable,
                forget=tuple(r.name for r in v.history) if v.releasable or v.adoptable else (),
                target=targets[role],
                adopt=v.adoptable,
                adopt_replicas=(v.new_replicas + sum(r.replicas for r in v.adoptable)) or targets[role]
                if v.adoptable
                else None,
            )
            for role, v in views.items()
        }
        back = any(v.adoptable for v in views.values())
        what = "taking back the generation of the key" if back else "releasing the old generation"
        return RolloutPlan(actions, active=True, message=f"{head}: {what}")
    sequence = steps(
        targets[contract.ROLE_PREFILL],
        targets[contract.ROLE_DECODE],
        surge_prefill=surge[contract.ROLE_PREFILL],
        surge_decode=surge[contract.ROLE_DECODE],
    )
    p, d = views[contract.ROLE_PREFILL], views[contract.ROLE_DECODE]
    observed = Observed(
        new_ready=Counts(p.new_ready, d.new_ready), old_present=Counts(p.old_pods, d.old_pods)
    )
    applied = Step(
        new=Counts(p.new_replicas, d.new_replicas),
        old=Counts(sum(r.replicas for r in p.retiring), sum(r.replicas for r in d.retiring)),
    )
    decision = advance(sequence, observed, applied)
    actions = {}
    for role, v in views.items():
        new = getattr(decision.step.new, role)
        old_total = getattr(decision.step.old, role)
        done = decision.done and v.old_pods == 0
        actions[role] = PoolAction(
            replicas=new,
            retiring_replicas=_share(old_total, v.retiring),
            delete=tuple(r.name for r in v.retiring) if done else (),
        )
    state = "done" if decision.done else f"step {decision.index + 1} of {decision.total}"
    return RolloutPlan(
        actions, active=True, decision=decision, message=f"{head}: {state}; {_describe(views)}"
    )
