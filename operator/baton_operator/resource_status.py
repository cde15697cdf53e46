"""The InferenceDeployment's own status, computed (purely) from what it owns: the child
Deployments and their pods in, the operator's `status` fields (conditions, counts per pool, the
endpoint) out, as a merge patch. (Its schema: `models/status.py`; the autoscaler's part of
status: `autoscaler/status_record.py`.)"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from baton_engine import contract
from baton_operator.models import Condition, RoleStatus
from baton_operator.pod_problems import pool_problems, summary
from baton_operator.rollout.generations import PoolView, pool_view

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
#: Status keys per contract role (the aggregated pool is `status.pool`).
STATUS_KEY: dict[str, str] = {
    contract.ROLE_PREFILL: "prefill",
    contract.ROLE_DECODE: "decode",
    contract.ROLE_AGGREGATED: "pool",
    contract.ROLE_ROUTER: "router",
}


def _tensor_parallel_size(deployment: Mapping[str, Any]) -> int:
    """The `--tensor-parallel-size` the pool's engine container runs with (1 when absent)."""
    containers = deployment.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    for container in containers:
        args = list(container.get("args", []))
        if contract.FLAG_TENSOR_PARALLEL_SIZE in args[:-1]:
            value = args[args.index(contract.FLAG_TENSOR_PARALLEL_SIZE) + 1]
            return int(value) if str(value).isdigit() and int(value) >= 1 else 1
    return 1


def role_status(deployment: Mapping[str, Any] | None, selector: Mapping[str, str]) -> RoleStatus:
    """Counts of one pool; a Deployment not created yet counts as zero of zero."""
    if deployment is None:
        return RoleStatus(selector=contract.selector_arg(dict(selector)))
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    desired = int(spec.get("replicas", 1))
    ready = int(status.get("readyReplicas", 0))
    return RoleStatus(
        replicas=int(status.get("replicas", 0)),
        ready_replicas=ready,
        desired_replicas=desired,
        ready=f"{ready}/{desired}",
        selector=contract.selector_arg(dict(selector)),
        tensor_parallel_size=_tensor_parallel_size(deployment),
    )


def _rolling(deployment: Mapping[str, Any]) -> bool:
    spec, status = deployment.get("spec", {}), deployment.get("status", {})
    desired = int(spec.get("replicas", 1))
    generation = deployment.get("metadata", {}).get("generation", 0)
    return (
        int(status.get("observedGeneration", 0)) < generation
        or int(status.get("updatedReplicas", 0)) < desired
        or int(status.get("replicas", 0)) != desired
        or int(status.get("readyReplicas", 0)) < desired
    )


def _failing(deployment: Mapping[str, Any]) -> str | None:
    """The reason a Deployment's own conditions report a failure, if any."""
    for cond in deployment.get("status", {}).get("conditions", []):
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return f"{deployment['metadata']['name']}: progress deadline exceeded"
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return f"{deployment['metadata']['name']}: {cond.get('message', 'replica failure')}"
    return None


#: Condition reasons of a reconcile that did not finish: a child the API server refused (it will
#: be refused again until the spec or the cluster changes), or any other failure (retried).
FAILURE_REASONS = frozenset({"ChildRefused", "ReconcileFailed"})


@dataclass(frozen=True)
class Failure:
    """Why the last reconcile did not finish, as Ready and Degraded report it (and its Warning
    Event)."""

    reason: str  # one of FAILURE_REASONS
    message: str


@dataclass(frozen=True)
class Observed:
    """What one reconcile saw: the child Deployments by role, their pods, and the reconcile's own
    failure."""

    deployments: Mapping[str, Mapping[str, Any] | None]  # role -> Deployment (None: not found)
    failure: Failure | None = None
    pods: Mapping[str, Sequence[Mapping[str, Any]]] = field(default_factory=dict)  # role -> its pods
    keys: Mapping[str, str] = field(default_factory=dict)  # pool -> the KV-compatibility key it must have
    scale_to_zero: bool = False  # the autoscaler may scale every pool to zero (builtin, minReplicas 0)

    def generations(self) -> dict[str, PoolView]:
        """The pools with a key, their pods sorted into the key's and other keys' (a rollout)."""
        return {
            role: pool_view(role, key, None, (), self.pods.get(role, ()), "")
            for role, key in self.keys.items()
        }


def _with_generations(status: RoleStatus, view: PoolView) -> RoleStatus:
    """A pool's counts with its pods of every key: during a rollout the old generation's pods
    serve beside the Deployment's new ones."""
    extra = {"kv_compat_key": view.key, "new_key_pods": view.new_pods, "old_key_pods": view.old_pods}
    if view.old_pods:
        ready = status.ready_replicas + view.old_ready
        extra |= {
            "ready_replicas": ready,
            "replicas": status.replicas + view.old_pods,
            "ready": f"{ready}/{status.desired_replicas}",
        }
    return status.model_copy(update=extra)


def rollout_message(generations: Mapping[str, PoolView]) -> str | None:
    """The Progressing message of a KV-key rollout under way (None: none is)."""
    rolling = [v for v in generations.values() if v.old_pods]
    if not rolling:
        return None
    old = sorted({k or "(none)" for v in rolling for k in v.old_keys})
    new = sorted({v.key for v in generations.values()})
    pools = "; ".join(
        f"{role}: {v.new_ready}/{v.new_pods} new Ready, {v.old_pods} old" for role, v in generations.items()
    )
    return f"KV-compatibility key {', '.join(old)} -> {', '.join(new)}, decode first; {pools}"


def _condition(
    kind: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    now: str,
    previous: Sequence[Mapping[str, Any]],
) -> Condition:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == kind), None)
    since = before["lastTransitionTime"] if before and before.get("status") == status else now
    return Condition(
        type=kind,
        status=status,
        observed_generation=generation,
        last_transition_time=since,
        reason=reason,
        message=message,
    )


def _parse_time(now: str) -> dt.datetime:
    return dt.datetime.fromisoformat(now.replace("Z", "+00:00"))


def conditions(
    observed: Observed,
    roles: Mapping[str, RoleStatus],
    generation: int,
    now: str,
    previous: Sequence[Mapping[str, Any]],
) -> list[Condition]:
    """Ready, Progressing and Degraded; a transition time moves only when its status flips."""
    counts = ", ".join(f"{role} {s.ready}" for role, s in roles.items())
    engines = [r for r in roles if r in contract.ENGINE_ROLES]
    missing = [role for role, d in observed.deployments.items() if d is None]
    not_ready = [
        role for role, s in roles.items() if s.desired_replicas == 0 or s.ready_replicas < s.desired_replicas
    ]
    rolling = [role for role, d in observed.deployments.items() if d is not None and _rolling(d)]
    failures = [f for d in observed.deployments.values() if d is not None and (f := _failing(d))]
    stuck = summary(pool_problems(observed.pods, _parse_time(now)))

    failure = observed.failure
    if failure is not None:
        ready = _condition(READY, False, failure.reason, failure.message, generation, now, previous)
    elif missing:
        ready = _condition(
            READY, False, "Creating", f"waiting for {', '.join(missing)}", generation, now, previous
        )
    elif observed.scale_to_zero and engines and all(roles[r].desired_replicas == 0 for r in engines):
        message = "every pool is scaled to zero; the router holds requests and a request wakes the pools"
        ready = _condition(READY, True, "ScaledToZero", message, generation, now, previous)
    elif not_ready and stuck is not None:
        ready = _condition(READY, False, stuck.reason, stuck.message, generation, now, previous)
    elif not_ready:
        ready = _condition(READY, False, "PodsNotReady", counts, generation, now, previous)
    else:
        ready = _condition(READY, True, "AllPodsReady", counts, generation, now, previous)

    rollout = rollout_message(observed.generations())
    if rollout is not None:
        progressing = _condition(PROGRESSING, True, "RollingOut", rollout, generation, now, previous)
    elif missing or rolling:
        waiting = ", ".join(missing + rolling)
        progressing = _condition(
            PROGRESSING, True, "RollingOut", f"updating {waiting}", generation, now, previous
        )
    else:
        progressing = _condition(
            PROGRESSING, False, "Stable", "every pool is at its spec", generation, now, previous
        )

    if failure is not None:
        degraded = _condition(DEGRADED, True, failure.reason, failure.message, generation, now, previous)
    elif stuck is not None:
        degraded = _condition(DEGRADED, True, stuck.reason, stuck.message, generation, now, previous)
    elif failures:
        degraded = _condition(
            DEGRADED, True, "DeploymentFailing", "; ".join(failures), generation, now, previous
        )
    else:
        degraded = _condition(
            DEGRADED, False, "AsExpected", "no failures observed", generation, now, previous
        )
    return [ready, progressing, degraded]


def compute_status(
    *,
    name: str,
    generation: int,
    observed: Observed,
    endpoint: str,
    now: str,
    previous: Mapping[str, Any],
    record_generation: bool = True,
) -> dict[str, Any]:
    """The status fields the operator owns, as a merge patch (absent roles are nulled).

    `observedGeneration` is written only by a reconcile that applied every child of
    `generation` (`record_generation`); a refresh from child events leaves it as stored."""
    roles = {
        role: role_status(deployment, contract.pod_selector(name, role))
        for role, deployment in observed.deployments.items()
    }
    for role, view in observed.generations().items():
        if role in roles:
            roles[role] = _with_generations(roles[role], view)
    patch: dict[str, Any] = {key: None for key in STATUS_KEY.values()}
    for role, role_state in roles.items():
        patch[STATUS_KEY[role]] = role_state.model_dump(by_alias=True, exclude_none=True)
    patch["conditions"] = [
        c.model_dump(by_alias=True, exclude_none=True)
        for c in conditions(observed, roles, generation, now, previous.get("conditions", []))
    ]
    patch["endpoint"] = endpoint
    if observed.failure is None and record_generation:
        patch["observedGeneration"] = generation
    return patch


def stored_failure(stored: Mapping[str, Any]) -> Failure | None:
    """The failure a stored status reports from the last reconcile (Degraded with a failure
    reason), kept by status refreshes until a reconcile succeeds."""
    for cond in stored.get("conditions") or []:
        reason = cond.get("reason")
        if cond.get("type") == DEGRADED and cond.get("status") == "True" and reason in FAILURE_REASONS:
            return Failure(str(reason), str(cond.get("message") or "reconcile failed"))
    return None


def status_changed(stored: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether a JSON merge patch (RFC 7386) would change `stored`: a null deletes a key, an
    object merges key by key, anything else (lists included) replaces."""
    for key, value in patch.items():
        current = stored.get(key)
        if value is None:
            if current is not None:
                return True
        elif isinstance(value, Mapping):
            if not isinstance(current, Mapping) or status_changed(current, value):
                return True
        elif current != value:
            return True
    return False
